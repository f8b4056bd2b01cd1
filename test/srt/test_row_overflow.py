"""Regression tests for bug #2: the spec-v2 decode reservation writes past a request's
``req_to_token`` row into the next request's row.

Real sglang code of the installed release drives each case (``proof.row_overflow``): the row
sizing, ``ReqToTokenPool``, the token allocator, ``ChunkCache``, ``Req``, ``ScheduleBatch``,
the spec-v2 prepare and its Triton kernel ``assign_req_to_token_pool`` (Triton's CPU
interpreter on CPU), and ``release_kv_cache``; the neighbour row holds a canary.

- pristine: the reservation writes exactly ``width.row_overflow_columns`` columns past the row
  end (D - 7 from D 8 on 0.5.13 / 0.5.14 with overlap on), and they land on the canary;
- runtime fix (the plugin's hook body) and in-tree patch (a patched temporary copy of the
  installed file): never past the row end, canary intact, every KV slot back in the allocator.

The fast tier covers the boundary (D 7, 8, 9; block 16 for DFLASH): each D's last decode steps
(~20 prepares), the whole decode (~150 prepares, 1-3 s a case in Triton's interpreter) at D 9
only, which passes the pristine row with overlap on and off; SGLANG_DSA_FIX_FULL=1 sweeps D 2..16 ×
page 1/64 × overlap on/off × context 256 / 163840 × prompts around the clamp × accept 1 / D.
"""

import inspect
import itertools
import os
import unittest

from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

from sglang_dsa_fix import release, runtime_fix, width
from sglang_dsa_fix.proof import row_overflow
from sglang_dsa_fix.proof.patched_copy import patched_copy
from sglang_dsa_fix.proof.replay import installed_form, installed_version

register_cpu_ci(est_time=120, suite="stage-a-test-cpu")
register_cuda_ci(est_time=60, suite="stage-b-test-small-1-gpu")

FULL = os.environ.get("SGLANG_DSA_FIX_FULL") == "1"
VERSION = installed_version()
FORM = installed_form()  # the release's form, as its files show it
SIZING = row_overflow.sizing_module()
# 0.5.9 - 0.5.12 size the row inline in ModelRunner: no function to drive, patch or hook.
sized_by_function = unittest.skipIf(SIZING is None, "this release sizes the req_to_token row inline")


# The fast tier's one D whose whole decode runs (at each page size and overlap mode).
WHOLE_DECODE_D = 9


def cases():
    if FULL:
        draft_tokens, contexts, accepts = range(2, 17), (256, 163840), ("1", "D")
    else:
        draft_tokens, contexts, accepts = (7, 8, 9), (256,), ("1",)
    for D, page, overlap, C, accept in itertools.product(
        draft_tokens, (1, 64), (True, False), contexts, accepts
    ):
        # Prompts around the clamp: the request's whole decode (C 256), or its last few steps.
        remaining = (2, D + 1, 2 * D + 3) if FULL else (2 * D + 3,)
        prompts = [100] if C == 256 and (FULL or D == WHOLE_DECODE_D) else []
        prompts += [C - 2 - r for r in remaining if C - 2 - r > 0]
        for prompt in prompts:
            yield row_overflow.RowCase(C, D, page, overlap, prompt, accept_len=1 if accept == "1" else D)


def shape_of(case):
    return width.SpecShape(
        case.context_len,
        case.num_draft_tokens,
        case.steps,
        case.topk,
        case.page_size,
        overlap=case.overlap,
        preclaims_bonus=release.decode_prepare(case.algorithm) != release.DFLASH_PREPARE,
    )


def runtime_fixed_sizing():
    """The installed sizing function with the plugin's AFTER-hook body applied, as HookRegistry does."""
    hook = runtime_fix.row_extra_fix(SIZING.__name__)
    original = SIZING.get_req_to_token_extra_context_len
    return lambda *args, **kwargs: hook(original(*args, **kwargs), *args, **kwargs)


