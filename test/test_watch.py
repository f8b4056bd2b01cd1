"""The family watch (``sglang_dsa_fix.watch``) on the real sglang code, CPU.

Each watch hook is put around the real sglang function the way sglang's HookRegistry does
(``hook_registry._wrap_fn`` with HookType.AROUND, set on the object the target names), then:

- row writes: the bug #2 driver (``proof.row_overflow``) runs the real spec-v2 prepare and its
  Triton writer; its ``WriteRecorder``, an observer that depends on no watch code, keeps every
  row's [start, end) and the row width. The watch's counters must equal what it counts, be >= 1
  where the reservation overflows (fixes off) and 0 with the runtime fix. Installed release for
  D 7 / 8 / 9 / 12 x page 1 / 64; 0.5.23 (overlay, a child process) for one case at page 1;
- DSA CUDA-graph replays: the bug #1 replay driver (``proof.replay``) on the pristine backend: a
  TARGET_VERIFY replay that reads past the graph page_table is counted (it then raises), one with
  the runtime fix is not; over a sweep the count equals the replays whose columns exceed the buffer;
- the other backends' CUDA-graph replays (FA3, flashinfer, flashinfer MLA, triton, FlashMLA,
  TRT-LLM MHA / MLA): the real backend class through its own capture and replay entry on CPU
  (``graph_backends``), a replay that fits is not counted, one past a deliberately narrowed
  buffer is; and at sglang's own sizes, the verify replays near the context limit that need more
  pages than the tables hold (TRT-LLM MHA, TRT-LLM MLA, FlashMLA, flashinfer MLA);
- no host read on the hot path: the row check (one Triton kernel launch) runs with every
  tensor-to-host read patched to raise;
- the plugin registers the watch with the kill switch on, and reports it under ``watch``.
"""

import contextlib
import functools
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import graph_backends
import torch
from helpers import PluginRegistration

from sglang_dsa_fix import plugin, row_check, runtime_fix, watch
from sglang_dsa_fix.members.fa3 import tables as fa3_width

REPO = Path(__file__).resolve().parents[1]
# Other releases as overlays (scripts/release_matrix.py installs them into .matrix/).
MATRIX = Path(os.environ.get("SGLANG_DSA_FIX_MATRIX", REPO / ".matrix"))
OVERLAY_0_5_23 = MATRIX / "sglang-0.5.23"
# 0.5.17+: EAGLE's verify reads its slots through this reader (members/row_overflow.py).
UNIFORM_READER = "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_uniform_func"
# 0.5.23: EAGLE's draft reads its slots (and with topk 1 the verify window) through this reader.
DRAFT_READER = "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_func"


# Releases whose pristine graph page_table is max_context_len + D (RELEASES.md) that the watch covers.
AFFECTED_BY_BUG_1 = ("0.5.11", "0.5.12", "0.5.13", "0.5.14")


def installed_version():
    from sglang_dsa_fix.proof.replay import installed_version

    return installed_version()


def watch_hook(kind: str, version=None):
    """(target, hook) of the watch's hook of this kind for the release."""
    by_kind = {watch._SITES[target].kind: (target, hook) for target, _, hook in watch.hooks(version)}
    return by_kind[kind]


@contextlib.contextmanager
def hooked(target: str, hook):
    """The target wrapped as HookRegistry wraps it (0.5.14 plugins/hook_registry.py:236-296), undone
    on exit. Without the propagation to other importers: the drivers call the target's own name."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    wrapped = _wrap_fn(getattr(owner, name), hook, HookType.AROUND)
    with mock.patch.object(owner, name, wrapped):
        yield


def observed(writes):
    """The independent count: rows whose [start, end) reaches past the row, and those columns."""
    past = [max(0, end - max(start, row_width)) for start, end, row_width in writes]
    return sum(p > 0 for p in past), sum(past)


def runtime_fixed_sizing():
    """The installed sizing function with the plugin's AFTER-hook body (test_row_overflow.py)."""
    from sglang_dsa_fix.proof import row_overflow

    module = row_overflow.sizing_module()
    hook = runtime_fix.row_extra_fix(module.__name__)
    original = module.get_req_to_token_extra_context_len
    return lambda *args, **kwargs: hook(original(*args, **kwargs), *args, **kwargs)


def watched_row_cases(cases, fixed: bool) -> list:
    """Run each case of the bug #2 driver with the watch around the real writer: one dict per case."""
    from sglang_dsa_fix.proof import row_overflow

    target, hook = watch_hook("row_write", installed_version())
    module = row_overflow.writer_module()
    assert target == f"{module.__name__}.assign_req_to_token_pool_func", target
    out = []
    for case in cases:
        watch.reset()
        with hooked(target, hook):
            result = row_overflow.run(case, runtime_fixed_sizing() if fixed else None)
        report = watch.report()
        out.append(
            dict(
                case=[case.num_draft_tokens, case.page_size],
                target=target,
                watched=[report["row_writes_past_end"], report["row_columns_past_end"]],
                observed=list(observed(result.writes)),
                writes=len(result.writes),
                columns_past_row_end=result.columns_past_row_end,
                first_violation=report["first_violation"],
                row_width=result.row_width,
            )
        )
    return out


def row_case(D: int, page: int):
    from sglang_dsa_fix.proof import row_overflow

    # The request's last few decode steps (prompt 2D + 3 below the clamp), overlap on.
    return row_overflow.RowCase(256, D, page, True, 256 - 2 - (2 * D + 3))


