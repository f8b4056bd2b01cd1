"""Regression tests: DSA CUDA-graph page_table width vs req_to_token under EAGLE.

The real sglang backend class is driven through init_cuda_graph_state, capture and replay
(DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2) for seq_len from context_len-2 up to the request
pool's limit, three ways:
  * pristine: replays that read past the graph buffer raise sglang's size-mismatch
    RuntimeError (TARGET_VERIFY past context_len always does on an affected release);
  * runtime fix (sglang_dsa_fix.runtime_fix) and
  * in-tree patch (applied to a temporary copy of the installed sglang): every replay
    succeeds and every written page_table_1 / real_page_table row equals req_to_token.

The multi-step draft backend is driven through its precompute + fused metadata-copy path
with sentinel-guarded buffers (sglang_dsa_fix.multi_step).

CPU tier: runs anywhere; the only stand-in is seqlens_expand_triton (checked below against
brute force). GPU tier (``*CUDA`` classes): the same cases on a CUDA device with the real
Triton / deep_gemm / JIT kernels, and a real CUDA graph captured once per case that reads
page_table_1 and real_page_table after every replay update; skipped without CUDA.
Runs under pytest and as ``python test/srt/test_dsa_cuda_graph.py``. With
SGLANG_DSA_FIX_RESULTS=<file> every sweep appends one JSON line (machine-readable results).
"""

import itertools
import json
import os
import sys
import unittest

import torch
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

from sglang_dsa_fix import runtime_fix, width
from sglang_dsa_fix.proof import multi_step, replay
from sglang_dsa_fix.proof.cpu_stand_ins import seqlens_expand_reference
from sglang_dsa_fix.proof.patched_copy import patched_copy

register_cpu_ci(est_time=300, suite="stage-a-test-cpu")
register_cuda_ci(est_time=300, suite="stage-b-test-small-1-gpu")

# The fast default tier covers every mode at the boundary with a few shapes; make test-full
# (SGLANG_DSA_FIX_FULL=1) sweeps them all.
FULL = os.environ.get("SGLANG_DSA_FIX_FULL") == "1"
DRAFT_TOKENS = (2, 4, 5, 6, 8) if FULL else (2, 5)
PAGE_SIZES = (1, 64)
MAX_BS = 4
HAS_CUDA = torch.cuda.is_available()
RESULTS_FILE = os.environ.get("SGLANG_DSA_FIX_RESULTS")

LAYOUT, BACKEND_CLS = replay.import_backend_class()
MULTI_STEP_CLS = getattr(sys.modules[BACKEND_CLS.__module__], LAYOUT.multi_step_class_name)


def cases(device, context_lens, draft_tokens=DRAFT_TOKENS, max_bs=MAX_BS):
    for ctx, D, page in itertools.product(context_lens, draft_tokens, PAGE_SIZES):
        yield replay.Case(ctx, D, page, max_bs, device)


def record(test, case, mode, bs, results):
    """One JSON line per sweep, for the GPU report."""
    if not RESULTS_FILE:
        return
    errors = sorted({r.error for r in results if r.error})
    line = {
        "test": type(test).__name__,
        "device": case.device,
        "context_len": case.context_len,
        "num_draft_tokens": case.num_draft_tokens,
        "page_size": case.page_size,
        "mode": mode,
        "bs": bs,
        "buffer_width": results[0].buffer_width,
        "seq_lens": [results[0].seq_len, results[-1].seq_len],
        "replays": len(results),
        "failed": sum(not r.ok for r in results),
        "errors": errors[:3],
    }
    if isinstance(results[0], multi_step.MultiStepResult):
        line.update(
            copy_paths=sorted({r.copy_path for r in results}),
            sentinel_clobbered=sum(r.sentinel_clobbered for r in results),
            rows_beyond_bs_clobbered=sum(r.rows_beyond_bs_clobbered for r in results),
            mismatched_rows=sum(r.mismatched_rows for r in results),
        )
    with open(RESULTS_FILE, "a") as handle:
        handle.write(json.dumps(line) + "\n")


