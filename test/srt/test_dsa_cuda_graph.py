"""Regression tests: DSA CUDA-graph page_table width vs req_to_token under EAGLE.

The real sglang backend class is driven through init_cuda_graph_state, capture and replay
(DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2) for seq_len from context_len-2 up to the request
pool's limit, three ways:
  * pristine: replays that read past the graph buffer raise sglang's size-mismatch
    RuntimeError (TARGET_VERIFY past context_len always does on an affected release);
  * runtime fix (sglang_dsa_fix.runtime_fix) and
  * in-tree patch (applied to a temporary copy of the installed sglang): every replay
    succeeds and every written page_table_1 / real_page_table row equals req_to_token.

CPU tier: runs anywhere; the only stand-in is seqlens_expand_triton (checked below against
brute force). Runs under pytest and as ``python test/srt/test_dsa_cuda_graph.py``.
"""

import itertools
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

from sglang_dsa_fix import replay, runtime_fix, width  # noqa: E402
from sglang_dsa_fix.backends import import_backend_class  # noqa: E402
from sglang_dsa_fix.cpu_stand_ins import seqlens_expand_reference  # noqa: E402
from sglang_dsa_fix.patched_copy import patched_backend_class  # noqa: E402

register_cpu_ci(est_time=300, suite="stage-a-test-cpu")

DRAFT_TOKENS = (2, 4, 5, 6, 8)
PAGE_SIZES = (1, 64)
CONTEXT_LENS = (256, 614400)
MAX_BS = 4
BATCH_SIZES = (1, MAX_BS)

_, BACKEND_CLS = import_backend_class()


def cases(device):
    for ctx, D, page in itertools.product(CONTEXT_LENS, DRAFT_TOKENS, PAGE_SIZES):
        yield replay.Case(ctx, D, page, MAX_BS, device)


class TestSeqlensExpandReference(CustomTestCase):
    """The CPU stand-in must equal the Triton kernel's contract, checked by brute force."""

    def test_reference_matches_brute_force(self):
        generator = torch.Generator().manual_seed(0)
        for trial in range(200):
            n = int(torch.randint(1, 9, (1,), generator=generator))
            max_q = int(torch.randint(1, 9, (1,), generator=generator))
            ext = torch.randint(1, max_q + 1, (n,), generator=generator, dtype=torch.int32)
            seq = torch.randint(max_q, 700000, (n,), generator=generator, dtype=torch.int32)
            expected = [
                kv - q + 1 + j for q, kv in zip(ext.tolist(), seq.tolist()) for j in range(q)
            ]
            got = seqlens_expand_reference(ext, seq, len(expected), max_q)
            with self.subTest(trial=trial):
                self.assertEqual(got.dtype, torch.int32)
                self.assertEqual(got.tolist(), expected)

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA for the Triton kernel")
    def test_reference_matches_triton_kernel(self):
        from sglang.srt.layers.attention.triton_ops.pad import seqlens_expand_triton

        ext = torch.tensor([5, 1, 3, 5], dtype=torch.int32, device="cuda")
        seq = torch.tensor([614405, 9, 256, 261], dtype=torch.int32, device="cuda")
        total = int(ext.sum())
        self.assertEqual(
            seqlens_expand_triton(ext, seq, total, 5).tolist(),
            seqlens_expand_reference(ext, seq, total, 5).tolist(),
        )


class _ReplayMatrix:
    """Shared body of the CPU tier (and, later, the GPU tier with device='cuda')."""

    device = "cpu"

    def backend_cls(self):
        raise NotImplementedError

    def sweeps(self):
        for case in cases(self.device):
            for mode, bs in itertools.product(replay.MODES, BATCH_SIZES):
                yield case, mode, bs, replay.sweep(self.backend_cls(), case, mode, bs)