class TestSwitchAndSites(unittest.TestCase):
    def test_enabled_values(self):
        for value in ("1", "true", "YES", " on "):
            self.assertTrue(watch.enabled(value), value)
        for value in ("", "0", "false", "off", "no", "2"):
            self.assertFalse(watch.enabled(value), value)

    def test_row_writer_target_per_release(self):
        def writer(version):
            return [c.target for c in watch.select(version, resolve=False) if c.kind == "row_write"]

        for version in ("0.5.11", "0.5.12", "0.5.13", "0.5.14", "0.5.15"):
            self.assertEqual(
                writer(version), ["sglang.srt.speculative.spec_utils.assign_req_to_token_pool_func"]
            )
        for version in ("0.5.16", "0.5.17", "0.5.23"):
            self.assertEqual(
                writer(version), ["sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"]
            )
        self.assertEqual(writer("0.5.10"), [])  # no plugin API before 0.5.11

    def test_uniform_reader_target_per_release(self):
        def reader(version):
            return [c.target for c in watch.select(version, resolve=False) if c.kind == "uniform_row_read"]

        for version in ("0.5.14", "0.5.16"):
            self.assertEqual(reader(version), [])
        for version in ("0.5.17", "0.5.23"):
            self.assertEqual(reader(version), [UNIFORM_READER])

    def test_draft_reader_target_per_release(self):
        def reader(version):
            return [c.target for c in watch.select(version, resolve=False) if c.kind == "draft_slot_read"]

        for version in ("0.5.14", "0.5.17", "0.5.22"):
            self.assertEqual(reader(version), [])
        self.assertEqual(reader("0.5.23"), [DRAFT_READER])

    def test_row_hooks_read_the_arguments_where_sglang_passes_them(self):
        # The row hooks take arguments by position, else by the keyword their kind declares: the
        # installed functions' own order and names.
        import inspect

        chosen = {c.kind: c.target for c in watch.select(installed_version())}
        self.assertEqual({"row_write", "row_read"} - set(chosen), set())
        device_kinds = [kind for kind in watch.kinds().values() if kind.batch_size_at is not None]
        self.assertEqual(
            {kind.kind for kind in device_kinds},
            {"row_write", "row_read", "uniform_row_read", "draft_slot_read"},
        )
        for kind in (kind for kind in device_kinds if kind.kind in chosen):
            with self.subTest(kind=kind.kind):
                parameters = list(inspect.signature(pkgutil.resolve_name(chosen[kind.kind])).parameters)
                self.assertEqual(parameters[: len(kind.parameters)], list(kind.parameters))
                self.assertEqual(kind.parameters[1], "req_to_token")


