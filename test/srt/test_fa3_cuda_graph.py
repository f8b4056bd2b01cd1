"""Bug #3 (issue 28) on CPU: FA3's CUDA-graph page tables, on the real FlashAttentionBackend.

The installed release's own ``FlashAttentionBackend`` (and its ``FlashAttentionMultiStepBackend``
for the draft decode) runs its own ``init_cuda_graph_state``, capture and replay through
``init_forward_metadata_out_graph`` (what the decode and draft cuda-graph runners call: 0.5.14
decode_cuda_graph_runner.py:772 / :950, eagle_draft_cuda_graph_runner.py:432 / :598), with the
release's own table builders (0.5.14: torch gather / Triton ``normal_decode_set_metadata``;
0.5.17: Triton ``build_trtllm_mha_page_table`` for the verify, unbounded; 0.5.23: Triton
``normal_decode_set_metadata`` clamped to ``max_num_pages``), run by Triton's interpreter.
So ``page_table`` and ``cache_seqlens`` below are exactly what the FA3 kernel would be handed.

What the kernel reads is counted from that metadata and the kernel's addressing: for batch row b
it reads ``page_table`` entries j < ceil(cache_seqlens[b] / page), flat element
``b * stride(0) + j`` of the ``[max_bs, W]`` buffer, with no check against W (flash-attention
hopper/paged_kv.h ``PagedKVManager::load_page_table``). So j >= W lands in the next buffer row, or
past the buffer's end for the last row at the largest captured batch.

The one instrument: right after ``init_cuda_graph_state`` (and the runtime fix) each graph table
the replay fills is swapped for a same-shape, same-stride view of a larger allocation filled
with a sentinel (``proof.fa3_replay.guarded``), so what a builder writes past the end lands in owned
memory where it is counted (0.5.17's verify builder does write there), not in the heap.

Cases: C 256, EAGLE topk 1, D 4 (D 8 too with SGLANG_DSA_FIX_FULL=1), page 1 and 16, max_bs 4
captured at bs 1, 2, 4, the request pool's row as wide as the release sizes it
(``width.pristine_row_extra``), seq_len at ``width.verify_seq_len_bound`` (C + D - 4: the
overlap scheduler's last verify of a finished request). Batches: the longest request in the last
row of bs 4 (``last``), in every row (``all``), in the last row of bs 2 < max_bs (``small``).

- pristine: the last row at bs 4 reads ceil(cache_seqlens / page) - W entries past the buffer
  (draft decode on 0.5.14: the release's own assert fires instead); a release whose verify
  builder is unbounded also *writes* them there, and into the next buffer row at bs 2.
- fixed, at runtime (``fa3_width.enforce``) and in-tree (``fa3_sites`` applied to a temporary
  copy of the release's own file, imported and driven the same way): every entry the kernel
  reads lies inside its own row and holds that request's own page id
  (``req_to_token[row, j * page] // page``); nothing written outside the batch's rows.
- the pristine assertions fail on both fixed forms (so this module fails if the fix is removed
  from a fixed tree, and the pristine half fails on a fixed tree).

Set SGLANG_DSA_FIX_FA3_REPORT=<file> to write the measured numbers as JSON.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import textwrap
import unittest
from pathlib import Path

import graph_backends as g
import torch

from sglang_dsa_fix import width
from sglang_dsa_fix.members.fa3 import sites as fa3_sites
from sglang_dsa_fix.members.fa3 import tables as fa3_width
from sglang_dsa_fix.proof import fa3_replay
from sglang_dsa_fix.proof.fa3_replay import Built, cache_seqlen, replay
from sglang_dsa_fix.proof.fa3_replay import table_bytes as _table_bytes
from sglang_dsa_fix.proof.replay import installed_form

C = 256
MAX_BS = 4
CAPTURED = (1, 2, MAX_BS)
SHORT = 100  # seq_len of the other requests
PAGES = (1, 16)
DRAFTS = (4, 8) if os.environ.get("SGLANG_DSA_FIX_FULL") else (4,)
MODES = ("verify", "draft")
REPORT: dict = {}
FORM = installed_form()  # the release's form, as its files show it


def version() -> str:
    import sglang

    return sglang.__version__


def row_extra(page: int, D: int) -> int:
    return width.pristine_row_extra(FORM, width.SpecShape(C, D, D - 1, 1, page))


def longest(D: int) -> int:
    return width.verify_seq_len_bound(C, D)


def _verify_branch_calls(cls) -> set:
    """Names called in ``_apply_cuda_graph_metadata``'s topk <= 1 target-verify branch."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls._apply_cuda_graph_metadata)))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "is_target_verify" in ast.unparse(node.test):
            topk1 = node.body[0] if node.body and isinstance(node.body[0], ast.If) else node
            return {
                getattr(n.func, "id", getattr(n.func, "attr", ""))
                for stmt in topk1.body
                for n in ast.walk(stmt)
                if isinstance(n, ast.Call)
            }
    return set()


