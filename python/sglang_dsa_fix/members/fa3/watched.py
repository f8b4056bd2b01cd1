"""What the family watch checks for bug #3 (FA3): every graph replay, against its page_table."""

from __future__ import annotations

from sglang_dsa_fix import replay_checks
from sglang_dsa_fix.members import WatchKind
from sglang_dsa_fix.release import WatchTarget


def check_replay(site, arguments) -> None:
    """Pages the FA3 kernel reads per request vs the graph page_table width (0.5.14
    flashattention_backend.py:2150-2470, topk 1): decode max(seq_lens) (+ step + 1 for draft
    decode), target_verify max(seq_lens) + D, draft_extend_v2 max(seq_lens)."""
    backend, bs, mode = next(iter(arguments.values())), arguments["bs"], arguments.get("forward_mode")
    if mode is None or (getattr(backend, "topk", 1) or 1) > 1:
        return  # topk > 1 splits prefix and draft tokens in two tables: not judged here
    if mode.is_target_verify():
        metadata = getattr(backend, "target_verify_metadata", {}).get(bs)
        extra = backend.speculative_num_draft_tokens or 0
    elif mode.is_decode_or_idle():
        metadata = getattr(backend, "decode_cuda_graph_metadata", {}).get(bs)
        spec = arguments.get("spec_info") is not None
        extra = (getattr(backend, "speculative_step_id", 0) or 0) + 1 if spec else 0
    elif mode.is_draft_extend_v2():
        metadata = getattr(backend, "draft_extend_metadata", {}).get(bs)
        extra = 0
    else:
        return
    table = getattr(metadata, "page_table", None)
    longest = replay_checks.longest(arguments)
    if table is None or longest is None:
        return
    page = backend.page_size
    replay_checks.count_short(site, int(table.shape[1]), -(-(longest + extra) // page))


FA3_REPLAY = "fa3_replay"
WATCHES = (
    WatchKind(
        FA3_REPLAY,
        ("fa3_page_table_short", None),
        targets=(
            # FA3: target_verify sets cache_seqlens = seq_lens + D (0.5.14 flashattention_backend.py:2292-2325)
            # while the graph page_table is ceil(max_context_len / page) wide (:1610); the copy is sliced
            # to that width, so nothing raises and the kernel reads past the filled columns.
            # 0.5.14 :2115, 0.5.17 :2596, 0.5.23 :2997.
            WatchTarget(
                FA3_REPLAY,
                "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend._apply_cuda_graph_metadata",
                "page_table (pages)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_replay,
    ),
)
