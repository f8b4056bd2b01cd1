"""GPU: the family watch adds no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``
turns any synchronising CUDA call into an error). Only the watch's hook bodies run under it:
sglang itself synchronises elsewhere. Skipped without CUDA."""

import unittest

import torch

from sglang_dsa_fix import row_check, watch

UNIFORM_READER = "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_uniform_func"


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class TestWatchAddsNoSync(unittest.TestCase):
    def setUp(self):
        watch.reset()
        self.addCleanup(watch.reset)
        self.addCleanup(torch.cuda.set_sync_debug_mode, "default")

    def test_row_write_check_never_synchronises(self):
        site = watch.Site("row_write", "test.writer", "req_to_token", slot=0)
        pool = torch.zeros((4, 300), dtype=torch.int32, device="cuda")
        start = torch.tensor([250, 10, 290], dtype=torch.int64, device="cuda")
        end = torch.tensor([306, 20, 290], dtype=torch.int64, device="cuda")  # row 0: 6 past, row 2: none
        row_check._counters(
            torch.device("cuda", torch.cuda.current_device())
        )  # the once-per-device allocation
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(100):
            row_check.check(site, pool, start, end, 3)
        torch.cuda.set_sync_debug_mode("default")
        counters = row_check.DEVICE_COUNTERS[end.device][0].tolist()
        self.assertEqual(counters[:2], [100, 600])
        self.assertEqual(counters[2], 306)

    def test_compiled_launch_counts_as_the_jit_launch(self):
        # After its first call per (device, dtypes, programs) the row check launches the compiled
        # kernel directly (row_check._LAUNCHES, row_check._direct_launch): every later call must count
        # what a host reference counts, for both offset dtypes, views at odd offsets (no alignment
        # assumed) and batch sizes of one to three programs.
        self._count_as_the_host_reference()

    def test_a_launcher_of_no_known_form_is_called_itself(self):
        # Where the installed CudaLauncher.__call__ is none the watch read (a future Triton),
        # the cached launch calls that launcher, with the same counts.
        from unittest import mock

        with mock.patch.dict(row_check._C_LAUNCH_SOURCES, clear=True):
            self._count_as_the_host_reference(form="launcher")

    def test_a_runner_of_no_known_form_launches_itself(self):
        # Where CompiledKernel.__getitem__ is none the watch read, its runner launches.
        from unittest import mock

        with mock.patch.dict(row_check._RUNNER_SOURCES, clear=True):
            self._count_as_the_host_reference(form="runner")

    def test_a_registered_launch_hook_gets_the_runner_and_its_metadata(self):
        # While a launch hook is registered (a profiler), the cached launch goes through
        # CompiledKernel[grid]'s runner, which hands the hook its metadata; the counts are the same.
        from triton import knobs

        seen = []

        def hook(metadata):
            seen.append(metadata.get()["name"])

        knobs.runtime.launch_enter_hook.add(hook)
        self.addCleanup(knobs.runtime.launch_enter_hook.remove, hook)
        self._count_as_the_host_reference()
        self.assertEqual(set(seen), {"row_check"})
        self.assertEqual(len(seen), 2 * 3 * 3 * 3)  # every call: the JIT one and the cached ones

    def test_a_host_tensor_after_a_cached_launch_is_refused_not_read(self):
        # The cached launch passes addresses as ints, which Triton's launcher does not check: a
        # host tensor where a device one was cached must take the JIT path, which refuses it
        # (the site switches off), never have its host address read on the GPU.
        site = watch.Site("row_write", "test.host", "req_to_token", slot=2)
        hook = watch._hook(watch.kinds()["row_write"], site)
        pool, rows = torch.zeros((4, 50), dtype=torch.int32, device="cuda"), torch.arange(3, device="cuda")
        start = torch.tensor([10, 20, 48], device="cuda")
        end = start + 5  # the last row: 3 past
        for _ in range(2):  # the JIT launch, then the cached one
            hook(lambda *a: None, rows, pool, start, end, None, 3)
        self.assertIsNone(site.failed)
        hook(lambda *a: None, rows, pool, start.cpu(), end, None, 3)
        self.assertIsNotNone(site.failed)
        torch.cuda.synchronize()  # no illegal address was read
        self.assertEqual(row_check.DEVICE_COUNTERS[end.device][2].tolist(), [2, 6, 53])

    def test_a_check_captured_in_a_cuda_graph_counts_every_replay(self):
        # A cached row check launched while a graph is captured becomes part of the graph: each
        # replay checks the rows it is given, into the same counters. A key first seen during a
        # capture is not compiled there (nothing launched, nothing cached, the site keeps checking).
        site = watch.Site("row_write", "test.captured", "req_to_token", slot=3)
        pool = torch.zeros((4, 50), dtype=torch.int32, device="cuda")
        start = torch.tensor([10, 48, 20], device="cuda")
        end = start + 5  # row 1: 3 past
        row_check.check(site, pool, start, end, 3)  # outside the capture: the JIT launch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            row_check.check(site, pool, start, end, 3)
            row_check.check(site, pool, start.int(), end.int(), 3)  # a new key: skipped
        torch.cuda.synchronize()
        counters = row_check.DEVICE_COUNTERS[end.device]
        self.assertEqual(counters[3].tolist(), [1, 3, 53])  # capturing runs nothing
        end.add_(1)  # what the replays read: row 1 now 4 past
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(counters[3].tolist(), [1 + 4, 3 + 4 * 4, 54])
        self.assertIsNone(site.failed)
        self.assertEqual({key[3] for key in row_check._LAUNCHES}, {torch.int64})
        watch.reset()  # in place: the graph's counters are the watch's
        graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(row_check.DEVICE_COUNTERS[end.device][3].tolist(), [1, 4, 54])

    @unittest.skipUnless(watch._resolves(UNIFORM_READER), "no uniform verify reader in this sglang (0.5.17+)")
    def test_uniform_reader_counted_without_a_sync(self):
        # 0.5.17+ EAGLE verify's reader on its GPU path: no end tensor (end = start + N in its
        # kernel); the hook passes start and N. Its result is sglang's own.
        import pkgutil

        from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

        original = pkgutil.resolve_name(UNIFORM_READER)
        site = watch.Site("uniform_row_read", UNIFORM_READER, "req_to_token", slot=4)
        wrapped = _wrap_fn(original, watch._hook(watch.kinds()["uniform_row_read"], site), HookType.AROUND)
        pool = torch.arange(4 * 10, dtype=torch.int32, device="cuda").reshape(4, 10)
        arguments = dict(
            req_pool_indices=torch.tensor([0, 1, 2], device="cuda"),
            req_to_token=pool,
            start_offset=torch.tensor([3, 8, 6], device="cuda"),  # row 1: 2 past
            batch_size=3,
            draft_token_num=4,
            device="cuda",
        )
        wrapped(**arguments)  # the JIT launch
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(10):  # the cached launch
            out = wrapped(**arguments)
        torch.cuda.set_sync_debug_mode("default")
        self.assertIsNone(site.failed)
        self.assertEqual(row_check.DEVICE_COUNTERS[pool.device][4].tolist(), [11, 22, 12])
        self.assertEqual(out.tolist(), original(**arguments).tolist())

    def _count_as_the_host_reference(self, form=None):
        site = watch.Site("row_write", "test.compiled", "req_to_token", slot=1)
        generator = torch.Generator().manual_seed(0)
        expected = [0, 0, 0]
        device = torch.device("cuda", torch.cuda.current_device())
        for dtype in (torch.int64, torch.int32):
            for batch in (3, 130, 300):
                for offset in (0, 1, 3):  # views starting 0, 1, 3 elements in
                    pool = torch.zeros((batch, 50), dtype=torch.int32, device="cuda")
                    start = torch.randint(0, 60, (batch + offset,), generator=generator)
                    end = start + torch.randint(0, 9, (batch + offset,), generator=generator)
                    rows = list(zip(start.tolist(), end.tolist()))[offset:]
                    for add in (0, 3, 0):  # the first call takes the JIT path, the others not
                        row_check.check(
                            site,
                            pool,
                            start.to(dtype).cuda()[offset:],
                            end.to(dtype).cuda()[offset:],
                            batch,
                            add,
                        )
                        past = [max(0, e + add - max(s, 50)) for s, e in rows]
                        expected[0] += sum(p > 0 for p in past)
                        expected[1] += sum(past)
                        expected[2] = max(expected[2], max(e + add for _, e in rows))
                    launch = row_check._LAUNCHES[
                        (device, device, device.index, dtype, dtype, -(-batch // 128))
                    ]
                    if form is None:  # the C launch of the installed Triton form (3.6 on the GPU host)
                        self.assertIn(getattr(launch, "direct", None), row_check._C_LAUNCH_SOURCES.values())
                    else:
                        self.assertEqual(getattr(launch, "direct", None), form)
        self.assertIsNone(site.failed)
        self.assertEqual(row_check.DEVICE_COUNTERS[device][1].tolist(), expected)


if __name__ == "__main__":
    unittest.main()
