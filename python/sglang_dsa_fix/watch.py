"""Family watch: an opt-in runtime checker that counts width violations of the req_to_token family.

Off by default; ``SGLANG_DSA_FIX_WATCH`` = 1 / true / yes / on turns it on. ``plugin.register()``
then adds the AROUND hooks of ``hooks()`` through sglang's HookRegistry, independently of the
fixes (it watches with the kill switch ``SGLANG_DSA_FIX=0`` too, which is how one sees the bugs
happen). It changes nothing: every hook checks the arguments, then calls sglang's own function.
A check that fails logs one warning and is switched off; sglang's call goes on.

What it counts:

- row writes: every call of the Triton writer ``assign_req_to_token_pool_func(req_pool_indices,
  req_to_token, start_offset, end_offset, out_cache_loc, batch_size)``, which masks only
  ``col < end`` and never the row width (bug #2): rows whose [start, end) reaches past
  ``req_to_token.shape[1]`` (``row_writes_past_end``) and the columns written there
  (``row_columns_past_end``), which land in the next request's row;
- row reads: ``assign_extend_cache_locs_func`` (same arguments less out_cache_loc), which reads
  the verify slots back out of a row with the same unmasked kernel (``row_reads_past_end``);
- CUDA-graph replays (bug #1 and its relatives): replays whose graph buffer, sized from
  max_context_len at capture, is smaller than what the replay asks the attention kernel to read
  (``graph_replays_short``, one counter per backend: ``dsa_page_table_short``,
  ``fa3_page_table_short``, ``flashinfer_kv_indices_short``, ``flashinfer_mla_kv_indices_short``,
  ``triton_kv_indices_short``, ``flashmla_block_table_short``, ``trtllm_mha_page_table_short``,
  ``trtllm_mla_block_table_short``). Per-row tables compare pages per request, flat index
  buffers (flashinfer, triton) their total length with the sum of the lengths.

No host synchronisation on the hot path: a row check is one launch of a small Triton kernel
(``_row_check_kernel``, Triton like the sglang kernel it watches) that accumulates into an int64
tensor on the tensors' own device; nothing is read back (no ``.item()``, no ``bool()`` of a
device tensor). One launch because the host time matters: the eager form (a dozen torch ops)
cost about 190 us per call on the H200 (benchmark/watch_overhead.py, docs/gpu-results.md). The
replay checks only read ``seq_lens_cpu``, a host tensor the replay already holds.
Only ``report()`` reads the device counters (one copy to the host per device).
"""

from __future__ import annotations

import inspect
import logging
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from sglang_dsa_fix import width
from sglang_dsa_fix.release import (
    DSA_REPLAY,
    FA3_REPLAY,
    FLASHINFER_MLA_REPLAY,
    FLASHINFER_REPLAY,
    FLASHMLA_REPLAY,
    ROW_READ,
    ROW_WRITE,
    TRITON_REPLAY,
    TRTLLM_MHA_REPLAY,
    TRTLLM_MLA_REPLAY,
    WATCH_TARGETS,
    WatchTarget,
)

logger = logging.getLogger("sglang_dsa_fix")

WATCH_ENV = "SGLANG_DSA_FIX_WATCH"
ON_VALUES = ("1", "true", "yes", "on")
AROUND = "AROUND"  # sglang's HookType name: hook(original_fn, *args, **kwargs)

DEVICE_KINDS = (ROW_WRITE, ROW_READ)  # checked on the device
# Counter names per kind: (sites counted, columns past the end), as report() spells them.
COUNTERS = {
    ROW_WRITE: ("row_writes_past_end", "row_columns_past_end"),
    ROW_READ: ("row_reads_past_end", "row_read_columns_past_end"),
    DSA_REPLAY: ("dsa_page_table_short", None),
    FA3_REPLAY: ("fa3_page_table_short", None),
    FLASHINFER_REPLAY: ("flashinfer_kv_indices_short", None),
    FLASHINFER_MLA_REPLAY: ("flashinfer_mla_kv_indices_short", None),
    TRITON_REPLAY: ("triton_kv_indices_short", None),
    FLASHMLA_REPLAY: ("flashmla_block_table_short", None),
    TRTLLM_MHA_REPLAY: ("trtllm_mha_page_table_short", None),
    TRTLLM_MLA_REPLAY: ("trtllm_mla_block_table_short", None),
}
GRAPH_TOTAL = "graph_replays_short"


