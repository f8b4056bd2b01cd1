"""Cost of the family watch (``SGLANG_DSA_FIX_WATCH=1``) on one decode step, hook by hook.

An end-to-end A/B of the watch cannot resolve a 1 % goal on one GPU command: the long-gen
benchmark's A/A pilot spreads 10 % per paired rep (docs/gpu-results.md). So this measures what
the watch adds where it runs, and divides it by a decode step measured in the same run:

1. Every hook the watch installs on this release (``watch.select``) that the backend under test
   calls, called through sglang's HookRegistry wrapper and timed against sglang's own function,
   interleaved (A B, B A, ...), with the host clock around whole blocks that end in
   ``torch.cuda.synchronize()`` (what the hook adds to the GPU queue counts too):
   - ``row_write``: around ``assign_req_to_token_pool_func`` (its Triton kernel writes the decode
     reservation into req_to_token);
   - ``row_read``: around ``assign_extend_cache_locs_func`` (verify reads its slots back);
   - ``uniform_row_read`` (0.5.17+): around ``assign_extend_cache_locs_uniform_func`` (EAGLE's
     verify read, called by keyword as sglang calls it);
   - ``draft_slot_read`` (0.5.23+): around ``assign_draft_cache_locs_contiguous_func`` (EAGLE's
     draft slot read, topk 1, D columns, positional as sglang calls it);
   - the backend's replay check (``dsa_replay`` or ``triton_replay``): around the real backend's
     replay method, repeating one real TARGET_VERIFY replay of ``bs`` requests
     (``watch_replay_calls.py``).
2. A real decode step of the same configuration (``decode_step.py``): a pristine ``sglang.Engine``
   on the tiny model of that backend, ``bs`` requests at once, the median gap between streamed
   chunks; the same engine counts how often each watched function runs per step
   (``hook_calls.py``).

Per decode step the watch adds sum over kinds of (calls per step x added us per call) of host
time, and ``share_of_step`` is that over the measured step. A watched function the engine
calls that no timing here covers is listed under ``untimed_calls`` and fails the run (exit 1).
Host time is an upper bound: with the overlap scheduler the host prepares the next batch while
the GPU runs, so it costs throughput only where the host is the bottleneck.

torch and sglang are imported after the arguments are parsed: ``--help`` needs neither.
``--smoke`` (CI, CPU, Triton interpreter): tiny sizes (batch 2, context 64, steps 1, 2 blocks of
1 call), the same hook timing code on the real backends, the engine's configuration built but
no engine started; its rows say ``"smoke": true`` and hold no timing (null).

    python benchmark/watch_overhead.py [--backend dsa|triton] [--batch-sizes 4 32] [--context-length 1024]
        [--speculative-num-steps 5] [--max-new-tokens 384] [--output-file FILE]
    python benchmark/watch_overhead.py --smoke [--backend triton] [--output-file FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import decode_step
from bench_common import add_output_file_argument, append_jsonl, jsonl_row

# --smoke: the sizes of the CPU run (CI), small enough for Triton's interpreter.
SMOKE_SIZES = {"batch_sizes": [2], "context_length": 64, "speculative_num_steps": 1, "calls": 1, "blocks": 2}
REPLAY_KIND = {"dsa": "dsa_replay", "triton": "triton_replay"}  # members/page_table.py, graph_table.py


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_step.add_arguments(parser)
    parser.add_argument("--calls", type=int, default=500, help="calls per timed block (default 500)")
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks per variant (default 40)")
    add_output_file_argument(parser, what="batch size")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run on CPU (Triton interpreter): batch 2, context 64, steps 1, 2 blocks of 1 "
        'call, no engine; the rows say "smoke": true and hold no timing',
    )
    return parser


def _timed_blocks(variants: dict, calls: int, blocks: int, sync) -> dict:
    """Microseconds per call, per block, per variant; variants interleaved block by block, their
    order reversed every other block (A B, B A, A B, ...): a variant that always ran second
    would carry whatever running second does to a block (the 17:25 UTC H200 run of
    docs/gpu-results.md saw +-7 us between variants that differ by a no-op call)."""
    per_call = {name: [] for name in variants}
    order = list(variants.items())
    for block in range(blocks):
        for name, call in order if block % 2 == 0 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            sync()
            per_call[name].append((time.perf_counter() - t0) * 1e6 / calls)
    return per_call


def _summary(per_call: dict) -> dict:
    plain, watched = per_call["plain"], per_call["watched"]
    added = [w - p for w, p in zip(watched, plain)]
    return {
        "plain_us_median": statistics.median(plain),
        "watched_us_median": statistics.median(watched),
        "added_us_median": statistics.median(added),
        "added_us_min": min(added),
        "added_us_max": max(added),
        "plain_us_per_block": plain,
        "watched_us_per_block": watched,
    }


def _time_hook(watch, candidate, original, args, kwargs, context, settings) -> dict:
    """One hook around sglang's function, against that function alone, on the same arguments.
    The hook is called as a server calls it: through the wrapper sglang's HookRegistry puts in
    the function's place (hook_registry._wrap_fn, AROUND; 0.5.13 - 0.5.23 :386-392)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    site = watch.Site(candidate.kind, candidate.target, candidate.buffer, slot=0)
    wrapped = _wrap_fn(original, watch._hook(watch.kinds()[candidate.kind], site), HookType.AROUND)
    variants = {
        "plain": lambda: original(*args, **kwargs),
        "watched": lambda: wrapped(*args, **kwargs),
    }
    with context():
        for call in variants.values():  # warm-up: Triton compiles, the counters are allocated
            call()
        if site.width is None or site.failed:  # returned early: the time would not be the check's
            raise RuntimeError(f"the {candidate.kind} check did not reach its comparison ({site.failed})")
        timed = _timed_blocks(variants, settings.calls, settings.blocks, settings.sync)
    watch.reset()
    return {"target": candidate.target, **_summary(timed)}


