"""Issue 28: the two flat graph buffers the family watch flags, measured on the real classes.

The triton backend's ``cuda_graph_kv_indices`` and the flashinfer (non-MLA) backend's flat
kv_indices buffer are ``max_num_tokens * max_context_len`` entries, read through ``kv_indptr``;
their multi-step draft-decode backends own a ``[num_steps, max_bs * topk * max_context_len]``
buffer filled by ``generate_draft_decode_kv_indices``. This module drives each at sglang's own
sizes (what the cuda-graph runners pass: the target's verify runner ``max_bs * D`` tokens, the
draft runner ``max_bs * topk``) with EAGLE topk 1, D 4 and 8, C 256 (page 1), max_bs 4, and two
batches at the longest verify ``seq_len`` the scheduler runs (``width.verify_seq_len_bound``,
C + D - 4): (a) only the last row there, the others at 100; (b) every row of the largest batch
there. Numbers and verdicts: docs/graph-tables-other-backends.md, "Triton and flashinfer flat
buffers".

Driving, as test_graph_tables_other_backends.py does: the release's class built with ``__new__``
and the fields its ``__init__`` sets, its own ``init_cuda_graph_state`` (on the host where it
names "cuda"), capture and one replay through ``init_forward_metadata_out_graph`` (+ the in-graph
call), the Triton fill kernels run by Triton's interpreter. Stand-ins only for flashinfer's
wrappers (absent here): the prefill plan copies the kv indices into its buffer after the length
check flashinfer makes; decode plans are recorded. Each buffer the replay fills is ``guarded``
(a view of a larger allocation filled with a sentinel), so writes past its end are counted. What
a kernel reads is taken from the metadata it is handed: entries ``[0, kv_indptr[bs])`` from the
start of the indices it is given.

The draft decode's positions are the batch's seq_lens (0.5.14 base_spec_worker.py:265), its
seq_len the one the next verify runs with, so (a) / (b) apply to it as well.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import unittest

import graph_backends as g
import test_graph_tables_other_backends as o
import torch

from sglang_dsa_fix.verdicts import Bug

MAX_BS = 4
SHORT = 100
DRAFTS = (4, 8)
C = 256
SENTINEL = -7
ATTENTION = g.ATTENTION
TRITON = importlib.import_module(f"{ATTENTION}.triton_backend")
FLASHINFER, _FI_WHY = o.importable(f"{ATTENTION}.flashinfer_backend")


def last_row(D: int) -> list:
    return [SHORT] * (MAX_BS - 1) + [o.longest(C, D)]


def every_row(D: int) -> list:
    return [o.longest(C, D)] * MAX_BS


def own_slots(pool, seq_lens: list, extra: int = 0) -> torch.Tensor:
    """Request b's first s_b + extra slots of pool row b + 1, end to end (what a correct fill
    writes: kv_indptr is the cumsum of these lengths)."""
    rows = pool.req_to_token
    return torch.cat([rows[b + 1, : s + extra] for b, s in enumerate(seq_lens)]).to(torch.int64)


def o_record(name: str, m: dict) -> dict:
    """Into test_graph_tables_other_backends' report (SGLANG_DSA_FIX_OTHER_REPORT)."""
    o.REPORT.setdefault(o.version(), {})[name] = {
        k: v for k, v in m.items() if k not in ("error", "table")
    } | {"error": "" if m.get("error") is None else str(m["error"])}
    return m


def row_of(pool) -> int:
    return int(pool.req_to_token.shape[1])


# ------------------------------------------------------------------------------------ triton


def triton_fixed(class_name: str):
    """The class as the plugin runs it (``o.plugin_form``: the bytes `apply` writes, compiled)."""
    return o.plugin_form(TRITON, Bug.TRITON_KV_INDICES, class_name)