class TestSeqlensExpandReference(CustomTestCase):
    """The CPU stand-in must equal the Triton kernel's contract, checked by brute force."""

    def test_reference_matches_brute_force(self):
        generator = torch.Generator().manual_seed(0)
        for trial in range(200):
            n = int(torch.randint(1, 9, (1,), generator=generator))
            max_q = int(torch.randint(1, 9, (1,), generator=generator))
            ext = torch.randint(1, max_q + 1, (n,), generator=generator, dtype=torch.int32)
            seq = torch.randint(max_q, 700000, (n,), generator=generator, dtype=torch.int32)
            expected = [kv - q + 1 + j for q, kv in zip(ext.tolist(), seq.tolist()) for j in range(q)]
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


class TestPoolWidthMirror(CustomTestCase):
    """The pool's width the benchmark reads back must be sglang's own sizing."""

    def test_matches_sglang(self):
        for D, page in itertools.product(DRAFT_TOKENS, PAGE_SIZES):
            case = replay.Case(256, D, page, MAX_BS)
            shape = width.SpecShape(256, D, D - 1, page_size=page)
            with self.subTest(D=D, page=page):
                self.assertEqual(
                    replay.req_to_token_width(case) - 256,
                    width.pristine_row_extra(replay.installed_form(), shape),
                )


class _ReplayMatrix:
    """Shared body of the CPU tier and the GPU tier (device='cuda')."""

    device = "cpu"
    context_lens = (256, 614400)
    max_bs = MAX_BS

    def backend_cls(self):
        raise NotImplementedError

    def cases(self, draft_tokens=DRAFT_TOKENS):
        return cases(self.device, self.context_lens, draft_tokens, self.max_bs)

    def sweeps(self):
        for case in self.cases():
            for mode, bs in itertools.product(replay.MODES, (1, self.max_bs)):
                results = replay.sweep(self.backend_cls(), case, mode, bs)
                record(self, case, mode, bs, results)
                yield case, mode, bs, results

    def multi_step_sweeps(self):
        # Draft decode needs >= 2 steps: D >= 3 with topk 1; D >= 5 takes the fused
        # three-backend kernel, D = 4 the per-backend copy.
        for case in self.cases(draft_tokens=[d for d in DRAFT_TOKENS if d >= 4]):
            for bs in (1, self.max_bs):
                results = multi_step.sweep(MULTI_STEP_CLS, self.backend_cls(), case, bs)
                record(self, case, "DRAFT_DECODE_MULTI_STEP", bs, results)
                yield case, bs, results


class _FixedReplayTests(_ReplayMatrix):
    def test_invariant_after_init_cuda_graph_state(self):
        for case in self.cases():
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

    def test_multi_step_draft_decode_is_exact_and_stays_in_bounds(self):
        for case, bs, results in self.multi_step_sweeps():
            with self.subTest(case=case, bs=bs):
                self.assertEqual(results[-1].seq_len, replay.req_to_token_width(case))
                for r in results:
                    self.assertTrue(r.ok, r)
                    self.assertGreater(r.checked_rows, 0, r)

    def test_row_comparison_detects_a_wrong_page_index(self):
        # The equality check itself must be able to fail.
        case = replay.Case(self.context_lens[0], 5, 64, self.max_bs, self.device)
        session = replay.GraphSession(self.backend_cls(), case)
        result = session.replay("TARGET_VERIFY", self.max_bs, case.context_len + 1)
        self.assertTrue(result.ok, result)
        session.backend.forward_metadata.page_table_1[3, 100] += 1
        idx, _, accept = replay.batch_for(case, "TARGET_VERIFY", self.max_bs, case.context_len + 1)
        session._compare(result, idx, accept)
        self.assertEqual(result.mismatched_rows, 1)


