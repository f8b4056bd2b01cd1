"""The width rules of bugs #1 and #2, each written once, and every bug at a configuration.

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
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from sglang_dsa_fix import graph_tables, release
from sglang_dsa_fix.release import Form
from sglang_dsa_fix.verdicts import Bug, Verdict

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
# Each bug at a configuration (``bugs.judge`` turns it into a state). Bug #3's table arithmetic
# sits here beside the others; its rule and runtime fix are ``fa3_width``'s.


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


# What the row arithmetic says beside the numbers, per decode prepare (``release.DECODE_PREPARE``).
PREPARE_NOTES = {
    release.DFLASH_PREPARE: (
        "DFLASH (and DSPARK, its family) reserves 2 x block in its own decode path "
        "(DFlashDraftInputV2.prepare_for_decode, speculative/dflash_info_v2.py 0.5.17:113, "
        "0.5.23:114) with no row check; judged from get_alloc_reserve_per_decode(), which equals "
        "that at steps = topk = 1; `--prove` drives that prepare itself on CPU; both fixes raise "
        "the row to it"
    ),
    release.UNO_PREPARE: (
        "UNO reserves 2 x (D + 1) in its own decode path and raises where it would pass the row "
        "(speculative/uno_info.py 0.5.20:141-146): a refused request, not a silent overflow; "
        "judged from sglang's own sizing, which holds that reservation from 0.5.20"
    ),
}


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
    """What the per-bug arithmetic reads, from a resolved (or static) configuration."""
    config, widths = resolved["configuration"], resolved["widths"]
    algorithm = config.get("speculative_algorithm")
    inputs = {
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
        "resolved": resolved.get("basis") == "sglang",
        "page_size": config.get("page_size") or 1,
        "topk": config.get("speculative_eagle_topk") or 1,
        "cuda_graphs_disabled": bool(config.get("disable_cuda_graph")),
    }
    prepare = release.DECODE_PREPARE.get("NONE" if not algorithm else str(algorithm).upper(), "unknown")
    inputs["preclaims_bonus"] = prepare != release.DFLASH_PREPARE
    if prepare in PREPARE_NOTES:
        inputs["row_note"] = PREPARE_NOTES[prepare]
    if prepare == "unknown":
        inputs["row_cannot_tell"] = (
            f"speculative algorithm {algorithm}: this tool has no rule for its decode path "
            "(release.DECODE_PREPARE)"
        )
    backend = decode_backend(config)
    verify = verify_backend(config)
    if resolved.get("basis") == "sglang" and not algorithm:
        inputs["page_table_not_reachable"] = inputs["row_not_reachable"] = "no speculative decoding"
        inputs["fa3_not_reachable"] = "no speculative decoding"
    elif config.get("disable_cuda_graph"):
        inputs["page_table_not_reachable"] = inputs["fa3_not_reachable"] = "CUDA graphs disabled"
    elif resolved.get("basis") == "sglang":
        if backend not in release.DSA_BACKENDS:
            inputs["page_table_not_reachable"] = (
                f"decode attention backend {backend}: no DSA/NSA graph page_table"
            )
        if verify not in release.FA3_BACKENDS and backend not in release.FA3_BACKENDS:
            inputs["fa3_not_reachable"] = (
                f"verify / decode attention backend {verify} / {backend}: not FlashAttention (FA3)"
            )
    if algorithm and config.get("speculative_runs_spec_v2") is False:
        inputs["row_not_reachable"] = (
            f"{algorithm} runs sglang's spec-v1 decode path here (ScheduleBatch.is_spec_v2 is False): "
            "no spec-v2 decode reservation"
        )
    if resolved.get("basis") != "sglang":
        inputs["fa3_not_reachable"] = (
            "static rule: the shape flags describe bug #1's DSA deployment, which runs no FA3 "
            "(give the launch arguments after `--` to judge an FA3 deployment)"
        )
    inputs["graph_not_reachable"] = {
        bug: graph_table_not_reachable(layout, resolved, config, backend, verify)
        for bug, layout in graph_tables.LAYOUTS.items()
    }
    return inputs


def graph_table_not_reachable(layout, resolved: dict, config: dict, backend, verify) -> str:
    """Why a relative of bug #3 (``release.GRAPH_TABLE_LAYOUTS``) is not reached at this
    configuration; "" where it is."""
    if resolved.get("basis") != "sglang":
        return (
            f"static rule: the shape flags describe bug #1's DSA deployment, which runs no {layout.name} "
            "(give the launch arguments after `--` to judge it)"
        )
    if not config.get("speculative_algorithm"):
        return "no speculative decoding"
    draft = config.get("speculative_draft_attention_backend") or backend
    if config.get("disable_cuda_graph"):
        if not layout.eager:
            return "CUDA graphs disabled"
        if draft not in layout.backends:  # eager, only the draft decode's buffer is sized from C
            return f"CUDA graphs disabled and draft attention backend {draft}: not {layout.name}"
    if layout.backends:
        if not {verify, backend, draft} & set(layout.backends):
            return (
                f"verify / decode / draft attention backend {verify} / {backend} / {draft}: not {layout.name}"
            )
    elif config.get("model_attention_backend") not in [name for name, _ in layout.classes]:
        return f"sglang picks {layout.name} by the model (not this one)"
    return ""


def page_table_at(verdict, found: str, inputs: dict) -> dict:
    """Bug #1 at a configuration: the pool and graph buffer widths, and whether the longest
    target_verify the scheduler can run reads past the buffer (``width.verify_seq_len_bound``,
    observed on the H200 at D 5, checked by the CPU driver on 0.5.14: test/srt/test_verify_reach.py)."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    pool = C + inputs["row_extra"]
    buffer, source = inputs.get("graph_page_table_width"), inputs.get("graph_page_table_from")
    if buffer is None:  # the static rule: the file's own expression at this shape
        source = "static rule: the file's width expression"
        if inputs.get("graph_page_table_error"):
            source += f" (init_cuda_graph_state could not run here: {inputs['graph_page_table_error']})"
        if verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE):
            buffer = pool
        else:
            buffer = evaluate_page_table_expression(found, C, D, pool)
    longest = verify_seq_len_bound(C, D, inputs["overlap"])
    out = {
        "req_to_token_width": pool,
        "graph_page_table_width": buffer,
        "graph_page_table_from": source,
        "longest_verify_seq_len": longest,
    }
    if inputs.get("page_table_not_reachable"):
        out.update(reachable=False, why_not=inputs["page_table_not_reachable"])
    elif buffer is None:
        out["reachable"] = None
    else:
        # The replay copies min(seq_len + D, pool) columns of req_to_token into the buffer
        # (slices clamp): only a pool wider than the buffer can overflow it.
        out["reachable"] = longest + D > buffer and pool > buffer
        out["overflowing_seq_lens"] = [buffer - D + 1, longest] if out["reachable"] else None
    return out