def _row_calls(torch, bs: int, C: int, D: int, device: str) -> dict:
    """(args, kwargs) sglang passes the row writer (decode reservation 2D) and readers (verify, D;
    draft, topk 1 x D)."""
    width = C + 4 + 2 * D  # any width: the check's cost does not depend on it
    pool = torch.zeros((bs + 1, width), dtype=torch.int32, device=device)
    rows = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    start = torch.full((bs,), C - 2 * D, dtype=torch.int64, device=device)
    out_cache_loc = torch.arange(bs * 2 * D, dtype=torch.int64, device=device)
    uniform = dict(
        req_pool_indices=rows,
        req_to_token=pool,
        start_offset=start,
        batch_size=bs,
        draft_token_num=D,
        device=device,
    )
    return {
        "row_write": ((rows, pool, start, start + 2 * D, out_cache_loc, bs), {}),
        "row_read": ((rows, pool, start, start + D, bs, D, device), {}),
        "uniform_row_read": ((), uniform),
        "draft_slot_read": ((rows, pool, start, out_cache_loc, 1, D), {}),
    }


def time_hooks(args, bs: int, settings) -> dict:
    """{kind: timing} of the hooks the backend calls, each on its real sglang function."""
    import contextlib
    import pkgutil

    import watch_replay_calls

    from sglang_dsa_fix import watch

    torch, device = settings.torch, settings.device
    candidates = {c.kind: c for c in watch.select(settings.version, resolve=False)}
    C, D = args.context_length, args.speculative_num_steps + 1
    results = {}
    for kind, (arguments, keywords) in _row_calls(torch, bs, C, D, device).items():
        if kind not in candidates:  # a reader this release does not have
            continue
        original = pkgutil.resolve_name(candidates[kind].target)
        results[kind] = _time_hook(
            watch, candidates[kind], original, arguments, keywords, contextlib.nullcontext, settings
        )
    replay = candidates[REPLAY_KIND[args.backend]]
    original, replay_args, replay_kwargs, context = watch_replay_calls.REPLAYS[args.backend](
        replay.target, bs, C, D, device
    )
    results[replay.kind] = _time_hook(watch, replay, original, replay_args, replay_kwargs, context, settings)
    return results


def per_step(hooks: dict, installed: list, step: dict | None) -> dict:
    """The watch's host time per decode step from the timed hooks and the engine's call counts."""
    if step is None:
        return {"added_us_per_decode_step": None, "share_of_step": None, "untimed_calls": None}
    calls = step["calls_per_step"]
    if not set(hooks) <= set(calls):  # the counting plugin did not run in the scheduler: unknown
        return {"added_us_per_decode_step": None, "share_of_step": None, "untimed_calls": None}
    untimed = {kind: n for kind, n in calls.items() if n and kind not in hooks}
    added = sum(calls.get(kind, 0) * timing["added_us_median"] for kind, timing in hooks.items())
    share = added / (step["step_ms"] * 1000) if step["step_ms"] else None
    return {"added_us_per_decode_step": added, "share_of_step": share, "untimed_calls": untimed}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
        for name, value in SMOKE_SIZES.items():
            setattr(args, name, value)
    try:
        import torch
    except ImportError:
        print("watch_overhead: needs torch", file=sys.stderr)
        return 2
    on_cuda = torch.cuda.is_available() and not args.smoke
    if not on_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
    from types import SimpleNamespace

    from sglang_dsa_fix import watch
    from sglang_dsa_fix.proof import replay

    settings = SimpleNamespace(
        torch=torch,
        device="cuda" if on_cuda else "cpu",
        sync=torch.cuda.synchronize if on_cuda else (lambda: None),
        version=replay.installed_version(),
        calls=args.calls,
        blocks=args.blocks,
    )
    installed = [c.kind for c in watch.select(settings.version)]
    hooks = {bs: time_hooks(args, bs, settings) for bs in args.batch_sizes}
    steps, error = measure_steps(args, on_cuda, settings)
    rows = [
        row_for(args, bs, hooks[bs], installed, steps.get(bs), settings, torch, on_cuda)
        for bs in args.batch_sizes
    ]
    for row in rows:
        report(row)
    if args.smoke:
        print("SMOKE RUN on CPU (Triton interpreter, no engine): the times above are not figures")
    uncounted = [r["batch_size"] for r in rows if r["decode_step"] and r["share_of_step"] is None]
    if uncounted and not error and not args.smoke:
        error = f"no call counts from the engine at bs {uncounted} (the counting plugin did not run there)"
    if error:
        print(f"watch_overhead: the decode step was not measured: {error}", file=sys.stderr)
    if args.output_file:
        append_jsonl(
            args.output_file, [without_timings(r) if args.smoke else {**r, "error": error} for r in rows]
        )
    return 1 if error or any(r["untimed_calls"] for r in rows) else 0


