"""Bug #3 on CPU: what FA3 would read from its CUDA-graph page tables after a real replay.

Shared by the demo (``compare``, ``as_expected``) and test/srt/test_fa3_cuda_graph.py
(``build``, ``replay``). The backend is the real FlashAttentionBackend (``fa3_backend``): its own
``init_cuda_graph_state``, capture and replay, with the release's own table builders (0.5.14:
torch gather / Triton ``normal_decode_set_metadata``; 0.5.17: Triton
``build_trtllm_mha_page_table``, unbounded; 0.5.23: ``normal_decode_set_metadata`` clamped to
``max_num_pages``), run by Triton's interpreter on CPU.

What the kernel reads is counted from that metadata and the kernel's addressing: for batch row b
it reads ``page_table`` entries j < ceil(cache_seqlens[b] / page), flat element
``b * stride(0) + j`` of the ``[max_bs, W]`` buffer, with no check against W (flash-attention
hopper/paged_kv.h ``PagedKVManager::load_page_table``): j >= W lands in the next buffer row, or
past the buffer's end for the last row at the largest captured batch.

The one instrument: right after ``init_cuda_graph_state`` (and the runtime fix) each graph table
the replay fills is swapped for a same-shape, same-stride view of a larger allocation filled with
``SENTINEL`` (``guarded``), so what a builder writes past the end lands in owned memory where it
is counted, not in the heap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_dsa_fix import width
from sglang_dsa_fix.members.fa3 import tables as fa3_width
from sglang_dsa_fix.proof import fa3_backend

SENTINEL = -7  # no page id is negative


def guarded(shape, fill=0, dtype=torch.int32):
    """A buffer of ``shape`` that is a view of one with room past its end (a spare row for a 2-D
    table, as many entries again for a flat one)."""
    if len(shape) == 2:
        return torch.full((shape[0] + 1, shape[1]), fill, dtype=dtype)[: shape[0]]
    return torch.full((2 * shape[0],), fill, dtype=dtype)[: shape[0]]


def table_bytes(backend) -> int:
    """Bytes of every topk-1 graph page table behind ``backend`` (``fa3_width.GRAPH_TABLES``)."""
    total = 0
    for inner in fa3_width.step_backends(backend):
        for attribute, key in fa3_width.GRAPH_TABLES:
            table = (getattr(inner, attribute, None) or {}).get(key)
            if table is not None:
                total += table.numel() * table.element_size()
    return total


@dataclass
class Built:
    mode: str  # "verify" (target_verify) or "draft" (the draft decode)
    page: int
    D: int
    backend: object  # FlashAttentionBackend (verify) or FlashAttentionMultiStepBackend (draft)
    pool: object
    tables: list  # per step backend: the guarded graph table its replay fills
    bytes_before: int = 0
    bytes_after: int = 0
    spec: object = None

    @property
    def steps(self):
        return fa3_width.step_backends(self.backend)


def _table_key(mode):
    if mode == "verify":
        return "target_verify_metadata", "page_table"
    return "decode_cuda_graph_metadata", "page_table_draft_decode"


def build(mode, page, D, context_len, max_bs, captured, row_extra, module=None, runtime_fix=False) -> Built:
    """The backend for ``mode`` over a pool ``context_len + row_extra`` wide (max_bs rows + the
    capture row), graph state for ``max_bs``, tables guarded, captured at each bs of ``captured``.
    ``runtime_fix``: ``fa3_width.enforce`` (what the plugin's hook runs) before the capture."""
    pool = fa3_backend.req_to_token_pool(context_len, row_extra, page, max_bs)
    if mode == "verify":
        backend = fa3_backend.fa3_release_backend(pool, context_len, D, page, module=module)
        backend.init_cuda_graph_state(max_bs, max_bs * D)
    else:  # the draft runner: max_num_tokens = max_bs * topk
        backend = fa3_backend.fa3_draft_backend(pool, context_len, D, page, module=module)
        backend.init_cuda_graph_state(max_bs, max_bs)
    before = table_bytes(backend)
    if runtime_fix:
        fa3_width.enforce(backend)
    built = Built(mode, page, D, backend, pool, [], before, table_bytes(backend))
    attribute, key = _table_key(mode)
    for inner in built.steps:
        table = getattr(inner, attribute)[key]
        table = getattr(inner, attribute)[key] = guarded(tuple(table.shape), fill=SENTINEL, dtype=table.dtype)
        built.tables.append(table)
    if mode == "verify":
        fields = [fa3_backend.capture_fields("TARGET_VERIFY", bs, D) for bs in captured]
    else:
        built.spec = fa3_backend.draft_input()
        fields = [fa3_backend.capture_fields("DECODE", bs, 1, built.spec) for bs in captured]
    for batch in fields:
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
    return built


@dataclass
class Row:
    pages: int  # entries the kernel reads: ceil(cache_seqlens / page)
    own: int = 0  # inside its own buffer row
    right: int = 0  # inside its own row and the request's own page id
    neighbour: int = 0  # another buffer row (the next request's pages, or a stale row)
    past: int = 0  # past the buffer's end


@dataclass
class Replay:
    error: str = ""
    rows: list = field(default_factory=list)  # per step backend: [Row per batch row]
    neighbour_writes: list = field(default_factory=list)  # per step: cells written in rows >= bs
    past_writes: list = field(default_factory=list)  # per step: cells written past the end
    width: int = 0
    seq_len: int = 0  # the longest request's

    def _sum(self, attribute) -> int:
        return sum(getattr(row, attribute) for rows in self.rows for row in rows)

    @property
    def reads(self) -> int:
        return self._sum("pages")

    @property
    def not_own(self) -> int:
        """Entries read that are not the request's own page id in its own row."""
        return self.reads - self._sum("right")

    @property
    def past(self) -> int:
        return self._sum("past")

    @property
    def writes_outside(self) -> int:
        return sum(self.neighbour_writes) + sum(self.past_writes)

    @property
    def clean(self) -> bool:
        return not self.error and not self.not_own and not self.writes_outside


def replay(built: Built, seq_lens: list) -> Replay:
    """One replay of the batch ``seq_lens`` (row b is pool row b + 1); what the kernel reads."""
    for table in built.tables:
        table._base.fill_(SENTINEL)
    out = Replay(width=int(built.tables[0].shape[1]), seq_len=max(seq_lens))
    try:
        if built.mode == "verify":
            view = fa3_backend.replay_view("TARGET_VERIFY", seq_lens, built.D)
        else:
            view = fa3_backend.draft_replay_batch(seq_lens, built.spec)
        built.backend.init_forward_metadata_out_graph(view)
    except AssertionError as exc:  # the release's own assert_buffer_fits
        out.error = str(exc).splitlines()[0]
        return out
    bs = len(seq_lens)
    attribute = "target_verify_metadata" if built.mode == "verify" else "decode_cuda_graph_metadata"
    for inner, table in zip(built.steps, built.tables):
        out.rows.append(kernel_reads(built, getattr(inner, attribute)[bs], table, bs))
        rows, cols = table.shape
        changed = table._base.reshape(-1) != SENTINEL
        out.neighbour_writes.append(int(changed[bs * cols : rows * cols].sum()))
        out.past_writes.append(int(changed[rows * cols :].sum()))
    return out


def kernel_reads(built: Built, metadata, table, bs: int) -> list:
    """What FA3 reads for each batch row, from the metadata it is handed: entries j <
    ceil(cache_seqlens[b] / page) at flat b * stride(0) + j of the buffer, unchecked."""
    page = built.page
    view = metadata.page_table
    assert view.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    offset = view.storage_offset() - table.storage_offset()
    stride, cols, numel = view.stride(0), table.shape[1], table.numel()
    flat = table._base.reshape(-1)
    r2t = built.pool.req_to_token
    rows = []
    for b in range(bs):
        need = fa3_width.pages_read(int(metadata.cache_seqlens_int32[b]), page)
        pool_row = b + 1  # replay row b is pool row b + 1 (fa3_backend.replay_view)
        row = Row(need)
        for j in range(need):
            k = offset + b * stride + j
            if k >= numel:
                row.past += 1
            elif k >= offset + b * stride + cols:
                row.neighbour += 1
            else:
                row.own += 1
                row.right += int(flat[k]) == int(r2t[pool_row, j * page]) // page
        rows.append(row)
    return rows


def cache_seqlen(mode: str, D: int, seq_len: int, step: int) -> int:
    """Keys the kernel is told to read: seq_len + D (target_verify), seq_len + step + 1 (draft
    decode step ``step``)."""
    return seq_len + D if mode == "verify" else seq_len + step + 1


def most_pages(mode: str, D: int, seq_len: int, page: int) -> int:
    """Pages the longest request's read spans: the verify's, or the draft decode's last step
    (steps 0 .. D - 3, ``fa3_backend.fa3_draft_backend``)."""
    last_step = 0 if mode == "verify" else D - 3
    return fa3_width.pages_read(cache_seqlen(mode, D, seq_len, last_step), page)


def sweep(mode, page, D, context_len, max_bs, row_extra, seq_lens, module=None, runtime_fix=False) -> list:
    """One backend captured at max_bs; a replay per seq_len with every request at that seq_len
    (so the first rows' reads run into the next request's row, the last one's past the buffer)."""
    built = build(mode, page, D, context_len, max_bs, (max_bs,), row_extra, module, runtime_fix)
    return [replay(built, [s] * max_bs) for s in seq_lens]


# ------------------------------------------------------------------------------ the demo's table

MODES = ("verify", "draft")


@dataclass
class Compared:
    """One seq_len of the demo's bug #3 table: the same replay three ways."""

    mode: str
    page: int
    seq_len: int
    pages: int  # pages the longest request's read spans (``most_pages``)
    runtime: Replay  # fa3_width.enforce after init_cuda_graph_state (the plugin's hook)
    in_tree: Replay  # the patched copy's FlashAttentionBackend
    pristine: Replay

    @property
    def outgrows_pristine(self) -> bool:
        """sglang's own table is narrower than the pages this replay reads."""
        return self.pages > self.pristine.width


def demo_seq_lens(context_len: int, D: int) -> list:
    """The last verify inside context_len, the first past it, context_len itself and the longest
    verify the scheduler runs (``width.verify_seq_len_bound``)."""
    bound = width.verify_seq_len_bound(context_len, D)
    return sorted({context_len - D, context_len - D + 1, context_len, bound})


def compare(context_len, D, pages, bs, patched_module, form) -> list:
    """Every mode, page and ``demo_seq_lens`` replayed pristine, runtime-fixed and in-tree
    patched (``patched_module``), over a request row as wide as the release ``form`` sizes it."""
    out = []
    for mode in MODES:
        for page in pages:
            row_extra = width.pristine_row_extra(form, width.SpecShape(context_len, D, D - 1, 1, page))
            seq_lens = demo_seq_lens(context_len, D)
            variants = ((None, True), (patched_module, False), (None, False))
            runs = [sweep(mode, page, D, context_len, bs, row_extra, seq_lens, m, f) for m, f in variants]
            for s, (runtime, in_tree, pristine) in zip(seq_lens, zip(*runs)):
                out.append(Compared(mode, page, s, most_pages(mode, D, s, page), runtime, in_tree, pristine))
    return out


def as_expected(entries: list) -> bool:
    """Pristine reads outside the request's row (or raises) exactly where the read outgrows its
    table, and does somewhere; both fixes read every page inside the row, its own page ids."""
    pristine = all(e.pristine.clean != e.outgrows_pristine for e in entries)
    fixed = all(r.clean and r.reads and r.width >= e.pages for e in entries for r in (e.runtime, e.in_tree))
    return any(e.outgrows_pristine for e in entries) and pristine and fixed