@sized_by_function
class TestPristineRowOverflow(CustomTestCase):
    """The bug, on the real code: must fail on an affected release (0.5.13 - 0.5.23 at page 1)."""

    def test_reservation_writes_past_the_row_exactly_as_the_rule_says(self):
        overflowing = 0
        for case in cases():
            with self.subTest(case=case):
                result = row_overflow.run(case)
                expected = width.row_overflow_columns(FORM, shape_of(case))
                if case.accept_len == 1 and case.context_len - 2 - case.prompt_len >= 2:
                    # accept 1 reaches the bound: the last prepare sees context_len - margin.
                    margin = width.committed_margin(FORM, case.overlap)
                    self.assertEqual(result.last_committed, case.context_len - margin)
                    self.assertEqual(result.columns_past_row_end, expected)
                else:
                    self.assertLessEqual(result.columns_past_row_end, expected)
                # Whatever passed the row end landed on the next request's row.
                self.assertEqual(result.canary_clobbered, result.columns_past_row_end)
                overflowing += result.columns_past_row_end > 0
        self.assertGreater(overflowing, 0)

    def test_d8_overwrites_the_neighbour_on_0_5_14(self):
        result = row_overflow.run(row_overflow.RowCase(256, 8, 1, True, 100))
        expected = width.row_overflow_columns(FORM, shape_of(result.case))
        self.assertEqual((result.columns_past_row_end, result.canary_clobbered), (expected, expected))
        if VERSION in ("0.5.13", "0.5.14"):
            self.assertEqual(expected, 1)
            self.assertEqual(result.leaked_slots, 1)  # the overflowed slot is never freed (page 1)

    def test_canary_check_can_fail(self):
        # The observer itself: a write into the neighbour row must be counted.
        result = row_overflow.run(row_overflow.RowCase(256, 7, 1, True, 100))
        self.assertTrue(result.clean, result)  # D 7 fits on every release
        reserve = width.reserve_per_decode(shape_of(result.case), FORM)
        self.assertEqual(result.furthest_column, result.last_committed + reserve - 1)


class _FixedRowTests:
    def sizing(self):
        raise NotImplementedError

    def test_no_write_past_the_row_and_every_slot_freed(self):
        for case in cases():
            with self.subTest(case=case):
                result = row_overflow.run(case, self.sizing())
                self.assertTrue(result.clean, result)
                self.assertEqual(
                    result.row_extra,
                    max(
                        width.pristine_row_extra(FORM, shape_of(case)),
                        width.row_extra_floor(2 * width.alloc_len_per_decode(shape_of(case), FORM)),
                    ),
                )


@sized_by_function
class TestRuntimeFixRow(_FixedRowTests, CustomTestCase):
    def sizing(self):
        return runtime_fixed_sizing()


