"""Bug #3 at topk > 1 on CPU: FA3's token-wide topk > 1 graph tables, on the real backend.

At topk > 1 (EAGLE / EAGLE3 topk > 1) the installed release's own ``FlashAttentionBackend``
splits a draft decode or a verify in two halves: the prefix half reads the request's KV through
``draft_decode_metadata_topk_normal`` / ``target_verify_metadata_topk_normal``'s page_table,
``[max_bs, max_context_len]`` in tokens (0.5.14 flashattention_backend.py:1699, :1826), filled
from the page-start gather ``decode_cuda_graph_metadata["strided_indices"][:max_seq_pages]``
(0.5.14 :2203-2212, :2339-2345) or, 0.5.16+, the verify's device-side
``build_trtllm_mha_page_table``; the expand half holds the draft tokens only. As in
test_fa3_cuda_graph.py, the release's own ``init_cuda_graph_state``, capture and replay through
``init_forward_metadata_out_graph`` run, and what FA3 reads is counted from the metadata handed
to it: for batch row b, entries j < ceil(cache_seqlens[b] / page) at flat b * stride(0) + j of
the table, unchecked (flash-attention hopper/paged_kv.h).

Past context_len (a verify accepts up to steps + 1 tokens: seq_len up to
``width.verify_seq_len_bound(C, steps + 1)``, C + 2 here):

- pristine: at page 1 the table is C entries wide and the kernel reads seq_len: the last row at
  max_bs reads past the buffer, silently; at page 16 (0.5.13 - 0.5.15, and 0.5.16+ where a CPU
  mirror of seq_lens is handed over) the gather stops at ceil(C / page) pages and the copy into
  ``page_table[:, :ceil(seq_len / page)]`` raises a size mismatch;
- the topk-1 fix alone (every buffer of ``fa3_width.GRAPH_TABLES`` / ``STRIDED_INDICES`` widened,
  the topk > 1 tables left): the widened gather no longer fits the C-wide table and the page 1
  replay raises ``The size of tensor a (C) must match the size of tensor b (seq_len)`` where
  sglang alone was silent: a fix that made the deployment worse (``test_topk1_fix_alone_crashes``);
- fixed (``fa3_width.enforce`` and the in-tree change, ``members.fa3.sites``): no raise, every entry the
  kernel reads inside its own row and the request's own page id. The runtime form cannot change
  the replay's host bound (``members.fa3.sites`` ``host_bound``): on 0.5.16+ without a CPU mirror its
  draft decode reads its own row but the entries past ceil(C / page) pages are unfilled; the
  in-tree change fills them (``test_runtime_fix_limit_without_cpu_mirror`` says so exactly).
"""

from __future__ import annotations

import inspect
import sys
import unittest
from dataclasses import dataclass, field
from types import SimpleNamespace

import graph_backends as g
import torch

from sglang_dsa_fix import width
from sglang_dsa_fix.members.fa3 import tables as fa3_width
from sglang_dsa_fix.proof.replay import installed_form

C = 256
MAX_BS = 4
CAPTURED = (1, 2, MAX_BS)
TOPK, STEPS, D = 2, 5, 8  # EAGLE topk 2, 5 steps, 8 draft tokens
SHORT = 100
SENTINEL = -7
FORM = installed_form()
LONGEST = width.verify_seq_len_bound(C, STEPS + 1)  # a verify accepts up to steps + 1 tokens
BATCHES = {"last": [SHORT] * (MAX_BS - 1) + [LONGEST], "all": [LONGEST] * MAX_BS}
# The guarded table per mode: the prefix half of a topk > 1 verify / draft decode; the draft
# extend's (topk-1 layout, ceil(C / page) pages; it reads seq_len + D keys at topk > 1 too).
TABLE = {
    "verify": "target_verify_metadata_topk_normal",
    "draft": "draft_decode_metadata_topk_normal",
    "extend": "draft_extend_metadata",
}


@dataclass(frozen=True)
class Shape:
    """A speculative shape as sglang resolves it (EAGLE: D >= steps + 1; NGRAM: steps D // topk)."""

    topk: int = TOPK
    steps: int = STEPS
    D: int = D
    algorithm: str = "EAGLE"


SHAPE = Shape()


def spec_shape(shape: Shape, page: int) -> width.SpecShape:
    return width.SpecShape(
        C, shape.D, shape.steps, shape.topk, page, has_draft_kv=shape.algorithm not in width.DRAFTLESS
    )