def triton_step(
    pool, D: int, skip_prefill: bool, kv_indptr=None, fixed: bool = False, topk: int = 1, steps=None
):
    """TritonAttnBackend as ``__init__`` leaves it for a small MHA model, no sliding window, EAGLE
    topk 1 (0.5.14 triton_backend.py:97-281; 0.5.17 / 0.5.23 add page_size, the
    kv_index_translator, is_draft_runner, _verify_mask and the DCP fields: 0.5.23 :150-420);
    ``topk`` / ``steps`` (default D - 1) as sglang resolves them otherwise."""
    cls = triton_fixed("TritonAttnBackend") if fixed else TRITON.TritonAttnBackend
    b = cls.__new__(cls)
    b.skip_prefill, b.sliding_window_size, b.use_sliding_window_kv_pool = skip_prefill, None, False
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b.token_to_kv_pool_allocator = None
    b.num_draft_tokens, b.speculative_num_steps, b.topk = D, steps or D - 1, topk
    b.use_mla, b.num_head, b.num_kv_head, b.v_head_dim, b.swa_v_head_dim = False, 1, 1, 8, None
    b.max_context_len, b.device, b.device_core_count = C, torch.device("cpu"), 0
    b.static_kv_splits, b.enable_deterministic, b.split_tile_size, b.max_kv_splits = True, False, None, 2
    b.kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32) if kv_indptr is None else kv_indptr
    b.window_kv_indptr = None
    b.qo_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32)
    b.mask_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64)
    b.forward_metadata, b.cuda_graph_custom_mask = None, None
    b.page_size, b.kv_index_translator = 1, o._translator(pool)
    b.is_draft_runner, b._verify_mask, b.dcp_size, b.dcp_rank = False, None, 1, 0
    b.target_verify_num_tokens_per_req, b.dllm_block_size = D, None
    # 0.5.23: Lean decode (off) still sizes its graph buffers (:318-323), the verify variants off.
    b.enable_lean_attention, b.lean_total_programs, b.lean_block_m = False, 1, 16
    b._translate_kv_loc = None  # 0.5.17 (:168): a plain pool translates nothing
    b.use_verify_splitkv = b.use_verify_shared_kv = b.is_hip_dspark_draft = False
    return b


@contextlib.contextmanager
def gpu_mask_mode():
    """0.5.17+ size the verify mask by ``default_tree_mask_mode()``, which answers QLEN_ONLY on a
    CPU build (the intel_amx kernel) and FULL_MASK on a GPU (0.5.23 eagle_utils.py:132-135):
    the GPU's answer here. Releases without it (0.5.14) size the mask themselves."""
    try:
        vm = importlib.import_module(f"{ATTENTION}.verify_mask")
        from sglang.srt.speculative.eagle_utils import TreeMaskMode
    except ImportError:
        yield
        return
    with g.patched(vm, default_tree_mask_mode=lambda: TreeMaskMode.FULL_MASK):
        yield


def mask_buffer(b):
    return b._verify_mask.buffer if b._verify_mask is not None else b.cuda_graph_custom_mask