def enabled(value: Optional[str] = None) -> bool:
    value = os.environ.get(WATCH_ENV, "") if value is None else value
    return value.strip().lower() in ON_VALUES


@dataclass
class Site:
    """One hooked target: its static part (host) and, for host-checked kinds, its counters."""

    kind: str
    target: str
    buffer: str
    slot: int = -1  # row in the device counters (device kinds)
    width: Optional[int] = None  # recorded at the first check
    count: int = 0  # host-checked kinds
    columns: int = 0
    needed: int = 0
    failed: Optional[str] = None
    parameters: Optional[tuple] = field(default=None, repr=False)  # the hooked function's, in order


MAX_DEVICE_SITES = 8
_SITES: dict[str, Site] = {}  # by target, in registration order
_DEVICE_COUNTERS: dict = {}  # torch.device -> int64 [MAX_DEVICE_SITES, 3]: rows, columns, max end
_logged = set()


def reset() -> None:
    """Zero every counter (tests); the hooks stay."""
    _DEVICE_COUNTERS.clear()
    _logged.clear()
    for site in _SITES.values():
        site.width, site.count, site.columns, site.needed, site.failed = None, 0, 0, 0, None


def _version_of(version_or_tree_info) -> Optional[str]:
    if version_or_tree_info is None:
        from sglang_dsa_fix import tree

        return tree.find_tree(None).version
    return getattr(version_or_tree_info, "version", version_or_tree_info)


def _resolves(target: str) -> bool:
    try:
        pkgutil.resolve_name(target)  # as HookRegistry resolves it when applying
    except Exception:
        return False
    return True


def select(version: Optional[str], resolve: bool = True) -> list[WatchTarget]:
    """Per kind, the first candidate for this release (that resolves, if ``resolve``)."""
    chosen = {}
    for candidate in WATCH_TARGETS:
        if candidate.kind in chosen or not candidate.covers(version):
            continue
        if resolve and not _resolves(candidate.target):
            continue
        chosen[candidate.kind] = candidate
    return list(chosen.values())


def hooks(version_or_tree_info=None, resolve: bool = True) -> list[tuple[str, str, Callable]]:
    """[(target, HookType name, hook)] for this release (a version string, or anything with a
    ``version``, e.g. ``tree.find_tree(None)``; None: the installed tree). Idempotent per target."""
    out = []
    for candidate in select(_version_of(version_or_tree_info), resolve):
        site = _SITES.get(candidate.target)
        if site is None:
            site = Site(candidate.kind, candidate.target, candidate.buffer)
            if site.kind in DEVICE_KINDS:
                site.slot = sum(s.kind in DEVICE_KINDS for s in _SITES.values())
                assert site.slot < MAX_DEVICE_SITES
            _SITES[candidate.target] = site
        out.append((candidate.target, AROUND, _HOOK_FACTORIES[candidate.kind](site)))
    return out


def _fail(site: Site, exc: Exception) -> None:
    """A check that cannot run: one warning, and this site stops checking."""
    site.failed = f"{type(exc).__name__}: {exc}"
    logger.warning("sglang-dsa-fix watch: check on %s switched off (%s)", site.target, site.failed)


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs[name]


# --------------------------------------------------------------------------------------------
# Row writes and reads: device-side counting.


def _counters(device):
    import torch

    counters = _DEVICE_COUNTERS.get(device)
    if counters is None:  # once per device: an allocation, no synchronisation
        counters = torch.zeros((MAX_DEVICE_SITES, 3), dtype=torch.int64, device=device)
        _DEVICE_COUNTERS[device] = counters
    return counters


def _capturing(device) -> bool:
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_KERNEL = None
_ROW_CHECK_BLOCK = 128  # rows per program


