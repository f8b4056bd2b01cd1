"""The one invariant this project enforces, written once.

After ``init_cuda_graph_state`` the CUDA-graph ``page_table`` buffer (when not None) must be
exactly as wide as ``req_to_token``: replay copies ``req_to_token[idx, :k]`` into
``page_table[:, :k]`` with ``k`` up to ``req_to_token.shape[1]`` (target_verify reads
``max(seq_lens) + num_draft_tokens`` columns, and speculative decoding lets seq_len pass
context_len; the pool is over-allocated for exactly that). A narrower buffer makes ``copy_``
raise ``The size of tensor a (W) must match the size of tensor b (k)``.

sglang 0.5.14 sizes it ``max_context_len + num_draft_tokens``
(layers/attention/dsa_backend.py:995-1000); 0.5.15 uses ``self.req_to_token.shape[1]``
(dsa_backend.py:1119), as deepseek_v4_backend already did.
"""

from __future__ import annotations

# The in-tree patch writes this expression; status/check recognise it as "fixed".
REQUIRED_WIDTH_EXPR = "self.req_to_token.shape[1]"


def required_width(backend) -> int:
    """Width the graph page_table must have: the request pool's row width."""
    return int(backend.req_to_token.shape[1])


def graph_page_table(backend):
    """The CUDA-graph page_table buffer, or None (not allocated, or dropped upstream)."""
    metadata = getattr(backend, "decode_cuda_graph_metadata", None) or {}
    return metadata.get("page_table")


def holds(backend) -> bool:
    table = graph_page_table(backend)
    return table is None or table.shape[1] == required_width(backend)


def enforce(backend) -> bool:
    """Re-allocate a too-narrow graph page_table at the required width.

    Must run right after ``init_cuda_graph_state`` and before any capture: capture keeps
    views of this buffer (``page_table[:bs*D, :]``), so swapping it later would leave the
    captured graphs reading the old storage. Same rows, dtype and device; zero-filled like the
    original. Returns True when it changed anything; a no-op where the width is already right.
    """
    import torch

    table = graph_page_table(backend)
    width = required_width(backend)
    if table is None or table.shape[1] == width:
        return False
    backend.decode_cuda_graph_metadata["page_table"] = torch.zeros(
        table.shape[0], width, dtype=table.dtype, device=table.device
    )
    return True


def req_to_token_extra(num_draft_tokens: int, page_size: int, topk: int) -> int:
    """Columns ``req_to_token`` has beyond context_len with speculative decoding on.

    Mirrors sglang 0.5.14 mem_cache/common.py:251-267 (``4 + num_draft_tokens``; more for
    page>1 & topk>1, which DSA rejects). Older releases use the same ``4 + draft`` headroom
    inline in model_runner. Where sglang provides the function, callers should prefer it;
    tests check that this mirror agrees with it.
    """
    extra = 4 + (num_draft_tokens or 0)
    if page_size > 1 and topk > 1:
        # get_alloc_reserve_per_decode grows with topk*steps; never reached with DSA.
        raise ValueError("page_size > 1 with topk > 1 is not supported by the DSA backend")
    return extra


def target_verify_columns(seq_len: int, num_draft_tokens: int) -> int:
    """Columns a TARGET_VERIFY replay copies for a batch whose longest request is seq_len."""
    return seq_len + num_draft_tokens
