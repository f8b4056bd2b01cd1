"""topk > 1 judged on FA3 and Triton: the rule's numbers against the real backends on CPU.

Two deployments sglang resolves at topk > 1: EAGLE topk 4 / steps 3 / D 8, and NGRAM at its
defaults (topk = ``speculative_ngram_max_bfs_breadth`` 10, D 12, steps D // topk = 1: 0.5.14
arg_groups/speculative_hook.py:408-430), context 256, max batch 4. Three things are measured:

- the longest seq_len: the release's own spec-v2 prepare under the scheduler loop
  (``proof.row_overflow``) at full acceptance of the most tokens a verify appends (EAGLE steps + 1,
  NGRAM D: ``width.tokens_per_verify``) reaches ``width.longest_seq_len`` exactly;
- FA3 (``FlashAttentionBackend``, its own ``init_cuda_graph_state``, capture and replay, as
  test_fa3_topk_cuda_graph.py drives it): per path the rule names (verify prefix, draft decode
  prefix, draft extend), the entries the kernel is told to read in the last row of the largest
  batch, every request at that seq_len: pristine, the pages past the table are the rule's
  ``pages_past_table`` of that path; NGRAM's verify at sglang's own row raises in its expand
  gather (``verify_expand_columns_read`` > ``req_to_token_width``), and with bug #2's row alone
  its prefix reads the rule's pages past; fixed (the runtime form with both fixes' rows, and the
  in-tree change), every entry read inside the request's own row and its own page id;
- Triton (``TritonAttnBackend`` / ``TritonMultiStepDraftBackend``, as
  test_graph_tables_flat_buffers.py drives them): the verify mask cells and the draft decode's
  kv_indices per branch, pristine against the rule's ``*_needed`` / ``*_per_request``, and fixed
  (the plugin's form) inside.

Each test fails on the tree before topk > 1 was judged: the rules said ``cannot_tell`` there and
``width.longest_seq_len`` did not exist.
"""

from __future__ import annotations

import unittest
from pathlib import Path

import graph_backends as g
import test_fa3_topk_cuda_graph as t
import test_graph_tables_flat_buffers as f

from sglang_dsa_fix import graph_tables, members, width
from sglang_dsa_fix.verdicts import Bug, Verdict

C, MAX_BS = t.C, t.MAX_BS
EAGLE = t.Shape(topk=4, steps=3, D=8)
NGRAM = t.Shape(topk=10, steps=1, D=12, algorithm="NGRAM")
MODE = {"verify prefix": "verify", "draft decode prefix": "draft", "draft extend": "extend"}
assert f.C == C and f.MAX_BS == MAX_BS


def resolved(shape: t.Shape, page: int, backend: str) -> dict:
    """The configuration as ``resolve`` hands it over, with the release's own row widths."""
    spec = t.spec_shape(shape, page)
    return {
        "basis": "sglang",
        "configuration": {
            "context_length": C,
            "speculative_algorithm": shape.algorithm,
            "speculative_num_draft_tokens": shape.D,
            "speculative_num_steps": shape.steps,
            "speculative_eagle_topk": shape.topk,
            "page_size": page,
            "attention_backend": backend,
        },
        "widths": {
            "row_extra": width.pristine_row_extra(t.FORM, spec),
            "row_extra_with_plugin": width.fixed_row_extra(t.FORM, spec),
            "decode_reserve": width.reserve_per_decode(spec, t.FORM),
            "alloc_page_size": page,
        },
    }


def rule(bug: Bug, shape: t.Shape, page: int, backend: str, found: str = "") -> dict:
    at = resolved(shape, page, backend)
    return members.of(bug).rule(Verdict.AFFECTED, found, t.FORM, width.configuration_inputs(at), at)


def seq_len(shape: t.Shape) -> int:
    return width.longest_seq_len(width.configuration_inputs(resolved(shape, 1, "fa3")))


