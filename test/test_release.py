"""The release table and the rules over it, pure: no torch, no sglang (``test_pure.py`` runs this
module in an interpreter that has neither)."""

import unittest

from sglang_dsa_fix import release, width
from sglang_dsa_fix.release import FORMS, UNKNOWN_FORM, detected_form, form_for


def form(name: str) -> release.Form:
    return next(f for f in FORMS if f.name == name)


class TestForms(unittest.TestCase):
    def test_a_label_names_its_form(self):
        for label, name in (
            ("0.5.9", "0.5.9"),
            ("0.5.12.post1", "0.5.9"),
            ("0.5.13.post1", "0.5.13"),
            ("0.5.14", "0.5.14"),
            ("0.5.15.post1", "0.5.15"),
            ("0.5.18", "0.5.16"),
            ("0.5.19", "0.5.19"),
            ("0.5.23", "0.5.19"),
            ("0.5.4", "0.5.9"),  # older than every form: the oldest
        ):
            with self.subTest(label=label):
                self.assertEqual(form_for(label).name, name)
        self.assertIs(form_for("not a version"), UNKNOWN_FORM)

    def test_the_files_win_over_a_contradicting_label(self):
        # (label, pre-claims the bonus, sizing module, sizes by get_alloc_page_size) -> form, contradicted
        for label, preclaims, sizing, holds, name, contradicted in (
            ("0.5.14", True, "common", False, "0.5.14", False),
            ("0.5.15", True, "common", False, "0.5.14", True),
            ("0.5.15", False, "common", False, "0.5.15", False),
            ("0.5.17", False, "allocation_sizing", False, "0.5.16", False),
            ("0.5.23", False, "allocation_sizing", True, "0.5.19", False),
            ("0.5.17", False, "allocation_sizing", True, "0.5.19", True),
            ("0.5.23", False, "allocation_sizing", False, "0.5.16", True),
            (None, False, "allocation_sizing", True, "0.5.19", True),
            ("0.5.11", True, None, False, "0.5.9", False),
        ):
            with self.subTest(label=label, preclaims=preclaims, sizing=sizing, holds=holds):
                found, note = detected_form(label, preclaims, sizing, holds)
                self.assertEqual(found.name, name)
                self.assertEqual(bool(note), contradicted, note)

    def test_every_algorithm_needs_a_rule(self):
        self.assertEqual(release.algorithms_without_rule(["EAGLE", "dspark", "NONE"]), [])
        self.assertEqual(release.algorithms_without_rule(["EAGLE", "Next_Thing"]), ["NEXT_THING"])
        self.assertEqual(release.decode_prepare("DSPARK"), release.DFLASH_PREPARE)
        self.assertIsNone(release.decode_prepare(None))
        with self.assertRaises(KeyError):
            release.decode_prepare("NEXT_THING")


class TestRowRule(unittest.TestCase):
    """Columns the last decode reservation writes past the row end on a pristine tree, per form
    (the counts ``../shared/ROW_OVERFLOW.md`` records from the real code on CPU)."""

    def columns(self, name, D, topk=1, steps=None, page=1, draftless=False):
        shape = width.SpecShape(256, D, steps or D - 1, topk, page, has_draft_kv=not draftless)
        return width.row_overflow_columns(form(name), shape)

    def test_eagle_topk_1(self):
        for name, counts in (
            ("0.5.14", {7: 0, 8: 1, 9: 2, 12: 5}),
            ("0.5.15", {7: 0, 8: 0, 9: 1, 12: 4}),
            ("0.5.16", {7: 0, 8: 0, 9: 1, 12: 4}),
            ("0.5.19", {7: 0, 8: 0, 9: 1, 12: 4}),
        ):
            for D, expected in counts.items():
                with self.subTest(form=name, D=D):
                    self.assertEqual(self.columns(name, D), expected)

    def test_page_64_is_held_from_0_5_16(self):
        self.assertEqual(self.columns("0.5.14", 12, page=64), 5)
        self.assertEqual(self.columns("0.5.16", 12, page=64), 0)

    def test_topk_4_and_ngram_at_page_1(self):
        self.assertEqual(self.columns("0.5.16", 8, topk=4, steps=3), 8)
        self.assertEqual(self.columns("0.5.16", 12, topk=10, steps=1, draftless=True), 4)

    def test_the_fix_holds_the_whole_reservation(self):
        for name in ("0.5.14", "0.5.16", "0.5.19"):
            shape = width.SpecShape(256, 12, 11, 1, 1)
            with self.subTest(form=name):
                self.assertGreaterEqual(
                    width.fixed_row_extra(form(name), shape), width.reserve_per_decode(shape, form(name))
                )

    def test_the_allocator_page_is_written_once(self):
        from types import SimpleNamespace

        self.assertEqual(width.alloc_page_size(SimpleNamespace(page_size=64, dcp_size=2)), 128)
        self.assertEqual(width.alloc_page_size(SimpleNamespace(page_size=64)), 64)
        self.assertEqual(width.alloc_page_size(None), 1)
        # The runtime-context reading (0.5.18's in-tree change, the plugin there): the same rule.
        schedule, parallel = SimpleNamespace(page_size=64), SimpleNamespace(attn_dcp_size=2)
        self.assertEqual(width.alloc_page_in_context(lambda: schedule, lambda: parallel), 128)
        for reads in width.ALLOC_PAGE_READS:
            with self.subTest(reads=reads):
                self.assertEqual(width.alloc_page_source(reads).count(" * "), 1)


if __name__ == "__main__":
    unittest.main()
