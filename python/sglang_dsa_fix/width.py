"""The width arithmetic every member shares, written once: bug #1's graph page_table width and
its runtime fix, bug #2's row headroom, the longest verify, and a configuration's inputs
(``configuration_inputs``); each member's rule at a configuration is its unit's (``members``).

Bug #1 (crash): the CUDA-graph ``page_table`` of the DSA/NSA backend must be exactly as wide as
``req_to_token``. Replay copies ``req_to_token[idx, :k]`` into ``page_table[:, :k]`` with ``k`` up
to ``req_to_token.shape[1]`` (target_verify reads ``max(seq_lens) + D`` columns and speculative
decoding lets seq_len pass context_len). A narrower buffer makes ``copy_`` raise
``The size of tensor a (W) must match the size of tensor b (k)``. sglang 0.5.14 sizes it
``max_context_len + num_draft_tokens`` (layers/attention/dsa_backend.py:995-1000); 0.5.15 uses
``self.req_to_token.shape[1]`` (dsa_backend.py:1119), as deepseek_v4_backend already did.

Bug #2 (silent corruption): each spec-v2 decode step writes ``req_to_token[row, cur:nxt]`` with
``nxt = max(cur, kv_committed_len + reserve)`` (0.5.14 speculative/eagle_info_v2.py:55, 0.5.15
speculative/eagle_utils.py:794; rounded up to a page from 0.5.16) through the Triton kernel
``assign_req_to_token_pool``, which masks only ``col < nxt`` (0.5.14
speculative/triton_ops/cache_locs.py:45), never the row width. The row is
``context_len + extra`` wide (``get_req_to_token_extra_context_len``: 0.5.14 mem_cache/common.py:251,
0.5.16+ mem_cache/allocation_sizing.py:46), ``extra = 4 + D`` at page size 1. kv_committed_len at
the last prepare before a request finishes reaches ``context_len - margin`` (below), so the row
must hold ``reserve - margin`` columns past context_len (+ ``page_size - 1`` where nxt is
page-aligned); anything beyond the row lands in the next request's row.

This module imports no torch and no sglang at import time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from sglang_dsa_fix.release import Form

# The ``basis`` of a configuration sglang did not resolve (``resolve.unresolved``): no numbers,
# so every bug the configuration decides is ``cannot_tell``.
UNRESOLVED = "unresolved"

# --------------------------------------------------------------------------------------------
# Bug #1: the graph page_table width.

# The in-tree patch writes this expression; check/status recognise it as "fixed".
PAGE_TABLE_WIDTH_EXPR = "self.req_to_token.shape[1]"


# Nodes a width expression may use for us to evaluate it (e.g. ``self.max_context_len +
# (self.speculative_num_draft_tokens or 0)``); anything else is reported, not evaluated.
_SAFE_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.BoolOp,
    ast.Add,
    ast.Sub,
    ast.Or,
    ast.Attribute,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Subscript,
)


def evaluate_page_table_expression(
    expression: str, context_len: int, draft: int, pool_width: int
) -> Optional[int]:
    """The static rule for bug #1's buffer: the release's own page_table width expression (as
    the file spells it) evaluated for a shape; None if it is not plain arithmetic."""
    parsed = ast.parse(expression, mode="eval")
    if not all(isinstance(node, _SAFE_NODES) for node in ast.walk(parsed)):
        return None
    fake_self = SimpleNamespace(
        max_context_len=context_len,
        speculative_num_draft_tokens=draft,
        req_to_token=SimpleNamespace(shape=(None, pool_width)),
    )
    try:
        return int(eval(compile(parsed, "<width>", "eval"), {"__builtins__": {}}, {"self": fake_self}))
    except Exception:
        return None


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


def enforce(backend) -> Optional[tuple[int, int]]:
    """Re-allocate a too-narrow graph page_table at the required width.

    Must run right after ``init_cuda_graph_state`` and before any capture: capture keeps
    views of this buffer (``page_table[:bs*D, :]``), so swapping it later would leave the
    captured graphs reading the old storage. Same rows, dtype and device; zero-filled like the
    original. Returns (old width, new width) when it changed anything, else None.
    """
    import torch

    table = graph_page_table(backend)
    width = required_width(backend)
    if table is None or table.shape[1] == width:
        return None
    backend.decode_cuda_graph_metadata["page_table"] = torch.zeros(
        table.shape[0], width, dtype=table.dtype, device=table.device
    )
    return table.shape[1], width


def target_verify_columns(seq_len: int, num_draft_tokens: int) -> int:
    """Columns a TARGET_VERIFY replay copies for a batch whose longest request is seq_len."""
    return seq_len + num_draft_tokens


def verify_seq_len_bound(context_len: int, num_draft_tokens: int, overlap: bool = True) -> int:
    """The longest seq_len a TARGET_VERIFY can be run with (topk 1, full acceptance).

    Admission clamps prompt + max_new_tokens to context_len - 2 (0.5.14 managers/scheduler.py:
    1868); a request finishes inside the verify that reaches max_new_tokens. With the overlap
    scheduler (the default) one more verify runs for it with seq_len advanced by the tokens that
    verify appended: seq_len - context_len = k·D - M - 2 with k = ceil((M - 1) / D), at most
    D - 4 (M - 1 = (k - 1)·D + 1). Without overlap the last verify starts at most at
    context_len - 4. So bug #1 needs seq_len + D > buffer width: with the buffer at
    context_len + D, D >= 5 (overlap). Observed at the bound on the H200 (0.5.14, context 512,
    D 5, prompt 503, max_new 7): seq_len 513, the replay copied 518 columns into a 517-wide buffer.
    Checked by the CPU driver on 0.5.14 (``proof.verify_reach``; test/srt/test_verify_reach.py):
    ``proof.row_overflow`` runs each request's whole decode through the real spec-v2 prepare
    under a scheduler loop modelled on sglang's (clamp, overlap lag, seq_lens advance), over every
    residue of max_new_tokens mod D near the clamp; the longest verify seq_len it records equals
    this bound exactly, overlap on and off (D 4 - 6; D 2 - 8 with SGLANG_DSA_FIX_FULL=1), 513 for
    the H200 case; constant partial acceptance a stops at context_len + a - 4 (overlap). The
    pristine DSA replay at that seq_len passes at D 4 (context 512: 516 columns into a 516-wide
    buffer, none to spare) and fails at D 5 with ``size_mismatch_message``.
    """
    if overlap:
        return context_len + num_draft_tokens - 4
    return context_len - 4


def size_mismatch_message(buffer_width: int, columns: int) -> str:
    """The exact error torch raises when a replay copies ``columns`` into the buffer."""
    return (
        f"The size of tensor a ({buffer_width}) must match the size of tensor b ({columns}) "
        "at non-singleton dimension 1"
    )


# --------------------------------------------------------------------------------------------
# Bug #2: the req_to_token row width.


def committed_margin(form: Form, overlap: bool = True, preclaims: bool = True) -> int:
    """How far below context_len kv_committed_len can be at a request's last decode prepare.

    Admission clamps prompt + max_new_tokens to context_len - 2 (0.5.14
    managers/scheduler.py:1868). 0.5.13 / 0.5.14 pre-claim the bonus slot in prepare
    (eagle_info_v2.py:61 ``kv_committed_len += 1``) and the overlap scheduler (the default)
    prepares the next batch before the previous result is processed, so the last prepare sees
    context_len - 3 (context_len - 4 with ``--disable-overlap-schedule``). From 0.5.15 the bonus
    is committed in resolve (eagle_utils.py:791-793) and the bound is context_len - 4 either way
    (0.5.23 managers/batch_result_processor.py:831). A retracted request re-prefills its prompt
    plus the output so far under the same clamp, so the bound holds after retraction too.
    A release the tool cannot place (``release.UNKNOWN_FORM``) gets the smaller, safer margin. DFLASH's own prepare (0.5.14
    speculative/dflash_info_v2.py:131) pre-claims nothing (``preclaims=False``): context_len - 4
    on every release. The CPU tier runs the real code to check every value. Only the pristine
    arithmetic uses it: the fixes hold the whole reservation.
    """
    if not form.preclaims_bonus or not preclaims:
        return 4
    return 3 if overlap else 4


@dataclass(frozen=True)
class SpecShape:
    """A deployment's speculative shape, spelled as sglang's flags."""

    context_length: int
    speculative_num_draft_tokens: int  # D
    speculative_num_steps: int
    speculative_eagle_topk: int = 1
    page_size: int = 1
    has_draft_kv: bool = True  # False for NGRAM (no draft model KV)
    overlap: bool = True  # False with --disable-overlap-schedule
    preclaims_bonus: bool = True  # False for DFLASH, whose own prepare pre-claims nothing


def alloc_len_per_decode(shape: SpecShape, form: Form) -> int:
    """A = get_alloc_len_per_decode (0.5.14 mem_cache/common.py:211-239, same through 0.5.23;
    0.5.13 :155-182 has no exemption for algorithms without draft KV, e.g. NGRAM)."""
    steps, topk, tokens, page = (
        shape.speculative_num_steps or 1,
        shape.speculative_eagle_topk or 1,
        shape.speculative_num_draft_tokens,
        shape.page_size,
    )
    exempt = not shape.has_draft_kv and form.exempts_draftless
    if page == 1 or topk == 1 or exempt:
        return max(steps * topk, tokens)
    pages_per_branch = ((page - 1) + steps + page - 1) // page
    return max(pages_per_branch * page * topk, tokens)


def reserve_per_decode(shape: SpecShape, form: Form) -> int:
    """get_alloc_reserve_per_decode: 2·A, the double buffer for the overlap lag (mirror)."""
    return 2 * alloc_len_per_decode(shape, form)


def pristine_row_extra(form: Form, shape: SpecShape) -> int:
    """``get_req_to_token_extra_context_len`` of that release (mirror; tests check it)."""
    extra = 4 + shape.speculative_num_draft_tokens
    reserve = reserve_per_decode(shape, form)
    if form.page_aligns_reservation:  # 0.5.16+: widened for page > 1 only
        if shape.page_size > 1:
            extra = max(extra, reserve + shape.page_size - 1)
    elif shape.page_size > 1 and shape.speculative_eagle_topk > 1:  # 0.5.13 - 0.5.15
        extra = max(extra, reserve)
    return extra


def required_row_extra(
    reserve: int,
    page_size: int,
    form: Form,
    overlap: bool = True,
    preclaims: bool = True,
    context_len: Optional[int] = None,
) -> int:
    """Columns past context_len the row must have for a decode reservation of ``reserve``.

    ``reserve`` is sglang's ``get_alloc_reserve_per_decode()`` (2·A). The fix forms call it with
    the release's own function; status calls it with ``reserve_per_decode(shape, form)``.
    ``page_size`` is the allocator's page, which 0.5.16+ round nxt up to: the last prepare writes
    up to ``ceil_page(context_len - margin + reserve)``, exactly that for a given
    ``context_len`` (every earlier prepare ends no further), else its bound ``+ page - 1``.
    """
    margin = committed_margin(form, overlap, preclaims)
    if not form.page_aligns_reservation or page_size <= 1:
        return reserve - margin
    if context_len is None:
        return reserve + page_size - 1 - margin
    return -(-(context_len - margin + reserve) // page_size) * page_size - context_len


def row_extra_floor(reserve: int, alloc_page: int = 1) -> int:
    """What both fix forms guarantee: the whole decode reservation, plus the page rounding of
    ``nxt`` where the prepare rounds it (0.5.16+): ``reserve + alloc_page - 1``.

    The invariant sglang's own repository tests (``row_width >= context_len +
    get_alloc_reserve_per_decode()``, with the allocator page ``page_size x dcp_size``): it
    holds whatever kv_committed_len the scheduler lets a request reach, so the fix needs no
    version-dependent margin. ``alloc_page`` is the allocator's page, which the prepare rounds
    ``nxt`` up to (0.5.17 speculative/eagle_utils.py:889-907: ``token_to_kv_pool_allocator
    .page_size``, page_size x dcp_size under decode context parallel, mem_cache/
    kv_cache_builder.py:212); 1 where nxt is not rounded (0.5.13 - 0.5.15). 0.5.16 - 0.5.18 size
    the row with ``page_size - 1`` only, so under DCP their row is up to ``page x (dcp - 1)``
    columns short (0.5.19+ size it by ``get_alloc_page_size()``, 0.5.19 allocation_sizing.py:11-14,
    :90-95).
    """
    return reserve + max(0, alloc_page - 1)


# The token allocator's page, which the prepare rounds ``nxt`` up to: ``page_size x dcp_size``
# under decode context parallel (0.5.17 mem_cache/kv_cache_builder.py:212; 0.5.18
# mem_cache/kv_cache_configurator.py:1713-1716). Written once, as source, over the two places a
# release reads that configuration from: the server args (0.5.16 - 0.5.17 pass them to the
# sizing function) or the runtime context (0.5.18 reads it, no argument; 0.5.19's own
# get_alloc_page_size is this expression, allocation_sizing.py:11-14). The in-tree change writes
# this text into sglang's sizing function where the release has no get_alloc_page_size; the
# plugin and status evaluate the same text (``alloc_page_size``, ``alloc_page_in_context``).
ALLOC_PAGE_RULE = "{page_size} * {dcp_size}"
ALLOC_PAGE_READS = {
    "server_args": ("server_args.page_size", 'getattr(server_args, "dcp_size", 1)'),
    "runtime_context": ("get_schedule().page_size", "get_parallel().attn_dcp_size"),
}


def alloc_page_source(reads: str) -> str:
    """``ALLOC_PAGE_RULE`` as source reading its fields from ``reads`` (a key of ``ALLOC_PAGE_READS``)."""
    page_size, dcp_size = ALLOC_PAGE_READS[reads]
    return ALLOC_PAGE_RULE.format(page_size=page_size, dcp_size=dcp_size)


_ALLOC_PAGE_CODE = {
    reads: compile(alloc_page_source(reads), "<alloc page>", "eval") for reads in ALLOC_PAGE_READS
}


def alloc_page_size(server_args) -> int:
    """The allocator page for anything with sglang's ``page_size`` (and ``dcp_size``) fields;
    an unset field counts as 1."""
    fields = SimpleNamespace(
        page_size=getattr(server_args, "page_size", None) or 1,
        dcp_size=getattr(server_args, "dcp_size", None) or 1,
    )
    scope = {"__builtins__": {"getattr": getattr}}
    return int(eval(_ALLOC_PAGE_CODE["server_args"], scope, {"server_args": fields}))


def alloc_page_in_context(get_schedule, get_parallel) -> int:
    """The allocator page as a release that reads sglang's runtime context computes it, given
    that module's ``get_schedule`` and ``get_parallel``."""
    scope = {"__builtins__": {}, "get_schedule": get_schedule, "get_parallel": get_parallel}
    return int(eval(_ALLOC_PAGE_CODE["runtime_context"], scope))