def fa3_at(verdict, inputs: dict) -> dict:
    """Bug #3 at a configuration: the pages of the longest verify's read (topk 1) against the FA3
    graph tables' pages, sglang's (ceil(context_len / page), every release 0.5.4 - 0.5.23) or the
    rule's (req_to_token's row, ``fa3_width``), now and with the fix."""
    if inputs.get("fa3_not_reachable"):
        return {"reachable": False, "why_not": inputs["fa3_not_reachable"]}
    if inputs["topk"] > 1:
        return {
            "reachable": None,
            "cannot_tell": "topk > 1: FA3 verifies through its token-wide topk > 1 tables, which "
            "this tool's rule (topk 1) does not judge",
        }
    C, D, page = inputs["context_len"], inputs["num_draft_tokens"], inputs["page_size"]
    pool = C + inputs["row_extra"]
    pool_with_fix = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    table = graph_table_pages(pool if fixed else C, page)
    read = longest_verify_pages(C, D, page, inputs["overlap"])
    with_fix = graph_table_pages(pool_with_fix, page)
    return {
        "graph_page_table_pages": table,
        "graph_page_table_from": (
            "static rule: "
            + ("req_to_token's width in pages" if fixed else "ceil(context_len / page_size)")
            + " (FlashAttentionBackend.init_cuda_graph_state)"
        ),
        "longest_verify_pages_read": read,
        "pages_past_table": max(0, read - table),
        "graph_page_table_pages_with_fix": with_fix,
        "pages_past_table_with_fix": max(0, read - with_fix),
        "reachable": read > table,
    }