class TestRowCheck(unittest.TestCase):
    def test_counts_columns_written_past_the_row(self):
        site = watch.Site("row_write", "test.row_write", "req_to_token", slot=row_check.MAX_DEVICE_SITES - 1)
        rows = [(8, 12), (11, 11), (12, 14), (3, 9)]  # 2 past, nothing written, 2 past, inside
        start, end = (torch.tensor(list(x), dtype=torch.int32) for x in zip(*rows))
        try:
            row_check.check(site, torch.zeros(4, 10, dtype=torch.int32), start, end, 4)
            counters = row_check.DEVICE_COUNTERS[torch.device("cpu")][site.slot].tolist()
        finally:
            watch.reset()
        self.assertEqual(counters, [*observed([(s, e, 10) for s, e in rows]), 14])
        self.assertEqual(counters[:2], [2, 4])

    def test_many_rows_strided_offsets_and_a_short_batch(self):
        # 300 rows: three kernel programs adding into the same counters; strided offsets; a
        # batch_size larger than the tensors (read only what is there).
        site = watch.Site("row_write", "test.many", "req_to_token", slot=row_check.MAX_DEVICE_SITES - 1)
        start = torch.arange(300, dtype=torch.int64) % 20
        end = start + torch.arange(300, dtype=torch.int64) % 7
        rows = list(zip(start.tolist(), end.tolist()))
        try:
            row_check.check(site, torch.zeros(2, 20, dtype=torch.int32), start, end, 300)
            strided = torch.stack((start, end), dim=1)
            row_check.check(site, torch.zeros(2, 20, dtype=torch.int32), strided[:, 0], strided[:, 1], 500)
            counters = row_check.DEVICE_COUNTERS[torch.device("cpu")][site.slot].tolist()
        finally:
            watch.reset()
        once = observed([(s, e, 20) for s, e in rows])
        self.assertGreater(once[0], 0)
        self.assertEqual(counters, [2 * once[0], 2 * once[1], max(e for _, e in rows)])

    def test_row_check_reads_nothing_back_from_the_device(self):
        # The check is one kernel launch: no .item() / int() / bool() / .tolist() of a tensor on
        # the way (the GPU tier runs it under set_sync_debug_mode("error"), test_watch_cuda.py).
        site = watch.Site("row_write", "test.reads", "req_to_token", slot=row_check.MAX_DEVICE_SITES - 1)
        start, end = torch.tensor([8, 2, 9]), torch.tensor([12, 5, 9])

        def refuse(*args, **kwargs):
            raise AssertionError("the row check read a tensor value back")

        row_check._counters(torch.device("cpu"))  # the once-per-device allocation
        try:
            with contextlib.ExitStack() as stack:
                for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
                    stack.enter_context(mock.patch.object(torch.Tensor, name, refuse))
                row_check.check(site, torch.zeros(4, 10, dtype=torch.int32), start, end, 3)
            self.assertIsNone(site.failed)
            self.assertEqual(row_check.DEVICE_COUNTERS[torch.device("cpu")][site.slot].tolist(), [1, 2, 12])
        finally:
            watch.reset()

    def test_positional_and_named_arguments_count_the_same(self):
        # The row hook reads sglang's positional arguments by index, named ones by name.
        site = watch.Site("row_write", "test.arguments", "req_to_token", slot=row_check.MAX_DEVICE_SITES - 1)
        hook = watch._hook(watch.kinds()["row_write"], site)
        calls = []
        pool, rows = torch.zeros(4, 10, dtype=torch.int32), torch.arange(3)
        start, end = torch.tensor([8, 2, 9]), torch.tensor([12, 5, 9])
        try:
            hook(lambda *a, **k: calls.append((a, k)), rows, pool, start, end, None, 3)
            hook(
                lambda *a, **k: calls.append((a, k)),
                rows,
                pool,
                end_offset=end,
                start_offset=start,
                out_cache_loc=None,
                batch_size=3,
            )
            counters = row_check.DEVICE_COUNTERS[torch.device("cpu")][site.slot].tolist()
        finally:
            watch.reset()
        self.assertIsNone(site.failed)
        self.assertEqual(len(calls), 2)  # sglang's function still called, with its arguments
        self.assertEqual(counters, [2, 4, 12])

    def test_a_numpy_batch_size_is_read_as_its_value(self):
        # (numpy 2's integers have a .device too: only a tensor's value is left unread.)
        import numpy

        site = watch.Site("row_write", "test.numpy", "req_to_token", slot=row_check.MAX_DEVICE_SITES - 1)
        start, end = torch.tensor([8, 2, 9]), torch.tensor([12, 5, 15])
        try:
            row_check.check(site, torch.zeros(4, 10, dtype=torch.int32), start, end, numpy.int64(2))
            counters = row_check.DEVICE_COUNTERS[torch.device("cpu")][site.slot].tolist()
        finally:
            watch.reset()
        self.assertEqual(counters, [1, 2, 12])

    def test_the_current_device_is_torchs_own_read_of_it(self):
        # row_check._CURRENT_DEVICE is what torch.cuda.current_device() calls after its lazy-init
        # check; a torch whose current_device() does anything else fails here.
        import inspect

        body = inspect.getsource(torch.cuda.current_device).split('"""')[-1].split()
        self.assertEqual(body, ["_lazy_init()", "return", "torch._C._cuda_getDevice()"])
        with (
            mock.patch.object(row_check, "_CUDA", None),
            mock.patch.object(row_check, "_CURRENT_DEVICE", None),  # (both as they were after)
            mock.patch.object(torch._C, "_cuda_getDevice", lambda: 3),
        ):
            row_check._cuda()
            self.assertEqual(row_check._CURRENT_DEVICE(), 3)

    def test_the_installed_triton_runner_is_one_read_here(self):
        # row_check._direct_launch stands in for CompiledKernel[grid]'s runner only where the installed
        # Triton's is one read for it (row_check._RUNNER_SOURCES): a Triton that changes it fails here
        # (the GPU tier, test/srt/test_watch_cuda.py, runs the launch itself).
        from triton.compiler.compiler import CompiledKernel

        self.assertIn(row_check._source_digest(CompiledKernel.__getitem__), row_check._RUNNER_SOURCES)

    def test_the_c_launch_is_the_installed_launchers_own_call(self):
        # Below the runner, row_check._direct_launch calls the C launch as the installed launcher
        # (CudaLauncher.__call__) calls it, where that launcher is one of row_check._C_LAUNCH_SOURCES,
        # read whole; any other launcher, even one that keeps the same call and adds a step
        # before it, is called itself (form None), and so is a kernel that needs scratch memory,
        # which only the launcher allocates.
        import importlib.util
        import inspect
        import textwrap

        from triton.backends.nvidia.driver import CudaLauncher

        installed = row_check._C_LAUNCH_SOURCES.get(row_check._source_digest(CudaLauncher.__call__))
        self.assertIsNotNone(installed, "the installed Triton's CudaLauncher.__call__ is not one read here")
        launcher = CudaLauncher.__new__(CudaLauncher)  # (its __init__ compiles a kernel's launch)
        launcher.global_scratch_size, launcher.profile_scratch_size = 0, 0
        self.assertEqual(row_check._c_launch_form(launcher), installed)
        launcher.global_scratch_size = 128
        self.assertIsNone(row_check._c_launch_form(launcher))
        launcher.global_scratch_size, launcher.gsan_enabled = 0, True
        self.assertIsNone(row_check._c_launch_form(launcher))

        # Copies of the installed __call__ in a file of their own: unchanged, it is the installed
        # form; with one statement added at its top (the same C-launch call after it), none.
        source = textwrap.dedent(inspect.getsource(CudaLauncher.__call__))
        head, body = source.split(":\n", 1)
        step = body[: len(body) - len(body.lstrip())] + "self.steps = 1\n"
        for name, call, form in (("Copied", source, installed), ("Stepped", f"{head}:\n{step}{body}", None)):
            with self.subTest(launcher=name), tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{name.lower()}_launcher.py"
                path.write_text(
                    "from triton.backends.nvidia.driver import CudaLauncher\n\n\n"
                    f"class {name}(CudaLauncher):\n" + textwrap.indent(call, "    ")
                )
                spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                copy = getattr(module, name).__new__(getattr(module, name))
                copy.global_scratch_size, copy.profile_scratch_size = 0, 0
                self.assertEqual(row_check._c_launch_form(copy), form)

        # A wrapper in __call__'s place (functools.wraps: inspect.getsource would read what it
        # wraps) and a __call__ whose source cannot be read: neither is a form read here.
        installed_call = CudaLauncher.__call__

        @functools.wraps(installed_call)
        def wrapped(self, *args):
            return installed_call(self, *args)

        namespace = {}
        exec("def unread(self, *args):\n    pass\n", namespace)
        self.assertEqual(row_check._source_digest(namespace["unread"]), "")
        for name, call in (("Wrapped", wrapped), ("Unread", namespace["unread"])):
            with self.subTest(launcher=name):
                other = type(name, (CudaLauncher,), {"__call__": call})
                copy = other.__new__(other)
                copy.global_scratch_size, copy.profile_scratch_size = 0, 0
                self.assertIsNone(row_check._c_launch_form(copy))
        self.assertIsNone(row_check._c_launch_form(SimpleNamespace()))  # no sizes: unknown, not 0

    def test_the_c_launch_gets_what_the_installed_launcher_gives_it(self):
        # The same launch both ways, on the installed Triton: CompiledKernel[grid]'s runner through
        # the real CudaLauncher.__call__, and row_check._direct_launch's C launch. Only the C launch
        # itself (it needs a GPU) and the driver's device and stream are stand-ins, which record.
        import triton
        from triton.backends.nvidia.driver import CudaLauncher
        from triton.compiler.compiler import CompiledKernel

        class RecordingDriver:
            def get_current_device(self):
                return 0

            def get_current_stream(self, device):
                return 1234

        calls = []
        launcher = CudaLauncher.__new__(CudaLauncher)  # (its __init__ compiles the C launch)
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        launcher.num_ctas, launcher.gsan_enabled = 1, False
        launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
        launcher.arg_annotations, launcher.kernel_signature = ["annotations"], b"signature"
        launcher.launch = lambda *args: calls.append(args)
        compiled = CompiledKernel.__new__(CompiledKernel)
        compiled.module, compiled._run, compiled.function = object(), launcher, 99
        compiled.packed_metadata = (4, 1, 0)
        compiled.launch_metadata = lambda grid, stream, *args: None
        # (the previous active driver back after: on CPU none is, and reset_active would raise)
        recording = mock.patch.object(triton.runtime.driver, "_active", RecordingDriver())
        recording.start()
        self.addCleanup(recording.stop)
        self.addCleanup(setattr, compiled, "module", None)  # (nothing for __del__ to unload)
        start, counters = torch.arange(3), torch.zeros(row_check.MAX_DEVICE_SITES, 3, dtype=torch.int64)
        end = start + 5
        compiled[(1, 1, 1)](start, end, counters, 2, 50, 3, 4, row_check._ROW_CHECK_BLOCK)
        launch = row_check._direct_launch(compiled, 1, 0, counters)
        launch(start, end, 2, 50, 3, 4)
        self.assertIn(launch.direct, row_check._C_LAUNCH_SOURCES.values())
        through_launcher, direct = calls
        # (the runner hands the C launch tensors and its empty hook chains, the watch addresses
        # and None, which the C launch reads alike)
        hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)

        def as_read(value):
            if isinstance(value, tuple):
                return tuple(as_read(item) for item in value)
            if isinstance(value, torch.Tensor):
                return value.data_ptr()
            return None if any(value is hook for hook in hooks) else value

        self.assertEqual(as_read(through_launcher), direct)


