"""Bug #3's rule, written once: FA3's CUDA-graph page tables as wide as ``req_to_token``'s row.

They must cover the widest row a verify or a draft decode can read, which is that row, in pages.

sglang's ``FlashAttentionBackend.init_cuda_graph_state`` allocates every topk-1 graph page table
``[max_bs, max_num_pages]`` with ``max_num_pages = ceil(max_context_len / page_size)`` (0.5.14
layers/attention/flashattention_backend.py:1610; 0.5.17 :2061; 0.5.23 :2432), and the releases
with a device-side builder bound it by ``self.max_num_pages``, the same value set in
``__init__`` (0.5.17 :180-182, 0.5.23 :196-198). A replay tells the FA3 kernel to read
``cache_seqlens = seq_len + D`` keys (target_verify) or ``seq_len + step + 1`` (draft decode),
and speculative decoding lets seq_len pass context_len (``width.verify_seq_len_bound``: up to
``context_len + D - 4``). The kernel follows ``page_table.stride(0)`` with no check against the
width (flash-attention hopper/paged_kv.h), so the row's last pages are read from the next row,
or, for the last row at the largest captured batch, from past the buffer.

The fix: every such table ``ceil(req_to_token.shape[1] / page_size)`` pages wide, and the
replay's own bounds with it (the ``strided_indices`` gathers of <= 0.5.14, the
``self.max_num_pages`` clamp of 0.5.17+), so the new columns are *filled* with the request's
pages, not left at 0. ``req_to_token``'s row holds the longest read (bug #2's rule keeps it so).

The in-tree form (``fa3_sites``) writes ``WIDTH_EXPR`` / ``STRIDED_STOP_EXPR`` into sglang's
file; ``enforce`` is the runtime form. This module imports no torch and no sglang at import time.
"""

from __future__ import annotations

from typing import Optional

from sglang_dsa_fix.width import pages_read  # noqa: F401 (the FA3 tests' name for it)

# (the reach arithmetic at a configuration is in ``width``)

# The in-tree change writes these expressions (fa3_sites); enforce evaluates the same rule.
WIDTH_EXPR = "-(-self.req_to_token.shape[1] // self.page_size)"
STRIDED_STOP_EXPR = "self.req_to_token.shape[1]"

# (metadata dict attribute, key) of every graph page table init_cuda_graph_state sizes
# ``max_num_pages`` wide (topk 1; the SWA siblings only exist with a sliding-window pool).
# Same keys in 0.5.14, 0.5.17 and 0.5.23 (0.5.14 :1621/1669/1742/1763/1786/1798/1804).
GRAPH_TABLES = (
    ("decode_cuda_graph_metadata", "page_table"),  # normal decode
    ("decode_cuda_graph_metadata", "swa_page_table"),
    ("decode_cuda_graph_metadata", "page_table_draft_decode"),  # draft decode, topk 1
    ("target_verify_metadata", "page_table"),
    ("target_verify_metadata", "swa_page_table"),
    ("draft_extend_metadata", "page_table"),
    ("draft_extend_metadata", "swa_page_table"),
)
# The topk > 1 tables of the prefix half of a draft decode or verify (and the verify's SWA one),
# allocated ``[rows, max_context_len]`` in *tokens* (flashattention_backend.py 0.5.14 :1699, :1826,
# :1877; 0.5.23 :2499, :2637, :2690) and filled through the same page-start gather
# (``strided_indices[:max_seq_pages]``, 0.5.14 :2203-2212, :2339-2345) or, 0.5.16+, the verify's
# device-side ``build_trtllm_mha_page_table``. Widening the gather alone would make the copy
# ``[bs, min(pages read, row)]`` into ``[bs, :max_seq_pages]`` of a table still C wide: at page 1
# past C that raises ``The size of tensor a (C) must match ... (seq_len)``, where sglang alone
# read past the row silently. So they are widened under the same rule, in their own unit.
TOPK_TABLES = (
    ("draft_decode_metadata_topk_normal", "page_table"),
    ("target_verify_metadata_topk_normal", "page_table"),
    ("target_verify_metadata_topk_swa", "page_table"),
)
# req_to_token's row in tokens: as many columns as the row has tokens, so at least its pages at
# any page size (the tables' own unit is tokens, ``max_context_len``).
TOPK_WIDTH_EXPR = "self.req_to_token.shape[1]"

# The page-start gathers ``arange(0, max_context_len, page_size)``: ceil(C / page) entries, which
# bound the <= 0.5.14 verify gather (it slices decode's, :2308-2311) and the topk>1 / draft-extend
# gathers of every release.
STRIDED_INDICES = (
    ("decode_cuda_graph_metadata", "strided_indices"),
    ("target_verify_metadata", "strided_indices"),
    ("draft_extend_metadata", "strided_indices"),
)