def verify_builder_writes_past_row(cls) -> bool:
    """The release's topk-1 verify table builder is bounded by the request's page count only,
    not by the table width: 0.5.15 - 0.5.21 ``build_trtllm_mha_page_table`` (0.5.17
    flashattention_backend.py:2833; kernels/ops/kvcache/trtllm_mha_page_table.py:78-87 masks
    ``page_idx < cdiv(seq_len, PAGE_SIZE)`` and stores at ``pid_req * stride + page_idx``). The
    torch gather (<= 0.5.14, sliced by strided_indices) and ``normal_decode_set_metadata``
    (0.5.22+, ``min(.., max_seq_pages)``) stop at the width. Read from the file, not the version."""
    return "build_trtllm_mha_page_table" in _verify_branch_calls(cls)


def draft_decode_asserts(cls) -> bool:
    """0.5.14's draft decode checks the table before filling it (flashattention_backend.py
    :2162-2166, ``assert_buffer_fits(.., "FA3 draft-decode page_table")``); 0.5.17+ clamp."""
    return "FA3 draft-decode page_table" in inspect.getsource(cls._apply_cuda_graph_metadata)


# ------------------------------------------------------------------------------ driving
# The driving and the counting are the demo's too: proof.fa3_replay.


def build(mode: str, page: int, D: int, module=None, runtime_fix=False) -> Built:
    return fa3_replay.build(mode, page, D, C, MAX_BS, CAPTURED, row_extra(page, D), module, runtime_fix)


def batches(D: int) -> dict:
    s = longest(D)
    return {
        "last": [SHORT] * (MAX_BS - 1) + [s],
        "all": [s] * MAX_BS,
        "small": [SHORT, s],
    }


def _record(name, built, replays):
    entry = REPORT.setdefault(version(), {}).setdefault(name, {})
    key = f"{built.mode} page {built.page} D {built.D}"
    entry[key] = {
        "table_width_pages": replays["last"].width,
        "required_pages": fa3_width.required_pages(built.steps[0]),
        "row_width": int(built.pool.req_to_token.shape[1]),
        "seq_len": longest(built.D),
        "bytes_before": built.bytes_before,
        "bytes_after": built.bytes_after,
        **{
            batch: {
                "error": r.error,
                "past_reads_last_row": [rows[-1].past for rows in r.rows],
                "neighbour_reads": [sum(x.neighbour for x in rows) for rows in r.rows],
                "past_writes": r.past_writes,
                "neighbour_writes": r.neighbour_writes,
            }
            for batch, r in replays.items()
        },
    }