class _FixedReplayTests(_ReplayMatrix):
    def test_invariant_after_init_cuda_graph_state(self):
        for case in cases(self.device):
            with self.subTest(case=case):
                session = replay.GraphSession(self.backend_cls(), case)
                self.assertTrue(width.holds(session.backend))
                self.assertEqual(session.buffer_width, session.pool.req_to_token.shape[1])

    def test_every_replay_writes_req_to_token_rows(self):
        for case, mode, bs, results in self.sweeps():
            with self.subTest(case=case, mode=mode, bs=bs):
                limit = replay.seq_len_limit(case, mode, replay.req_to_token_width(case))
                self.assertEqual([r.seq_len for r in results][-1], limit)
                self.assertGreater(limit, case.context_len)
                for r in results:
                    self.assertIsNone(r.error, r)
                    self.assertGreater(r.checked_rows, 0, r)
                    self.assertEqual(r.mismatched_rows, 0, r)


    def test_row_comparison_detects_a_wrong_page_index(self):
        # The equality check itself must be able to fail.
        case = replay.Case(256, 5, 64, MAX_BS, self.device)
        session = replay.GraphSession(self.backend_cls(), case)
        result = session.replay("TARGET_VERIFY", MAX_BS, case.context_len + 1)
        self.assertTrue(result.ok, result)
        session.backend.forward_metadata.page_table_1[3, 100] += 1
        idx, _, accept = replay.batch_for(case, "TARGET_VERIFY", MAX_BS, case.context_len + 1)
        session._compare(result, idx, accept)
        self.assertEqual(result.mismatched_rows, 1)


class TestPristineBackendCPU(_ReplayMatrix, CustomTestCase):
    """The bug, on the real backend: these must fail on sglang 0.5.4 - 0.5.14."""

    def setUp(self):
        self.assertFalse(runtime_fix.is_installed(BACKEND_CLS))

    def backend_cls(self):
        return BACKEND_CLS

    def test_invariant_violated_after_init_cuda_graph_state(self):
        for case in cases(self.device):
            with self.subTest(case=case):
                session = replay.GraphSession(self.backend_cls(), case)
                self.assertFalse(width.holds(session.backend))
                self.assertLessEqual(
                    session.buffer_width, case.context_len + case.num_draft_tokens
                )

    def test_replay_raises_exactly_when_reading_past_the_buffer(self):
        for case, mode, bs, results in self.sweeps():
            with self.subTest(case=case, mode=mode, bs=bs):
                for r in results:
                    if r.columns > r.buffer_width:
                        self.assertEqual(
                            r.error,
                            f"The size of tensor a ({r.buffer_width}) must match the size "
                            f"of tensor b ({r.columns}) at non-singleton dimension 1",
                        )
                    else:
                        self.assertTrue(r.ok, r)
                if mode == "TARGET_VERIFY":
                    past_context = [r for r in results if r.seq_len > case.context_len]
                    self.assertTrue(past_context)
                    self.assertTrue(all(r.error for r in past_context), past_context)


class TestRuntimeFixCPU(_FixedReplayTests, CustomTestCase):
    @classmethod
    def setUpClass(cls):
        runtime_fix.install(BACKEND_CLS)

    @classmethod
    def tearDownClass(cls):
        runtime_fix.uninstall(BACKEND_CLS)

    def backend_cls(self):
        return BACKEND_CLS

    def test_install_is_idempotent_and_reversible(self):
        wrapped = BACKEND_CLS.__dict__["init_cuda_graph_state"]
        runtime_fix.install(BACKEND_CLS)
        self.assertIs(BACKEND_CLS.__dict__["init_cuda_graph_state"], wrapped)
        session = replay.GraphSession(BACKEND_CLS, replay.Case(256, 5, 64, MAX_BS))
        self.assertFalse(width.enforce(session.backend))  # already right: no-op


class TestInTreePatchCPU(_FixedReplayTests, CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._patched = patched_backend_class()
        cls.patched_cls, cls.apply_message = cls._patched.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls._patched.__exit__(None, None, None)

    def backend_cls(self):
        return self.patched_cls

    def test_patched_copy_is_a_distinct_real_backend(self):
        self.assertTrue(self.apply_message.startswith("applied:"), self.apply_message)
        self.assertIsNot(self.patched_cls, BACKEND_CLS)
        self.assertEqual(self.patched_cls.__name__, BACKEND_CLS.__name__)
        self.assertFalse(runtime_fix.is_installed(self.patched_cls))


if __name__ == "__main__":
    unittest.main()