class TestRowWritesInstalled(unittest.TestCase):
    """bug #2 on the installed release (0.5.14): D 8+ overflows at page 1 and 64 (D - 7 columns)."""

    CASES = [(D, page) for D in (7, 8, 9, 12) for page in (1, 64)]

    def test_pristine_counts_equal_the_observer(self):
        results = watched_row_cases([row_case(D, page) for D, page in self.CASES], fixed=False)
        overflowing = 0
        for r in results:
            with self.subTest(case=r["case"]):
                self.assertGreater(r["writes"], 0)
                self.assertEqual(r["watched"], r["observed"])
                self.assertEqual(r["watched"][0] > 0, r["columns_past_row_end"] > 0)
                if r["watched"][0]:
                    overflowing += 1
                    self.assertEqual(
                        r["first_violation"],
                        dict(
                            where=r["target"],
                            buffer="req_to_token",
                            width=r["row_width"],
                            needed=r["row_width"] + r["columns_past_row_end"],
                        ),
                    )
                else:
                    self.assertIsNone(r["first_violation"])
        if installed_version() in ("0.5.13", "0.5.14"):
            self.assertEqual(overflowing, 6)  # D 8, 9, 12 at both pages
            self.assertEqual(results[2]["watched"][0], 1)  # D 8, page 1: one row, one column
        self.assertGreater(overflowing, 0)

    def test_runtime_fix_counts_nothing(self):
        for r in watched_row_cases([row_case(D, page) for D, page in self.CASES], fixed=True):
            with self.subTest(case=r["case"]):
                self.assertGreater(r["writes"], 0)
                self.assertEqual(r["watched"], [0, 0])
                self.assertEqual(r["observed"], [0, 0])
                self.assertIsNone(r["first_violation"])


@unittest.skipUnless(  # (the stamp: the matrix may be installing it beside this run)
    (OVERLAY_0_5_23 / ".complete").exists(),
    f"no sglang 0.5.23 overlay at {OVERLAY_0_5_23} (the release matrix runs it)",
)
class TestRowWrites0523(unittest.TestCase):
    """0.5.23, page 1, D 12 (K 1, D >= 9 overflows there): in a child with the overlay first."""

    def test_pristine_counted_fixed_not(self):
        code = (
            "import json, test_watch as t;"
            "print('RESULT', json.dumps([t.installed_version(),"
            " t.watched_row_cases([t.row_case(12, 1)], False), t.watched_row_cases([t.row_case(12, 1)], True)]))"
        )
        paths = [str(OVERLAY_0_5_23), str(REPO / "python"), str(REPO / "test")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        self.assertTrue(line, proc.stderr[-3000:])
        version, (pristine,), (fixed,) = json.loads(line[0][len("RESULT ") :])
        self.assertEqual(version, "0.5.23")
        self.assertEqual(pristine["target"], "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func")
        self.assertEqual(pristine["watched"], pristine["observed"])
        self.assertGreaterEqual(pristine["watched"][0], 1)
        self.assertGreater(pristine["columns_past_row_end"], 0)
        self.assertEqual((fixed["watched"], fixed["observed"]), ([0, 0], [0, 0]))


@unittest.skipUnless(
    watch._resolves(UNIFORM_READER),
    "no uniform verify reader in this sglang (0.5.17+: the release matrix runs it)",
)
class TestUniformRowReads(unittest.TestCase):
    """0.5.17+: EAGLE's verify reads the same draft_token_num columns of every row from start, the
    end computed in sglang's kernel (no end tensor). The real reader, its Triton kernel under the
    interpreter where sglang takes its GPU path; the same reader's CPU fallback calls the (hooked)
    end-tensor reader, whose read is the uniform call's, counted once."""

    WIDTH, D = 10, 4
    STARTS = [3, 8, 6]  # [3, 7) inside; [8, 12) 2 past the row; [6, 10) ends at the width

    def read(self, gpu_path: bool, positional: bool = False, uniform_failed=None):
        import sglang.kernels.ops.speculative.cache_locs as cache_locs

        pool = torch.arange(4 * self.WIDTH, dtype=torch.int32).reshape(4, self.WIDTH)
        rows, start = torch.tensor([0, 1, 2]), torch.tensor(self.STARTS)
        uniform_target, uniform_hook = watch_hook("uniform_row_read", installed_version())
        end_target, end_hook = watch_hook("row_read", installed_version())
        self.assertEqual(end_target, f"{cache_locs.__name__}.assign_extend_cache_locs_func")
        fallback_reads = []
        end_reader = cache_locs.assign_extend_cache_locs_func

        def recorded(*args, **kwargs):
            fallback_reads.append(kwargs["end_offset"].tolist())
            return end_reader(*args, **kwargs)

        watch.reset()
        self.addCleanup(watch.reset)
        watch._SITES[uniform_target].failed = uniform_failed  # (a check switched off earlier)
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(cache_locs, "assign_extend_cache_locs_func", recorded))
            if gpu_path:  # sglang's CUDA branch, its real kernel under TRITON_INTERPRET
                stack.enter_context(mock.patch.object(cache_locs, "_is_cuda", True))
            stack.enter_context(hooked(end_target, end_hook))
            stack.enter_context(hooked(uniform_target, uniform_hook))
            arguments = (rows, pool, start, 3, self.D, "cpu")
            names = (
                "req_pool_indices",
                "req_to_token",
                "start_offset",
                "batch_size",
                "draft_token_num",
                "device",
            )
            reader = cache_locs.assign_extend_cache_locs_uniform_func
            out = reader(*arguments) if positional else reader(**dict(zip(names, arguments)))
        return out, watch.report(), fallback_reads

    def expected(self):
        return list(observed([(s, s + self.D, self.WIDTH) for s in self.STARTS]))

    def test_gpu_path_counts_the_rows_read_past_the_end(self):
        if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no CUDA
            raise unittest.SkipTest("sglang's kernel runs on CPU tensors here: needs TRITON_INTERPRET=1")
        self.assertEqual(self.expected(), [1, 2])
        for positional in (False, True):
            with self.subTest(positional=positional):
                out, report, fallback_reads = self.read(gpu_path=True, positional=positional)
                self.assertEqual(fallback_reads, [])
                counted = [report["uniform_row_reads_past_end"], report["uniform_row_read_columns_past_end"]]
                self.assertEqual(counted, self.expected())
                self.assertEqual(report["row_reads_past_end"], 0)
                self.assertIsNone(report.get("failed"))
                # What the read past the end returned: row 1's slots 8, 9 and row 2's first two.
                self.assertEqual(out.view(3, self.D)[1].tolist(), [18, 19, 20, 21])

    def test_fallback_read_is_counted_once(self):
        out, report, fallback_reads = self.read(gpu_path=False)
        self.assertEqual(fallback_reads, [[s + self.D for s in self.STARTS]])  # the hooked reader ran
        counted = [report["uniform_row_reads_past_end"], report["uniform_row_read_columns_past_end"]]
        self.assertEqual(counted, self.expected())
        self.assertEqual([report["row_reads_past_end"], report["row_read_columns_past_end"]], [0, 0])

    def test_a_switched_off_uniform_check_leaves_the_fallback_read_counted(self):
        _, report, fallback_reads = self.read(gpu_path=False, uniform_failed="RuntimeError: earlier")
        self.assertEqual(len(fallback_reads), 1)
        self.assertEqual(report["uniform_row_reads_past_end"], 0)
        self.assertEqual([report["row_reads_past_end"], report["row_read_columns_past_end"]], self.expected())