def required_pages(backend) -> int:
    """Pages a graph table must hold: req_to_token's row width in pages."""
    return -(-int(backend.req_to_token.shape[1]) // int(backend.page_size))


def step_backends(backend) -> list:
    """The FlashAttentionBackend instances behind ``backend``: itself, or the per-step backends
    of a FlashAttentionMultiStepBackend (the draft decode's, one per step 0 .. num_steps - 2)."""
    inner = getattr(backend, "attn_backends", None)
    return list(inner) if inner is not None else [backend]


def _tables(backend):
    for attribute, key in GRAPH_TABLES:
        table = (getattr(backend, attribute, None) or {}).get(key)
        if table is not None:
            yield attribute, key, table


def _topk_tables(backend):
    for attribute, key in TOPK_TABLES:
        table = (getattr(backend, attribute, None) or {}).get(key)
        if table is not None:
            yield attribute, key, table


def _strided(backend):
    for attribute, key in STRIDED_INDICES:
        indices = (getattr(backend, attribute, None) or {}).get(key)
        if indices is not None:
            yield attribute, key, indices


def short_tables(backend) -> list:
    """(attribute, key, width, required) of each graph table or bound narrower than the rule,
    over every step backend; ``max_num_pages`` is reported as (None, "max_num_pages", ...)."""
    out = []
    for inner in step_backends(backend):
        need = required_pages(inner)
        for attribute, key, table in (*_tables(inner), *_topk_tables(inner)):
            if table.shape[1] < need:
                out.append((attribute, key, int(table.shape[1]), need))
        for attribute, key, indices in _strided(inner):
            if indices.shape[0] < need:
                out.append((attribute, key, int(indices.shape[0]), need))
        bound = getattr(inner, "max_num_pages", None)
        if bound is not None and bound < need:
            out.append((None, "max_num_pages", int(bound), need))
    return out


def holds(backend) -> bool:
    return not short_tables(backend)


def _captured(backend) -> bool:
    """Has capture bound views of the tables already (int batch-size keys)?"""
    return any(
        isinstance(key, int)
        for attribute, _ in (*GRAPH_TABLES, *TOPK_TABLES)
        for key in (getattr(backend, attribute, None) or {})
    )


def enforce(backend) -> list:
    """Re-allocate each too-narrow FA3 graph page table at ``required_pages`` (the topk > 1
    token-wide tables at the row's width in tokens) and widen the replay's bounds with it
    (``strided_indices``; ``max_num_pages`` where the release has it).

    Must run right after ``init_cuda_graph_state`` and before any capture: capture binds
    ``[:bs, :]`` views of these buffers into the per-bs metadata, so a later swap would leave the
    captured graphs on the old storage (RuntimeError then, nothing changed). ``backend`` is a
    FlashAttentionBackend or a FlashAttentionMultiStepBackend. Same rows, dtype and device,
    zero-filled like the original. Returns one (step, attribute, key, old, new) per change.
    """
    import torch

    inners = step_backends(backend)
    if any(_captured(inner) for inner in inners) and not holds(backend):
        raise RuntimeError("fa3_width.enforce after capture: the captured graphs keep the old tables")
    changes = []
    for step, inner in enumerate(inners):
        need = required_pages(inner)
        for attribute, key, table in list(_tables(inner)):
            if table.shape[1] >= need:
                continue
            getattr(inner, attribute)[key] = torch.zeros(
                table.shape[0], need, dtype=table.dtype, device=table.device
            )
            changes.append((step, attribute, key, int(table.shape[1]), need))
        row = int(inner.req_to_token.shape[1])
        for attribute, key, table in list(_topk_tables(inner)):
            if table.shape[1] >= need:  # in tokens: at page > 1 already wider than the row's pages
                continue
            getattr(inner, attribute)[key] = torch.zeros(
                table.shape[0], row, dtype=table.dtype, device=table.device
            )
            changes.append((step, attribute, key, int(table.shape[1]), row))
        for attribute, key, indices in list(_strided(inner)):
            if indices.shape[0] >= need:
                continue
            getattr(inner, attribute)[key] = torch.arange(
                0,
                int(inner.req_to_token.shape[1]),
                int(inner.page_size),
                dtype=indices.dtype,
                device=indices.device,
            )
            changes.append((step, attribute, key, int(indices.shape[0]), need))
        bound: Optional[int] = getattr(inner, "max_num_pages", None)
        if bound is not None and bound < need:
            inner.max_num_pages = need
            changes.append((step, None, "max_num_pages", int(bound), need))
    return changes


def extra_bytes(max_bs: int, context_len: int, row_width: int, page_size: int, itemsize: int = 4) -> int:
    """What the rule adds to one ``[max_bs, pages]`` int32 table: rows x extra pages x itemsize."""
    extra = -(-row_width // page_size) - -(-context_len // page_size)
    return max_bs * max(0, extra) * itemsize
