"""Bug #1 at D 4 and D 5, settled by driving the real code (``proof.verify_reach``).

The longest target_verify seq_len comes from a drive, not from the formula: ``proof.row_overflow``
runs one request's whole spec-v2 decode through the release's own prepare and reservation under
a scheduler loop modelled on sglang's (admission clamp of max_new_tokens, the overlap lag, the
seq_lens advance; cited in row_overflow) and records the seq_lens every verify runs with. The
loop is a model; the H200 run at D 5 (seq_len 513) is the measurement it must reproduce. Then the pristine DSA backend is replayed (TARGET_VERIFY,
buffer ``context_len + D``) at the longest of them:

- the driven maximum equals ``width.verify_seq_len_bound`` exactly (overlap on and off), so
  an off-by-one in the bound fails here; partial acceptance stays at or below it;
- the H200 observation is reproduced (0.5.14, context 512, D 5, prompt 503, clamped
  max_new_tokens: seq_len 513, 518 columns into a 517-wide buffer);
- D 4: the replay at the longest reachable seq_len passes (its columns fill the buffer to the
  last one: one more and it fails); D 5: it fails with the upstream size-mismatch message.

The fast tier drives context 256 / 512, D 4..6; SGLANG_DSA_FIX_FULL=1 sweeps D 2..8 × context
256 / 512 × acceptance 1, 2, D - 1, D over prompts 1 .. 3D + 2 tokens short of the clamp.
"""

import itertools
import os
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_dsa_fix import runtime_fix, width
from sglang_dsa_fix.proof import replay, row_overflow, verify_reach

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

FULL = os.environ.get("SGLANG_DSA_FIX_FULL") == "1"
VERSION = replay.installed_version()
LAYOUT, BACKEND_CLS = replay.import_backend_class()
# The bookkeeping cited in row_overflow is 0.5.14's; the pristine buffer width C + D is 0.5.13 / 0.5.14's.
on_0_5_14 = unittest.skipUnless(
    VERSION in ("0.5.13", "0.5.14") and row_overflow.sizing_module() is not None,
    "the seq_lens bookkeeping and the pristine C + D buffer are read from 0.5.13 / 0.5.14",
)


@on_0_5_14
class TestLongestVerifySeqLen(CustomTestCase):
    def test_measured_maximum_is_the_bound(self):
        contexts, draft_tokens = ((256, 512), range(2, 9)) if FULL else ((256,), (4, 5, 6))
        for C, D, overlap in itertools.product(contexts, draft_tokens, (True, False)):
            with self.subTest(C=C, D=D, overlap=overlap):
                reach = verify_reach.longest_verify(C, D, overlap)
                self.assertEqual(reach.longest, width.verify_seq_len_bound(C, D, overlap))
                for result in reach.results:
                    # The real prepare had reserved every verify's draft columns [seq_len, seq_len + D).
                    self.assertTrue(all(s + D <= allocated for s, allocated in result.verifies), result)

    @unittest.skipUnless(FULL, "the wide sweep runs with SGLANG_DSA_FIX_FULL=1")
    def test_partial_acceptance_and_far_prompts_stay_within_the_bound(self):
        for C, D, overlap in itertools.product((256, 512), range(2, 9), (True, False)):
            prompts = [C - 2 - m for m in range(1, 3 * D + 3)]
            for accept in sorted({1, 2, D - 1, D} & set(range(1, D + 1))):
                with self.subTest(C=C, D=D, overlap=overlap, accept=accept):
                    reach = verify_reach.longest_verify(C, D, overlap, accept, prompts)
                    # Overlap: one more verify after the last useful one, accept_len further.
                    expected = C - 4 + (accept if overlap else 0)
                    self.assertEqual(reach.longest, expected)
                    self.assertLessEqual(reach.longest, width.verify_seq_len_bound(C, D, overlap))

    def test_h200_observation(self):
        # 0.5.14, context 512, D 5 (steps 4, topk 1), page 64, overlap on, prompt 503,
        # max_new_tokens unset (clamped to 7), every draft accepted: verifies at 503, 508, 513.
        reach = verify_reach.longest_verify(512, 5, True, prompts=[503])
        self.assertEqual([s for s, _ in reach.results[0].verifies], [503, 508, 513])
        self.assertEqual(reach.longest, 513)


@on_0_5_14
@unittest.skipIf(BACKEND_CLS is None, "no DSA/NSA backend in this sglang")
class TestPristineReplayAtTheLongestVerify(CustomTestCase):
    """The two drives composed: the scheduler's longest verify fed to the pristine backend."""

    def setUp(self):
        self.assertFalse(runtime_fix.page_table_fix_installed(BACKEND_CLS))

    def test_d4_passes_and_d5_fails(self):
        for C in (256, 512):
            for D in (4, 5):
                with self.subTest(C=C, D=D):
                    longest = verify_reach.longest_verify(C, D, True).longest
                    result = verify_reach.replay_target_verify(C, D, longest, BACKEND_CLS)
                    self.assertEqual(result.buffer_width, C + D)  # pristine 0.5.14 sizing
                    if D == 4:
                        self.assertTrue(result.ok, result)
                        self.assertEqual(result.columns, result.buffer_width)  # not a column to spare
                        past = verify_reach.replay_target_verify(C, D, longest + 1, BACKEND_CLS)
                        self.assertEqual(past.error, width.size_mismatch_message(C + D, C + D + 1))
                    else:
                        self.assertEqual(result.error, width.size_mismatch_message(C + D, longest + D))
                        before = verify_reach.replay_target_verify(C, D, longest - 1, BACKEND_CLS)
                        self.assertTrue(before.ok, before)

    def test_h200_crash_reproduced(self):
        result = verify_reach.replay_target_verify(512, 5, 513, BACKEND_CLS)
        self.assertEqual(result.error, width.size_mismatch_message(517, 518))


if __name__ == "__main__":
    unittest.main()