@unittest.skipUnless(
    watch._resolves(DRAFT_READER), "no draft slot reader in this sglang (0.5.23+: the release matrix runs it)"
)
class TestDraftSlotReads(unittest.TestCase):
    """0.5.23: EAGLE's draft reads topk x num_cols columns of every row from seq_lens (no end tensor,
    no batch size: seq_lens' length). sglang's real reader and its Triton kernel under the interpreter."""

    WIDTH = 12
    SEQ_LENS = [2, 7, 9]  # 4 columns: [2, 6) inside; [7, 11) inside; [9, 13) 1 past the row

    def read(self, topk: int, num_cols: int, keywords: bool = False):
        import sglang.kernels.ops.speculative.cache_locs as cache_locs

        pool = torch.arange(4 * self.WIDTH, dtype=torch.int32).reshape(4, self.WIDTH)
        rows, seq_lens = torch.tensor([0, 1, 2]), torch.tensor(self.SEQ_LENS)
        out = torch.full((3 * topk * num_cols,), -1, dtype=torch.int64)
        target, hook = watch_hook("draft_slot_read", installed_version())
        self.assertEqual(target, DRAFT_READER)
        watch.reset()
        self.addCleanup(watch.reset)
        with hooked(target, hook):
            reader = cache_locs.assign_draft_cache_locs_contiguous_func
            if keywords:
                reader(rows, pool, seq_lens=seq_lens, out_cache_loc=out, topk=topk, num_cols=num_cols)
            else:
                reader(rows, pool, seq_lens, out, topk, num_cols)  # as eagle_worker_common.py:290 calls it
        return out, watch.report()

    def test_counts_the_rows_read_past_the_end(self):
        if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no CUDA
            raise unittest.SkipTest("sglang's kernel runs on CPU tensors here: needs TRITON_INTERPRET=1")
        for topk, num_cols, keywords in ((1, 4, False), (2, 2, True), (1, 3, False)):
            with self.subTest(topk=topk, num_cols=num_cols, keywords=keywords):
                span = topk * num_cols
                out, report = self.read(topk, num_cols, keywords)
                expected = list(observed([(s, s + span, self.WIDTH) for s in self.SEQ_LENS]))
                counted = [report["draft_slot_reads_past_end"], report["draft_slot_read_columns_past_end"]]
                self.assertEqual(counted, expected)
                self.assertEqual(expected, [1, 1] if span == 4 else [0, 0])
                self.assertIsNone(report.get("failed"))
                self.assertEqual(report["row_reads_past_end"] + report["uniform_row_reads_past_end"], 0)
                if span == 4:  # what the read past the end returned: row 2's 9, 10, 11 and row 3's first
                    self.assertEqual(out.view(3, span)[2].tolist(), [33, 34, 35, 36])


class TestDsaReplay(unittest.TestCase):
    """bug #1 on the installed release's DSA backend (pristine 0.5.14: page_table max_context_len + D)."""

    @classmethod
    def setUpClass(cls):
        from sglang_dsa_fix.proof import replay

        cls.replay = replay
        cls.layout, cls.cls = replay.import_backend_class()
        cls.target, hook = watch_hook("dsa_replay", installed_version())
        cls.hook = staticmethod(hook)
        cls.case = replay.Case(256, 5, 1, 4)

    def setUp(self):
        # 0.5.13+: the DSA body behind capture and replay; 0.5.11 - 0.5.12 (NSA): the replay entry.
        method = (
            "_apply_cuda_graph_metadata"
            if self.layout.module.endswith("dsa_backend")
            else ("init_forward_metadata_replay_cuda_graph")
        )
        self.assertEqual(self.target, f"{self.layout.module}.{self.layout.class_name}.{method}")
        self.assertFalse(runtime_fix.page_table_fix_installed(self.cls))
        watch.reset()
        self.addCleanup(watch.reset)

    @contextlib.contextmanager
    def fixed(self):
        runtime_fix.install_page_table_fix(self.cls)
        try:
            yield
        finally:
            runtime_fix.uninstall_page_table_fix(self.cls)

    def test_pristine_overshooting_target_verify_is_counted(self):
        session = self.replay.GraphSession(self.cls, self.case)
        with hooked(self.target, self.hook):
            fits = session.replay("TARGET_VERIFY", 4, 256)  # 256 + 5 columns: as wide as the buffer
            self.assertEqual(watch.report()["graph_replays_short"], 0)
            over = session.replay("TARGET_VERIFY", 4, 257)
        self.assertTrue(fits.ok, fits)
        if installed_version() not in AFFECTED_BY_BUG_1:
            self.skipTest("bug #1 is fixed upstream in this release")
        self.assertIsNotNone(over.error)  # counted before the replay raised
        report = watch.report()
        self.assertEqual((report["dsa_page_table_short"], report["graph_replays_short"]), (1, 1))
        self.assertEqual(
            report["first_violation"],
            dict(where=self.target, buffer='decode_cuda_graph_metadata["page_table"]', width=261, needed=262),
        )

    def test_fixed_replay_is_not_counted(self):
        with self.fixed():
            session = self.replay.GraphSession(self.cls, self.case)
            with hooked(self.target, self.hook):
                result = session.replay("TARGET_VERIFY", 4, 257)
        self.assertTrue(result.ok, result)
        report = watch.report()
        self.assertEqual((report["dsa_page_table_short"], report["graph_replays_short"]), (0, 0))
        self.assertIsNone(report["first_violation"])

    def test_sweep_count_equals_replays_past_the_buffer(self):
        case = self.replay.Case(256, 5, 64, 4)
        for fixed in (False, True):
            watch.reset()
            with self.fixed() if fixed else contextlib.nullcontext(), hooked(self.target, self.hook):
                results = self.replay.sweep(self.cls, case, "TARGET_VERIFY", 2)
            short = [r for r in results if r.columns > r.buffer_width]
            with self.subTest(fixed=fixed):
                self.assertEqual(watch.report()["dsa_page_table_short"], len(short))
                self.assertEqual(short, [r for r in results if r.error])
                if fixed or installed_version() not in AFFECTED_BY_BUG_1:
                    self.assertEqual(short, [])
                else:
                    self.assertGreater(len(short), 0)