class TestLongestSeqLen(unittest.TestCase):
    def test_real_prepare_reaches_the_bound(self):
        from sglang_dsa_fix.proof import row_overflow

        for shape, bound in ((EAGLE, {True: 256, False: 252}), (NGRAM, {True: 264, False: 252})):
            a = width.tokens_per_verify(shape.algorithm, shape.topk, shape.steps, shape.D)
            for overlap in (True, False):
                with self.subTest(shape=shape, overlap=overlap):
                    longest = max(
                        row_overflow.run(
                            row_overflow.RowCase(
                                C,
                                shape.D,
                                1,
                                overlap,
                                C - 2 - m,
                                accept_len=a,
                                topk=shape.topk,
                                num_steps=shape.steps,
                                algorithm=shape.algorithm,
                            )
                        ).longest_verify_seq_len
                        or 0
                        for m in range(1, a + 2)
                    )
                    inputs = width.configuration_inputs(resolved(shape, 1, "fa3"))
                    inputs["overlap"] = overlap
                    self.assertEqual(
                        (longest, width.longest_seq_len(inputs)), (bound[overlap], bound[overlap])
                    )


class FA3Checks:
    module = None  # the installed release's FlashAttentionBackend module

    def drive(self, shape, page, mode, fix=None, wide_row=False, cpu_mirror=True):
        """The last row of the largest batch, every request at the longest seq_len."""
        p = t.pool(page, shape, fixed_row=wide_row)
        built = t.build(mode, page, module=self.module, fix=fix, cpu_mirror=cpu_mirror, shape=shape, p=p)
        return t.replay(built, [seq_len(shape)] * MAX_BS, cpu_mirror)

    def cases(self):
        yield EAGLE, 1
        yield EAGLE, 16
        yield NGRAM, 1

    def assert_inside(self, r, where):
        self.assertEqual(r.error, "", where)
        for step, rows in enumerate(r.rows):
            for b, row in enumerate(rows):
                self.assertEqual(
                    (row.outside, row.own, row.right), (0, row.pages, row.pages), f"{where} {step} {b}"
                )
            self.assertEqual(r.stray_writes[step], 0, where)


