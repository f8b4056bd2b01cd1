"""The family watch's CUDA-graph replay checks: host-side, from the lengths the replay holds.

One check per backend the watch hooks (``watch._HOOK_FACTORIES``): it compares what the replay asks
the attention kernel to read with the graph buffer captured for it, and counts the short ones on the
watch's ``Site``. Split from ``watch.py`` (hooks, row checks, report), which calls them.

Cost: these run on every CUDA-graph replay (target_verify, draft_extend and every draft-decode
step), so the host lengths are read as Python ints with one ``tolist()`` of the host tensor
(``host_lengths``), not with torch reductions: ``int(seq_lens_cpu[:bs].max())`` is a slice, a
reduction and a read, three dispatcher round trips (about 7 us of the 10 us the DSA check cost
on the H200, benchmark/watch_overhead.py); a list of bs ints is about 1 us. Nothing here touches
a device tensor.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Optional

from sglang_dsa_fix import width
from sglang_dsa_fix.release import (
    DSA_REPLAY,
    FA3_REPLAY,
    FLASHINFER_MLA_REPLAY,
    FLASHINFER_REPLAY,
    FLASHMLA_REPLAY,
    TRITON_REPLAY,
    TRTLLM_MHA_REPLAY,
    TRTLLM_MLA_REPLAY,
)

if TYPE_CHECKING:
    from sglang_dsa_fix.watch import Site


def replay_args(site: Site, original_fn, args, kwargs) -> dict:
    # The arguments by name, as Signature.bind would give them (defaults left out), without
    # bind's per-call cost: this runs on every CUDA-graph replay.
    if site.parameters is None:
        site.parameters = tuple(inspect.signature(original_fn).parameters)
    arguments = dict(zip(site.parameters, args))
    arguments.update(kwargs)
    return arguments


def host_lengths(lengths, bs: int) -> list:
    """``lengths[:bs]`` of a host tensor as Python ints: one ``tolist()``, of a numpy view of the
    first bs where the buffer is longer (a view, no torch op)."""
    if lengths.numel() > bs:
        lengths = lengths.numpy()[:bs]
    return lengths.tolist()


def _longest(arguments) -> Optional[int]:
    """max(seq_lens[:bs]) from the host copy; None where there is none (never sync for it)."""
    seq_lens_cpu, bs = arguments.get("seq_lens_cpu"), arguments.get("bs")
    if seq_lens_cpu is None or not bs or getattr(seq_lens_cpu, "device", None) is None:
        return None
    if seq_lens_cpu.device.type != "cpu":
        return None
    return max(host_lengths(seq_lens_cpu, bs))


def _count_short(site: Site, table_width: int, needed: int) -> None:
    # The first violation is reported as it was (width and needed of the same replay: one class
    # can serve backends of other sizes, target and draft); before any, the first width seen.
    if site.width is None:
        site.width = table_width
    if needed > table_width:
        if not site.count:
            site.width, site.needed = table_width, needed
        site.count += 1
        site.columns += needed - table_width


def _check_dsa(site: Site, arguments) -> None:
    """Columns the DSA replay copies into the graph page_table (0.5.14 dsa_backend.py:1201-1266):
    decode and draft_extend_v2 max(seq_lens), target_verify max(seq_lens) + D."""
    backend, bs, mode = next(iter(arguments.values())), arguments["bs"], arguments.get("forward_mode")
    graph = getattr(backend, "decode_cuda_graph_metadata", None)
    if mode is None or not isinstance(graph, dict) or bs not in graph:
        return  # capture: the per-bs metadata is being built, nothing replayed yet
    longest = _longest(arguments)
    if longest is None:
        return
    if mode.is_target_verify():
        needed = longest + (backend.speculative_num_draft_tokens or 0)
    elif mode.is_decode_or_idle() or mode.is_draft_extend_v2():
        needed = longest
    else:
        return
    table = getattr(graph[bs], "page_table_1", None)
    if table is None:  # 0.5.17+ may drop the wide table; then it reads req_to_token's width
        table = width.graph_page_table(backend)
    table_width = int(table.shape[1]) if table is not None else width.required_width(backend)
    _count_short(site, table_width, needed)


def _check_fa3(site: Site, arguments) -> None:
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
    longest = _longest(arguments)
    if table is None or longest is None:
        return
    page = backend.page_size
    _count_short(site, int(table.shape[1]), -(-(longest + extra) // page))


def _graph_replay(arguments):
    """(backend, view, bs, mode, host lengths[:bs] as ints) of a replay through
    init_forward_metadata_out_graph; None at capture or without fresh host lengths.

    The view's seq_lens_cpu is the runner's host buffer, refreshed only when the batch carries
    host lengths (0.5.14 runner_utils/buffers.py:340-343); under spec-v2 overlap a backend that
    opts out (needs_cpu_seq_lens False: triton, TRT-LLM) gets None for both seq_lens_cpu and
    seq_lens_sum (managers/overlap_utils.py:291-295), and the view keeps seq_lens_sum None
    (decode_cuda_graph_runner.py:147-151). So seq_lens_sum None means stale: not judged.
    """
    backend, view = next(iter(arguments.values())), arguments.get("forward_batch")
    if view is None or arguments.get("in_capture"):
        return None
    bs, mode = getattr(view, "batch_size", None), getattr(view, "forward_mode", None)
    lengths = getattr(view, "seq_lens_cpu", None)
    if not bs or mode is None or getattr(view, "seq_lens_sum", None) is None:
        return None
    if getattr(lengths, "device", None) is None or lengths.device.type != "cpu":
        return None
    return backend, view, bs, mode, host_lengths(lengths, bs)


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


def _draft_columns(backend, mode) -> Optional[int]:
    """Columns a per-request MLA table replay reads past seq_len: D for target_verify, none for
    decode and draft_extend_v2; None for the modes these backends do not replay from a graph."""
    if mode.is_target_verify():
        return backend.num_draft_tokens or 0
    if mode.is_decode_or_idle() or mode.is_draft_extend_v2():
        return 0
    return None


def _check_flashinfer(site: Site, arguments) -> None:
    """Entries written into the flat kv_indices: sum(s) (+ D per request for target_verify)."""
    replay = _graph_replay(arguments)
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
        _count_short(site, int(buffers[0].numel()), needed)


def _check_flashinfer_mla(site: Site, arguments) -> None:
    """Entries written into the flat kv_indices: decode sum(s), target_verify sum(s + D)."""
    replay = _graph_replay(arguments)
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
        _count_short(site, int(buffer.numel()), needed)


def _check_triton(site: Site, arguments) -> None:
    """Entries written into the flat kv_indices: sum(s), decode and target_verify (prefix only).
    draft_extend_v2 writes s - extend per request, less than that, with extend lengths only on
    the device: not judged. Draft decode reads the multi-step backend's own buffer."""
    replay = _graph_replay(arguments)
    if replay is None:
        return
    backend, view, _, mode, lengths = replay
    spec = getattr(view, "spec_info", None)
    if not (mode.is_target_verify() or (mode.is_decode_or_idle() and spec is None)):
        return
    buffer = getattr(backend, "cuda_graph_kv_indices", None)
    if buffer is not None:
        _count_short(site, int(buffer.numel()), sum(lengths))