class TestFa3Check(unittest.TestCase):
    """The FA3 replay check's arithmetic on a minimal backend object, with sglang's real
    ForwardMode and the 0.5.14 signature of _apply_cuda_graph_metadata (the real
    FlashAttentionBackend is driven in TestBackendReplays.test_fa3_page_table_at_sglangs_size)."""

    def test_target_verify_past_the_page_table(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        def _apply_cuda_graph_metadata(
            self,
            bs,
            req_pool_indices,
            seq_lens,
            seq_lens_sum,
            encoder_lens,
            forward_mode,
            spec_info,
            seq_lens_cpu,
        ):
            return "sglang's own"

        site = watch.Site("fa3_replay", "test.fa3", "page_table (pages)")
        hook = watch._hook(watch.kinds()["fa3_replay"], site)
        # context 256, page 64: ceil(256 / 64) = 4 pages; target_verify reads seq_len + D tokens.
        table = SimpleNamespace(page_table=torch.zeros(2, 4, dtype=torch.int32))
        backend = SimpleNamespace(
            topk=1, page_size=64, speculative_num_draft_tokens=5, target_verify_metadata={2: table}
        )
        for longest, short in ((251, 0), (252, 1), (300, 2)):
            seq_lens = torch.tensor([longest, 3])
            mode = ForwardMode.TARGET_VERIFY
            out = hook(_apply_cuda_graph_metadata, backend, 2, None, seq_lens, 0, None, mode, None, seq_lens)
            self.assertEqual((out, site.count), ("sglang's own", short))
        self.assertEqual((site.width, site.needed), (4, 5))
        # Lengths that are not on the host are never read (that would wait on the device): not judged.
        on_device = torch.tensor([300, 3], device="meta")
        hook(_apply_cuda_graph_metadata, backend, 2, None, on_device, 0, None, mode, None, on_device)
        self.assertEqual((site.count, site.failed), (2, None))


class TestBackendReplays(unittest.TestCase):
    """The replay check of every other backend whose graph buffer is sized from max_context_len,
    on the real backend class driven through its own init_forward_metadata_out_graph (capture,
    then a replay view from the runner's build_replay_fb_view; test/graph_backends.py says what
    stands in for GPU-only code). A replay that fits counts nothing; one past a deliberately
    narrowed buffer is counted, and the first violation names the buffer, its width and what
    the replay needed. Where the kernel that fills the buffer does not stop at its end, what it
    wrote past the end is compared with req_to_token: the narrowing is real, not only counted.

    Backends (0.5.14): flashinfer, flashinfer MLA, triton, TRT-LLM MHA / MLA (sm100 kernels,
    metadata only), FlashMLA (sgl_kernel, metadata only). C 64 for the flat buffers (max_bs 2),
    256 for the tables; D 4."""

    D = 4

    @classmethod
    def setUpClass(cls):
        if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no CUDA
            raise unittest.SkipTest("the backends' Triton fills run on CPU tensors: needs TRITON_INTERPRET=1")
        if installed_version() != "0.5.14":
            raise unittest.SkipTest(
                f"graph_backends builds the backends with 0.5.14's attributes, not {installed_version()}'s"
            )
        cls.addClassCleanup(graph_backends.import_flashmla())
        cls.addClassCleanup(graph_backends.import_fa3())

    def setUp(self):
        watch.reset()
        self.addCleanup(watch.reset)

    def candidate(self, kind):
        (candidate,) = [c for c in watch.select(installed_version(), resolve=False) if c.kind == kind]
        return candidate

    def watched(self, kind, built, mode, seq_lens, spec_info=None, stale_host=None, D=None):
        """Capture (mode, bs) and replay seq_lens with the watch hook around the real entry.
        Returns (report, the error the replay raised or None); only this site is reported."""
        backend, stand_ins = built
        candidate = self.candidate(kind)
        site = watch.Site(kind, candidate.target, candidate.buffer)
        tokens = 1 if mode == "DECODE" else D or self.D
        error = None
        with (
            mock.patch.dict(watch._SITES, {candidate.target: site}, clear=True),
            stand_ins,
            hooked(candidate.target, watch._hook(watch.kinds()[kind], site)),
        ):
            graph_backends.capture(backend, mode, len(seq_lens), tokens, spec_info)
            try:
                graph_backends.replay(backend, mode, seq_lens, tokens, spec_info, stale_host)
            except (RuntimeError, ValueError) as exc:  # flashinfer's plan refuses, as on a GPU
                error = exc
            report = watch.report()
        self.assertIsNone(site.failed)
        return report, error

    def assert_fits(self, kind, report, error=None):
        name = watch.counter_names()[kind][0]
        self.assertEqual((report[name], report["graph_replays_short"], error), (0, 0, None))
        self.assertIsNone(report["first_violation"])

    def assert_short(self, kind, report, width, needed):
        candidate = self.candidate(kind)
        self.assertEqual((report[watch.counter_names()[kind][0]], report["graph_replays_short"]), (1, 1))
        self.assertEqual(
            report["first_violation"],
            dict(where=candidate.target, buffer=candidate.buffer, width=width, needed=needed),
        )

    def flat_kv_indices(self, backend, seq_lens, extra=0):
        """What the replay writes into a flat kv_indices: request b's first s + extra slots of
        pool row b + 1, laid end to end."""
        rows = backend.req_to_token_pool.req_to_token
        return torch.cat([rows[b + 1, : s + extra] for b, s in enumerate(seq_lens)]).to(torch.int64)

    def table_page(self, backend, row: int, page_index: int, page: int) -> int:
        """The page number a table fill writes for pool row ``row``, page ``page_index``."""
        return int(backend.req_to_token_pool.req_to_token[row, page_index * page]) // page

    # flat kv_indices: the sum of the lengths against the buffer's length

    def test_triton_kv_indices(self):
        seq_lens, kind = [60, 50], "triton_replay"
        built = graph_backends.triton_backend(64, self.D)
        report, error = self.watched(kind, built, "DECODE", seq_lens)
        self.assert_fits(kind, report, error)
        written = built[0].cuda_graph_kv_indices[:110].to(torch.int64)
        self.assertTrue(torch.equal(written, self.flat_kv_indices(built[0], seq_lens)))

        buffer = graph_backends.guarded((100,), dtype=torch.int64)
        built = graph_backends.triton_backend(64, self.D, kv_indices=buffer)
        report, error = self.watched(kind, built, "DECODE", seq_lens)
        self.assertIsNone(error)  # nothing in sglang notices
        self.assert_short(kind, report, 100, 110)
        expected = self.flat_kv_indices(built[0], seq_lens)
        self.assertTrue(torch.equal(graph_backends.past_the_end(buffer)[:10], expected[100:]))

        watch.reset()  # target_verify reads the prefix only: the same 110 entries
        built = graph_backends.triton_backend(
            64, self.D, kv_indices=graph_backends.guarded((100,), dtype=torch.int64)
        )
        spec = graph_backends.verify_input(2, self.D)
        self.assert_short(kind, self.watched(kind, built, "TARGET_VERIFY", seq_lens, spec)[0], 100, 110)

    def test_stale_host_lengths_are_not_judged(self):
        # seq_lens_sum None: the batch published no host lengths; the view's seq_lens_cpu still
        # holds an earlier batch's (60 + 50 > 100), the replay writes 10 + 10.
        kind = "triton_replay"
        built = graph_backends.triton_backend(
            64, self.D, kv_indices=graph_backends.guarded((100,), dtype=torch.int64)
        )
        report, error = self.watched(kind, built, "DECODE", [10, 10], stale_host=[60, 50])
        self.assert_fits(kind, report, error)

    def test_flashinfer_kv_indices(self):
        seq_lens, kind = [60, 50], "flashinfer_replay"
        report, error = self.watched(kind, graph_backends.flashinfer_backend(64, self.D), "DECODE", seq_lens)
        self.assert_fits(kind, report, error)
        buffer = graph_backends.guarded((100,))
        built = graph_backends.flashinfer_backend(64, self.D, kv_indices=buffer)
        report, error = self.watched(kind, built, "DECODE", seq_lens)
        self.assertIsNone(error)  # the Triton fill writes straight into the graph buffer
        self.assert_short(kind, report, 100, 110)
        expected = self.flat_kv_indices(built[0], seq_lens)
        self.assertTrue(torch.equal(graph_backends.past_the_end(buffer)[:10].to(torch.int64), expected[100:]))

        # target_verify: spec_info builds s + D per request, the wrapper's plan copies them in.
        watch.reset()
        spec = graph_backends.verify_input(2, self.D)
        built = graph_backends.flashinfer_backend(64, self.D)
        report, error = self.watched(kind, built, "TARGET_VERIFY", seq_lens, spec)
        self.assert_fits(kind, report, error)
        written = built[0].cuda_graph_kv_indices[0][:118].to(torch.int64)
        self.assertTrue(torch.equal(written, self.flat_kv_indices(built[0], seq_lens, self.D)))
        watch.reset()
        built = graph_backends.flashinfer_backend(64, self.D, kv_indices=graph_backends.guarded((115,)))
        report, error = self.watched(
            kind, built, "TARGET_VERIFY", seq_lens, graph_backends.verify_input(2, self.D)
        )
        self.assertIsInstance(error, ValueError)
        self.assert_short(kind, report, 115, 118)

    def test_flashinfer_mla_kv_indices(self):
        seq_lens, kind = [50, 40], "flashinfer_mla_replay"
        built = graph_backends.flashinfer_mla_backend(64, self.D)
        report, error = self.watched(
            kind, built, "TARGET_VERIFY", seq_lens, graph_backends.verify_input(2, self.D)
        )
        self.assert_fits(kind, report, error)
        written = built[0].cuda_graph_kv_indices[:98].to(torch.int64)
        self.assertTrue(torch.equal(written, self.flat_kv_indices(built[0], seq_lens, self.D)))
        built = graph_backends.flashinfer_mla_backend(64, self.D, kv_indices=graph_backends.guarded((90,)))
        report, error = self.watched(
            kind, built, "TARGET_VERIFY", seq_lens, graph_backends.verify_input(2, self.D)
        )
        self.assertIsInstance(error, RuntimeError)  # the plan's copy into a shorter slice
        self.assert_short(kind, report, 90, 98)

    # per-request tables: pages of the longest request against the table's width

    def test_trtllm_mha_page_table(self):
        # C 256, page 16: 16 pages. target_verify fills ceil((s + D) / 16) pages per request:
        # s 238 needs 16 (15 without D).
        kind = "trtllm_mha_replay"
        report, error = self.watched(
            kind, graph_backends.trtllm_mha_backend(256, self.D), "TARGET_VERIFY", [200, 238]
        )
        self.assert_fits(kind, report, error)
        built = graph_backends.trtllm_mha_backend(256, self.D, width=15)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 238])
        self.assertIsNone(error)
        self.assert_short(kind, report, 15, 16)
        # The fill masks by the request's own pages: the last row's 16th page lands past the table.
        table = graph_backends.verify_table(built[0])
        self.assertEqual(int(graph_backends.past_the_end(table)[0, 0]), self.table_page(built[0], 2, 15, 16))

    def test_trtllm_mla_block_table(self):
        # C 256, page 64: _calc_padded_blocks pads 4 pages to 64 (0.5.14 trtllm_mla_backend.py:209-230);
        # s 253 + D 4 needs 5 pages (4 without D).
        kind = "trtllm_mla_replay"
        built = graph_backends.trtllm_mla_backend(256, self.D)
        self.assertEqual(built[0].decode_cuda_graph_kv_indices.shape[1], 64)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assert_fits(kind, report, error)
        built = graph_backends.trtllm_mla_backend(256, self.D, width=4)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assertIsNone(error)
        self.assert_short(kind, report, 4, 5)
        table = graph_backends.verify_table(built[0])
        self.assertEqual(int(graph_backends.past_the_end(table)[0, 0]), self.table_page(built[0], 2, 4, 64))

    def test_fa3_page_table_at_sglangs_size(self):
        # The real FlashAttentionBackend at sglang's own size: C 256, page 64 -> ceil(256 / 64) = 4
        # pages (0.5.14 flashattention_backend.py:1610); target_verify asks the kernel for s + D keys
        # (:2292-2325): s 253 + D 4 needs 5 pages. The copy is sliced to the table: nothing raises.
        kind = "fa3_replay"
        report, error = self.watched(
            kind, graph_backends.fa3_backend(256, self.D), "TARGET_VERIFY", [200, 252]
        )
        self.assert_fits(kind, report, error)
        built = graph_backends.fa3_backend(256, self.D)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assertIsNone(error)  # silent: the kernel is told 257 keys, the table holds 256
        self.assert_short(kind, report, 4, 5)
        metadata = built[0].target_verify_metadata[2]
        self.assertEqual(int(metadata.cache_seqlens_int32[1]), 253 + self.D)
        self.assertEqual(metadata.page_table.shape[1], 4)
        # Bug #3's fix (the plugin's hook, right after init_cuda_graph_state): the counter stays 0.
        built = graph_backends.fa3_backend(256, self.D)
        self.assertTrue(fa3_width.enforce(built[0]))
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assert_fits(kind, report, error)

    def test_flashmla_block_table(self):
        # C 256: (256 + 64) // 64 = 5 pages; s 253 + D 4 needs 5 (4 without D).
        kind = "flashmla_replay"
        built = graph_backends.flashmla_backend(256, self.D)
        self.assertEqual(built[0].cuda_graph_kv_indices.shape[1], 5)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assert_fits(kind, report, error)
        built = graph_backends.flashmla_backend(256, self.D, width=4)
        report, error = self.watched(kind, built, "TARGET_VERIFY", [200, 253])
        self.assertIsNone(error)
        self.assert_short(kind, report, 4, 5)
        table = graph_backends.verify_table(built[0])
        self.assertEqual(int(graph_backends.past_the_end(table)[0, 0]), self.table_page(built[0], 2, 4, 64))

    def at_sglang_size(self, kind, built, seq_lens, D, width, needed, page, spills):
        backend = built[0]
        table = graph_backends.verify_table(backend)
        self.assertEqual(tuple(table.shape), (graph_backends.MAX_BS, width))  # as sglang sizes it
        untouched = int(graph_backends.past_the_end(table)[0, 0])
        report, error = self.watched(kind, built, "TARGET_VERIFY", seq_lens, D=D)
        self.assertIsNone(error)
        self.assert_short(kind, report, width, needed)
        past = int(graph_backends.past_the_end(table)[0, 0])
        self.assertEqual(past, self.table_page(backend, 2, width, page) if spills else untouched)

    def test_sglang_sizes_near_the_context_limit(self):
        # Not narrowed: sglang's own sizes, a target_verify with the longest request at s = C - 3
        # (the longest a live request verifies at: P + M <= C - 2) in the last row, bs = max_bs.
        # Metadata only. The table fills launch whole blocks of 4096 tokens' pages for the width
        # and mask by the request's pages: inside the last block the extra page is written past
        # the row (here past the table, into the spare row); at a block boundary it is not
        # written, and the kernel, told s + D, would read the next row's first page (as FA3's).
        mha, mla, flashmla = "trtllm_mha_replay", "trtllm_mla_replay", "flashmla_replay"
        # C 256, page 16: 16 pages; s + D = 257 needs 17, inside the one 256-page block.
        built = graph_backends.trtllm_mha_backend(256, 4)
        self.at_sglang_size(mha, built, [200, 253], 4, width=16, needed=17, page=16, spills=True)
        # C 4096, page 64: 64 pages, already a multiple of the padding (as C 163840 is); 4097
        # needs 65, past the one 64-page block: not written.
        watch.reset()
        built = graph_backends.trtllm_mla_backend(4096, 4)
        self.at_sglang_size(mla, built, [4000, 4093], 4, width=64, needed=65, page=64, spills=False)
        # C 254, D 8: (254 + 64) // 64 = 4 pages; s + D = 259 needs 5.
        watch.reset()
        built = graph_backends.flashmla_backend(254, 8)
        self.at_sglang_size(flashmla, built, [200, 251], 8, width=4, needed=5, page=64, spills=True)
        # flashinfer MLA: a full batch verifying at C - 3 needs max_bs * (C + 1) > max_bs * C entries.
        watch.reset()
        built = graph_backends.flashinfer_mla_backend(64, 4)
        spec = graph_backends.verify_input(2, 4)
        report, error = self.watched("flashinfer_mla_replay", built, "TARGET_VERIFY", [61, 61], spec)
        self.assertIsInstance(error, RuntimeError)
        self.assert_short("flashinfer_mla_replay", report, 128, 130)


