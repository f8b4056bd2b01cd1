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
  which mask only ``col < end`` and never the row width: bug #2), counting rows whose [start, end)
  reaches past ``req_to_token.shape[1]`` and the columns there, which land in the next request's row;
- or a CUDA-graph replay check on the host (``replay_check``): replays whose graph buffer, sized
  from max_context_len at capture, is smaller than what the replay asks the attention kernel to
  read (bug #1 and its relatives), summed over backends as ``graph_replays_short``.

No host synchronisation on the hot path: a row check is one launch of a small Triton kernel
(``_row_check_kernel``, Triton like the sglang kernel it watches) that accumulates into an int64
tensor on the tensors' own device; nothing is read back (no ``.item()``, no ``bool()`` of a
device tensor). One launch because the host time matters: the eager form (a dozen torch ops)
cost about 190 us per call on the H200 (benchmark/watch_overhead.py, docs/gpu-results.md). The
replay checks (``replay_checks.py``) only read ``seq_lens_cpu``, a host tensor the replay already
holds, as Python ints (one ``tolist()``).
Only ``report()`` reads the device counters (one copy to the host per device), and ``by_kind()``
for /metrics, through the plugin's reader that never waits (``metrics.read_without_waiting``).
"""

from __future__ import annotations

import logging
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from sglang_dsa_fix import members, replay_checks
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


MAX_DEVICE_SITES = 8
_SITES: dict[str, Site] = {}  # by target, in registration order
_DEVICE_COUNTERS: dict = {}  # torch.device -> int64 [MAX_DEVICE_SITES, 3]: rows, columns, max end
_logged = set()


def reset() -> None:
    """Zero every counter (tests and benchmarks only); the hooks stay."""
    # In place: a CUDA graph that captured a row check holds its device's counters' address (on
    # the current stream: a replay on another stream at the same time is not ordered with it).
    for counters in _DEVICE_COUNTERS.values():
        counters.zero_()
    _LAUNCHES.clear()
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
                assert site.slot < MAX_DEVICE_SITES
            _SITES[candidate.target] = site
        out.append((candidate.target, AROUND, _hook(kinds()[candidate.kind], site)))
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


_CUDA = _CURRENT_DEVICE = None


def _cuda():
    """torch.cuda, imported once (an import statement per call costs host time on the hot path);
    ``_CURRENT_DEVICE``: torch.cuda.current_device() (0.2 / 0.5 us a call on an H100 / H200) less its
    lazy-init check (torch 2.11 / 2.14 cuda/__init__.py), needless with a CUDA tensor in hand."""
    global _CUDA, _CURRENT_DEVICE
    if _CUDA is None:
        import torch

        _CUDA, _CURRENT_DEVICE = torch.cuda, getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    return _CUDA


_KERNEL = None
_ROW_CHECK_BLOCK = 128  # rows per program
# (start device, end device, current device, start dtype, end dtype, programs) -> launch
# (``_direct_launch``). Triton's JIT launch (binder, cache key, globals check:
# triton/runtime/jit.py JITFunction.run, 3.6 and 3.8) is most of a row check's host time (about
# 16 us per call on the H100, benchmark/watch_overhead.py); after a key's first call the compiled
# kernel is launched without it. The key is where the kernel runs and reads and everything it is
# specialised on: the pointers' dtypes (not their alignment, see do_not_specialize_on_alignment)
# and, for ints below 2**31, nothing.
_LAUNCHES: dict = {}
_INT32_LIMIT = 2**31
# The installed Triton code the cached launch stands in for, read whole (whitespace collapsed,
# sha256): CompiledKernel[grid]'s runner (triton/compiler/compiler.py CompiledKernel.__getitem__,
# 3.6 :490-501, 3.8 :504-515, the same code) and, per Triton form, the launcher it calls
# (triton/backends/nvidia/driver.py CudaLauncher.__call__, 3.6 :700-714, 3.8 :297-336). Between
# them they look up the current device and stream, build launch_metadata, allocate scratch (the
# row check asks for none: both are then None) and, on 3.8, a sanitizer's state (gsan, off unless
# asked for); ``_direct_launch`` makes the C launch as that code makes it. A Triton that changes
# either function at all (a step added before an unchanged call, as 3.8 added gsan), or a wrapper
# put in its place (a profiler's), gets the runner or the launcher itself. (What the two call,
# launch_metadata and the scratch allocators among them, is not hashed: the row check skips only
# these two bodies.)
_RUNNER_SOURCES = {"fe2f1a6e918027859e3dc4802ca369fc8a0da050e0cf705186077bdd26f3eb26": "3.6, 3.8"}
_C_LAUNCH_SOURCES = {
    "b5e4d84a36af22efc4017e23f5873393dc885ae5ca6077a545182aa971d8d324": "3.6",
    "16d77af07087b0df72582dd8b3b5b7355a94aaad72544f4597391b4cb7d7169c": "3.8",
}
_SOURCE_DIGESTS: dict = {}  # function -> sha256 of its source, whitespace collapsed ("" unreadable)


def _source_digest(function) -> str:
    """The sha256 of the source of ``function``'s own code, whitespace collapsed ("" where it
    cannot be read); read once per process (not on each new key while serving)."""
    import hashlib
    import inspect

    if function not in _SOURCE_DIGESTS:
        try:
            # The code object's source, not the function's: inspect.getsource(function) follows
            # __wrapped__ and would read a functools.wraps wrapper as what it wraps.
            form = " ".join(inspect.getsource(function.__code__).split())
        except Exception:  # no code object, no file, a file changed since import: unknown
            form = None
        _SOURCE_DIGESTS[function] = hashlib.sha256(form.encode()).hexdigest() if form else ""
    return _SOURCE_DIGESTS[function]


def _c_launch_form(launcher) -> Optional[str]:
    """The form of ``_C_LAUNCH_SOURCES`` the installed launcher is, where the kernel needs no
    scratch and no sanitizer runs; None otherwise (the launcher itself is called)."""
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    if getattr(launcher, "gsan_enabled", False):
        return None
    return _C_LAUNCH_SOURCES.get(_source_digest(type(launcher).__call__))


def _row_check_kernel():
    """The row check as one Triton kernel, compiled on first use (the plugin imports no triton
    at start-up). For rows i < batch_size: past = max(0, end[i] - max(start[i], width)); adds
    (rows with past > 0, sum of past) to counters[slot, 0:2] and raises counters[slot, 2] to max(end)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        # No specialisation on the ints (a new batch size or the other site's slot must not
        # compile a new variant in the middle of serving) nor on the pointers' alignment (a
        # cached launcher must fit any view of the offsets).
        @triton.jit(
            do_not_specialize=["slot", "row_width", "batch_size"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr", "counters_ptr"],
        )
        def row_check(start_ptr, end_ptr, counters_ptr, slot, row_width, batch_size, BLOCK: tl.constexpr):
            site_counters = counters_ptr + slot * 3  # the site's row of [MAX_DEVICE_SITES, 3]
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < batch_size
            start = tl.load(start_ptr + offsets, mask=inside, other=0).to(tl.int64)
            end = tl.load(end_ptr + offsets, mask=inside, other=0).to(tl.int64)
            past = tl.where(inside, tl.maximum(end - tl.maximum(start, row_width), 0), 0)
            tl.atomic_add(site_counters, tl.sum((past > 0).to(tl.int64), axis=0))
            tl.atomic_add(site_counters + 1, tl.sum(past, axis=0))
            tl.atomic_max(site_counters + 2, tl.max(tl.where(inside, end, 0), axis=0))

        _KERNEL = row_check
    return _KERNEL


def _direct_launch(compiled, programs: int, device: Optional[int], counters):
    """launch(start, end, slot, row_width, batch_size) of the compiled kernel into ``counters``,
    as CompiledKernel[grid]'s runner launches it, without what the runner adds per call: the
    current device and stream looked up through the driver proxy, and launch_metadata, a LazyDict
    built on every launch because Triton's launch hooks are a HookChain, never None (about 2 us of
    a runner call's 8 on the H100). Where the installed launcher is a form of
    ``_C_LAUNCH_SOURCES`` its C launch is called as it calls it (no scratch to allocate), else the
    launcher. Where the installed Triton's runner is not one of ``_RUNNER_SOURCES`` the runner
    itself launches; so does every call while a launch hook is registered (a profiler): the runner gives
    the hook its metadata."""
    import triton
    from triton import knobs

    runner = compiled[(programs, 1, 1)]  # also loads the kernel on the current device

    def through_runner(start, end, slot, row_width, batch_size):
        runner(start, end, counters, slot, row_width, batch_size, _ROW_CHECK_BLOCK)

    through_runner.direct = "runner"  # (tests read which launch it is)
    if _source_digest(type(compiled).__getitem__) not in _RUNNER_SOURCES:
        return through_runner
    get_stream, runtime = triton.runtime.driver.active.get_current_stream, knobs.runtime
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    # Addresses as ints, as the launcher reads them from a tensor's data_ptr(): the counters' is
    # fixed (about 0.2 us less per pointer than a tensor, on the H100). Triton checks no int: the
    # key (both tensors' devices) keeps a host tensor off.
    counters_at = counters.data_ptr()
    form = _c_launch_form(launcher)
    c_launch = cooperative = pdl = annotations = signature = None
    if form:
        c_launch, cooperative, pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    if form == "3.8":
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature

    def launch(start, end, slot, row_width, batch_size):
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
            runner(start, end, counters, slot, row_width, batch_size, _ROW_CHECK_BLOCK)
            return
        stream = get_stream(device)
        if form == "3.6":
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, None, None, metadata, None,
                     None, None, start.data_ptr(), end.data_ptr(), counters_at, slot, row_width,
                     batch_size, _ROW_CHECK_BLOCK)  # fmt: skip
        elif form == "3.8":
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, metadata, None, None, None,
                     None, None, annotations, signature,
                     (start.data_ptr(), end.data_ptr(), counters_at, slot, row_width, batch_size,
                      _ROW_CHECK_BLOCK))  # fmt: skip
        else:
            launcher(programs, 1, 1, stream, function, metadata, None, None, None,
                     start.data_ptr(), end.data_ptr(), counters_at, slot, row_width, batch_size,
                     _ROW_CHECK_BLOCK)  # fmt: skip

    launch.direct = form or "launcher"  # (tests read which launch it is)
    return launch