def _row_check_kernel():
    """The row check as one Triton kernel, compiled on first use (the plugin imports no triton
    at start-up). For rows i < batch_size: past = max(0, end[i] - max(start[i], width)); adds
    (rows with past > 0, sum of past) to counters[0:2] and raises counters[2] to max(end)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        # No specialisation on the two ints: a new batch size must not compile a new variant
        # in the middle of serving.
        @triton.jit(do_not_specialize=["row_width", "batch_size"])
        def row_check(start_ptr, end_ptr, counters_ptr, row_width, batch_size, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < batch_size
            start = tl.load(start_ptr + offsets, mask=inside, other=0).to(tl.int64)
            end = tl.load(end_ptr + offsets, mask=inside, other=0).to(tl.int64)
            past = tl.where(inside, tl.maximum(end - tl.maximum(start, row_width), 0), 0)
            tl.atomic_add(counters_ptr, tl.sum((past > 0).to(tl.int64), axis=0))
            tl.atomic_add(counters_ptr + 1, tl.sum(past, axis=0))
            tl.atomic_max(counters_ptr + 2, tl.max(tl.where(inside, end, 0), axis=0))

        _KERNEL = row_check
    return _KERNEL


def _check_rows(site: Site, req_to_token, start_offset, end_offset, batch_size) -> None:
    """Columns of [start, end) at or past the row end, per row, accumulated on the device.

    The kernel writes (reads) columns [start, end) of row req_pool_indices[i] for i < batch_size,
    at ``req_to_token + row * width + col`` (0.5.14 triton_ops/cache_locs.py:15-46), so every
    column >= width is a cell of a later row. A row with start >= end touches nothing.
    """
    import torch

    if isinstance(batch_size, torch.Tensor):  # sglang passes an int; never read a device value
        batch_size = end_offset.shape[0]
    batch_size = min(int(batch_size), start_offset.shape[0], end_offset.shape[0])
    if not batch_size or _capturing(end_offset.device):
        return
    if not (start_offset.is_contiguous() and end_offset.is_contiguous()):  # the kernel reads stride 1
        start_offset, end_offset = start_offset.contiguous(), end_offset.contiguous()
    row_width = int(req_to_token.shape[1])
    if site.width is None:
        site.width = row_width
    # Launched on the current device, as sglang launches the kernel it watches on these tensors.
    counters = _counters(end_offset.device)[site.slot]
    grid = (-(-batch_size // _ROW_CHECK_BLOCK),)
    _row_check_kernel()[grid](
        start_offset, end_offset, counters, row_width, batch_size, BLOCK=_ROW_CHECK_BLOCK
    )


def _row_write_hook(site: Site):
    def watch_row_write(original_fn, *args, **kwargs):
        if site.failed is None:
            try:
                _check_rows(
                    site,
                    _arg(args, kwargs, 1, "req_to_token"),
                    _arg(args, kwargs, 2, "start_offset"),
                    _arg(args, kwargs, 3, "end_offset"),
                    _arg(args, kwargs, 5, "batch_size"),
                )
            except Exception as exc:  # never break sglang
                _fail(site, exc)
        return original_fn(*args, **kwargs)

    return watch_row_write


def _row_read_hook(site: Site):
    def watch_row_read(original_fn, *args, **kwargs):
        if site.failed is None:
            try:
                _check_rows(
                    site,
                    _arg(args, kwargs, 1, "req_to_token"),
                    _arg(args, kwargs, 2, "start_offset"),
                    _arg(args, kwargs, 3, "end_offset"),
                    _arg(args, kwargs, 4, "batch_size"),
                )
            except Exception as exc:
                _fail(site, exc)
        return original_fn(*args, **kwargs)

    return watch_row_read


# --------------------------------------------------------------------------------------------
# CUDA-graph replays: host-side checks from seq_lens_cpu.


def _replay_args(site: Site, original_fn, args, kwargs) -> dict:
    # The arguments by name, as Signature.bind would give them (defaults left out), without
    # bind's per-call cost: this runs on every CUDA-graph replay.
    if site.parameters is None:
        site.parameters = tuple(inspect.signature(original_fn).parameters)
    arguments = dict(zip(site.parameters, args))
    arguments.update(kwargs)
    return arguments


def _longest(arguments) -> Optional[int]:
    """max(seq_lens[:bs]) from the host copy; None where there is none (never sync for it)."""
    seq_lens_cpu, bs = arguments.get("seq_lens_cpu"), arguments.get("bs")
    if seq_lens_cpu is None or not bs or getattr(seq_lens_cpu, "device", None) is None:
        return None
    if seq_lens_cpu.device.type != "cpu":
        return None
    return int(seq_lens_cpu[:bs].max())


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
    """(backend, view, bs, mode, host lengths[:bs]) of a replay through
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
    return backend, view, bs, mode, lengths[:bs]


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
        needed = int(lengths.sum())
    elif mode.is_target_verify() and spec is not None:
        needed = int(lengths.sum()) + bs * (getattr(spec, "draft_token_num", 0) or 0)
    elif mode.is_draft_extend_v2():
        needed = int(lengths.sum())
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
        needed = int(lengths.sum())
    elif mode.is_target_verify() and spec is not None:
        needed = int(lengths.sum()) + bs * (getattr(spec, "draft_token_num", 0) or 0)
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
        _count_short(site, int(buffer.numel()), int(lengths.sum()))


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
        _count_short(site, int(table.shape[1]), _pages(int(lengths.max()) + extra, page))


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
        _count_short(site, int(table.shape[1]), _pages(int(lengths.max()) + extra, backend.page_size))


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
        _count_short(site, int(table.shape[1]), _pages(int(lengths.max()) + extra, backend.page_size))