class TestPlugin(PluginRegistration):
    def setUp(self):
        super().setUp()
        self.addCleanup(watch.reset)

    def test_watch_registered_with_the_kill_switch(self):
        registered = self.register(SGLANG_DSA_FIX="0", SGLANG_DSA_FIX_WATCH="1")
        targets = [target for target, _, _ in watch.hooks(None)]
        self.assertTrue(targets)
        for target in targets:
            self.assertIn("AROUND", registered.get(target, []), target)
        # The kill switch: every bug either disabled or not hooked (the files' own state).
        self.assertTrue(all(info["hook"] in ("disabled", "none") for info in plugin.STATE["bugs"].values()))
        with mock.patch.dict(os.environ, SGLANG_DSA_FIX_WATCH="1"):
            report = plugin.report()
        self.assertTrue(report["watch"]["enabled"])
        self.assertEqual(report["watch"]["sites"], targets)
        self.assertEqual(report["bugs"], plugin.STATE["bugs"])
        # /server_info: the hooked Scheduler.get_internal_state carries it.
        result = SimpleNamespace(internal_state={})
        plugin._internal_state_body(result)
        self.assertEqual(result.internal_state[plugin.STATE_KEY]["watch"]["row_writes_past_end"], 0)

    def test_not_registered_unless_asked(self):
        registered = self.register(SGLANG_DSA_FIX_WATCH="0")
        for kind in watch.kinds().values():
            for candidate in kind.targets:
                self.assertNotIn("AROUND", registered.get(candidate.target, []))

    def test_first_violation_logged_once(self):
        watch.reset()
        target, hook = watch_hook("row_write", installed_version())
        start, end = torch.tensor([9]), torch.tensor([12])
        hook(lambda *args: None, None, torch.zeros(2, 10, dtype=torch.int32), start, end, None, 1)
        with self.assertLogs("sglang_dsa_fix", "WARNING") as logs:
            first = plugin.report()["watch"]
            again = plugin.report()["watch"]
        self.assertEqual(len(logs.records), 1)
        self.assertIn(target, logs.output[0])
        self.assertEqual(first, again)
        self.assertEqual(
            first["first_violation"], dict(where=target, buffer="req_to_token", width=10, needed=12)
        )
        self.assertEqual((first["row_writes_past_end"], first["row_columns_past_end"]), (1, 2))


if __name__ == "__main__":
    unittest.main()
