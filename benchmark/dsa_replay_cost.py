"""Cost of one TARGET_VERIFY CUDA-graph replay update, pristine vs fixed, in the same run.

The fix makes the graph page_table ``req_to_token.shape[1]`` wide instead of
``context_length + D`` (4 more columns): this measures what that costs on the replay hot path,
below the boundary where both work. The real backend's ``init_forward_metadata_out_graph``
(what the cuda-graph runner calls before each ``graph.replay()``) is timed with CUDA events
and with the host clock, pristine and fixed interleaved (A B A B ...) over rotated inputs,
after a warm-up; kernel launches per update are counted with torch.profiler. ``--output-file``
(bench_serving's flag; ``--json`` is the old name) appends the result as one JSON line with the
sglang version, this tool's version and git commit and the UTC date. torch and sglang are
imported after the arguments are parsed: ``--help`` needs neither.

``--smoke`` (CI, no GPU) runs the same code on CPU with tiny sizes (``TRITON_INTERPRET=1``, as the
CPU test tier has it): context_length 256, bs 2, 3 updates; no CUDA events and no profiler, so
its row says ``"smoke": true`` and holds no timing (null): only the buffer widths and bytes.

    python benchmark/dsa_replay_cost.py [--context-length 163840] [--iters 400] [--output-file FILE]
    python benchmark/dsa_replay_cost.py --smoke [--output-file FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_common import add_output_file_argument, append_jsonl, jsonl_row

# --smoke: the sizes of the CPU run (CI), small enough for Triton's interpreter.
SMOKE_SIZES = {"context_length": 256, "bs": 2, "iters": 3, "warmup": 1, "rotate": 2}


def quantiles(values):
    q = statistics.quantiles(values, n=20)
    return {"median": statistics.median(values), "p5": q[0], "p95": q[-1]}


def count_launches(update) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--context-length", type=int, default=163840, help="the model's context_length (default 163840)"
    )
    parser.add_argument(
        "--speculative-num-draft-tokens", type=int, default=5, help="D, draft tokens per verify (default 5)"
    )
    parser.add_argument("--page-size", type=int, default=64, help="KV page size (default 64)")
    parser.add_argument("--bs", type=int, default=8, help="batch size of the captured graph (default 8)")
    parser.add_argument("--iters", type=int, default=400, help="timed updates per variant (>= 200)")
    parser.add_argument(
        "--warmup", type=int, default=50, help="untimed updates per variant first (default 50)"
    )
    parser.add_argument("--rotate", type=int, default=16, help="distinct input batches cycled")
    add_output_file_argument(parser, "--json", what="run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run on CPU (Triton interpreter): context_length 256, bs 2, 3 updates; the "
        'row says "smoke": true and holds no timing',
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
        for name, value in SMOKE_SIZES.items():
            setattr(args, name, value)
    try:
        import torch
    except ImportError:
        print("dsa_replay_cost: needs torch" + ("" if args.smoke else " with a CUDA device"), file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("dsa_replay_cost: needs a CUDA device (--smoke: a CPU run for CI)", file=sys.stderr)
        return 2
    on_cuda = not args.smoke

    from sglang_dsa_fix import runtime_fix, width
    from sglang_dsa_fix.proof import replay

    _, backend_cls = replay.import_backend_class()
    if backend_cls is None:
        print("dsa_replay_cost: no DSA / NSA backend in the installed sglang", file=sys.stderr)
        return 2
    case = replay.Case(
        args.context_length,
        args.speculative_num_draft_tokens,
        args.page_size,
        args.bs,
        "cuda" if on_cuda else "cpu",
    )
    sessions = {"pristine": replay.GraphSession(backend_cls, case)}
    runtime_fix.install_page_table_fix(backend_cls)
    try:
        sessions["fixed"] = replay.GraphSession(backend_cls, case)
    finally:
        runtime_fix.uninstall_page_table_fix(backend_cls)
    mode, bs = "TARGET_VERIFY", args.bs
    # Inputs below the boundary (both variants must succeed), rotated so no two consecutive
    # updates copy the same rows.
    batches = []
    for i in range(args.rotate):
        seq_len = case.context_len - 1 - 97 * i
        idx, seq_lens, accept = replay.batch_for(case, mode, bs, seq_len)
        batches.append((idx.roll(i), seq_lens, accept))

    def update(session, i):
        idx, seq_lens, accept = batches[i % len(batches)]
        session._run(mode, bs, seq_lens, idx, accept, in_capture=False)

    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    for session in sessions.values():
        session.capture(mode, bs)
        for i in range(args.warmup):
            update(session, i)
        check = session.replay(mode, bs, case.context_len - 1)
        assert check.ok, check
    sync()

    gpu_ms = {name: [] for name in sessions}
    host_us = {name: [] for name in sessions}
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(args.iters):
        for name, session in sessions.items():
            sync()
            t0 = time.perf_counter()
            if on_cuda:
                start.record()
            update(session, i)
            if on_cuda:
                end.record()
                end.synchronize()
            host_us[name].append((time.perf_counter() - t0) * 1e6)
            if on_cuda:
                gpu_ms[name].append(start.elapsed_time(end))

    ratios_host = [f / p for f, p in zip(host_us["fixed"], host_us["pristine"])]
    result = jsonl_row(
        {
            "benchmark": "dsa_replay_cost",
            **({"smoke": True, "device": "cpu"} if args.smoke else {}),
            "gpu": torch.cuda.get_device_name() if on_cuda else None,
            "torch": torch.__version__,
            "sglang": __import__("sglang").__version__,
            "context_length": case.context_len,
            "speculative_num_draft_tokens": case.num_draft_tokens,
            "page_size": case.page_size,
            "bs": bs,
            "iters": args.iters,
            "warmup": args.warmup,
            "rotated_inputs": args.rotate,
        }
    )
    for name, session in sessions.items():
        table = width.graph_page_table(session.backend)
        launches = count_launches(lambda session=session: update(session, 0)) if on_cuda else None
        result[name] = {
            "page_table_width": table.shape[1],
            "page_table_bytes": table.numel() * table.element_size(),
            "kernel_launches_per_update": launches,
            "gpu_us": {k: v * 1000 for k, v in quantiles(gpu_ms[name]).items()} if on_cuda else None,
            "host_us": quantiles(host_us[name]),
        }
    result["page_table_bytes_difference"] = (
        result["fixed"]["page_table_bytes"] - result["pristine"]["page_table_bytes"]
    )
    if on_cuda:
        ratios_gpu = [f / p for f, p in zip(gpu_ms["fixed"], gpu_ms["pristine"])]
        result["ratio_fixed_over_pristine_gpu"] = quantiles(ratios_gpu)
    else:
        result["ratio_fixed_over_pristine_gpu"] = None
    result["ratio_fixed_over_pristine_host"] = quantiles(ratios_host)
    report(result, case, args, list(sessions))
    if args.output_file:
        append_jsonl(args.output_file, [without_timings(result, sessions) if args.smoke else result])
    return 0


def without_timings(result: dict, names) -> dict:
    """A smoke row: CPU times of a 3-update run are no figure, so the row holds none (null)."""
    row = {**result, "ratio_fixed_over_pristine_host": None}
    for name in names:
        row[name] = {**result[name], "host_us": None}
    return row


def report(result: dict, case, args, names) -> None:
    """The run as a table on stdout (what the GPU tier keeps as replay_cost.txt)."""
    where = "SMOKE RUN on CPU (Triton interpreter; timings are not figures)" if args.smoke else result["gpu"]
    print(
        f"TARGET_VERIFY replay update, {where}, sglang {result['sglang']}, torch "
        f"{result['torch']}: context_length {case.context_len}, D {case.num_draft_tokens}, page "
        f"{case.page_size}, bs {result['bs']}, {args.iters} interleaved updates each, {args.rotate} rotated "
        "inputs"
    )
    print(
        f"{'variant':<9} {'width':>8} {'page_table bytes':>17} {'launches':>8} "
        f"{'GPU us p50 [p5, p95]':>26} {'host us p50 [p5, p95]':>26}"
    )
    for name in names:
        r = result[name]
        g, h = r["gpu_us"], r["host_us"]
        gpu = f"{g['median']:>9.2f} [{g['p5']:.2f}, {g['p95']:.2f}]" if g else f"{'-':>9}"
        launches = "-" if r["kernel_launches_per_update"] is None else r["kernel_launches_per_update"]
        print(
            f"{name:<9} {r['page_table_width']:>8} {r['page_table_bytes']:>17} {launches:>8} "
            f"{gpu}{h['median']:>12.1f} [{h['p5']:.1f}, {h['p95']:.1f}]"
        )
    rg, rh = result["ratio_fixed_over_pristine_gpu"], result["ratio_fixed_over_pristine_host"]
    gpu = f"GPU {rg['median']:.4f} [{rg['p5']:.4f}, {rg['p95']:.4f}], " if rg else ""
    print(
        f"fixed/pristine per interleaved pair: {gpu}host {rh['median']:.4f} [{rh['p5']:.4f}, "
        f"{rh['p95']:.4f}]; page_table +{result['page_table_bytes_difference']} bytes"
    )


if __name__ == "__main__":
    sys.exit(main())
