"""The family watch's row check (``watch.py``): how many rows of a ``req_to_token`` writer or
reader reach past the row end, counted on the device, with no host synchronisation.

One launch of a small Triton kernel per call (Triton like the sglang kernels it watches), adding
into an int64 tensor on the tensors' own device; nothing is read back (no ``.item()``, no
``bool()`` of a device tensor). One launch because the host time matters: the eager form (a dozen
torch ops) cost about 190 us per call on the H200 (benchmark/watch_overhead.py,
docs/gpu-results.md). Only the watch's report reads ``DEVICE_COUNTERS``.
"""

from __future__ import annotations

from typing import Optional

MAX_DEVICE_SITES = 8
DEVICE_COUNTERS: dict = {}  # torch.device -> int64 [MAX_DEVICE_SITES, 3]: rows, columns, max end


def reset() -> None:
    """Zero every counter and forget the cached launches (tests and benchmarks only)."""
    # In place: a CUDA graph that captured a row check holds its device's counters' address (on
    # the current stream: a replay on another stream at the same time is not ordered with it).
    for counters in DEVICE_COUNTERS.values():
        counters.zero_()
    _LAUNCHES.clear()


def _counters(device):
    import torch

    counters = DEVICE_COUNTERS.get(device)
    if counters is None:  # once per device: an allocation, no synchronisation
        counters = torch.zeros((MAX_DEVICE_SITES, 3), dtype=torch.int64, device=device)
        DEVICE_COUNTERS[device] = counters
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
    at start-up). For rows i < batch_size, with end = end[i] + end_add (a reader that reads
    start + N: end is start, end_add N): past = max(0, end - max(start[i], width)); adds
    (rows with past > 0, sum of past) to counters[slot, 0:2] and raises counters[slot, 2] to max(end)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        # No specialisation on the ints (a new batch size or the other site's slot must not
        # compile a new variant in the middle of serving) nor on the pointers' alignment (a
        # cached launcher must fit any view of the offsets).
        @triton.jit(
            do_not_specialize=["slot", "row_width", "batch_size", "end_add"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr", "counters_ptr"],
        )
        def row_check(
            start_ptr, end_ptr, counters_ptr, slot, row_width, batch_size, end_add, BLOCK: tl.constexpr
        ):
            site_counters = counters_ptr + slot * 3  # the site's row of [MAX_DEVICE_SITES, 3]
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < batch_size
            start = tl.load(start_ptr + offsets, mask=inside, other=0).to(tl.int64)
            end = tl.load(end_ptr + offsets, mask=inside, other=0).to(tl.int64) + end_add
            past = tl.where(inside, tl.maximum(end - tl.maximum(start, row_width), 0), 0)
            tl.atomic_add(site_counters, tl.sum((past > 0).to(tl.int64), axis=0))
            tl.atomic_add(site_counters + 1, tl.sum(past, axis=0))
            tl.atomic_max(site_counters + 2, tl.max(tl.where(inside, end, 0), axis=0))

        _KERNEL = row_check
    return _KERNEL


def _direct_launch(compiled, programs: int, device: Optional[int], counters):
    """launch(start, end, slot, row_width, batch_size, end_add) of the compiled kernel into ``counters``,
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

    def through_runner(start, end, slot, row_width, batch_size, end_add):
        runner(start, end, counters, slot, row_width, batch_size, end_add, _ROW_CHECK_BLOCK)

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

    def launch(start, end, slot, row_width, batch_size, end_add):
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
            runner(start, end, counters, slot, row_width, batch_size, end_add, _ROW_CHECK_BLOCK)
            return
        stream = get_stream(device)
        if form == "3.6":
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, None, None, metadata, None,
                     None, None, start.data_ptr(), end.data_ptr(), counters_at, slot, row_width,
                     batch_size, end_add, _ROW_CHECK_BLOCK)  # fmt: skip
        elif form == "3.8":
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, metadata, None, None, None,
                     None, None, annotations, signature,
                     (start.data_ptr(), end.data_ptr(), counters_at, slot, row_width, batch_size,
                      end_add, _ROW_CHECK_BLOCK))  # fmt: skip
        else:
            launcher(programs, 1, 1, stream, function, metadata, None, None, None,
                     start.data_ptr(), end.data_ptr(), counters_at, slot, row_width, batch_size,
                     end_add, _ROW_CHECK_BLOCK)  # fmt: skip

    launch.direct = form or "launcher"  # (tests read which launch it is)
    return launch


def _new_launch(
    start_offset, end_offset, slot: int, row_width: int, batch_size: int, end_add: int, key: tuple
) -> None:
    """The first row check of a key: Triton's JIT launch (compiles the kernel once per process);
    the compiled kernel's launch is kept for the key's later calls."""
    counters = _counters(end_offset.device)
    current, programs = key[2], key[5]
    compiled = _row_check_kernel()[(programs,)](
        start_offset, end_offset, counters, slot, row_width, batch_size, end_add, BLOCK=_ROW_CHECK_BLOCK
    )
    # Under TRITON_INTERPRET (the CPU tier) there is no compiled kernel: every call takes the
    # JIT path. An int at or past 2**31 is an int64 argument of another compiled form: never cached.
    if (
        row_width < _INT32_LIMIT
        and -_INT32_LIMIT <= end_add < _INT32_LIMIT
        and callable(getattr(compiled, "__getitem__", None))
    ):
        _LAUNCHES[key] = _direct_launch(compiled, programs, current, counters)


def check(site, req_to_token, start_offset, end_offset, batch_size, end_add: int = 0) -> None:
    """Columns of [start, end + end_add) at or past the row end, per row, accumulated on the
    device into ``site.slot``'s counters (``site.width`` records the width at the first check).

    The kernel writes (reads) columns [start, end) of row req_pool_indices[i] for i < batch_size,
    at ``req_to_token + row * width + col`` (0.5.14 triton_ops/cache_locs.py:15-46), so every
    column >= width is a cell of a later row. A row with start >= end touches nothing. A reader
    of a fixed N columns from start has no end tensor: pass start as ``end_offset`` and N.
    This runs on every decode step (twice): each line here is host time (watch_overhead.py).
    """
    if type(batch_size) is not int:  # sglang passes an int, or a tensor of one per row: its length
        if hasattr(batch_size, "data_ptr"):  # (a tensor's value is never read: a host sync)
            batch_size = batch_size.shape[0] if batch_size.dim() else end_offset.shape[0]
        else:
            batch_size = int(batch_size)
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
    small = row_width < _INT32_LIMIT and -_INT32_LIMIT <= end_add < _INT32_LIMIT
    launch = _LAUNCHES.get(key) if small else None
    if launch is not None:  # the whole counters tensor and the site's row number: no view made per call
        # Also while a CUDA graph is captured: the graph then checks the rows of each replay,
        # into counters that live as long as the process (``reset`` zeroes them in place).
        launch(start_offset, end_offset, site.slot, row_width, batch_size, end_add)
    elif not (on_cuda and _cuda().is_current_stream_capturing()):  # (no compiling into a capture)
        _new_launch(start_offset, end_offset, site.slot, row_width, batch_size, end_add, key)
