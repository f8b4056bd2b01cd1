"""Family watch: an opt-in runtime checker that counts width violations of the req_to_token family.

Off by default; ``SGLANG_DSA_FIX_WATCH`` = 1 / true / yes / on turns it on. ``plugin.register()``
then adds the AROUND hooks of ``hooks()`` through sglang's HookRegistry, independently of the
fixes (it watches with the kill switch ``SGLANG_DSA_FIX=0`` too, which is how one sees the bugs
happen). It changes nothing: every hook checks the arguments, then calls sglang's own function.
A check that fails logs one warning and is switched off; sglang's call goes on.

What it counts: each member's unit declares the kinds that see it (``members.WatchKind`` in its
``WATCHES``; ``members/watch_only.py`` for what no member judges yet): the functions to wrap per
release, the counters' names, and either

- a row check on the device (``batch_size_at``): every call of a writer or reader of
  ``req_to_token`` rows (sglang's ``assign_req_to_token_pool_func`` / ``assign_extend_cache_locs_func``,
  which mask only ``col < end`` and never the row width: bug #2; a reader of the same N columns from
  each start, ``span_at``: ``assign_extend_cache_locs_uniform_func``, 0.5.23's
  ``assign_draft_cache_locs_contiguous_func``), counting rows whose [start, end)
  reaches past ``req_to_token.shape[1]`` and the columns there, which land in the next request's row;
- or a CUDA-graph replay check on the host (``replay_check``): replays whose graph buffer, sized
  from max_context_len at capture, is smaller than what the replay asks the attention kernel to
  read (bug #1 and its relatives), summed over backends as ``graph_replays_short``.

No host synchronisation on the hot path: a row check is one launch of a small Triton kernel
that accumulates into an int64 tensor on the tensors' own device, nothing read back
(``row_check.py``). The replay checks (``replay_checks.py``) only read ``seq_lens_cpu``, a host
tensor the replay already holds, as Python ints (one ``tolist()``).
Only ``report()`` reads the device counters (one copy to the host per device), and ``by_kind()``
for /metrics, through the plugin's reader that never waits (``metrics.read_without_waiting``).
"""

from __future__ import annotations

import logging
import os
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from sglang_dsa_fix import members, replay_checks, row_check
from sglang_dsa_fix.release import WatchTarget

logger = logging.getLogger("sglang_dsa_fix")

WATCH_ENV = "SGLANG_DSA_FIX_WATCH"
ON_VALUES = ("1", "true", "yes", "on")
AROUND = "AROUND"  # sglang's HookType name: hook(original_fn, *args, **kwargs)

GRAPH_TOTAL = "graph_replays_short"


def kinds() -> dict:
    """Every kind the watch counts, by name (each member's unit declares its own: ``WATCHES``)."""
    return {kind.kind: kind for kind in members.watch_kinds()}


def counter_names() -> dict:
    """Per kind: (sites counted, columns past the end or None), as ``report()`` spells them."""
    return {name: kind.counters for name, kind in kinds().items()}


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


_SITES: dict[str, Site] = {}  # by target, in registration order
_logged = set()


# ``.on`` while sglang's fixed-span reader runs in this thread: off CUDA / ROCm / MUSA / XPU it
# falls back to the end-tensor reader (0.5.17 kernels/ops/speculative/cache_locs.py:420-429),
# hooked too, whose read is then the one the fixed-span hook counted.
class _FixedSpanRead(threading.local):
    on = False  # (a class default: every thread starts off)


_in_fixed_span_read = _FixedSpanRead()


def reset() -> None:
    """Zero every counter (tests and benchmarks only); the hooks stay."""
    row_check.reset()
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
    chosen = []
    for kind in members.watch_kinds():
        for candidate in kind.targets:
            if candidate.covers(version) and (not resolve or _resolves(candidate.target)):
                chosen.append(candidate)
                break
    return chosen


def hooks(version_or_tree_info=None, resolve: bool = True) -> list[tuple[str, str, Callable]]:
    """[(target, HookType name, hook)] for this release (a version string, or anything with a
    ``version``, e.g. ``tree.find_tree(None)``; None: the installed tree). Idempotent per target."""
    out = []
    for candidate in select(_version_of(version_or_tree_info), resolve):
        site = _SITES.get(candidate.target)
        if site is None:
            site = Site(candidate.kind, candidate.target, candidate.buffer)
            if kinds()[site.kind].batch_size_at is not None:  # checked on the device: a counters row
                site.slot = sum(s.slot >= 0 for s in _SITES.values())
                assert site.slot < row_check.MAX_DEVICE_SITES
            _SITES[candidate.target] = site
        out.append((candidate.target, AROUND, _hook(kinds()[candidate.kind], site)))
    return out


def _fail(site: Site, exc: Exception) -> None:
    """A check that cannot run: one warning, and this site stops checking."""
    site.failed = f"{type(exc).__name__}: {exc}"
    logger.warning("sglang-dsa-fix watch: check on %s switched off (%s)", site.target, site.failed)


def _arg(args, kwargs, index: int, parameters: tuple):
    """The argument at ``index`` of sglang's call: by position, else by its keyword."""
    return args[index] if len(args) > index else kwargs[parameters[index]]


