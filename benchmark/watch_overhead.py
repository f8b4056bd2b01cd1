"""Cost of the family watch (``SGLANG_DSA_FIX_WATCH=1``) on one decode step, hook by hook.

An end-to-end A/B of the watch cannot resolve a 2 % goal on one GPU command: the long-gen
benchmark's A/A pilot spreads 10 % per paired rep (docs/gpu-results.md). So this measures what
the watch adds where it runs: each hook the watch puts around a real sglang function, timed
against that function alone, interleaved (A B A B ...), with the host clock around whole blocks
that end in ``torch.cuda.synchronize()`` (what the hook adds to the GPU queue counts too):

- ``row_write``: the watch around sglang's own ``assign_req_to_token_pool_func`` (its Triton
  kernel writes the decode reservation into req_to_token), once per decode step;
- ``row_read``: around ``assign_extend_cache_locs_func`` (verify reads its slots back), once
  per verify;
- ``dsa_replay``: around the DSA backend's ``_apply_cuda_graph_metadata`` (a host-side check on
  seq_lens_cpu), timed against a call that does nothing with the same signature (the real
  method needs a captured graph): per CUDA-graph replay (target_verify, draft_extend and the
  draft-decode steps).

Per decode step the watch then adds ``row_write + row_read + replays x dsa_replay`` of host
time (``--replays-per-step``, default steps + 1); ``--step-ms`` (a measured decode step) turns it
into a share. It is host time, an upper bound: with the overlap scheduler the host prepares the
next batch while the GPU runs, so it costs throughput only where the host is the bottleneck. torch and sglang are imported
after the arguments are parsed: ``--help`` needs neither. Runs on CPU too (Triton interpreter;
slow): ``--smoke`` is that run for CI, with tiny sizes (batch 2, context 64, steps 1, 2 blocks of
1 call); its row says ``"smoke": true`` and holds no timing (null), only the hooks' targets.

    python benchmark/watch_overhead.py [--batch-size 4] [--context-length 1024] [--speculative-num-steps 5]
        [--step-ms 10.6] [--output-file FILE]
    python benchmark/watch_overhead.py --smoke [--output-file FILE]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time

from bench_common import add_output_file_argument, append_jsonl, jsonl_row

# --smoke: the sizes of the CPU run (CI), small enough for Triton's interpreter.
SMOKE_SIZES = {"batch_size": 2, "context_length": 64, "speculative_num_steps": 1, "calls": 1, "blocks": 2}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4, help="requests per decode step (default 4)")
    parser.add_argument("--context-length", type=int, default=1024, help="context_length (default 1024)")
    parser.add_argument(
        "--speculative-num-steps", type=int, default=5, help="EAGLE steps, topk 1: D = steps + 1 (default 5)"
    )
    parser.add_argument(
        "--replays-per-step",
        type=int,
        default=None,
        help="CUDA-graph replays per decode step the replay check runs on (default steps + 1)",
    )
    parser.add_argument("--calls", type=int, default=500, help="calls per timed block (default 500)")
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per variant (default 20)")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="a measured decode step in ms, to state the watch's share of it (default: not stated)",
    )
    add_output_file_argument(parser, what="run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run on CPU (Triton interpreter): batch 2, context 64, steps 1, 2 blocks of 1 "
        'call; the row says "smoke": true and holds no timing',
    )
    return parser


def _resolve(target: str):
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # Class.method
        module, _, owner = module.rpartition(".")
        return getattr(getattr(importlib.import_module(module), owner), name)


def _candidate(watch, version: str, kind: str):
    return next(c for c in watch.select(version, resolve=False) if c.kind == kind)


def _timed_blocks(variants: dict, calls: int, blocks: int, sync) -> dict:
    """Microseconds per call, per block, per variant; variants interleaved block by block."""
    per_call = {name: [] for name in variants}
    for _ in range(blocks):
        for name, call in variants.items():
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
    device = "cuda" if on_cuda else "cpu"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)

    from sglang_dsa_fix import watch
    from sglang_dsa_fix.proof import replay

    version = replay.installed_version()
    bs, C, steps = args.batch_size, args.context_length, args.speculative_num_steps
    D = steps + 1
    width = C + 4 + 2 * D  # any width: the check's cost does not depend on it
    pool = torch.zeros((bs + 1, width), dtype=torch.int32, device=device)
    rows = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    start = torch.full((bs,), C - 2 * D, dtype=torch.int64, device=device)
    end = start + 2 * D
    out_cache_loc = torch.arange(bs * 2 * D, dtype=torch.int64, device=device)

    results = {}
    for kind, arguments in (
        (watch.ROW_WRITE, (rows, pool, start, end, out_cache_loc, bs)),
        (watch.ROW_READ, (rows, pool, start, start + D, bs, D, device)),
    ):
        candidate = _candidate(watch, version, kind)
        original = _resolve(candidate.target)
        hook = watch._HOOK_FACTORIES[kind](watch.Site(kind, candidate.target, candidate.buffer))
        variants = {
            "plain": lambda o=original, a=arguments: o(*a),
            "watched": lambda h=hook, o=original, a=arguments: h(o, *a),
        }
        for call in variants.values():  # warm-up: Triton compiles, the counters are allocated
            call()
        results[kind] = {
            "target": candidate.target,
            **_summary(_timed_blocks(variants, args.calls, args.blocks, sync)),
        }
        watch.reset()

    # The replay check: host arithmetic on seq_lens_cpu; the real method needs a captured graph,
    # so both variants call a no-op with its signature.
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    candidate = _candidate(watch, version, watch.DSA_REPLAY)
    real = _resolve(candidate.target)
    noop = functools.wraps(real)(lambda *a, **k: None)  # inspect.signature follows __wrapped__
    backend = type("Backend", (), {})()
    backend.speculative_num_draft_tokens = D
    backend.req_to_token = pool
    backend.decode_cuda_graph_metadata = {
        bs: type("Metadata", (), {"page_table_1": torch.zeros((bs * D, width), dtype=torch.int32)})()
    }
    seq_lens_cpu = torch.full((bs,), C - 2 * D, dtype=torch.int64)
    replay_args = (backend, bs, rows, start, seq_lens_cpu, ForwardMode.TARGET_VERIFY, None)
    hook = watch._HOOK_FACTORIES[watch.DSA_REPLAY](
        watch.Site(watch.DSA_REPLAY, candidate.target, candidate.buffer)
    )
    variants = {"plain": lambda: noop(*replay_args), "watched": lambda: hook(noop, *replay_args)}
    for call in variants.values():
        call()
    results[watch.DSA_REPLAY] = {
        "target": candidate.target,
        **_summary(_timed_blocks(variants, args.calls, args.blocks, lambda: None)),
    }
    watch.reset()

    replays = args.replays_per_step if args.replays_per_step is not None else steps + 1
    per_step_us = (
        results[watch.ROW_WRITE]["added_us_median"]
        + results[watch.ROW_READ]["added_us_median"]
        + replays * results[watch.DSA_REPLAY]["added_us_median"]
    )
    row = jsonl_row(
        {
            "benchmark": "watch_overhead",
            **({"smoke": True} if args.smoke else {}),
            "device": torch.cuda.get_device_name() if on_cuda else "cpu",
            "torch": torch.__version__,
            "batch_size": bs,
            "context_length": C,
            "speculative_num_steps": steps,
            "speculative_num_draft_tokens": D,
            "replays_per_step": replays,
            "calls_per_block": args.calls,
            "blocks": args.blocks,
            "hooks": results,
            "added_us_per_decode_step": per_step_us,
            "step_ms": args.step_ms,
            "share_of_step": per_step_us / (args.step_ms * 1000) if args.step_ms else None,
        }
    )
    for kind, r in results.items():
        print(
            f"{kind:10s} {r['target']}: {r['plain_us_median']:.1f} us alone, {r['watched_us_median']:.1f} us "
            f"watched -> +{r['added_us_median']:.1f} us per call (blocks: {r['added_us_min']:.1f} .. "
            f"{r['added_us_max']:.1f})"
        )
    share = (
        f" = {100 * row['share_of_step']:.2f} % of a {args.step_ms} ms decode step" if args.step_ms else ""
    )
    print(
        f"per decode step (1 row write, 1 row read, {replays} replays; bs {bs}, D {D}): "
        f"+{per_step_us:.1f} us of host time{share}"
    )
    if args.smoke:
        print("SMOKE RUN on CPU (Triton interpreter): the times above are not figures")
    if args.output_file:
        append_jsonl(args.output_file, [without_timings(row) if args.smoke else row])
    return 0


def without_timings(row: dict) -> dict:
    """A smoke row: a CPU run of 2 calls is no figure, so the row holds no time (null)."""
    hooks = {
        kind: {"target": r["target"], **{k: None for k in r if k != "target"}}
        for kind, r in row["hooks"].items()
    }
    return {**row, "hooks": hooks, "added_us_per_decode_step": None, "share_of_step": None}


if __name__ == "__main__":
    raise SystemExit(main())