def relative_table_pages(bug, tokens: int, page: int) -> int:
    """Pages of a relative of bug #3's graph table (``graph_tables``) when its width expression
    reads ``tokens`` (sglang's own arithmetic, as the static rule: 0.5.23 trtllm_mha_backend.py:
    351-353, trtllm_mla_backend.py:336-357, flashmla_backend.py:282,
    minimax_sparse_nvfp4_backend.py:213)."""
    pages = -(-tokens // page)
    if bug is Bug.TRTLLM_MLA_KV_INDICES:
        # _calc_padded_blocks: a multiple of lcm(128 / page, 4096-token Triton blocks in pages).
        step = math.lcm(max(1, 128 // page), max(1, 4096 // page))
        return -(-pages // step) * step
    if bug is Bug.FLASHMLA_KV_INDICES:
        return (tokens + page) // page
    return max(1, pages)


def flat_buffers_at(verdict, found: str, inputs: dict) -> dict:
    """Triton's flat buffers (``release.GRAPH_TABLE_LAYOUTS``, reach "batch") at a configuration,
    per request of a batch whose every request is at the longest verify's seq_len s: the draft
    decode's last step writes s + D - 1 kv_indices into a row of C per request; the verify mask
    needs D * (s + D) cells of D * C per request (D * (C + D) where the file sizes it through
    ``max_context_len=``, 0.5.17+). With the fix, req_to_token's row instead of C."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    s = verify_seq_len_bound(C, D, inputs["overlap"])
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    row = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    per_token = (lambda width: width + D) if "max_context_len=" in found else (lambda width: width)
    now = C + inputs["row_extra"] if fixed else C  # the tree's own row, as fa3_at reads it
    draft, mask = s + D - 1, D * (s + D)
    if inputs["cuda_graphs_disabled"]:
        # Eager: the draft decode sizes its kv_indices per batch from C (0.5.14
        # triton_backend.py:1507, 0.5.23 :2718), a lone request's row of C entries, so one
        # request at s writes s + D - 1 (test_graph_tables_flat_buffers.py drives it); the
        # verify's mask is built per batch, not from C.
        return {
            "draft_kv_indices_per_request": now,
            "draft_kv_indices_needed": draft,
            "from": "static rule: Triton's eager draft width expression over "
            + ("req_to_token's width" if fixed else "context_len"),
            "reachable_with_fix": draft > row,
            "reachable": draft > now,
            "when": f"a request at seq_len {s} (CUDA graphs disabled: the eager draft decode's buffer is "
            "sized per batch, so a lone request reaches it)",
        }
    return {
        "draft_kv_indices_per_request": now,
        "draft_kv_indices_needed": draft,
        "verify_mask_cells_per_request": D * per_token(now),
        "verify_mask_cells_needed": mask,
        "from": "static rule: Triton's width expressions over "
        + ("req_to_token's width" if fixed else "context_len"),
        "reachable_with_fix": draft > row or mask > D * per_token(row),
        "reachable": draft > now or mask > D * per_token(now),
        "when": f"every request of the largest captured batch at seq_len {s} (the longest verify's)",
    }


def graph_table_at(bug, verdict, found: str, inputs: dict) -> dict:
    """A relative of bug #3 at a configuration, as ``fa3_at``: the longest verify's pages against
    the backend's graph table (``relative_table_pages``: its own expression over
    context_len, or over req_to_token's row with the fix)."""
    why = inputs["graph_not_reachable"][bug]
    if why:
        return {"reachable": False, "why_not": why}
    layout = graph_tables.LAYOUTS[bug]
    if inputs["topk"] > 1:
        return {"reachable": None, "cannot_tell": f"topk > 1: this tool's rule for {layout.name} is topk 1's"}
    if layout.reach == "batch":
        return flat_buffers_at(verdict, found, inputs)
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    page = layout.page_size or inputs["page_size"]
    pool = C + inputs["row_extra"]
    pool_with_fix = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    table = relative_table_pages(bug, pool if fixed else C, page)
    read = longest_verify_pages(C, D, page, inputs["overlap"])
    with_fix = relative_table_pages(bug, pool_with_fix, page)
    over = "req_to_token's width" if fixed else "context_len"
    out = {
        "graph_page_table_pages": table,
        "graph_page_table_from": f"static rule: {layout.name}'s width expression over {over}",
        "longest_verify_pages_read": read,
        "pages_past_table": max(0, read - table),
        "graph_page_table_pages_with_fix": with_fix,
        "pages_past_table_with_fix": max(0, read - with_fix),
        "reachable": read > table,
    }
    if release.VERIFY_MASK_EXPR in found:
        # The verify tree mask (TRT-LLM MLA 0.5.13 - 0.5.16, FlashMLA 0.5.16): D * (C + D) cells
        # a request; the tree builder writes D * (s + D) a request, with every request of the
        # largest captured batch at the longest verify's s (test/srt/test_graph_tables_mla_mask.py).
        s = verify_seq_len_bound(C, D, inputs["overlap"])
        cells, needed, with_fix = D * ((pool if fixed else C) + D), D * (s + D), D * (pool_with_fix + D)
        out.update(
            verify_mask_cells_per_request=cells,
            verify_mask_cells_needed=needed,
            verify_mask_cells_with_fix=with_fix,
            reachable=out["reachable"] or needed > cells,
            reachable_with_fix=out["pages_past_table_with_fix"] > 0 or needed > with_fix,
        )
    return out


def row_at(verdict, form: Form, inputs: dict) -> dict:
    """Bug #2 at a configuration, from the row headroom and the decode reservation (sglang's own
    numbers where resolved): how far the last reservation writes past the row end, now and with
    either fix (``width.row_extra_floor``: the reservation plus the allocator page's rounding)."""
    if inputs.get("row_not_reachable"):
        return {"reachable": False, "why_not": inputs["row_not_reachable"]}
    extra, reserve, page = inputs["row_extra"], inputs["decode_reserve"], inputs["alloc_page_size"]
    need = required_row_extra(
        reserve, page, form, inputs["overlap"], inputs["preclaims_bonus"], inputs["context_len"]
    )
    align = page if form.page_aligns_reservation else 1
    # Resolved by sglang: the plugin's own hook ran on sglang's numbers (runtime_fix); the
    # in-tree form computes the same. Else the rule: the reservation and the page's rounding.
    with_fix = inputs["row_extra_with_plugin"] or max(extra, row_extra_floor(reserve, align))
    # Resolved by sglang, the headroom is the tree's own function, an in-tree change included;
    # the static rule mirrors the pristine function, so a tree whose files hold the reservation
    # (patched, or fixed upstream) gets the fix's number.
    fixed = verdict in (Verdict.FIXED_IN_TREE, Verdict.FIXED_UPSTREAM)
    now = with_fix if fixed and not inputs["resolved"] else extra
    columns = max(0, need - now)
    return {
        **({"note": inputs["row_note"]} if "row_note" in inputs else {}),
        "row_extra": now,
        "decode_reserve": reserve,
        "alloc_page_size": page,
        "row_extra_needed": need,
        "row_extra_with_fix": with_fix,
        "columns_past_row_end": columns,
        "columns_past_row_end_with_fix": max(0, need - with_fix),
        "reachable": columns > 0,
    }


def measured(at: dict, prove: dict) -> dict:
    """``status --prove``: what sglang's real decode path wrote, beside the arithmetic."""
    if "columns_past_row_end" not in prove or "columns_past_row_end" not in at:
        return prove
    agrees = prove["columns_past_row_end"] == at["columns_past_row_end"]
    out = {**prove, "agrees_with_arithmetic": agrees}
    if not agrees:  # the drive ran sglang's own decode path; the arithmetic is this tool's model
        out["sglang_behaviour"] = "measured"
    return out


def at_configuration(bug, verdict, found: str, form: Form, resolved: dict) -> dict:
    """One bug at a resolved (or static) configuration: its widths, whether it is reached
    (``reachable``: True / False / None, or ``cannot_tell``), and the same with the fix."""
    if resolved.get("basis") == UNRESOLVED:
        return {"reachable": None, "cannot_tell": "sglang did not resolve the launch arguments"}
    inputs = configuration_inputs(resolved)
    if bug is Bug.PAGE_TABLE:
        return page_table_at(verdict, found, inputs)
    if bug is Bug.FA3_PAGE_TABLE:
        return fa3_at(verdict, inputs)
    if bug in graph_tables.LAYOUTS:
        return graph_table_at(bug, verdict, found, inputs)
    if "row_cannot_tell" in inputs:
        return {"reachable": None, "cannot_tell": inputs["row_cannot_tell"]}
    at = row_at(verdict, form, inputs)
    if "prove" in resolved:
        at["measured"] = measured(at, resolved["prove"])
    return at