def run_triton(
    mode: str,
    D: int,
    seq_lens: list,
    row_wide: bool = False,
    fixed: bool = False,
    own_mask: bool = False,
    pool=None,
) -> dict:
    """The target's TritonAttnBackend: its own init_cuda_graph_state(max_bs, max_bs * D) (the
    verify runner's sizes: decode_cuda_graph_runner.py:233-263, num_tokens_per_bs = D), flat
    kv_indices [max_bs * D * C] (0.5.14 :826-835, 0.5.17 :1003-1010, 0.5.23 :1226-1233); a
    TARGET_VERIFY or DECODE capture and replay. The verify's custom mask is the backend's own
    buffer, as the spec-v2 worker hands it to the tree builder (0.5.14 eagle_worker_v2.py:
    519-555, ``get_verify_buffers_to_fill_after_draft``; 0.5.23 eagle_worker_common.py:408-415).
    ``row_wide``: init_cuda_graph_state's sizes from req_to_token's row instead of C (kv_indices
    ``max_num_tokens * req_to_token.shape[1]``, the mask likewise); ``fixed``: the plugin's form.
    ``own_mask``: the verify input carries its own mask, D * (s + D) cells a request (NGRAM's,
    0.5.14 ngram_worker.py:301-320), which the replay copies into the backend's buffer
    (``custom_mask[: n] = spec_info.custom_mask``, 0.5.14 triton_backend.py:430-435, 0.5.23
    :634-638); the copy's error, if any, is ``error``. ``pool``: default ``o.pool_for(C, D, 1)``."""
    pool = o.pool_for(C, D, 1) if pool is None else pool
    b = triton_step(pool, D, skip_prefill=False, fixed=fixed)
    tokens = D if mode == "TARGET_VERIFY" else 1
    n = MAX_BS * D
    if row_wide:
        b.max_context_len = row_of(pool)
    with o.parallel_defaults(), gpu_mask_mode():
        b.init_cuda_graph_state(MAX_BS, n)
        b.cuda_graph_kv_indices = buf = g.guarded(tuple(b.cuda_graph_kv_indices.shape), SENTINEL, torch.int64)
        spec = g.verify_input(MAX_BS, D) if mode == "TARGET_VERIFY" else None
        if spec is not None:
            spec.custom_mask = mask_buffer(b)
        o.capture(b, mode, MAX_BS, tokens, spec)
        buf._base.fill_(SENTINEL)
        if own_mask:
            spec.custom_mask = torch.ones(D * sum(s + D for s in seq_lens), dtype=torch.bool)
        try:
            o.replay(b, mode, seq_lens, tokens, spec)
        except RuntimeError as exc:
            return dict(error=str(exc).splitlines()[0], mask_cells=int(mask_buffer(b).numel()))
    used = int(b.kv_indptr[MAX_BS])
    out = dict(
        error="",
        entries=int(buf.numel()),
        kv_used=used,
        kv_right=bool(torch.equal(buf[:used], own_slots(pool, seq_lens))) if used <= buf.numel() else False,
        kv_written_past=int((g.past_the_end(buf) != SENTINEL).sum()),
    )
    if mode == "TARGET_VERIFY":
        # The verify kernel reads the mask at mask_indptr[b] + ..., D * (s + D) cells per
        # request (0.5.14 :442-444, 0.5.23 :641-643): up to mask_indptr[bs].
        out.update(mask_cells=int(mask_buffer(b).numel()), mask_read=int(b.mask_indptr[MAX_BS]))
    return out


def triton_draft(pool, D: int, fixed: bool = False, topk: int = 1, steps=None):
    """TritonMultiStepDraftBackend (0.5.14 triton_backend.py:1416-1458, 0.5.23 :2504-2568):
    num_steps = D - 1 (EAGLE topk 1; else ``steps``), one step backend (skip_prefill) per step
    but the last, each over its row of the shared kv_indptr (max_bs * topk + 1 wide, :1432)."""
    cls = triton_fixed("TritonMultiStepDraftBackend") if fixed else TRITON.TritonMultiStepDraftBackend
    m = cls.__new__(cls)
    n = steps or D - 1
    m.topk, m.speculative_num_steps = topk, n
    m.kv_indptr = torch.zeros(n, MAX_BS * topk + 1, dtype=torch.int32)
    m.attn_backends = [triton_step(pool, D, True, m.kv_indptr[i], fixed, topk, n) for i in range(n - 1)]
    m.max_context_len, m.num_head, m.device = C, 1, torch.device("cpu")
    m.req_to_token_pool, m.pool_len, m.page_size = pool, row_of(pool), 1
    m.draft_window_size, m.draft_sink_size = 0, 0  # 0.5.23 resolve_draft_decode_window: unset
    m.kv_index_translator, m.token_to_kv_pool = o._translator(pool), None
    m.sliding_window_size, m.window_rail = None, False
    m.window_kv_indptr = m.cuda_graph_window_kv_indices = None
    return m