def measure_steps(args, on_cuda: bool, settings) -> tuple:
    """({bs: step}, error): the engine's decode steps. On CPU (no engine) its configuration is
    built, and the counting plugin counts one real row write through sglang's HookRegistry."""
    import decode_step

    from sglang_dsa_fix import watch

    with tempfile.TemporaryDirectory(prefix="watch-overhead-") as work:
        if on_cuda:
            try:
                return decode_step.measure(args.backend, args, Path(work)), None
            except Exception as exc:  # the hooks' timings are still worth their row
                return {}, f"{type(exc).__name__}: {exc}"
        model = decode_step.write_model(
            Path(work) / "model", args.context_length, decode_step.MODELS[args.backend]
        )
        decode_step.engine_config(args.backend, args, model)  # what a rename could break
        bs, D = args.batch_sizes[0], args.speculative_num_steps + 1
        write, _ = _row_calls(settings.torch, bs, args.context_length, D, "cpu")["row_write"]
        target = next(c.target for c in watch.select(settings.version) if c.kind == "row_write")
        settings.counted = decode_step.counted_once(Path(work), target, write)
        return {}, None


def row_for(args, bs: int, hooks: dict, installed: list, step, settings, torch, on_cuda: bool) -> dict:
    D = args.speculative_num_steps + 1
    return jsonl_row(
        {
            "benchmark": "watch_overhead",
            **({"smoke": True} if args.smoke else {}),
            "backend": args.backend,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu",
            "torch": torch.__version__,
            "batch_size": bs,
            "context_length": args.context_length,
            "speculative_num_steps": args.speculative_num_steps,
            "speculative_num_draft_tokens": D,
            "calls_per_block": args.calls,
            "blocks": args.blocks,
            "installed_hooks": installed,
            "hooks": hooks,
            "decode_step": step,
            **per_step(hooks, installed, step),
            **({"smoke_counted_calls": settings.counted} if args.smoke else {}),
        }
    )


def report(row: dict) -> None:
    calls = (row["decode_step"] or {}).get("calls_per_step", {})
    for kind, r in row["hooks"].items():
        print(
            f"bs {row['batch_size']} {kind:16s} {r['target']}: {r['plain_us_median']:.1f} us alone, "
            f"{r['watched_us_median']:.1f} us watched -> {r['added_us_median']:+.1f} us per call (blocks: "
            f"{r['added_us_min']:.1f} .. {r['added_us_max']:.1f}); {calls.get(kind, '?')} calls per step"
        )
    if row["decode_step"] and row["share_of_step"] is not None:
        step = row["decode_step"]
        print(
            f"bs {row['batch_size']} {row['backend']}: decode step {step['step_ms']:.2f} ms (median of "
            f"{step['step_gaps']} gaps, {step['steps']} steps); the watch {row['added_us_per_decode_step']:+.1f} "
            f"us of host time = {100 * row['share_of_step']:.2f} % of it"
        )
    if row["untimed_calls"]:
        print(f"bs {row['batch_size']}: watched functions called but not timed: {row['untimed_calls']}")


def without_timings(row: dict) -> dict:
    """A smoke row: a CPU run of 2 calls is no figure, so the row holds no time (null)."""
    hooks = {
        kind: {"target": r["target"], **{k: None for k in r if k != "target"}}
        for kind, r in row["hooks"].items()
    }
    return {**row, "hooks": hooks, "added_us_per_decode_step": None, "share_of_step": None}


if __name__ == "__main__":
    raise SystemExit(main())