def tearDownModule():
    target = os.environ.get("SGLANG_DSA_FIX_FA3_REPORT")
    if target:
        old = json.loads(Path(target).read_text()) if Path(target).exists() else {}
        for ver, entries in REPORT.items():
            for name, cases in entries.items():
                if isinstance(cases, dict):
                    old.setdefault(ver, {}).setdefault(name, {}).update(cases)
                else:
                    old.setdefault(ver, {})[name] = cases
        Path(target).write_text(json.dumps(old, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------ the checks


class Checks:
    """The pristine and fixed assertions, shared by the test classes below."""

    module = None  # None: the installed release's module

    def backend_class(self):
        return (self.module or __import__("sys").modules[g.FA3]).FlashAttentionBackend

    def run_case(self, mode, page, D, runtime_fix=False, name=None):
        built = build(mode, page, D, module=self.module, runtime_fix=runtime_fix)
        replays = {batch: replay(built, lens) for batch, lens in batches(D).items()}
        if name:
            _record(name, built, replays)
        return built, replays

    def check_pristine(self, mode, page, D, runtime_fix=False, name=None):
        built, replays = self.run_case(mode, page, D, runtime_fix=runtime_fix, name=name)
        s, W = longest(D), replays["last"].width
        self.assertEqual(W, -(-C // page))  # ceil(C / page): sglang's own width
        cls = self.backend_class()
        if mode == "draft" and draft_decode_asserts(cls):
            # 0.5.14: step 0 already needs ceil((s + 1) / page) > W pages; the replay raises.
            used = fa3_width.pages_read(s + 1, page)
            for batch in ("last", "all", "small"):
                self.assertEqual(
                    replays[batch].error, f"FA3 draft-decode page_table: used {used} > capacity {W}", batch
                )
            return built, replays
        writes = mode == "verify" and verify_builder_writes_past_row(cls)
        for batch, r in replays.items():
            self.assertEqual(r.error, "", batch)
            for step, rows in enumerate(r.rows):
                over = fa3_width.pages_read(cache_seqlen(mode, D, s, step), page) - W
                self.assertGreater(over, 0)
                # Inside its own row every row reads its own pages (nothing is wrong there).
                for row in rows:
                    self.assertEqual(row.right, row.own)
                if batch == "last":  # the longest request in the last row of max_bs
                    self.assertEqual([x.past for x in rows], [0] * (MAX_BS - 1) + [over])
                    self.assertEqual(sum(x.neighbour for x in rows), 0)
                    self.assertEqual(r.past_writes[step], over if writes else 0)
                elif batch == "all":  # rows 0..2 read the next row's first pages
                    self.assertEqual([x.neighbour for x in rows], [over] * (MAX_BS - 1) + [0])
                    self.assertEqual(rows[-1].past, over)
                    self.assertEqual(r.past_writes[step], over if writes else 0)
                else:  # bs 2 < max_bs: row 1 reads (and may write) buffer row 2
                    self.assertEqual([x.neighbour for x in rows], [0, over])
                    self.assertEqual(r.neighbour_writes[step], over if writes else 0)
                    self.assertEqual(r.past_writes[step], 0)
        return built, replays

    def check_fixed(self, mode, page, D, runtime_fix=False, name=None, rule=True):
        built, replays = self.run_case(mode, page, D, runtime_fix=runtime_fix, name=name)
        if rule:  # fa3_width's own judgement (tables and replay bounds); the reads decide below
            self.assertTrue(fa3_width.holds(built.backend), fa3_width.short_tables(built.backend))
        need = fa3_width.required_pages(built.steps[0])
        self.assertEqual(replays["last"].width, need)
        s = longest(D)
        for batch, r in replays.items():
            self.assertEqual(r.error, "", batch)
            for step, rows in enumerate(r.rows):
                for b, row in enumerate(rows):
                    where = f"{mode} page {page} D {D} {batch} step {step} row {b}"
                    self.assertLessEqual(row.pages, need, where)
                    self.assertEqual((row.neighbour, row.past), (0, 0), where)
                    self.assertEqual(row.own, row.pages, where)
                    # every entry read is the request's own page id (not a zero column)
                    self.assertEqual(row.right, row.pages, where)
                longest_row = rows[-1]
                self.assertEqual(
                    longest_row.pages, fa3_width.pages_read(cache_seqlen(mode, D, s, step), page)
                )
                self.assertEqual((r.neighbour_writes[step], r.past_writes[step]), (0, 0), where)
        return built, replays


class TestPristine(Checks, unittest.TestCase):
    """The installed release as it ships: the last row at max_bs reads past the buffer."""

    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_pristine_reads_past_the_buffer(self):
        for mode in MODES:
            for page in PAGES:
                for D in DRAFTS:
                    with self.subTest(mode=mode, page=page, D=D):
                        self.check_pristine(mode, page, D, name="pristine")


class TestRuntimeFix(Checks, unittest.TestCase):
    """fa3_width.enforce right after init_cuda_graph_state, before capture."""

    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_fixed_reads_inside_own_row(self):
        for mode in MODES:
            for page in PAGES:
                for D in DRAFTS:
                    with self.subTest(mode=mode, page=page, D=D):
                        built, _ = self.check_fixed(mode, page, D, runtime_fix=True, name="runtime fix")
                        # Measured cost = computed: rows x extra pages x 4 bytes per widened table.
                        tables = sum(
                            1
                            for inner in built.steps
                            for attribute, key in fa3_width.GRAPH_TABLES
                            if (getattr(inner, attribute, None) or {}).get(key) is not None
                        )
                        row = int(built.pool.req_to_token.shape[1])
                        self.assertEqual(
                            built.bytes_after - built.bytes_before,
                            tables * fa3_width.extra_bytes(MAX_BS, C, row, page),
                        )

    def test_pristine_checks_fail_when_fixed(self):
        # The pristine assertions fail on a fixed backend: this module catches a removed fix.
        for mode, page in (("verify", 1), ("draft", 16)):
            with self.subTest(mode=mode, page=page):
                with self.assertRaises(AssertionError):
                    self.check_pristine(mode, page, DRAFTS[0], runtime_fix=True)

    def test_fixed_checks_fail_unfixed(self):
        # Without the fix the fixed assertions fail: this module fails if the fix is removed.
        for mode, page in (("verify", 16), ("draft", 1)):
            with self.subTest(mode=mode, page=page):
                with self.assertRaises(AssertionError):
                    self.check_fixed(mode, page, DRAFTS[0], rule=False)

    def test_wider_tables_alone_are_not_a_fix(self):
        # Widen the tables but keep the replay's bounds (strided_indices, max_num_pages): the new
        # columns are never filled and the kernel reads the initial zeros there (0.5.17+: the
        # draft decode, and 0.5.23's verify, clamped by max_num_pages), or, 0.5.14's verify, the
        # gather sliced by strided_indices no longer matches the copy and the replay raises.
        real = fa3_width.enforce

        def tables_only(backend):
            kept = [
                (
                    inner,
                    dict(inner.decode_cuda_graph_metadata),
                    dict(inner.target_verify_metadata),
                    dict(inner.draft_extend_metadata),
                    getattr(inner, "max_num_pages", None),
                )
                for inner in fa3_width.step_backends(backend)
            ]
            changes = real(backend)
            for inner, decode, verify, extend, bound in kept:
                for attribute, old in (
                    ("decode_cuda_graph_metadata", decode),
                    ("target_verify_metadata", verify),
                    ("draft_extend_metadata", extend),
                ):
                    if "strided_indices" in old:
                        getattr(inner, attribute)["strided_indices"] = old["strided_indices"]
                if bound is not None:
                    inner.max_num_pages = bound
            return changes

        failed = []
        fa3_width.enforce = tables_only
        try:
            for mode in MODES:
                try:
                    self.check_fixed(mode, 1, DRAFTS[0], runtime_fix=True, rule=False)
                except AssertionError:
                    failed.append(f"{mode}: a read entry is not the request's page")
                except RuntimeError as exc:  # 0.5.14 verify: the sliced gather no longer fits
                    failed.append(f"{mode}: replay raised {str(exc).splitlines()[0]}")
        finally:
            fa3_width.enforce = real
        REPORT.setdefault(version(), {})["tables only (not a fix): modes that fail"] = failed
        self.assertTrue(failed)

    def test_memory_at_deployment_sizes(self):
        # The release's own init_cuda_graph_state on the meta device (shapes, no memory) at a
        # long context: bytes of the graph tables before and after enforce, vs the formula.
        # Tables per FlashAttentionBackend with spec on, no SWA: decode, draft decode, verify,
        # draft extend (fa3_width.GRAPH_TABLES).
        costs = {}
        for context, page, D in ((262144, 1, 4), (262144, 16, 4), (131072, 1, 8), (131072, 64, 8)):
            extra = width.pristine_row_extra(FORM, width.SpecShape(context, D, D - 1, 1, page))
            for max_bs in (1, 8, 64, 256, 512):
                pool = g.Fields(
                    req_to_token=torch.empty(max_bs + 1, context + extra, dtype=torch.int32, device="meta")
                )
                backend = g.fa3_release_backend(pool, context, D, page)
                backend.device = torch.device("meta")
                backend.init_cuda_graph_state(max_bs, max_bs * D)
                before = _table_bytes(backend)
                fa3_width.enforce(backend)
                added = _table_bytes(backend) - before
                self.assertEqual(added, 4 * fa3_width.extra_bytes(max_bs, context, context + extra, page))
                costs[f"C {context} page {page} D {D} row +{extra} max_bs {max_bs}"] = [before, added]
        REPORT.setdefault(version(), {})["memory (bytes before, added) per backend"] = costs

    def test_enforce_refuses_after_capture(self):
        pool = g.req_to_token_pool(C, row_extra(1, 4), 1, MAX_BS)
        backend = g.fa3_release_backend(pool, C, 4, 1)
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * 4)
        backend.init_forward_metadata_out_graph(g.capture_fields("TARGET_VERIFY", 2, 4), in_capture=True)
        with self.assertRaises(RuntimeError):
            fa3_width.enforce(backend)
        self.assertFalse(fa3_width.holds(backend))


@unittest.skipUnless(
    torch.cuda.is_available(), "needs a CUDA GPU (the GPU tier: scripts/gpu/run_gpu_tier.sh)"
)
class TestMemoryCUDA(unittest.TestCase):
    """The fixed tables' memory on a GPU, as the CUDA caching allocator counts it: the release's
    own init_cuda_graph_state on CUDA tensors at deployment sizes, then enforce. FA3's kernel is
    not needed (nor in the offline bundle): nothing here runs it."""

    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_fixed_tables_memory_on_the_gpu(self):
        costs = {}
        for context, page, D, max_bs in ((262144, 1, 4, 256), (262144, 16, 4, 256), (131072, 1, 8, 64)):
            extra = width.pristine_row_extra(FORM, width.SpecShape(context, D, D - 1, 1, page))
            row = context + extra
            pool = g.Fields(req_to_token=torch.empty(max_bs + 1, row, dtype=torch.int32, device="cuda"))
            backend = g.fa3_release_backend(pool, context, D, page)
            backend.device = torch.device("cuda")
            backend.init_cuda_graph_state(max_bs, max_bs * D)
            torch.cuda.synchronize()
            tables_before, allocated_before = _table_bytes(backend), torch.cuda.memory_allocated()
            changes = fa3_width.enforce(backend)
            torch.cuda.synchronize()
            measured = torch.cuda.memory_allocated() - allocated_before
            tables = _table_bytes(backend) - tables_before
            self.assertEqual(tables, 4 * fa3_width.extra_bytes(max_bs, context, row, page))
            # Beside the tables: the new strided_indices page starts (int64, one per page; an old
            # copy another entry still holds is not freed) and the caching allocator's rounding of
            # each new block.
            strided = sum(8 * new for _, _, key, _, new in changes if key == "strided_indices")
            self.assertGreaterEqual(measured, tables)
            self.assertLessEqual(measured, tables + strided + (2 << 20) * len(changes))
            costs[f"C {context} page {page} D {D} row {row} max_bs {max_bs}"] = {
                "tables_bytes_before": tables_before,
                "tables_bytes_added": tables,
                "strided_indices_bytes_new": strided,
                "cuda_memory_allocated_added": measured,
            }
            del backend, pool
            torch.cuda.empty_cache()
        REPORT.setdefault(version(), {})["memory on the GPU (bytes) per backend"] = costs


class TestInTreeChange(Checks, unittest.TestCase):
    """fa3_sites' edits applied to a temporary copy of the release's own file, imported and
    driven the same way (no runtime fix)."""

    @classmethod
    def setUpClass(cls):
        g.import_fa3_patched(cls, g.FA3 + "_fa3_fixed")
        cls.patched = cls.site.patched_bytes()

    def test_site(self):
        site = self.site
        self.assertFalse(site.patched_here)
        self.assertFalse(site.fixed_upstream)
        widths = site.of("width")
        self.assertEqual(len(widths), 7)  # decode, swa, draft decode, verify, draft extend, 2 swa
        self.assertTrue(all(e.found == "max_num_pages" for e in widths))
        self.assertEqual([e.found for e in site.of("strided_stop")], ["self.max_context_len"] * 3)
        has_bound = "self.max_num_pages" in site.data.decode()
        self.assertEqual(len(site.of("init_bound")), 1 if has_bound else 0)
        again = fa3_sites.locate(self.patched)
        self.assertTrue(again.patched_here)
        self.assertEqual(again.patched_bytes(), self.patched)  # applying twice changes nothing
        # Only the located ranges changed: undoing each edit gives the original bytes back.
        undone = self.patched
        for old, new in sorted(zip(site.edits, again.edits), key=lambda p: p[1].start, reverse=True):
            undone = undone[: new.start] + old.found.encode() + undone[new.end :]
        self.assertEqual(undone, site.data)

    def test_patched_reads_inside_own_row(self):
        for mode in MODES:
            for page in PAGES:
                for D in DRAFTS:
                    with self.subTest(mode=mode, page=page, D=D):
                        built, _ = self.check_fixed(mode, page, D, name="in-tree change")
                        self.assertEqual(fa3_width.enforce(built.backend), [])  # nothing left to do

    def test_pristine_checks_fail_on_patched_file(self):
        for mode, page in (("verify", 16), ("draft", 1)):
            with self.subTest(mode=mode, page=page):
                with self.assertRaises(AssertionError):
                    self.check_pristine(mode, page, DRAFTS[0])


if __name__ == "__main__":
    unittest.main()