def pool(page: int, shape: Shape = SHAPE, fixed_row: bool = False):
    """req_to_token as the release sizes it, or (``fixed_row``) as bug #2's fix widens it: the
    plugin fixes both, so a fixed deployment's FA3 tables follow the widened row."""
    extra = (width.fixed_row_extra if fixed_row else width.pristine_row_extra)(FORM, spec_shape(shape, page))
    return g.req_to_token_pool(C, extra, page, MAX_BS)


def replays_without_cpu_mirror(module) -> bool:
    """0.5.16+ replays without seq_lens_cpu where the backend does not ask for it (FA3 does not:
    0.5.23 flashattention_backend.py:202 ``needs_cpu_seq_lens = False``, :741 passes None); 0.5.13 -
    0.5.15 always hand it over. Read from the release's code, not its version."""
    return "if self.needs_cpu_seq_lens else None" in inspect.getsource(module.FlashAttentionBackend)


@dataclass
class Built:
    mode: str
    page: int
    backend: object
    pool: object
    tables: list  # per step backend: the guarded topk > 1 prefix table
    steps: list = field(default_factory=list)
    shape: Shape = SHAPE


def build(
    mode: str, page: int, module=None, fix=None, cpu_mirror: bool = True, shape: Shape = SHAPE, p=None
) -> Built:
    """``fix``: None (as sglang ships), "runtime" (``fa3_width.enforce``) or "topk1"
    (``enforce`` with the topk > 1 tables put back: the fix as it was before they were in it).
    ``cpu_mirror``: the backend asks for seq_lens_cpu (0.5.16+ ``needs_cpu_seq_lens``, on with a
    sharded KV pool, 0.5.23 :221); 0.5.13 - 0.5.15 always take it. ``mode`` "extend": the draft
    runner's draft extend (DRAFT_EXTEND_V2, D tokens a request: 0.5.14 eagle_worker_v2.py:818-821;
    its graph runner's max_num_tokens max_bs * D). ``p``: the pool (default ``pool(page, shape)``)."""
    p = pool(page, shape) if p is None else p
    topk, n, D = shape.topk, shape.steps, shape.D
    if mode in ("verify", "extend"):
        backend = g.fa3_release_backend(p, C, D, page, module=module)
        backend.topk, backend.speculative_num_steps = topk, n
        steps = [backend]
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * D)
    else:  # the draft runner: one step backend per step 0 .. steps - 2, max_num_tokens max_bs * topk
        backend = g.fa3_draft_backend(p, C, D, page, module=module)
        backend.topk, backend.speculative_num_steps = topk, n
        backend.attn_backends = backend.attn_backend_list = backend.attn_backends[: n - 1]
        for i, inner in enumerate(backend.attn_backends):
            inner.topk, inner.speculative_num_steps, inner.speculative_step_id = topk, n, i
        steps = list(backend.attn_backends)
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * topk)
    for inner in steps:
        inner.needs_cpu_seq_lens = cpu_mirror
    if fix is not None:
        kept = [dict(getattr(inner, TABLE[mode])) for inner in steps]
        fa3_width.enforce(backend)
        if fix == "topk1":
            for inner, old in zip(steps, kept):
                getattr(inner, TABLE[mode])["page_table"] = old["page_table"]
    built = Built(mode, page, backend, p, [], steps, shape)
    for inner in steps:
        table = getattr(inner, TABLE[mode])["page_table"]
        guarded = g.guarded(tuple(table.shape), fill=SENTINEL, dtype=table.dtype)
        getattr(inner, TABLE[mode])["page_table"] = guarded
        built.tables.append(guarded)
    spec = {"draft": g.draft_input(), "extend": g.Fields(num_tokens_per_req=D)}.get(mode)
    for bs in CAPTURED:
        if mode == "verify":
            backend.init_forward_metadata_out_graph(g.capture_fields("TARGET_VERIFY", bs, D), in_capture=True)
        elif mode == "extend":
            backend.init_forward_metadata_out_graph(
                g.capture_fields("DRAFT_EXTEND_V2", bs, D, spec), in_capture=True
            )
        else:
            backend.init_forward_metadata_out_graph(
                g.capture_fields("DECODE", bs, topk, spec), in_capture=True
            )
    built.spec = spec
    return built


@dataclass
class Row:
    pages: int
    own: int = 0
    right: int = 0
    outside: int = 0  # the next buffer row or past the buffer's end


@dataclass
class Replay:
    error: str = ""
    rows: list = field(default_factory=list)  # per step: [Row]
    stray_writes: list = field(default_factory=list)  # per step: cells written outside rows < bs