def flashinfer_draft(pool, D: int):
    """FlashInferMultiStepDraftBackend (0.5.14 flashinfer_backend.py:1834-1880, 0.5.23
    :2442-2492) over FlashInferAttnBackend step backends (skip_prefill)."""
    cls = FLASHINFER.FlashInferMultiStepDraftBackend
    m = cls.__new__(cls)
    m.topk, m.speculative_num_steps, m.page_size = 1, D - 1, 1
    m.generate_draft_decode_kv_indices = FLASHINFER.generate_draft_decode_kv_indices
    m.kv_indptr = torch.zeros(D - 1, MAX_BS + 1, dtype=torch.int32)
    m.kv_last_page_len = torch.ones(MAX_BS, dtype=torch.int32)
    m.attn_backends = [
        flashinfer_step(pool, D, True, m.kv_indptr[i], m.kv_last_page_len) for i in range(D - 2)
    ]
    m.max_context_len, m.pool_len, m.req_to_token_pool = C, row_of(pool), pool
    m.draft_window_size, m.draft_sink_size = 0, 0
    m.kv_index_translator = o._translator(pool)
    return m


def draft_batch(seq_lens: list, topk: int = 1):
    """The draft graph runner's batch at replay (g.draft_replay_batch), positions = seq_lens, one
    per branch (0.5.14 base_spec_worker.py:265: ``seq_lens.repeat_interleave(topk)``)."""
    fb = g.draft_replay_batch(seq_lens, g.draft_input())
    fb.positions = torch.tensor(seq_lens, dtype=torch.int64).repeat_interleave(topk)
    return fb


def draft_slots(pool, seq_lens: list, i: int, topk: int = 1, steps: int = 1) -> torch.Tensor:
    """What step i's kv_indices hold where filled right: per request b and branch k, its s_b
    prefix slots, then the i + 1 draft slots of branch k, row columns [s_b + k * steps, ...)
    (0.5.14 speculative/triton_ops/cache_locs.py:131-164, page 1)."""
    rows = pool.req_to_token
    parts = []
    for b, s in enumerate(seq_lens):
        for k in range(topk):
            parts += [rows[b + 1, :s], rows[b + 1, s + k * steps : s + k * steps + i + 1]]
    return torch.cat(parts).to(torch.int64)


def run_draft(
    backend: str,
    D: int,
    seq_lens: list,
    row_wide: bool = False,
    fixed: bool = False,
    topk: int = 1,
    steps=None,
    pool=None,
) -> dict:
    """The multi-step draft backend at the draft runner's sizes: init_cuda_graph_state(max_bs,
    max_bs * topk) (eagle_draft_cuda_graph_runner.py:142-147), buffer [num_steps,
    max_bs * topk * C] (``draft_kv_indices_buffer_width``, spec_utils.py:107-119); a capture and
    one replay. Step i's backend reads entries [0, kv_indptr[i][bs]) from the start of row i
    (its spec_info.kv_indices, a slice of that row: triton_backend.py:1497-1503). ``row_wide``:
    the row as ``max_bs * topk * req_to_token.shape[1]``. ``topk`` / ``steps`` / ``pool``: as
    ``triton_draft`` (triton only) and ``run_triton``."""
    pool = o.pool_for(C, D, 1) if pool is None else pool
    n = steps or D - 1
    m = triton_draft(pool, D, fixed, topk, n) if backend == "triton" else flashinfer_draft(pool, D)
    if row_wide:
        m.max_context_len = row_of(pool)
    error = None
    module = TRITON if backend == "triton" else FLASHINFER
    stand_ins = contextlib.nullcontext() if backend == "triton" else fi_stand_ins()
    with o.parallel_defaults(), o.host_torch(module), stand_ins:
        m.init_cuda_graph_state(MAX_BS, MAX_BS * topk)
        steps, width = m.cuda_graph_kv_indices.shape
        table = g.guarded((steps, width), SENTINEL, m.cuda_graph_kv_indices.dtype)
        m.cuda_graph_kv_indices = table
        for i, step in enumerate(m.attn_backends):
            step.cuda_graph_kv_indices = table[i] if backend == "triton" else [table[i]]
        m.init_forward_metadata_out_graph(
            g.capture_fields("DECODE", MAX_BS, topk, g.draft_input()), in_capture=True
        )
        table._base.fill_(SENTINEL)
        try:
            fb = draft_batch(seq_lens, topk)
            m.init_forward_metadata_out_graph(fb)
            m.init_forward_metadata_in_graph(fb)
        except AssertionError as exc:  # flashinfer's assert_buffer_fits
            error = exc
    flat = table._base.reshape(-1)
    total = steps * width
    per_step = []
    for i in range(steps - 1):  # the backends' steps; the fill kernel also writes row steps - 1
        used = int(m.kv_indptr[i, MAX_BS * topk])
        reads = range(i * width, i * width + used)
        expected = draft_slots(pool, seq_lens, i, topk, n)
        got = flat[i * width : i * width + used]
        per_step.append(
            dict(
                used=used,
                other_row=sum(1 for k in reads if width <= k - i * width and k < total),
                past=sum(1 for k in reads if k >= total),
                wrong=int((got != expected[: got.numel()]).sum()) if error is None else 0,
            )
        )
    return dict(
        width=int(width),
        steps=int(steps),
        per_step=per_step,
        last_row_used=int(topk * (sum(seq_lens) + MAX_BS * steps)),  # row steps - 1 (step index steps)
        written_past=int((flat[total:] != SENTINEL).sum()),
        error=error,
        table=table,
    )


