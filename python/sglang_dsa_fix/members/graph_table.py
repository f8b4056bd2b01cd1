"""Bug #3's relatives: the same graph-table shape in other backends (TRT-LLM MHA / MLA,
FlashMLA, MiniMax sparse NVFP4, Triton's flat buffers), one member per
``backend_layouts.GRAPH_TABLE_LAYOUTS`` entry. The in-tree change is ``graph_tables``' (each width
expression over ``req_to_token``'s row); the plugin runs those methods compiled with it
(``live_edit``, REPLACE hooks)."""

from __future__ import annotations

import inspect
import math
from typing import Optional

from sglang_dsa_fix import backend_layouts, graph_tables, replay_checks, width
from sglang_dsa_fix.members import HookPlan, Member, WatchKind
from sglang_dsa_fix.release import WatchTarget
from sglang_dsa_fix.verdicts import Bug, Verdict

TRITON_REPLAY, FLASHMLA_REPLAY = "triton_replay", "flashmla_replay"
TRTLLM_MHA_REPLAY, TRTLLM_MLA_REPLAY = "trtllm_mha_replay", "trtllm_mla_replay"
# The family watch's replay check of each layout's backend (``WATCHES``); MiniMax has none yet.
WATCH = {
    "trtllm_mha_page_table": TRTLLM_MHA_REPLAY,
    "trtllm_mla_kv_indices": TRTLLM_MLA_REPLAY,
    "flashmla_kv_indices": FLASHMLA_REPLAY,
    "triton_kv_indices": TRITON_REPLAY,
}
UNWATCHED = "the family watch has no replay check for this backend yet"


def why_not(layout, inputs: dict) -> str:
    """Why this relative is not reached at this configuration; "" where it may be."""
    if not inputs["resolved"]:
        return (
            f"static rule: the shape flags describe bug #1's DSA deployment, which runs no {layout.name} "
            "(give the launch arguments after `--` to judge it)"
        )
    config = inputs["config"]
    if not inputs["algorithm"]:
        return "no speculative decoding"
    verify, backend = inputs["verify_backend"], inputs["decode_backend"]
    draft = config.get("speculative_draft_attention_backend") or backend
    if inputs["cuda_graphs_disabled"]:
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


# At topk > 1 the draft decode's kv_indices hold s + steps a branch: unknown steps, no bound.
TOPK_STEPS_UNKNOWN = (
    "topk > 1 with speculative_num_steps not resolved: the draft decode's reach is not bounded"
)


def topk_cannot_tell(layout) -> str:
    """Why a table backend is not judged at topk > 1 (only FA3's and Triton's topk > 1 paths are
    driven: test/srt/test_topk_reach.py)."""
    return (
        f"topk > 1: {layout.name}'s verify and draft decode at topk > 1 are not driven by this tool "
        "(its rule is measured at topk 1)"
    )