def _row_hook(site: Site, batch_size_at: int, parameters: tuple):
    last = max(3, batch_size_at)

    def watch_rows(original_fn, *args, **kwargs):
        if site.failed is None and not _in_fixed_span_read.on:
            try:
                if len(args) > last:  # positional, as sglang calls them: no lookups by name
                    row_check.check(site, args[1], args[2], args[3], args[batch_size_at])
                else:
                    row_check.check(
                        site, *(_arg(args, kwargs, at, parameters) for at in (1, 2, 3, batch_size_at))
                    )
            except Exception as exc:  # never break sglang
                _fail(site, exc)
        return original_fn(*args, **kwargs)

    return watch_rows


def _fixed_span_hook(site: Site, batch_size_at: int, span_at: tuple, parameters: tuple):
    """A reader of the same N columns from start (position 2) in every row: no end tensor, end =
    start + N, N the product of the arguments at ``span_at`` (draft_token_num; topk x num_cols)."""

    def watch_fixed_span(original_fn, *args, **kwargs):
        if site.failed is None:
            try:
                span = 1
                for at in span_at:
                    columns = _arg(args, kwargs, at, parameters)
                    if type(columns) is not int:  # sglang passes ints
                        if hasattr(columns, "data_ptr"):  # a tensor's value is never read (a host sync)
                            raise TypeError(f"{parameters[at]} is a tensor: its value is not read")
                        columns = int(columns)
                    span *= columns
                start = _arg(args, kwargs, 2, parameters)
                batch_size = _arg(args, kwargs, batch_size_at, parameters)
                row_check.check(site, _arg(args, kwargs, 1, parameters), start, start, batch_size, span)
            except Exception as exc:  # never break sglang
                _fail(site, exc)
        if site.failed is not None:  # not counted here: a fallback read counts as the end-tensor read's
            return original_fn(*args, **kwargs)
        outer, _in_fixed_span_read.on = _in_fixed_span_read.on, True
        try:
            return original_fn(*args, **kwargs)
        finally:
            _in_fixed_span_read.on = outer

    return watch_fixed_span


def _replay_hook(site: Site, check):
    def watch_replay(original_fn, *args, **kwargs):
        # Checked before the call: on a pristine 0.5.14 the replay then raises.
        if site.failed is None:
            try:
                check(site, replay_checks.replay_args(site, original_fn, args, kwargs))
            except Exception as exc:
                _fail(site, exc)
        return original_fn(*args, **kwargs)

    return watch_replay


def _hook(kind: members.WatchKind, site: Site):
    if kind.span_at:
        return _fixed_span_hook(site, kind.batch_size_at, kind.span_at, kind.parameters)
    if kind.batch_size_at is not None:
        return _row_hook(site, kind.batch_size_at, kind.parameters)
    return _replay_hook(site, kind.replay_check)


# --------------------------------------------------------------------------------------------
# The report (and by_kind, for /metrics): the only places that read device counters.


def _read_device_counters(read=None) -> list[list[int]]:
    """[rows, columns, max end] per device slot, summed (max for the end) over devices.
    ``read(device, counters)``: the values as a list (None: ``tolist()``, which waits for them)."""
    totals = [[0, 0, 0] for _ in range(row_check.MAX_DEVICE_SITES)]
    for device, counters in list(row_check.DEVICE_COUNTERS.items()):
        for slot, (rows, columns, end) in enumerate(read(device, counters) if read else counters.tolist()):
            totals[slot][0] += rows
            totals[slot][1] += columns
            totals[slot][2] = max(totals[slot][2], end)
    return totals


def _site_counts(read=None):
    """(site, count, columns, needed) per hooked site; ``read`` as for ``_read_device_counters``."""
    device = _read_device_counters(read) if row_check.DEVICE_COUNTERS else None
    for site in _SITES.values():
        if site.slot >= 0:  # a device-checked site (its counters row)
            yield (site, *(device[site.slot] if device else (0, 0, 0)))
        else:
            yield site, site.count, site.columns, site.needed


def by_kind(read=None) -> dict:
    """Per watched kind: [sites counted, columns past the end (None where the kind counts
    none), checking (False once its check failed and switched off: its counts are then not
    whole; a row check a CUDA graph captured before goes on counting that graph's replays)]."""
    out, names = {}, counter_names()
    for site, count, columns, _ in _site_counts(read):
        counts_columns = names[site.kind][1] is not None
        entry = out.setdefault(site.kind, [0, 0 if counts_columns else None, True])
        entry[0] += count
        entry[1] = entry[1] + columns if counts_columns else None
        entry[2] = entry[2] and site.failed is None
    return out


def report() -> dict:
    out, names = {"enabled": enabled(), "sites": list(_SITES)}, counter_names()
    for kind in names:
        for name in names[kind]:
            if name:
                out[name] = 0
    out[GRAPH_TOTAL] = 0
    first, failed = None, {}
    for site, count, columns, needed in _site_counts():
        if site.slot < 0:
            out[GRAPH_TOTAL] += count
        sites_name, columns_name = names[site.kind]
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