class TestPristineBackendCPU(_ReplayMatrix, CustomTestCase):
    """The bug, on the real backend: these must fail on sglang 0.5.4 - 0.5.14."""

    def setUp(self):
        self.assertFalse(runtime_fix.page_table_fix_installed(BACKEND_CLS))

    def backend_cls(self):
        return BACKEND_CLS

    def test_invariant_violated_after_init_cuda_graph_state(self):
        for case in self.cases():
            with self.subTest(case=case):
                session = replay.GraphSession(self.backend_cls(), case)
                self.assertFalse(width.holds(session.backend))
                self.assertLessEqual(session.buffer_width, case.context_len + case.num_draft_tokens)

    def test_replay_raises_exactly_when_reading_past_the_buffer(self):
        for case, mode, bs, results in self.sweeps():
            with self.subTest(case=case, mode=mode, bs=bs):
                for r in results:
                    if r.columns > r.buffer_width:
                        self.assertEqual(r.error, width.size_mismatch_message(r.buffer_width, r.columns))
                    else:
                        self.assertTrue(r.ok, r)
                if mode == "TARGET_VERIFY":
                    past_context = [r for r in results if r.seq_len > case.context_len]
                    self.assertTrue(past_context)
                    self.assertTrue(all(r.error for r in past_context), past_context)

    def test_multi_step_draft_decode_past_the_buffer_is_unsafe(self):
        # Reading past the buffer must never pass silently: either the copy raises (torch
        # fallback path) or the guards show the fused kernel wrote out of bounds / wrong rows.
        for case, bs, results in self.multi_step_sweeps():
            with self.subTest(case=case, bs=bs):
                for r in results:
                    if r.seq_len <= r.buffer_width:
                        self.assertTrue(r.ok, r)
                    elif r.copy_path.startswith("fallback"):  # torch copy_: raises
                        self.assertIn("must match the size of tensor b", r.error or "", r)
                    else:  # fused JIT kernel: no error, but writes outside the rows it owns
                        self.assertIsNone(r.error, r)
                        self.assertGreater(r.sentinel_clobbered + r.rows_beyond_bs_clobbered, 0, r)


class TestRuntimeFixCPU(_FixedReplayTests, CustomTestCase):
    @classmethod
    def setUpClass(cls):
        runtime_fix.install_page_table_fix(BACKEND_CLS)

    @classmethod
    def tearDownClass(cls):
        runtime_fix.uninstall_page_table_fix(BACKEND_CLS)

    def backend_cls(self):
        return BACKEND_CLS

    def test_install_is_idempotent_and_reversible(self):
        wrapped = BACKEND_CLS.__dict__["init_cuda_graph_state"]
        runtime_fix.install_page_table_fix(BACKEND_CLS)
        self.assertIs(BACKEND_CLS.__dict__["init_cuda_graph_state"], wrapped)
        session = replay.GraphSession(BACKEND_CLS, replay.Case(256, 5, 64, MAX_BS))
        self.assertFalse(width.enforce(session.backend))  # already right: no-op


class TestInTreePatchCPU(_FixedReplayTests, CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._patched = patched_copy()
        copy = cls._patched.__enter__()
        cls.patched_cls, cls.changed = copy.backend_class, copy.outcome.changed

    @classmethod
    def tearDownClass(cls):
        cls._patched.__exit__(None, None, None)

    def backend_cls(self):
        return self.patched_cls

    def test_patched_copy_is_a_distinct_real_backend(self):
        self.assertTrue(any(p.name == f"{LAYOUT.relative_path.rsplit('/', 1)[1]}" for p in self.changed))
        self.assertIsNot(self.patched_cls, BACKEND_CLS)
        self.assertEqual(self.patched_cls.__name__, BACKEND_CLS.__name__)
        self.assertFalse(runtime_fix.page_table_fix_installed(self.patched_cls))


@unittest.skipUnless(HAS_CUDA, "GPU tier: needs a CUDA device")
class TestPristineBackendCUDA(TestPristineBackendCPU):
    device = "cuda"
    context_lens = (512, 614400)
    max_bs = 8


@unittest.skipUnless(HAS_CUDA, "GPU tier: needs a CUDA device")
class TestRuntimeFixCUDA(TestRuntimeFixCPU):
    device = "cuda"
    context_lens = (512, 614400)
    max_bs = 8


@unittest.skipUnless(HAS_CUDA, "GPU tier: needs a CUDA device")
class TestInTreePatchCUDA(TestInTreePatchCPU):
    device = "cuda"
    context_lens = (512, 614400)
    max_bs = 8


if __name__ == "__main__":
    unittest.main()