def _replay_hook(check):
    def factory(site: Site):
        def watch_replay(original_fn, *args, **kwargs):
            # Checked before the call: on a pristine 0.5.14 the replay then raises.
            if site.failed is None:
                try:
                    check(site, _replay_args(site, original_fn, args, kwargs))
                except Exception as exc:
                    _fail(site, exc)
            return original_fn(*args, **kwargs)

        return watch_replay

    return factory


_HOOK_FACTORIES = {
    ROW_WRITE: _row_write_hook,
    ROW_READ: _row_read_hook,
    DSA_REPLAY: _replay_hook(_check_dsa),
    FA3_REPLAY: _replay_hook(_check_fa3),
    FLASHINFER_REPLAY: _replay_hook(_check_flashinfer),
    FLASHINFER_MLA_REPLAY: _replay_hook(_check_flashinfer_mla),
    TRITON_REPLAY: _replay_hook(_check_triton),
    FLASHMLA_REPLAY: _replay_hook(_check_flashmla),
    TRTLLM_MHA_REPLAY: _replay_hook(_check_trtllm_mha),
    TRTLLM_MLA_REPLAY: _replay_hook(_check_trtllm_mla),
}


# --------------------------------------------------------------------------------------------
# The report: the only place that reads device counters.


def _read_device_counters() -> list[list[int]]:
    """[rows, columns, max end] per device slot, summed (max for the end) over devices."""
    totals = [[0, 0, 0] for _ in range(MAX_DEVICE_SITES)]
    for counters in list(_DEVICE_COUNTERS.values()):
        for slot, (rows, columns, end) in enumerate(counters.tolist()):
            totals[slot][0] += rows
            totals[slot][1] += columns
            totals[slot][2] = max(totals[slot][2], end)
    return totals


def report() -> dict:
    out = {"enabled": enabled(), "sites": list(_SITES)}
    for kind in COUNTERS:
        for name in COUNTERS[kind]:
            if name:
                out[name] = 0
    out[GRAPH_TOTAL] = 0
    device = _read_device_counters() if _DEVICE_COUNTERS else None
    first, failed = None, {}
    for site in _SITES.values():
        if site.kind in DEVICE_KINDS:
            count, columns, needed = device[site.slot] if device else (0, 0, 0)
        else:
            count, columns, needed = site.count, site.columns, site.needed
            out[GRAPH_TOTAL] += count
        sites_name, columns_name = COUNTERS[site.kind]
        out[sites_name] += count
        if columns_name:
            out[columns_name] += columns
        if count and first is None:
            first = {"where": site.target, "buffer": site.buffer, "width": site.width, "needed": needed}
        if site.failed:
            failed[site.target] = site.failed
    out["first_violation"] = first
    if failed:
        out["failed"] = failed
    if first is not None and "first" not in _logged:
        _logged.add("first")
        logger.warning(
            "sglang-dsa-fix watch: %s needed %d columns of %s, which is %d wide (width violation; "
            "counters under the plugin's state 'watch')",
            first["where"],
            first["needed"],
            first["buffer"],
            first["width"],
        )
    return out