def row_overflow_columns(form: Form, shape: SpecShape) -> int:
    """Columns the last decode reservation writes past the row end (0 = safe) on a pristine tree."""
    reserve = reserve_per_decode(shape, form)
    need = required_row_extra(
        reserve, shape.page_size, form, shape.overlap, shape.preclaims_bonus, shape.context_length
    )
    return max(0, need - pristine_row_extra(form, shape))


def fixed_row_extra(form: Form, shape: SpecShape) -> int:
    """The row headroom with either fix form live (mirror of what they compute)."""
    align = shape.page_size if form.page_aligns_reservation else 1
    return max(pristine_row_extra(form, shape), row_extra_floor(reserve_per_decode(shape, form), align))


# --------------------------------------------------------------------------------------------
# The shared arithmetic of a configuration: what every member's rule (``members``) reads.


def pages_read(cache_seqlen: int, page_size: int) -> int:
    """Page-table entries the FA3 kernel reads for one request told ``cache_seqlen`` keys."""
    return -(-int(cache_seqlen) // int(page_size))


def graph_table_pages(row_width: int, page_size: int) -> int:
    """A graph table's pages for a row of ``row_width`` tokens: sglang sizes it from
    context_len (pristine), the rule from req_to_token's width."""
    return -(-int(row_width) // int(page_size))


def longest_verify_pages(context_len: int, num_draft_tokens: int, page_size: int, overlap: bool) -> int:
    """Entries of its table row the longest target_verify reads (topk 1): seq_len + D keys at the
    longest seq_len the scheduler runs (``width.verify_seq_len_bound``). A draft decode reads
    seq_len + step + 1 <= that (step + 1 <= D - 1 at topk 1)."""
    longest = verify_seq_len_bound(context_len, num_draft_tokens, overlap)
    return pages_read(longest + num_draft_tokens, page_size)


# Algorithms that verify without a draft model (no draft decode, no draft extend): NGRAM drafts
# from its corpus on the host (0.5.14 speculative/ngram_worker.py:267-345).
DRAFTLESS = ("NGRAM",)


def tokens_per_verify(
    algorithm: Optional[str], topk: int, num_steps: Optional[int], num_draft_tokens: int
) -> int:
    """The most tokens one verify appends to a request: the width of sglang's ``accept_index``,
    ``verify_input.max_tree_depth`` (0.5.14 speculative/eagle_utils.py:431-433). EAGLE's tree is
    ``spec_steps + 1`` deep (0.5.14 eagle_info.py:59-63, 0.5.17 :44, 0.5.23 :52; 0.5.13 sizes
    accept_index so, eagle_info.py:284-285), so at topk > 1 fewer than D; NGRAM's is
    node-budgeted, up to D (0.5.14 ngram_info.py:50-54, 0.5.17 :48, 0.5.23 :49).
    At topk 1 sglang sets D = steps + 1. Unknown steps or another algorithm: D (no tree of D nodes
    is deeper), so the bound is never smaller than sglang's."""
    D = num_draft_tokens
    if topk <= 1 or not num_steps or (algorithm or "").upper() in DRAFTLESS:
        return D
    if (algorithm or "").upper() in ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE"):
        return min(D, num_steps + 1)
    return D


def longest_seq_len(inputs: dict) -> int:
    """The longest seq_len a verify (or the draft decode before it) runs with at a configuration:
    ``verify_seq_len_bound`` with the tokens one verify appends (``tokens_per_verify``). At topk
    > 1 the real spec-v2 prepare under the scheduler loop (``proof.row_overflow``) reaches it
    exactly: C 256, EAGLE topk 4 / steps 3 / D 8: 256 (overlap) / 252; NGRAM topk 10 / steps 1 /
    D 12: 264 / 252 (test/srt/test_topk_reach.py)."""
    a = tokens_per_verify(
        inputs["algorithm"], inputs["topk"], inputs["num_steps"], inputs["num_draft_tokens"]
    )
    return verify_seq_len_bound(inputs["context_len"], a, inputs["overlap"])


def decode_backend(config: dict) -> Optional[str]:
    """The attention backend decode (and its CUDA graphs) runs: sglang's
    --decode-attention-backend where set, else --attention-backend."""
    return config.get("decode_attention_backend") or config.get("attention_backend")


def verify_backend(config: dict) -> Optional[str]:
    """The attention backend target_verify runs: the decode backend under
    --speculative-attention-mode decode, else the prefill one (0.5.23
    layers/attention/hybrid_attn_backend.py:41-42, 76); one backend where neither is split."""
    if config.get("speculative_attention_mode") == "decode":
        return decode_backend(config)
    return config.get("prefill_attention_backend") or config.get("attention_backend")


def configuration_inputs(resolved: dict) -> dict:
    """What every member's rule reads (``members``), from a resolved (or static) configuration:
    sglang's numbers and the backends it picked; each member judges its own reach from them."""
    config, widths = resolved["configuration"], resolved["widths"]
    algorithm = config.get("speculative_algorithm")
    resolved_by_sglang = resolved.get("basis") == "sglang"
    return {
        "config": config,
        "algorithm": algorithm,
        "context_len": config["context_length"],
        "num_draft_tokens": config.get("speculative_num_draft_tokens") or 0,
        "overlap": not config.get("disable_overlap_schedule"),
        "alloc_page_size": widths["alloc_page_size"],
        "row_extra": widths["row_extra"],
        "row_extra_with_plugin": widths.get("row_extra_with_plugin"),
        "decode_reserve": widths["decode_reserve"],
        "graph_page_table_width": widths.get("graph_page_table_width"),
        "graph_page_table_from": widths.get("graph_page_table_from"),
        "graph_page_table_error": widths.get("graph_page_table_error"),
        "resolved": resolved_by_sglang,
        "no_speculative_decoding": resolved_by_sglang and not algorithm,
        "page_size": config.get("page_size") or 1,
        "topk": config.get("speculative_eagle_topk") or 1,
        "num_steps": config.get("speculative_num_steps"),
        "cuda_graphs_disabled": bool(config.get("disable_cuda_graph")),
        "decode_backend": decode_backend(config),
        "verify_backend": verify_backend(config),
    }
