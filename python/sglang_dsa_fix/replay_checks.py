"""What the family watch's CUDA-graph replay checks share: host-side, from the lengths the replay holds.

Each check lives in the unit of the member it watches (``members.WatchKind.replay_check``: DSA in
``members/page_table.py``, FA3 in ``members/fa3/watched.py``, the relatives in
``members/graph_table.py``, flashinfer in ``members/watch_only.py``): it compares what the replay
asks the attention kernel to read with the graph buffer captured for it, and counts the short ones
on the watch's ``Site`` (``count_short``). ``watch.py`` runs them before sglang's call.

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


def longest(arguments) -> Optional[int]:
    """max(seq_lens[:bs]) from the host copy; None where there is none (never sync for it)."""
    seq_lens_cpu, bs = arguments.get("seq_lens_cpu"), arguments.get("bs")
    if not bs or getattr(seq_lens_cpu, "is_cpu", False) is not True:  # (a host tensor, or nothing)
        return None
    return max(host_lengths(seq_lens_cpu, bs))


def count_short(site: Site, table_width: int, needed: int) -> None:
    # The first violation is reported as it was (width and needed of the same replay: one class
    # can serve backends of other sizes, target and draft); before any, the first width seen.
    if site.width is None:
        site.width = table_width
    if needed > table_width:
        if not site.count:
            site.width, site.needed = table_width, needed
        site.count += 1
        site.columns += needed - table_width


def graph_replay(arguments):
    """(backend, view, bs, mode, host lengths[:bs] as ints) of a replay through
    init_forward_metadata_out_graph; None at capture or without fresh host lengths.

    The backends whose graph buffers are sized from max_context_len (bug #3's relatives,
    flashinfer) are each hooked at init_forward_metadata_out_graph(forward_batch, in_capture),
    the entry the decode cuda-graph runner calls before every replay with build_replay_fb_view's
    view (0.5.14 decode_cuda_graph_runner.py:116-160, :940-950): one signature from 0.5.13 to
    0.5.23, unlike the private bodies under it. A subclass that inherits the method (or calls it
    through super()) is judged by the same rule only where it keeps the same buffer.

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
    if getattr(lengths, "is_cpu", False) is not True:  # a host tensor (is_cpu: cheaper than device.type)
        return None
    return backend, view, bs, mode, host_lengths(lengths, bs)


def pages(tokens: int, page: int) -> int:
    return -(-tokens // page)
