"""What the family watch counts without a member yet: flashinfer's flat graph buffers.

No rule judges these backends (their buffers hold sglang's own sizes, see the targets' notes), but
a narrowed or outgrown buffer is the same width violation: the watch counts it, so a deployment
sees it before a member exists for it.
"""

from __future__ import annotations

from sglang_dsa_fix import replay_checks
from sglang_dsa_fix.members import WatchKind
from sglang_dsa_fix.release import WatchTarget


def check_flashinfer(site, arguments) -> None:
    """Entries written into the flat kv_indices: sum(s) (+ D per request for target_verify)."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, view, bs, mode, lengths = replay
    spec = getattr(view, "spec_info", None)
    # Draft decode brings its own kv_indptr / kv_indices (the multi-step draft backend's buffer).
    if mode.is_decode_or_idle() and getattr(spec, "kv_indptr", None) is None:
        needed = sum(lengths)
    elif mode.is_target_verify() and spec is not None:
        needed = sum(lengths) + bs * (getattr(spec, "draft_token_num", 0) or 0)
    elif mode.is_draft_extend_v2():
        needed = sum(lengths)
    else:
        return
    buffers = getattr(backend, "cuda_graph_kv_indices", None)
    if isinstance(buffers, list) and buffers:
        replay_checks.count_short(site, int(buffers[0].numel()), needed)


def check_flashinfer_mla(site, arguments) -> None:
    """Entries written into the flat kv_indices: decode sum(s), target_verify sum(s + D)."""
    replay = replay_checks.graph_replay(arguments)
    if replay is None:
        return
    backend, view, bs, mode, lengths = replay
    spec = getattr(view, "spec_info", None)
    if mode.is_decode_or_idle() and spec is None:
        needed = sum(lengths)
    elif mode.is_target_verify() and spec is not None:
        needed = sum(lengths) + bs * (getattr(spec, "draft_token_num", 0) or 0)
    else:
        return
    buffer = getattr(backend, "cuda_graph_kv_indices", None)
    if buffer is not None and buffer.dim() == 1:  # FlashMLA / Cutlass MLA keep a 2-D table here
        replay_checks.count_short(site, int(buffer.numel()), needed)


FLASHINFER_REPLAY, FLASHINFER_MLA_REPLAY = "flashinfer_replay", "flashinfer_mla_replay"
WATCHES = (
    WatchKind(
        FLASHINFER_REPLAY,
        ("flashinfer_kv_indices_short", None),
        targets=(
            # flashinfer: one flat kv_indices buffer of max_num_tokens * max_context_len entries
            # (0.5.14 flashinfer_backend.py:830-845, 0.5.23 :1100-1115), bound to every graph wrapper.
            # Replay writes cumsum(lengths) entries into it: decode, the Triton kernel straight into the
            # wrapper's buffer (:1317-1341); target_verify, spec_info's s + D per request
            # (eagle_info.py:98-134), copied in by the wrapper's plan; draft_extend_v2, s per request
            # (eagle_info.py:412-447). Capacity is total, not per request; at sglang's own size
            # (max_num_tokens = max_bs * D) sum(s + D) stays below it, so only a narrowed buffer counts.
            WatchTarget(
                FLASHINFER_REPLAY,
                "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend.init_forward_metadata_out_graph",
                "cuda_graph_kv_indices (flat)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_flashinfer,
    ),
    WatchKind(
        FLASHINFER_MLA_REPLAY,
        ("flashinfer_mla_kv_indices_short", None),
        targets=(
            # flashinfer MLA: the flat buffer is max_bs * max_context_len (0.5.14
            # flashinfer_mla_backend.py:418-432, 0.5.23 :499-515), fed by decode (s per request,
            # :449-485 -> :680-705) and target_verify (s + D per request, eagle_info.py:118-125). A
            # verify batch near the context limit asks for up to max_bs * (C + D - 3): more than it holds.
            WatchTarget(
                FLASHINFER_MLA_REPLAY,
                "sglang.srt.layers.attention.flashinfer_mla_backend.FlashInferMLAAttnBackend.init_forward_metadata_out_graph",
                "cuda_graph_kv_indices (flat)",
                (0, 5, 13),
            ),
        ),
        replay_check=check_flashinfer_mla,
    ),
)