def replay(built: Built, seq_lens: list, cpu_mirror: bool = True) -> Replay:
    for table in built.tables:
        table._base.fill_(SENTINEL)
    bs = len(seq_lens)
    topk, n, D = built.shape.topk, built.shape.steps, built.shape.D
    if built.mode == "verify":
        # A verify's spec_info as the replay reads it at topk > 1: positions, and the tree mask of
        # D * (seq_len + D) cells a request (0.5.14 :2348-2375).
        spec = SimpleNamespace(
            positions=torch.zeros(bs * D, dtype=torch.int64),
            custom_mask=torch.ones(sum(s * D + D * D for s in seq_lens), dtype=torch.bool),
        )
        batch = g.replay_view("TARGET_VERIFY", seq_lens, D, spec)
    elif built.mode == "extend":
        # The draft extend after a verify at seq_len s: D tokens a request, the forward's seq_lens
        # s + D on device and host (0.5.14 base_spec_worker.py:147-150).
        spec = g.Fields(num_tokens_per_req=D, extend_seq_lens_cpu=[D] * bs)
        batch = g.draft_replay_batch([s + D for s in seq_lens], spec)
        batch.forward_mode = g._mode("DRAFT_EXTEND_V2")
    else:
        batch = g.draft_replay_batch(seq_lens, built.spec)
        batch.out_cache_loc = torch.arange(bs * topk * n, dtype=torch.int64) + 5000
    if not cpu_mirror:
        batch.seq_lens_cpu = None
    out = Replay()
    try:
        built.backend.init_forward_metadata_out_graph(batch)
    except (AssertionError, RuntimeError, IndexError) as exc:
        out.error = str(exc).splitlines()[0]
        return out
    r2t = built.pool.req_to_token
    for inner, table in zip(built.steps, built.tables):
        metadata = getattr(inner, TABLE[built.mode])[bs]
        view = metadata.page_table
        assert view.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
        stride, cols, numel = view.stride(0), table.shape[1], table.numel()
        flat = table._base.reshape(-1)
        rows = []
        for b in range(bs):
            row = Row(fa3_width.pages_read(int(metadata.cache_seqlens_int32[b]), built.page))
            for j in range(row.pages):
                k = b * stride + j
                if j >= cols or k >= numel:
                    row.outside += 1
                else:
                    row.own += 1
                    row.right += int(flat[k]) == int(r2t[b + 1, j * built.page]) // built.page
            rows.append(row)
        out.rows.append(rows)
        changed = table._base.reshape(-1) != SENTINEL
        out.stray_writes.append(int(changed[bs * cols :].sum()))
    return out


class Checks:
    module = None  # None: the installed release's module

    def fa3_module(self):
        return self.module or sys.modules[g.FA3]

    def cases(self):
        mirrors = (True, False) if replays_without_cpu_mirror(self.fa3_module()) else (True,)
        for mode in ("verify", "draft"):
            for page in (1, 16):
                for cpu_mirror in mirrors:
                    yield mode, page, cpu_mirror

    def assert_fixed(self, built: Built, cpu_mirror: bool, where: str):
        for batch, lens in BATCHES.items():
            r = replay(built, lens, cpu_mirror)
            self.assertEqual(r.error, "", f"{where} {batch}")
            for step, rows in enumerate(r.rows):
                for b, row in enumerate(rows):
                    at = f"{where} {batch} step {step} row {b}"
                    self.assertEqual((row.outside, row.own, row.right), (0, row.pages, row.pages), at)
                self.assertEqual(r.stray_writes[step], 0, f"{where} {batch} step {step}")
            # The longest request reads past ceil(C / page) pages at page 1: the case is real.
            if built.page == 1:
                self.assertGreater(r.rows[0][-1].pages, C, where)