def _check_flashmla(site: Site, arguments) -> None:
    """Pages per request vs the block table: ceil(max(s) (+ D for target_verify) / 64)."""
    replay = _graph_replay(arguments)
    if replay is None:
        return
    backend, _, _, mode, lengths = replay
    extra = _draft_columns(backend, mode)
    table = getattr(backend, "cuda_graph_kv_indices", None)
    if extra is not None and table is not None and table.dim() == 2:
        page = getattr(inspect.getmodule(type(backend)), "PAGE_SIZE", 64)
        _count_short(site, int(table.shape[1]), _pages(max(lengths) + extra, page))


def _check_trtllm_mha(site: Site, arguments) -> None:
    """Pages per request vs the per-mode page_table (topk 1): decode s (draft decode
    s + step + 1), target_verify s + D (the captured max_seq_len_q), draft_extend_v2 s."""
    replay = _graph_replay(arguments)
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
        _count_short(site, int(table.shape[1]), _pages(max(lengths) + extra, backend.page_size))


def _check_trtllm_mla(site: Site, arguments) -> None:
    """Pages per request vs the block table: decode and draft_extend_v2 s, target_verify s + D."""
    replay = _graph_replay(arguments)
    if replay is None:
        return
    backend, _, bs, mode, lengths = replay
    extra = _draft_columns(backend, mode)
    metadata = getattr(backend, "decode_cuda_graph_metadata", {}).get(bs)
    table = getattr(metadata, "block_kv_indices", None)
    if extra is not None and table is not None:
        _count_short(site, int(table.shape[1]), _pages(max(lengths) + extra, backend.page_size))


# The check of each replay kind (release.WATCH_TARGETS names the function it watches).
CHECKS = {
    DSA_REPLAY: _check_dsa,
    FA3_REPLAY: _check_fa3,
    FLASHINFER_REPLAY: _check_flashinfer,
    FLASHINFER_MLA_REPLAY: _check_flashinfer_mla,
    TRITON_REPLAY: _check_triton,
    FLASHMLA_REPLAY: _check_flashmla,
    TRTLLM_MHA_REPLAY: _check_trtllm_mha,
    TRTLLM_MLA_REPLAY: _check_trtllm_mla,
}