def run_draft_eager(D: int, seq_lens: list, fixed: bool = False) -> dict:
    """The multi-step draft backend with CUDA graphs disabled: its own ``init_forward_metadata``
    (0.5.14 triton_backend.py:1505-1520, 0.5.23 :2717-2760) allocates ``[num_steps,
    draft_kv_indices_buffer_width(batch_size, topk, C)]`` for the batch as it runs; that
    allocation is ``guarded`` (the module's torch.empty answers it), the rest as the release does."""
    pool = o.pool_for(C, D, 1)
    m = triton_draft(pool, D, fixed)
    made = []

    class _EagerTorch(o._HostTorch):
        @staticmethod
        def empty(shape, dtype=None, device=None):
            if isinstance(shape, tuple) and len(shape) == 2 and dtype == torch.int64:
                made.append(g.guarded(shape, SENTINEL, dtype))
                return made[-1]
            return torch.empty(shape, dtype=dtype, device="cpu")

    with o.parallel_defaults(), g.patched(TRITON, torch=_EagerTorch()):
        m.init_forward_metadata(draft_batch(seq_lens))
    (buffer,) = made
    return dict(width=int(buffer.shape[1]), written_past=int((g.past_the_end(buffer) != SENTINEL).sum()))


class TestTritonFlat(unittest.TestCase):
    """Target verify: kv_indices gets the prefix only, sum(s) (0.5.14 :335-353, :386-410), of a
    max_bs * D * C buffer: fits. Its custom mask is D * (s + D) per request. Draft decode:
    step i needs sum(s) + bs * (i + 1) entries of a max_bs * C row."""

    def test_verify_kv_indices_fit(self):
        for D in DRAFTS:
            for name, batch in (("last row", last_row(D)), ("every row", every_row(D))):
                with self.subTest(D=D, batch=name):
                    m = run_triton("TARGET_VERIFY", D, batch)
                    self.assertEqual(m["entries"], MAX_BS * D * C)
                    self.assertEqual(m["kv_used"], sum(batch))
                    self.assertTrue(m["kv_right"])
                    self.assertEqual(m["kv_written_past"], 0)

    def test_decode_fits(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_triton("DECODE", D, every_row(D))
                self.assertEqual(
                    (m["kv_used"], m["kv_right"], m["kv_written_past"]), (sum(every_row(D)), True, 0)
                )

    def test_draft_decode_last_row_fits(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                batch = last_row(D)
                m = run_draft("triton", D, batch)
                self.assertEqual((m["width"], m["steps"]), (MAX_BS * C, D - 1))
                for i, step in enumerate(m["per_step"]):
                    self.assertEqual(
                        step, dict(used=sum(batch) + MAX_BS * (i + 1), other_row=0, past=0, wrong=0)
                    )
                self.assertEqual(m["written_past"], 0)

    def test_verify_mask_every_row_reads_past(self):
        # Not the kv_indices: the verify's mask, D * (s + D) cells a request, in a buffer of
        # max_num_tokens * C (0.5.14 :838-843) or max_bs * D * (C + D) (0.5.17+ verify_mask.py:
        # tree_mask_numel). The last row alone fits; every row at C + D - 4 does not (0.5.17+:
        # exactly full at D 4). The tree builder writes this mask into the backend's buffer
        # (a CUDA kernel, not run here); the verify kernel reads it up to mask_indptr[bs].
        widened = importlib.util.find_spec(f"{ATTENTION}.verify_mask") is not None
        for D in DRAFTS:
            cells = MAX_BS * D * (C + D) if widened else MAX_BS * D * C
            for name, batch, past in (
                ("last row", last_row(D), 0),
                ("every row", every_row(D), max(0, D * sum(s + D for s in every_row(D)) - cells)),
            ):
                with self.subTest(D=D, batch=name):
                    m = run_triton("TARGET_VERIFY", D, batch)
                    self.assertEqual(m["mask_cells"], cells)
                    self.assertEqual(m["mask_read"], D * sum(s + D for s in batch))
                    self.assertEqual(max(0, m["mask_read"] - m["mask_cells"]), past)
        self.assertEqual(
            [
                max(
                    0,
                    D * sum(s + D for s in every_row(D))
                    - (MAX_BS * D * (C + D) if widened else MAX_BS * D * C),
                )
                for D in DRAFTS
            ],
            [0, 128] if widened else [64, 384],
        )

    def test_row_wide_verify_mask_holds_every_row(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_triton("TARGET_VERIFY", D, every_row(D), row_wide=True)
                self.assertLessEqual(m["mask_read"], m["mask_cells"])
                self.assertTrue(m["kv_right"])

    def test_draft_decode_every_row_reads_across_rows_and_writes_past_the_end(self):
        # Step i needs sum(s) + bs * (i + 1) = bs * (C + D - 3 + i) entries of a bs * C row: its
        # tail lands at the start of row i + 1, which the fill of step i + 1 writes in the same
        # launch (on a GPU, a race: the interpreter runs one order, step i reads step i + 1's
        # slots); the kernel also fills row num_steps - 1 (no backend reads it), whose tail is
        # written past the buffer's end.
        for D in DRAFTS:
            with self.subTest(D=D):
                batch = every_row(D)
                m = o_record(f"triton draft every row D {D}", run_draft("triton", D, batch))
                width = MAX_BS * C
                for i, step in enumerate(m["per_step"]):
                    used = sum(batch) + MAX_BS * (i + 1)
                    self.assertEqual(
                        step, dict(used=used, other_row=used - width, past=0, wrong=used - width)
                    )
                self.assertEqual(m["written_past"], sum(batch) + MAX_BS * (D - 1) - width)
                self.assertEqual(m["written_past"], {4: 12, 8: 44}[D])

    def test_fixed_verify_mask_holds_every_row(self):
        # The fix (bug token triton_kv_indices), as the plugin runs it: fails if it is removed.
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_triton("TARGET_VERIFY", D, every_row(D), fixed=True)
                self.assertLessEqual(m["mask_read"], m["mask_cells"])
                self.assertTrue(m["kv_right"])
                self.assertEqual(m["kv_written_past"], 0)

    def test_eager_draft_decode_lone_request_writes_past_the_end(self):
        # CUDA graphs disabled: the buffer is sized for the batch as it runs, so one request at
        # the longest verify's seq_len s writes s + D - 1 entries into a row of C; its last step's
        # tail lands past the buffer (3 at D 4, 11 at D 8). The fix (as the plugin runs it) sizes
        # the row from req_to_token: nothing past it. Fails if either is removed.
        for D in DRAFTS:
            s = o.longest(C, D)
            with self.subTest(D=D):
                m = run_draft_eager(D, [s])
                self.assertEqual((m["width"], m["written_past"]), (C, s + D - 1 - C))
                fixed = run_draft_eager(D, [s], fixed=True)
                self.assertEqual((fixed["width"], fixed["written_past"]), (row_of(o.pool_for(C, D, 1)), 0))

    def test_row_wide_and_fixed_draft_buffers_take_every_row(self):
        # row_wide: the control; fixed: the fix as the plugin runs it (fails if it is removed).
        for variant in ("row_wide", "fixed"):
            for D in DRAFTS:
                with self.subTest(variant=variant, D=D):
                    m = run_draft("triton", D, every_row(D), **{variant: True})
                    self.assertEqual(m["width"], MAX_BS * row_of(o.pool_for(C, D, 1)))
                    for step in m["per_step"]:
                        self.assertEqual((step["other_row"], step["past"], step["wrong"]), (0, 0, 0))
                    self.assertEqual(m["written_past"], 0)


# ------------------------------------------------------------------------------------ flashinfer


class _PrefillPlan(g._PrefillWrapper):
    """flashinfer's prefill wrapper in cuda-graph mode (g._PrefillWrapper: its length check, then
    the copy to the start of its kv indices buffer), the custom mask left as given."""


def flashinfer_step(pool, D: int, skip_prefill: bool, kv_indptr=None, kv_last_page_len=None):
    """FlashInferAttnBackend as ``__init__`` leaves it for a small MHA model, one wrapper, fa2,
    with its real indices updaters (g.flashinfer_backend's fields, 0.5.14 flashinfer_backend.py:
    294-480) and the later releases' (read where present)."""
    module = FLASHINFER
    b = module.FlashInferAttnBackend.__new__(module.FlashInferAttnBackend)
    b.prefill_backend = b.decode_backend = "fa2"
    b.req_to_token_pool, b.token_to_kv_pool, b.req_to_token = pool, None, pool.req_to_token
    b._swa_kv_pool, b.use_sliding_window_kv_pool = None, False
    b.max_context_len, b.skip_prefill, b.is_multimodal = C, skip_prefill, False
    b.num_wrappers, b.dispatch_reason, b.decode_use_tensor_cores = 1, None, False
    b.disable_cuda_graph_kv_split, b.workspace_buffer = False, None
    b.kv_indptr = [torch.zeros(MAX_BS + 1, dtype=torch.int32) if kv_indptr is None else kv_indptr]
    b.kv_last_page_len = (
        torch.ones(MAX_BS, dtype=torch.int32) if kv_last_page_len is None else kv_last_page_len
    )
    b.qo_indptr = [torch.zeros(MAX_BS + 1, dtype=torch.int32)]
    b.prefill_wrapper_ragged, b.forward_metadata = None, None
    b.decode_cuda_graph_metadata, b.prefill_cuda_graph_metadata = {}, {}
    b.draft_extend_cuda_graph_metadata = {}
    b.page_size, b.kv_index_translator = 1, o._translator(pool)
    g.flashinfer_updaters(module, b, pool, kv_index_translator=b.kv_index_translator, page_size=1)
    return b


def fi_stand_ins():
    return g.patched(
        FLASHINFER,
        BatchDecodeWithPagedKVCacheWrapper=g._Wrapper,
        BatchPrefillWithPagedKVCacheWrapper=_PrefillPlan,
        fast_decode_plan=g._fast_plan,
    )


def run_flashinfer_verify(D: int, seq_lens: list) -> dict:
    """The target's FlashInferAttnBackend: its own init_cuda_graph_state(max_bs, max_bs * D),
    flat kv_indices [max_bs * D * C] (0.5.14 :836-845, 0.5.17 :1006-1017, 0.5.23 :1106-1117);
    a TARGET_VERIFY capture and replay: the indices updater hands the plan s + D slots per
    request (generate_attn_arg_prefill, 0.5.14 eagle_info.py:98-134), which it copies into the
    buffer. The spec_info's mask is the full mask build_tree allocates (D * (s + D) a request:
    flashinfer hands the tree builder no buffer)."""
    pool = o.pool_for(C, D, 1)
    b = flashinfer_step(pool, D, skip_prefill=False)
    error = None
    with o.parallel_defaults(), o.host_torch(FLASHINFER), fi_stand_ins():
        b.init_cuda_graph_state(MAX_BS, MAX_BS * D)
        buf = g.guarded(tuple(b.cuda_graph_kv_indices[0].shape), SENTINEL, torch.int32)
        b.cuda_graph_kv_indices = [buf]
        spec = g.verify_input(MAX_BS, D)
        o.capture(b, "TARGET_VERIFY", MAX_BS, D, spec)
        buf._base.fill_(SENTINEL)
        spec = g.verify_input(MAX_BS, D)
        spec.custom_mask = torch.ones(D * sum(s + D for s in seq_lens), dtype=torch.bool)
        try:
            o.replay(b, "TARGET_VERIFY", seq_lens, D, spec)
        except (ValueError, RuntimeError) as exc:
            error = exc
    expected = own_slots(pool, seq_lens, D).to(torch.int32)
    used = int(expected.numel())
    return dict(
        entries=int(buf.numel()),
        kv_used=used,
        kv_right=bool(torch.equal(buf[:used], expected)),
        kv_written_past=int((g.past_the_end(buf) != SENTINEL).sum()),
        error=error,
    )


@unittest.skipUnless(FLASHINFER is not None, f"flashinfer_backend does not import: {_FI_WHY}")
class TestFlashinferFlat(unittest.TestCase):
    """Target verify: sum(s + D) entries of a max_bs * D * C buffer: fits. Draft decode: the
    same [num_steps, max_bs * C] buffer as triton's, but common_template checks the last step's
    extent first (``assert_buffer_fits``: 0.5.14 flashinfer_backend.py:1892-1901)."""

    def test_verify_fits(self):
        for D in DRAFTS:
            for name, batch in (("last row", last_row(D)), ("every row", every_row(D))):
                with self.subTest(D=D, batch=name):
                    m = run_flashinfer_verify(D, batch)
                    self.assertIsNone(m["error"])
                    self.assertEqual((m["entries"], m["kv_used"]), (MAX_BS * D * C, sum(batch) + MAX_BS * D))
                    self.assertTrue(m["kv_right"])
                    self.assertEqual(m["kv_written_past"], 0)

    def test_draft_decode_last_row_fits(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                batch = last_row(D)
                m = run_draft("flashinfer", D, batch)
                self.assertIsNone(m["error"])
                for i, step in enumerate(m["per_step"]):
                    self.assertEqual(
                        step, dict(used=sum(batch) + MAX_BS * (i + 1), other_row=0, past=0, wrong=0)
                    )
                self.assertEqual(m["written_past"], 0)

    def test_draft_decode_every_row_raises_before_the_fill(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                batch = every_row(D)
                m = run_draft("flashinfer", D, batch)
                self.assertIsInstance(m["error"], AssertionError)
                need = sum(batch) + MAX_BS * (D - 1)
                self.assertIn(f"used {need} > capacity {MAX_BS * C}", str(m["error"]))
                self.assertEqual(m["written_past"], 0)
                self.assertTrue(bool((m["table"] == SENTINEL).all()))  # the replay wrote nothing

    def test_row_wide_draft_buffer_takes_every_row(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_draft("flashinfer", D, every_row(D), row_wide=True)
                self.assertIsNone(m["error"])
                for step in m["per_step"]:
                    self.assertEqual((step["other_row"], step["past"], step["wrong"]), (0, 0, 0))
                self.assertEqual(m["written_past"], 0)


if __name__ == "__main__":
    unittest.main()