@sized_by_function
class TestInTreePatchRow(_FixedRowTests, CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._patched = patched_copy()
        cls.patched_sizing = staticmethod(cls._patched.__enter__().sizing_function)

    @classmethod
    def tearDownClass(cls):
        cls._patched.__exit__(None, None, None)

    def sizing(self):
        return self.patched_sizing


# (algorithm, D, topk, steps, page sizes): the configurations sglang's own repository tests the
# sizing invariant at, plus EAGLE topk 1 at D 8 / 16.
INVARIANT_CASES = (
    ("NGRAM", 12, 10, 1, (1,)),
    ("DFLASH", 16, 1, 1, (1,)),
    ("DSPARK", 16, 1, 1, (1,)),
    ("EAGLE", 8, 1, 7, (1, 64)),
    ("EAGLE", 16, 1, 15, (1, 64)),
    ("EAGLE", 8, 4, 3, (1, 16)),
)


def _algorithm_known(name: str) -> bool:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return hasattr(SpeculativeAlgorithm, name)


@sized_by_function
class TestFixedRowHoldsTheReservation(CustomTestCase):
    """With either fix, sglang's own ``get_req_to_token_extra_context_len()`` >=
    ``get_alloc_reserve_per_decode()`` (the invariant, no margin): the row holds the whole decode
    reservation whatever kv_committed_len the scheduler lets a request reach."""

    def test_both_fixes_hold_the_whole_reservation(self):
        with patched_copy() as patched:
            fixes = {"runtime fix": runtime_fixed_sizing(), "in-tree patch": patched.sizing_function}
            checked = 0
            for algorithm, D, topk, steps, pages in INVARIANT_CASES:
                if not _algorithm_known(algorithm):  # DFLASH: 0.5.14+, DSPARK: 0.5.16+
                    continue
                for page, (name, sizing) in itertools.product(pages, fixes.items()):
                    case = row_overflow.RowCase(
                        256, D, page, True, 100, topk=topk, num_steps=steps, algorithm=algorithm
                    )
                    with (
                        self.subTest(algorithm=algorithm, D=D, topk=topk, page=page, fix=name),
                        row_overflow.global_server_args(row_overflow.server_args_for(case)) as published,
                    ):
                        call = row_overflow.sizing_args(published)
                        reserve = SIZING.get_alloc_reserve_per_decode(*call)
                        self.assertGreaterEqual(sizing(*call), reserve)
                        checked += 1
            self.assertGreater(checked, 0)


@sized_by_function
class TestRowRuleAgainstSglang(CustomTestCase):
    """width.pristine_row_extra / alloc_len_per_decode (status's arithmetic) vs the real functions."""

    def test_mirror_equals_the_release(self):
        for D, page, topk, algorithm in itertools.product(
            (2, 8, 12, 64), (1, 64), (1, 4, 8), ("EAGLE", "NGRAM")
        ):
            steps = max(1, D - 1) if topk == 1 else 3
            case = row_overflow.RowCase(
                256, D, page, True, 100, topk=topk, num_steps=steps, algorithm=algorithm
            )
            args = row_overflow.server_args_for(case)
            shape = width.SpecShape(256, D, steps, topk, page, has_draft_kv=algorithm != "NGRAM")
            with (
                self.subTest(D=D, page=page, topk=topk, algorithm=algorithm),
                row_overflow.global_server_args(args) as published,
            ):
                call = row_overflow.sizing_args(published)
                self.assertEqual(
                    SIZING.get_req_to_token_extra_context_len(*call), width.pristine_row_extra(FORM, shape)
                )
                self.assertEqual(
                    SIZING.get_alloc_reserve_per_decode(*call), width.reserve_per_decode(shape, FORM)
                )


@sized_by_function
@unittest.skipUnless(FORM.page_aligns_reservation, "nxt is rounded to the allocator page from 0.5.16")
class TestDcpRowOverflow(CustomTestCase):
    """Decode context parallel: the allocator pages page_size x dcp_size and the prepare rounds
    nxt up to that page (0.5.17 speculative/eagle_utils.py:889-907), while 0.5.16 - 0.5.18 size
    the row with page_size - 1 only; 0.5.19+ size it by get_alloc_page_size() (0.5.19
    mem_cache/allocation_sizing.py:11-14, :90-95). DSA's page 64 with dcp 2, EAGLE D 4: the
    pristine row of 0.5.16 - 0.5.18 is short by the rule's count (57 columns at context 256);
    0.5.19+'s is not; both fixes hold it on every release (0.5.18: the page from the runtime
    context, under sglang's own ParallelContext.override standing in for the DCP group)."""

    def case(self, dcp: int):
        return row_overflow.RowCase(256, 4, 64, True, 100, dcp_size=dcp)

    def expected(self, result) -> int:
        case = result.case
        reserve = width.reserve_per_decode(shape_of(case), FORM)
        need = width.required_row_extra(reserve, case.alloc_page, FORM, case.overlap, True, case.context_len)
        return max(0, need - result.row_extra)

    def test_pristine_row_against_the_rule(self):
        for dcp in (1, 2, 4):
            with self.subTest(dcp=dcp):
                result = row_overflow.run(self.case(dcp))
                expected = self.expected(result)
                self.assertEqual((result.columns_past_row_end, result.canary_clobbered), (expected, expected))
                if dcp == 1 or FORM.row_holds_alloc_page:
                    self.assertEqual(expected, 0)
                elif dcp == 2:
                    self.assertEqual(expected, 57)  # ceil_128(252 + 8) = 384 against 256 + 71

    def test_both_fixes_hold_it(self):
        with patched_copy() as patched:
            for name, sizing in (
                ("runtime fix", runtime_fixed_sizing()),
                ("in-tree patch", patched.sizing_function),
            ):
                for dcp in (1, 2, 4):
                    with self.subTest(fix=name, dcp=dcp):
                        result = row_overflow.run(self.case(dcp), sizing)
                        self.assertTrue(result.clean, result)
                        self.assertGreaterEqual(result.row_extra, 8 + 64 * dcp - 1)  # reserve + page - 1


def _has_dflash_v2() -> bool:
    try:
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2  # noqa: F401
    except ImportError:
        return False
    return True


@sized_by_function
@unittest.skipUnless(_has_dflash_v2(), "this release has no DFLASH spec-v2 reservation (dflash_info_v2.py)")
class TestDflashRowOverflow(CustomTestCase):
    """DFLASH's own decode reservation (``DFlashDraftInputV2.prepare_for_decode``: 2 x block,
    no row check), which DSPARK runs too (0.5.16+, DFLASH's family), driven like the EAGLE
    prepare: block 16 at page 1 (steps = topk = 1, as sglang resolves DFLASH) overflows by the
    rule's count; both fixes keep it inside the row."""

    ALGORITHMS = [name for name in ("DFLASH", "DSPARK") if _algorithm_known(name)]

    def case(self, page: int, algorithm: str):
        return row_overflow.RowCase(256, 16, page, True, 100, topk=1, num_steps=1, algorithm=algorithm)

    def test_pristine_block_16_page_1_writes_into_the_next_row(self):
        for algorithm in self.ALGORITHMS:
            with self.subTest(algorithm=algorithm):
                result = row_overflow.run(self.case(1, algorithm))
                expected = width.row_overflow_columns(FORM, shape_of(result.case))
                self.assertEqual(expected, 8)  # 2 x 16 - (4 + 16) - 4: no bonus pre-claim, on 0.5.14 too
                self.assertEqual(result.last_committed, 256 - 4)
                self.assertEqual((result.columns_past_row_end, result.canary_clobbered), (8, 8))
                self.assertEqual(result.leaked_slots, 8)

    def test_both_fixes_keep_it_inside_the_row(self):
        with patched_copy() as patched:
            for name, sizing in (
                ("runtime fix", runtime_fixed_sizing()),
                ("in-tree patch", patched.sizing_function),
            ):
                for page, algorithm in itertools.product((1, 64) if FULL else (1,), self.ALGORITHMS):
                    with self.subTest(fix=name, page=page, algorithm=algorithm):
                        self.assertTrue(row_overflow.run(self.case(page, algorithm), sizing).clean)


@unittest.skipUnless(SIZING is None, "the release sizes the row with a function (tested above)")
class TestInlineSizedRowOverflow(CustomTestCase):
    """0.5.11 - 0.5.12 run spec v2 by default (0.5.9 - 0.5.10 with SGLANG_ENABLE_SPEC_V2=1) with
    the same reservation, but size the row inline: ``extra_max_context_len = 4`` plus D
    (0.5.12 model_executor/model_runner_kv_cache_mixin.py:245-247), nothing the plugin could
    hook. The real prepare and kernel with a row of that width (found in the installed source
    first) overflow; with the lines the in-tree patch writes there (executed from a patched
    copy) they do not."""

    def test_the_inline_width_overflows_as_the_rule_says(self):
        import sglang.srt.model_executor.model_runner_kv_cache_mixin as mixin

        source = inspect.getsource(mixin)
        self.assertIn("extra_max_context_len = 4", source)
        self.assertIn("extra_max_context_len += self.server_args.speculative_num_draft_tokens", source)
        overflowing = 0
        for D, page in itertools.product((7, 8, 9, 12), (1, 64)):
            case = row_overflow.RowCase(256, D, page, True, 100)
            with self.subTest(D=D, page=page):
                result = row_overflow.run(case, lambda *args, D=D: 4 + D)
                expected = width.row_overflow_columns(FORM, shape_of(case))
                self.assertEqual(result.columns_past_row_end, expected)
                self.assertEqual(result.canary_clobbered, expected)
                overflowing += expected > 0
        self.assertGreater(overflowing, 0)

    def test_the_patched_block_holds_the_reservation(self):
        with patched_copy() as patched:
            self.assertIsNotNone(patched.sizing_function)
            for D, page in itertools.product((7, 8, 9, 12, 16), (1, 64)):
                case = row_overflow.RowCase(256, D, page, True, 100)
                with self.subTest(D=D, page=page):
                    result = row_overflow.run(case, patched.sizing_function)
                    self.assertTrue(result.clean, result)
                    self.assertEqual(result.row_extra, width.fixed_row_extra(FORM, shape_of(case)))


class TestEveryAlgorithmHasARule(CustomTestCase):
    """Every speculative algorithm the release registers has a decode-prepare rule
    (``release.DECODE_PREPARE``): a new one fails here, never takes a silent default."""

    def test_registered_algorithms_have_rules(self):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        members = [member.name for member in SpeculativeAlgorithm]
        self.assertIn("EAGLE", members)
        self.assertEqual(release.algorithms_without_rule(members), [])

    def test_a_member_without_a_rule_is_named(self):
        self.assertEqual(release.algorithms_without_rule(["EAGLE", "Warp_Drive"]), ["WARP_DRIVE"])


def both_fixes(patched) -> dict:
    """The two fixed sizing functions: the plugin's hook body, and a ``patched_copy``'s."""
    return {"runtime fix": runtime_fixed_sizing(), "in-tree patch": patched.sizing_function}


@sized_by_function
@unittest.skipUnless(
    row_overflow.runs_spec_v2("FROZEN_KV_MTP"),
    "FROZEN_KV_MTP is not registered, or runs on spec v1 only (0.5.12 / 0.5.13 speculative/spec_info.py:148-149)",
)
class TestFrozenKvMtpRowOverflow(CustomTestCase):
    """FROZEN_KV_MTP (0.5.14+ spec v2: FrozenKVMTPWorkerV2 subclasses EAGLEWorkerV2 and reserves
    nothing itself) through sglang's own ``ScheduleBatch.prepare_for_decode`` dispatch with its
    real ``FrozenKVMTPDraftInput``: it reaches the EAGLE prepare (``release.DECODE_PREPARE``) and
    writes past the row exactly as EAGLE's rule says; both fixes keep it inside."""

    def cases(self):
        for D, page, overlap in itertools.product((8, 9), (1, 64), (True, False)):
            yield row_overflow.RowCase(
                256, D, page, overlap, 256 - 2 - (2 * D + 3), algorithm="FROZEN_KV_MTP"
            )

    def test_pristine_reservation_is_the_eagle_rule(self):
        overflowing = 0
        for case in self.cases():
            with self.subTest(case=case):
                result = row_overflow.run(case)
                self.assertEqual(result.prepares_run, {release.decode_prepare("FROZEN_KV_MTP")})
                expected = width.row_overflow_columns(FORM, shape_of(case))
                self.assertEqual(result.last_committed, 256 - width.committed_margin(FORM, case.overlap))
                self.assertEqual((result.columns_past_row_end, result.canary_clobbered), (expected, expected))
                if case.page_size == 1 and case.num_draft_tokens == 9:
                    self.assertGreater(expected, 0)  # 0.5.14: 2 (overlap) / 1, 0.5.15+: 1
                overflowing += expected > 0
        self.assertGreater(overflowing, 0)

    def test_both_fixes_keep_it_inside_the_row(self):
        with patched_copy() as patched:
            for (name, sizing), case in itertools.product(both_fixes(patched).items(), self.cases()):
                with self.subTest(fix=name, case=case):
                    result = row_overflow.run(case, sizing)
                    self.assertTrue(result.clean, result)
                    self.assertEqual(result.row_extra, width.fixed_row_extra(FORM, shape_of(case)))


@sized_by_function
@unittest.skipUnless(
    row_overflow.runs_spec_v2("UNO"), "UNO is registered from 0.5.20 (speculative/spec_info.py)"
)
class TestUnoRowOverflow(CustomTestCase):
    """UNO (0.5.20+) through sglang's own dispatch with its real ``UnoDraftInput``: its own
    prepare (speculative/uno_info.py:81) reserves ``get_alloc_reserve_per_decode()`` = 2 x (D + 1)
    rounded up to the page (allocation_sizing.py 0.5.20:36-40, :53-58), and the release's row
    holds it at every page size (:101-104: reserve + page - 1): 0 columns past the row, pristine
    and fixed. A row too narrow for it is refused, not overwritten (uno_info.py:141-146)."""

    def cases(self):
        for D, page, overlap in itertools.product((8, 16), (1, 64), (True, False)):
            yield row_overflow.RowCase(
                256, D, page, overlap, 256 - 2 - (2 * D + 3), topk=1, num_steps=1, algorithm="UNO"
            )

    def reserve(self, case) -> int:
        """sglang's own decode reservation for the case (the rule's input, as status reads it)."""
        with row_overflow.global_server_args(row_overflow.server_args_for(case)) as published:
            return SIZING.get_alloc_reserve_per_decode(*row_overflow.sizing_args(published))

    def test_pristine_reservation_against_the_rule(self):
        for case in self.cases():
            with self.subTest(case=case):
                result = row_overflow.run(case)
                self.assertEqual(result.prepares_run, {release.decode_prepare("UNO")})
                reserve = self.reserve(case)
                self.assertEqual(reserve, 2 * (case.num_draft_tokens + 1))
                need = width.required_row_extra(
                    reserve, case.page_size, FORM, case.overlap, shape_of(case).preclaims_bonus, 256
                )
                self.assertEqual(result.last_committed, 256 - width.committed_margin(FORM, case.overlap))
                # The last prepare reserves exactly up to the page-rounded committed + reserve.
                page = case.page_size
                self.assertEqual(
                    result.furthest_column + 1, -(-(result.last_committed + reserve) // page) * page
                )
                expected = max(0, need - result.row_extra)
                self.assertEqual((result.columns_past_row_end, result.canary_clobbered), (expected, expected))
                self.assertEqual(expected, 0)  # the release's row holds it at page 1 and 64
                self.assertEqual(result.leaked_slots, 0)

    def test_a_row_too_narrow_is_refused(self):
        # EAGLE's page-1 headroom (4 + D) is 2 columns short of 252 + 2 x 9 at D 8: UNO's own
        # check raises before it allocates or writes (uno_info.py 0.5.20:141-146, then :167).
        case = row_overflow.RowCase(256, 8, 1, True, 256 - 2 - 19, topk=1, num_steps=1, algorithm="UNO")
        with self.assertRaisesRegex(RuntimeError, "UNO allocation exceeds the req_to_token row"):
            row_overflow.run(case, lambda *args: 4 + 8)

    def test_both_fixes_keep_it_inside_the_row(self):
        with patched_copy() as patched:
            for (name, sizing), case in itertools.product(both_fixes(patched).items(), self.cases()):
                with self.subTest(fix=name, case=case):
                    result = row_overflow.run(case, sizing)
                    self.assertTrue(result.clean, result)
                    self.assertGreaterEqual(
                        result.row_extra, width.row_extra_floor(self.reserve(case), case.page_size)
                    )


if __name__ == "__main__":
    unittest.main()
