"""The demo's bug #3 table (``demo.fa3_entries`` / ``demo.fa3_table``) on the installed release.

The real FlashAttentionBackend, pristine, runtime-fixed (``fa3_width.enforce``) and in-tree
patched (``patched_copy(fa3=True)``'s module), replayed at the demo's shape: pristine reads past
its graph page table where the read outgrows it (or 0.5.14's draft decode asserts), both fixes
read every page inside the request's own row with its own page ids.
"""

from __future__ import annotations

import contextlib
import io
import unittest

from sglang_dsa_fix import width
from sglang_dsa_fix.members.fa3 import tables as fa3_width
from sglang_dsa_fix.proof import demo, fa3_backend, fa3_replay
from sglang_dsa_fix.proof.patched_copy import patched_copy
from sglang_dsa_fix.proof.replay import installed_form


class TestFa3DemoTable(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(fa3_backend.import_fa3())  # (compare, below, needs it imported)
        copy = patched_copy(fa3=True)
        cls.patched = copy.__enter__()
        cls.addClassCleanup(copy.__exit__, None, None, None)
        cls.form = installed_form()
        cls.entries = demo.fa3_entries(cls.patched.fa3_module, cls.form)

    def row_pages(self, page: int) -> int:
        """The request row's width in pages: what a fixed table holds."""
        D = demo.FA3_DRAFT_TOKENS
        extra = width.pristine_row_extra(self.form, width.SpecShape(demo.FA3_CONTEXT_LEN, D, D - 1, 1, page))
        return fa3_width.pages_read(demo.FA3_CONTEXT_LEN + extra, page)

    def test_shape(self):
        self.assertIsNotNone(self.patched.fa3_module)
        modes = {(e.mode, e.page) for e in self.entries}
        self.assertEqual(modes, {(m, p) for m in fa3_replay.MODES for p in demo.FA3_PAGES})
        # Near and past the context limit: the longest seq_len passes context_len.
        self.assertGreater(max(e.seq_len for e in self.entries), demo.FA3_CONTEXT_LEN)

    def test_pristine_reads_past_its_table(self):
        self.assertTrue(any(e.outgrows_pristine for e in self.entries))
        bs, C = demo.FA3_BS, demo.FA3_CONTEXT_LEN
        for e in self.entries:
            p, where = e.pristine, f"{e.mode} page {e.page} seq_len {e.seq_len}"
            self.assertEqual(p.width, -(-C // e.page), where)  # sglang's ceil(C / page)
            if not e.outgrows_pristine:
                self.assertTrue(p.clean, where)
                continue
            over = e.pages - p.width
            if e.mode == "verify":  # every row reads `over` entries outside its own row
                self.assertEqual((p.error, p.not_own, p.past), ("", bs * over, over), where)
            elif p.error:  # 0.5.14's draft decode checks the table first: step 0 overflows
                used = fa3_width.pages_read(e.seq_len + 1, e.page)
                self.assertEqual(p.error, f"FA3 draft-decode page_table: used {used} > capacity {p.width}")
            else:
                self.assertGreater(p.past, 0, where)

    def test_fixed_reads_inside_the_row_with_own_page_ids(self):
        for e in self.entries:
            for name, r in (("runtime fix", e.runtime), ("in-tree patch", e.in_tree)):
                where = f"{name} {e.mode} page {e.page} seq_len {e.seq_len}"
                self.assertEqual(r.error, "", where)
                rows = [row for step in r.rows for row in step]
                steps = 1 if e.mode == "verify" else demo.FA3_DRAFT_TOKENS - 2
                self.assertEqual(len(rows), demo.FA3_BS * steps, where)
                self.assertEqual(max(row.pages for row in rows), e.pages, where)  # the whole read
                for row in rows:
                    self.assertEqual((row.neighbour, row.past), (0, 0), where)
                    self.assertEqual(row.right, row.pages, where)  # its own page id, every entry
                self.assertEqual(r.writes_outside, 0, where)

    def test_fixed_tables_are_the_row(self):
        for e in self.entries:
            for name, r in (("runtime fix", e.runtime), ("in-tree patch", e.in_tree)):
                where = f"{name} {e.mode} page {e.page}"
                self.assertEqual(r.width, self.row_pages(e.page), where)  # req_to_token's row, in pages

    def test_table_says_as_expected(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertTrue(demo.fa3_table(self.entries))
        text = out.getvalue()
        self.assertIn(f"fixed: 0 failures in {2 * len(self.entries)} replays", text)
        outgrown = sum(e.outgrows_pristine for e in self.entries)
        self.assertIn(f"pristine: {outgrown}/{len(self.entries)} replays read outside", text)

    def test_verdict_fails_without_the_fixes(self):
        # No runtime fix (enforce does nothing) and the installed class for the in-tree column:
        # the fixed columns then read as pristine does, and the table is NOT as expected.
        real = fa3_width.enforce
        fa3_width.enforce = lambda backend: []
        try:
            entries = fa3_replay.compare(
                demo.FA3_CONTEXT_LEN, demo.FA3_DRAFT_TOKENS, (16,), demo.FA3_BS, None, self.form
            )
        finally:
            fa3_width.enforce = real
        self.assertFalse(fa3_replay.as_expected(entries))
        self.assertTrue(any(not e.runtime.clean and not e.in_tree.clean for e in entries))