def _new_launch(start_offset, end_offset, slot: int, row_width: int, batch_size: int, key: tuple) -> None:
    """The first row check of a key: Triton's JIT launch (compiles the kernel once per process);
    the compiled kernel's launch is kept for the key's later calls."""
    counters = _counters(end_offset.device)
    current, programs = key[2], key[5]
    compiled = _row_check_kernel()[(programs,)](
        start_offset, end_offset, counters, slot, row_width, batch_size, BLOCK=_ROW_CHECK_BLOCK
    )
    # Under TRITON_INTERPRET (the CPU tier) there is no compiled kernel: every call takes the
    # JIT path.
    if row_width < _INT32_LIMIT and callable(getattr(compiled, "__getitem__", None)):
        _LAUNCHES[key] = _direct_launch(compiled, programs, current, counters)


def _check_rows(site: Site, req_to_token, start_offset, end_offset, batch_size) -> None:
    """Columns of [start, end) at or past the row end, per row, accumulated on the device.

    The kernel writes (reads) columns [start, end) of row req_pool_indices[i] for i < batch_size,
    at ``req_to_token + row * width + col`` (0.5.14 triton_ops/cache_locs.py:15-46), so every
    column >= width is a cell of a later row. A row with start >= end touches nothing.
    This runs on every decode step (twice): each line here is host time (watch_overhead.py).
    """
    if type(batch_size) is not int:  # sglang passes an int; a tensor's value is never read
        batch_size = end_offset.shape[0] if hasattr(batch_size, "data_ptr") else int(batch_size)
    if batch_size > end_offset.shape[0] or batch_size > start_offset.shape[0]:
        batch_size = min(start_offset.shape[0], end_offset.shape[0])
    if batch_size <= 0:
        return
    on_cuda = end_offset.is_cuda
    if not (start_offset.is_contiguous() and end_offset.is_contiguous()):  # the kernel reads stride 1
        start_offset, end_offset = start_offset.contiguous(), end_offset.contiguous()
    row_width = req_to_token.shape[1]
    if site.width is None:
        site.width = row_width
    # Both tensors' devices: the cached launch passes their addresses as ints, which Triton's
    # launcher does not check (a host tensor's would be read on the GPU); a new key takes the JIT
    # path, which refuses a tensor it cannot reach. The current device too: Triton loads (and
    # launches) the kernel there, as sglang launches the kernel it watches, whatever the tensors'
    # device (CompiledKernel._init_handles).
    key = (
        start_offset.device,
        end_offset.device,
        (_cuda() and _CURRENT_DEVICE()) if on_cuda else None,
        start_offset.dtype,
        end_offset.dtype,
        -(-batch_size // _ROW_CHECK_BLOCK),
    )
    launch = _LAUNCHES.get(key) if row_width < _INT32_LIMIT else None
    if launch is not None:  # the whole counters tensor and the site's row number: no view made per call
        # Also while a CUDA graph is captured: the graph then checks the rows of each replay,
        # into counters that live as long as the process (``reset`` zeroes them in place).
        launch(start_offset, end_offset, site.slot, row_width, batch_size)
    elif not (on_cuda and _cuda().is_current_stream_capturing()):  # (no compiling into a capture)
        _new_launch(start_offset, end_offset, site.slot, row_width, batch_size, key)


def _row_hook(site: Site, batch_size_at: int):
    last = max(3, batch_size_at)

    def watch_rows(original_fn, *args, **kwargs):
        if site.failed is None:
            try:
                if len(args) > last:  # positional, as sglang calls them: no lookups by name
                    _check_rows(site, args[1], args[2], args[3], args[batch_size_at])
                else:
                    _check_rows(
                        site,
                        _arg(args, kwargs, 1, "req_to_token"),
                        _arg(args, kwargs, 2, "start_offset"),
                        _arg(args, kwargs, 3, "end_offset"),
                        _arg(args, kwargs, batch_size_at, "batch_size"),
                    )
            except Exception as exc:  # never break sglang
                _fail(site, exc)
        return original_fn(*args, **kwargs)

    return watch_rows


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
    if kind.batch_size_at is not None:
        return _row_hook(site, kind.batch_size_at)
    return _replay_hook(site, kind.replay_check)


# --------------------------------------------------------------------------------------------
# The report (and by_kind, for /metrics): the only places that read device counters.


def _read_device_counters(read=None) -> list[list[int]]:
    """[rows, columns, max end] per device slot, summed (max for the end) over devices.
    ``read(device, counters)``: the values as a list (None: ``tolist()``, which waits for them)."""
    totals = [[0, 0, 0] for _ in range(MAX_DEVICE_SITES)]
    for device, counters in list(_DEVICE_COUNTERS.items()):
        for slot, (rows, columns, end) in enumerate(read(device, counters) if read else counters.tolist()):
            totals[slot][0] += rows
            totals[slot][1] += columns
            totals[slot][2] = max(totals[slot][2], end)
    return totals


def _site_counts(read=None):
    """(site, count, columns, needed) per hooked site; ``read`` as for ``_read_device_counters``."""
    device = _read_device_counters(read) if _DEVICE_COUNTERS else None
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