class TestPristine(Checks, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_pristine_page1_reads_past_the_row_silently(self):
        for mode, page, cpu_mirror in self.cases():
            if page != 1:
                continue
            with self.subTest(mode=mode, cpu_mirror=cpu_mirror):
                built = build(mode, page, cpu_mirror=cpu_mirror)
                r = replay(built, BATCHES["last"], cpu_mirror)
                self.assertEqual(r.error, "")
                for rows in r.rows:
                    self.assertEqual([x.outside for x in rows], [0] * (MAX_BS - 1) + [LONGEST - C])

    def test_pristine_page16_with_cpu_mirror(self):
        # At page 16 the token-wide table has room; where the replay takes the host bound from the
        # CPU mirror, the gather stops at ceil(C / page) pages and the copy of ceil(seq_len / page)
        # raises (0.5.13 - 0.5.15, and 0.5.16+'s draft decode); a device-side builder (0.5.16+'s
        # verify) fills it right. Either way: nothing read outside the row.
        pages = fa3_width.pages_read(LONGEST, 16)
        mismatch = (
            f"The size of tensor a ({pages}) must match the size of tensor b ({pages - 1}) "
            "at non-singleton dimension 1"
        )
        raised = []
        for mode in ("verify", "draft"):
            with self.subTest(mode=mode):
                built = build(mode, 16)
                error = replay(built, BATCHES["last"]).error
                self.assertIn(error, ("", mismatch))
                if error:
                    raised.append(mode)
                else:
                    self.assert_fixed(built, True, f"{mode} page 16")
        self.assertIn("draft", raised)

    def test_topk1_fix_alone_crashes(self):
        # The fix before the topk > 1 tables were in it (07aa6f0): where sglang was silent (page 1,
        # a CPU mirror handed over), the widened gather no longer fits the table and the draft
        # decode's replay raises, and so does 0.5.13 - 0.5.15's verify; 0.5.16+'s verify builds
        # on the device and reads past the row as sglang alone does.
        mismatch = f"The size of tensor a ({C}) must match the size of tensor b ({LONGEST}) at non-singleton dimension 1"
        for mode in ("verify", "draft"):
            with self.subTest(mode=mode):
                built = build(mode, 1, fix="topk1", cpu_mirror=True)
                r = replay(built, BATCHES["last"], cpu_mirror=True)
                if mode == "verify" and not r.error:
                    self.assertTrue(replays_without_cpu_mirror(self.fa3_module()))
                    self.assertEqual(r.rows[0][-1].outside, LONGEST - C)
                else:
                    self.assertEqual(r.error, mismatch)


class TestRuntimeFix(Checks, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.addClassCleanup(g.import_fa3())

    def test_fixed_reads_inside_own_row(self):
        for mode, page, cpu_mirror in self.cases():
            if mode == "draft" and not cpu_mirror:
                continue  # the runtime form's limit: test_runtime_fix_limit_without_cpu_mirror
            with self.subTest(mode=mode, page=page, cpu_mirror=cpu_mirror):
                built = build(mode, page, fix="runtime", cpu_mirror=cpu_mirror)
                self.assertTrue(fa3_width.holds(built.backend), fa3_width.short_tables(built.backend))
                self.assert_fixed(built, cpu_mirror, f"{mode} page {page}")

    def test_runtime_fix_limit_without_cpu_mirror(self):
        # Without a CPU mirror the draft decode's gather stops at the host bound ceil(C / page)
        # (``members.fa3.sites`` host_bound, in-tree only): the kernel stays inside its own (widened) row,
        # no worse than sglang alone, but reads LONGEST - C unfilled entries at page 1.
        if not replays_without_cpu_mirror(self.fa3_module()):
            self.skipTest("this release always hands the CPU mirror over (0.5.13 - 0.5.15)")
        built = build("draft", 1, fix="runtime", cpu_mirror=False)
        r = replay(built, BATCHES["last"], cpu_mirror=False)
        self.assertEqual(r.error, "")
        last = r.rows[0][-1]
        self.assertEqual((last.outside, last.own, last.right), (0, LONGEST, C))

    def test_fixed_checks_fail_unfixed(self):
        for mode in ("verify", "draft"):
            with self.subTest(mode=mode), self.assertRaises(AssertionError):
                self.assert_fixed(build(mode, 1), True, mode)


class TestInTreeChange(Checks, unittest.TestCase):
    """``members.fa3.sites``' edits applied to a temporary copy of the release's file, imported and
    driven the same way (no runtime fix)."""

    @classmethod
    def setUpClass(cls):
        g.import_fa3_patched(cls, g.FA3 + "_fa3_topk_fixed")

    def test_topk_tables_located(self):
        widths = self.site.of("topk_width")
        self.assertGreaterEqual(len(widths), 2)  # draft decode's and verify's (+ the SWA one)
        self.assertTrue(all(e.found == "self.max_context_len" for e in widths))
        self.assertTrue(all(e.found == "self.max_context_len" for e in self.site.of("host_bound")))

    def test_patched_reads_inside_own_row(self):
        for mode, page, cpu_mirror in self.cases():
            with self.subTest(mode=mode, page=page, cpu_mirror=cpu_mirror):
                built = build(mode, page, module=self.module, cpu_mirror=cpu_mirror)
                self.assertEqual(fa3_width.enforce(built.backend), [])  # nothing left to do
                self.assert_fixed(built, cpu_mirror, f"{mode} page {page}")


if __name__ == "__main__":
    unittest.main()