def table_pages(layout, tokens: int, page: int) -> int:
    """Pages of the layout's graph table when its width expression reads ``tokens`` (sglang's
    own arithmetic, as the static rule: 0.5.23 trtllm_mha_backend.py:351-353,
    trtllm_mla_backend.py:336-357, flashmla_backend.py:282, minimax_sparse_nvfp4_backend.py:213)."""
    pages = -(-tokens // page)
    if layout.key == "trtllm_mla_kv_indices":
        # _calc_padded_blocks: a multiple of lcm(128 / page, 4096-token Triton blocks in pages).
        step = math.lcm(max(1, 128 // page), max(1, 4096 // page))
        return -(-pages // step) * step
    if layout.key == "flashmla_kv_indices":
        return (tokens + page) // page
    return max(1, pages)


def flat_buffers_rule(verdict, found: str, inputs: dict) -> dict:
    """Triton's flat buffers (reach "batch") at a configuration, per request (and draft branch)
    of a batch whose every request is at the longest seq_len s (``width.longest_seq_len``): the
    draft decode's last step writes s + steps kv_indices per branch into a row of C per branch
    (0.5.14 speculative/triton_ops/cache_locs.py:131-164; ``draft_kv_indices_buffer_width``
    counts topk, spec_utils.py:107-118); the verify mask needs D * (s + D) cells of D * C per
    request (D * (C + D) where the file sizes it through ``max_context_len=``, 0.5.17+), written
    past by EAGLE's tree builder, and NGRAM's own mask copied in by the replay (raises past it,
    0.5.14 triton_backend.py:430-435). NGRAM has no draft decode. With the fix, req_to_token's
    row instead of C. Driven at topk 1, and at topk 4 / steps 3 / D 8 and NGRAM's defaults
    (test/srt/test_graph_tables_flat_buffers.py, test/srt/test_topk_reach.py)."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    s = width.longest_seq_len(inputs)
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    row = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    per_token = (lambda w: w + D) if "max_context_len=" in found else (lambda w: w)
    now = C + inputs["row_extra"] if fixed else C  # the tree's own row, as the FA3 rule reads it
    steps = inputs["num_steps"] if inputs["topk"] > 1 else D - 1  # topk 1: sglang sets D = steps + 1
    drafts = (inputs["algorithm"] or "").upper() not in width.DRAFTLESS
    draft, mask = (s + steps if drafts else 0), D * (s + D)  # no draft decode: nothing written
    who = "" if drafts else f" ({inputs['algorithm']}: no draft decode)"
    if inputs["cuda_graphs_disabled"]:
        # Eager: the draft decode sizes its kv_indices per batch from C (0.5.14
        # triton_backend.py:1507, 0.5.23 :2718), a lone request's row of C entries, so one
        # request at s writes s + steps (test_graph_tables_flat_buffers.py drives it); the
        # verify's mask is built per batch, not from C.
        return {
            "draft_kv_indices_per_request": now,
            "draft_kv_indices_needed": draft,
            "from": "static rule: Triton's eager draft width expression over "
            + ("req_to_token's width" if fixed else "context_len"),
            "reachable_with_fix": draft > row,
            "reachable": draft > now,
            "when": f"a request at seq_len {s} (CUDA graphs disabled: the eager draft decode's buffer is "
            f"sized per batch, so a lone request reaches it){who}",
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
        "when": f"every request of the largest captured batch at seq_len {s} (the longest verify's){who}",
    }


def rule_for(layout):
    def rule(verdict, found: str, form, inputs: dict, resolved: dict) -> dict:
        """The longest verify's pages against the backend's graph table (``table_pages``: its
        own expression over context_len, or over req_to_token's row with the fix)."""
        why = why_not(layout, inputs)
        if why:
            return {"reachable": False, "why_not": why}
        if layout.reach == "batch":
            if inputs["topk"] > 1 and not inputs["num_steps"]:
                return {"reachable": None, "cannot_tell": TOPK_STEPS_UNKNOWN}
            return flat_buffers_rule(verdict, found, inputs)
        if inputs["topk"] > 1:
            return {"reachable": None, "cannot_tell": topk_cannot_tell(layout)}
        C, D = inputs["context_len"], inputs["num_draft_tokens"]
        page = layout.page_size or inputs["page_size"]
        pool = C + inputs["row_extra"]
        pool_with_fix = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
        fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
        table = table_pages(layout, pool if fixed else C, page)
        read = width.longest_verify_pages(C, D, page, inputs["overlap"])
        with_fix = table_pages(layout, pool_with_fix, page)
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
        if backend_layouts.VERIFY_MASK_EXPR in found:
            # The verify tree mask (TRT-LLM MLA 0.5.13 - 0.5.16, FlashMLA 0.5.16): D * (C + D)
            # cells a request; the tree builder writes D * (s + D) a request, with every request
            # of the largest captured batch at the longest verify's s
            # (test/srt/test_graph_tables_mla_mask.py). Sized from context_len whatever the
            # verdict: the file still holds sglang's expression (this tool's earlier form, block
            # tables only, is "fixed in-tree" and leaves it so).
            s = width.verify_seq_len_bound(C, D, inputs["overlap"])
            cells, needed, with_fix = D * (C + D), D * (s + D), D * (pool_with_fix + D)
            out.update(
                verify_mask_cells_per_request=cells,
                verify_mask_cells_needed=needed,
                verify_mask_cells_with_fix=with_fix,
                reachable=out["reachable"] or needed > cells,
                reachable_with_fix=out["pages_past_table_with_fix"] > 0 or needed > with_fix,
            )
        return out

    return rule


def hook_for(layout):
    def hook(files, site, sglang) -> HookPlan:
        return HookPlan(".".join((layout.module, *graph_tables.methods(site)[0])), replace=site)

    return hook


def member(layout) -> Member:
    bug = Bug(layout.key)
    return Member(
        bug=bug,
        title=TITLES[layout.key],
        column=bug.value,
        absent=f"no {layout.name} backend",
        holds=f"sizes the {layout.name} graph table from req_to_token",
        affected_what="these graph buffers are",
        legacy=graph_tables.legacy_detail(bug),
        locate=graph_tables.site_for(bug),
        rule=rule_for(layout),
        hook=hook_for(layout),
        watch=(WATCH[layout.key],) if layout.key in WATCH else (),
        unwatched="" if layout.key in WATCH else UNWATCHED,
        releases=f"the sglang releases that have the {layout.name} backend (`check` says whether yours does), "
        "where it runs the verify or the draft decode in CUDA graphs",
        symptoms=(
            (
                r"illegal memory access",
                f"near the context limit: a verify or draft decode read past {layout.name}'s CUDA-graph "
                "table (the same shape as FA3's, upstream #34239)",
            ),
        ),
    )


TITLES = {
    "trtllm_mha_page_table": "bug #3 TRT-LLM MHA CUDA-graph page tables (crash)",
    "trtllm_mla_kv_indices": "bug #3 TRT-LLM MLA CUDA-graph block table (and 0.5.13 - 0.5.16 verify mask) (crash)",
    "flashmla_kv_indices": "bug #3 FlashMLA CUDA-graph block table (and 0.5.16 verify mask) (crash)",
    "minimax_nvfp4_page_table": "bug #3 MiniMax sparse NVFP4 decode-plan page table (crash)",
    "triton_kv_indices": "bug #3 Triton verify mask and draft kv_indices (crash)",
}

MEMBERS = tuple(member(layout) for layout in backend_layouts.GRAPH_TABLE_LAYOUTS)


# ----------------------------------------------------------------------------------------------
# The family watch: each relative's graph replays, against the buffer captured for them.


def draft_columns(backend, mode) -> Optional[int]:
    """Columns a per-request MLA table replay reads past seq_len: D for target_verify, none for
    decode and draft_extend_v2; None for the modes these backends do not replay from a graph."""
    if mode.is_target_verify():
        return backend.num_draft_tokens or 0
    if mode.is_decode_or_idle() or mode.is_draft_extend_v2():
        return 0
    return None


def check_triton(site, arguments) -> None:
    """Entries written into the flat kv_indices: sum(s), decode and target_verify (prefix only).
    draft_extend_v2 writes s - extend per request, less than that, with extend lengths only on
    the device: not judged. Draft decode reads the multi-step backend's own buffer."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, view, _, mode, lengths = replay
    spec = getattr(view, "spec_info", None)
    if not (mode.is_target_verify() or (mode.is_decode_or_idle() and spec is None)):
        return
    buffer = getattr(backend, "cuda_graph_kv_indices", None)
    if buffer is not None:
        replay_checks.count_short(site, int(buffer.numel()), sum(lengths))


def check_flashmla(site, arguments) -> None:
    """Pages per request vs the block table: ceil(max(s) (+ D for target_verify) / 64)."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, _, _, mode, lengths = replay
    extra = draft_columns(backend, mode)
    table = getattr(backend, "cuda_graph_kv_indices", None)
    if extra is not None and table is not None and table.dim() == 2:
        page = getattr(inspect.getmodule(type(backend)), "PAGE_SIZE", 64)
        replay_checks.count_short(site, int(table.shape[1]), replay_checks.pages(max(lengths) + extra, page))


def check_trtllm_mha(site, arguments) -> None:
    """Pages per request vs the per-mode page_table (topk 1): decode s (draft decode
    s + step + 1), target_verify s + D (the captured max_seq_len_q), draft_extend_v2 s."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, view, bs, mode, lengths = replay
    if mode.is_target_verify():
        metadata = getattr(backend, "target_verify_metadata", {}).get(bs)
        extra = getattr(metadata, "max_seq_len_q", 0)
    elif mode.is_decode_or_idle():
        metadata = getattr(backend, "decode_cuda_graph_metadata", {}).get(bs)
        spec = getattr(view, "spec_info", None) is not None
        extra = (getattr(backend, "speculative_step_id", 0) or 0) + 1 if spec else 0
    elif mode.is_draft_extend_v2():
        metadata, extra = getattr(backend, "draft_extend_metadata", {}).get(bs), 0
    else:
        return
    table = getattr(metadata, "page_table", None)
    if table is not None:
        replay_checks.count_short(
            site, int(table.shape[1]), replay_checks.pages(max(lengths) + extra, backend.page_size)
        )


def check_trtllm_mla(site, arguments) -> None:
    """Pages per request vs the block table: decode and draft_extend_v2 s, target_verify s + D."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, _, bs, mode, lengths = replay
    extra = draft_columns(backend, mode)
    metadata = getattr(backend, "decode_cuda_graph_metadata", {}).get(bs)
    table = getattr(metadata, "block_kv_indices", None)
    if extra is not None and table is not None:
        replay_checks.count_short(
            site, int(table.shape[1]), replay_checks.pages(max(lengths) + extra, backend.page_size)
        )


WATCHES = (
    WatchKind(
        TRITON_REPLAY,
        ("triton_kv_indices_short", None),
        targets=(
            # triton: flat cuda_graph_kv_indices of max_num_tokens * max_context_len (0.5.14
            # triton_backend.py:826-835, 0.5.23 :1224-1230); decode and target_verify write
            # cumsum(seq_lens) into it, the prefix only (0.5.14 :335-353, :386-400; 0.5.23 :515-534).
            # Bounded by bs * C <= its size in practice (upstream/ISSUE-fa3-target-verify-page-table.md,
            # "Triton backend"), but nothing checks it: a narrowed buffer is overrun.
            WatchTarget(
                TRITON_REPLAY,
                "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata_out_graph",
                "cuda_graph_kv_indices (flat)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_triton,
    ),
    WatchKind(
        FLASHMLA_REPLAY,
        ("flashmla_block_table_short", None),
        targets=(
            # FlashMLA (sgl_kernel only): block table [max_bs, (C + 64) // 64] (0.5.14
            # flashmla_backend.py:180-192, 0.5.23 :274-286); target_verify fills ceil((s + D) / 64)
            # pages (0.5.14 :213-262, 0.5.23 :328-380). The fill kernel launches whole 64-page blocks
            # for the width and masks by the request's own pages, not the row's (triton_ops/
            # kv_indices.py:99-146): an extra page inside the last block is written into the next row.
            # C = 254, D = 8, s = 251 (a live request): 5 pages needed, 4 held.
            WatchTarget(
                FLASHMLA_REPLAY,
                "sglang.srt.layers.attention.flashmla_backend.FlashMLABackend.init_forward_metadata_out_graph",
                "cuda_graph_kv_indices (pages)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_flashmla,
    ),
    WatchKind(
        TRTLLM_MHA_REPLAY,
        ("trtllm_mha_page_table_short", None),
        targets=(
            # TRT-LLM MHA (sm100): per-mode page tables [max_bs, ceil(C / page)] (0.5.14
            # trtllm_mha_backend.py:142-146, :302-392; 0.5.23 :351-353, :706-811): decode s (draft
            # decode s + step + 1), target_verify s + D (0.5.14 :492-566; 0.5.23 :941-1048, one fused
            # kernel looping max_num_pages), so where C is a multiple of the page, s = C - 3 with D >= 4
            # already needs a page more. The
            # 0.5.14 fill kernel, like FlashMLA's, masks by the request's pages within whole
            # 4096-token blocks (triton_ops/trtllm_mha_page_table.py:38-93).
            WatchTarget(
                TRTLLM_MHA_REPLAY,
                "sglang.srt.layers.attention.trtllm_mha_backend.TRTLLMHAAttnBackend.init_forward_metadata_out_graph",
                "page_table (pages)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_trtllm_mha,
    ),
    WatchKind(
        TRTLLM_MLA_REPLAY,
        ("trtllm_mla_block_table_short", None),
        targets=(
            # TRT-LLM MLA (sm100): block table [max_bs, _calc_padded_blocks(C)], ceil(C / page) padded
            # to a multiple of 4096 tokens' pages (0.5.14 trtllm_mla_backend.py:209-230, :275-285,
            # :334-370; 0.5.23 :477-485); target_verify asks for s + D (0.5.14 :372-424, 0.5.23
            # :604-667), draft_extend_v2 s. Short only where C is at or just below such a multiple
            # (4096, 163840): s + D then needs one page more.
            WatchTarget(
                TRTLLM_MLA_REPLAY,
                "sglang.srt.layers.attention.trtllm_mla_backend.TRTLLMMLABackend.init_forward_metadata_out_graph",
                "block_kv_indices (pages)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_trtllm_mla,
    ),
)