class TestFA3(FA3Checks, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_rule_answers(self):
        # EAGLE page 1: the draft extend reads s + D = 264 pages of 256; NGRAM: its verify
        # prefix reads 264 and its expand gathers to column 276 of a 272-wide row.
        got = {(s.algorithm, p): rule(Bug.FA3_PAGE_TABLE, s, p, "fa3") for s, p in self.cases()}
        self.assertEqual(
            {k: (v["reachable"], v["pages_past_table"], v["reachable_with_fix"]) for k, v in got.items()},
            {("EAGLE", 1): (True, 8, False), ("EAGLE", 16): (True, 1, False), ("NGRAM", 1): (True, 8, False)},
        )
        ngram = got["NGRAM", 1]
        self.assertEqual((ngram["verify_expand_columns_read"], ngram["req_to_token_width"]), (276, 272))

    def test_pristine_reads_what_the_rule_says(self):
        for shape, page in self.cases():
            at = rule(Bug.FA3_PAGE_TABLE, shape, page, "fa3")
            for path, pages in at["pages_read"].items():
                with self.subTest(shape=shape.algorithm, page=page, path=path):
                    # NGRAM's pristine row fails its expand gather first: bug #2's row shows the prefix.
                    wide = at["verify_expand_columns_read"] > at["req_to_token_width"]
                    r = self.drive(shape, page, MODE[path], wide_row=wide)
                    self.assertEqual(r.error, "")
                    for rows in r.rows:
                        last = rows[-1]
                        self.assertEqual(last.pages, pages)
                        self.assertEqual(last.outside, max(0, pages - at["graph_page_table_pages"]))

    def test_pristine_ngram_row_fails_the_expand_gather(self):
        at = rule(Bug.FA3_PAGE_TABLE, NGRAM, 1, "fa3")
        r = self.drive(NGRAM, 1, "verify")
        row = at["req_to_token_width"]
        self.assertEqual(r.error, f"index {row} is out of bounds for dimension 1 with size {row}")

    def test_runtime_fix_reads_inside_own_row(self):
        for shape, page in self.cases():
            for path in rule(Bug.FA3_PAGE_TABLE, shape, page, "fa3")["pages_read"]:
                with self.subTest(shape=shape.algorithm, page=page, path=path):
                    self.assert_inside(
                        self.drive(shape, page, MODE[path], fix="runtime", wide_row=True), path
                    )


class TestFA3InTree(FA3Checks, unittest.TestCase):
    """``fa3_sites``' edits on a temporary copy of the release's file, with bug #2's fixed row;
    with and without the CPU mirror where the release replays without it (0.5.16+)."""

    @classmethod
    def setUpClass(cls):
        g.import_fa3_patched(cls, g.FA3 + "_fa3_topk_reach_fixed")

    def test_patched_reads_inside_own_row(self):
        mirrors = (True, False) if t.replays_without_cpu_mirror(self.module) else (True,)
        for shape, page in self.cases():
            for path in rule(Bug.FA3_PAGE_TABLE, shape, page, "fa3")["pages_read"]:
                for cpu_mirror in mirrors:
                    with self.subTest(shape=shape.algorithm, page=page, path=path, cpu_mirror=cpu_mirror):
                        r = self.drive(shape, page, MODE[path], wide_row=True, cpu_mirror=cpu_mirror)
                        self.assert_inside(r, path)


def triton_found() -> str:
    """The release's Triton width expressions (the site's ``found``: 0.5.17+ size the verify mask
    through ``max_context_len=``)."""
    path = Path(f.TRITON.__file__)
    return graph_tables.locate(Bug.TRITON_KV_INDICES, path.read_bytes(), path).found


class TestTriton(unittest.TestCase):
    def at(self, shape):
        return rule(Bug.TRITON_KV_INDICES, shape, 1, "triton", triton_found())

    def test_rule_answers(self):
        eagle, ngram = self.at(EAGLE), self.at(NGRAM)
        self.assertEqual(
            (eagle["draft_kv_indices_needed"], eagle["draft_kv_indices_per_request"]), (259, 256)
        )
        self.assertEqual((ngram["draft_kv_indices_needed"], ngram["verify_mask_cells_needed"]), (0, 12 * 276))
        self.assertEqual((eagle["reachable"], ngram["reachable"]), (True, True))
        self.assertEqual((eagle["reachable_with_fix"], ngram["reachable_with_fix"]), (False, False))

    def test_draft_decode_writes_what_the_rule_says(self):
        at, lens = self.at(EAGLE), [seq_len(EAGLE)] * MAX_BS
        branches = MAX_BS * EAGLE.topk
        for fixed in (False, True):
            with self.subTest(fixed=fixed):
                m = f.run_draft(
                    "triton",
                    EAGLE.D,
                    lens,
                    fixed=fixed,
                    topk=EAGLE.topk,
                    steps=EAGLE.steps,
                    pool=t.pool(1, EAGLE, fixed_row=fixed),
                )
                per = m["width"] // branches  # a branch's share: C, or the fixed row
                self.assertEqual(per, t.pool(1, EAGLE, fixed_row=True).req_to_token.shape[1] if fixed else C)
                for i, step in enumerate(m["per_step"]):
                    over = branches * max(0, seq_len(EAGLE) + i + 1 - per)
                    self.assertEqual((step["other_row"], step["past"], step["wrong"]), (over, 0, over))
                past = branches * max(0, at["draft_kv_indices_needed"] - per)
                self.assertEqual(m["written_past"], past)
                self.assertEqual(past > 0, not fixed)

    def test_verify_mask_as_the_rule_says(self):
        for shape in (EAGLE, NGRAM):
            at, lens = self.at(shape), [seq_len(shape)] * MAX_BS
            with self.subTest(shape=shape.algorithm):
                m = f.run_triton(
                    "TARGET_VERIFY", shape.D, lens, own_mask=shape.algorithm == "NGRAM", pool=t.pool(1, shape)
                )
                self.assertEqual(m["mask_cells"], MAX_BS * at["verify_mask_cells_per_request"])
                over = MAX_BS * (at["verify_mask_cells_needed"] - at["verify_mask_cells_per_request"])
                if shape.algorithm == "NGRAM":  # its own mask, copied in by the replay: raises past it
                    self.assertGreater(over, 0)
                    self.assertIn("must match the existing size", m["error"])
                else:  # EAGLE's tree builder writes the backend's buffer: read up to mask_indptr[bs]
                    self.assertEqual(m["mask_read"] - m["mask_cells"], over)
                fixed = f.run_triton(
                    "TARGET_VERIFY",
                    shape.D,
                    lens,
                    fixed=True,
                    own_mask=shape.algorithm == "NGRAM",
                    pool=t.pool(1, shape, fixed_row=True),
                )
                self.assertEqual(fixed["error"], "")
                self.assertLessEqual(fixed["mask_read"], fixed["mask_cells"])
                self.assertTrue(fixed["kv_right"])


if __name__ == "__main__":
    unittest.main()
