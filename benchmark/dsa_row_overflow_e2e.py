"""Bug #2 end to end: the spec-v2 decode reservation writes into the next request's row.

The real engine on the tiny dummy-weight DSA model of ``long_gen_worker.py``: EAGLE topk 1,
steps 7 / D 8, ``SGLANG_SIMULATE_ACC_LEN=1`` (one token per verify: kv_committed_len reaches the
bound), context 256, two concurrent requests (prompts 100 and 20, max_new_tokens unset,
ignore_eos). A benchmark-only plugin (``row_observer.py``) watches every row write and the next
row's first columns; it does not depend on any fix. Variants, each in its own process:

  bug1_only  in-tree patch of bug #1 only (a copy of the installed sglang; its row sizing file
             put back): what a deployment fixed for the crash alone runs
  plugin     this package's plugin (both fixes), sglang untouched
  apply      the in-tree patch of both bugs, on a copy

With ``--server`` the plugin variant runs under ``launch_server`` instead, and the run also
reads ``/server_info`` (stored whole as the row's ``server_info``, as bench_serving does) and
``sglang-dsa-fix status --url`` from it. One JSON line per variant (``--output-file``, bench_serving's
flag; ``--jsonl`` is the old name), each with the sglang version, this tool's version and git
commit and the UTC date.

``--case llama-ngram-page1`` is the same two-request run on the case that needs no draft model and
no DSA, for releases past 0.5.16 (their row is wide enough at page > 1 only): a tiny dummy-weight
Llama (``tiny_llama_model.json``), triton attention, page size 1, NGRAM at its defaults (D 12,
topk 10, steps 1; reservation 2 * 12 per decode), one token per verify. There bug #1 is fixed
upstream, so ``bug1_only`` is the pristine release.
Exit 0 only if bug1_only writes past the row end into a live neighbour and no fixed variant
writes past the row end, and every request completes.

    python benchmark/dsa_row_overflow_e2e.py [--variants bug1_only,plugin,apply] [--server]

``--smoke`` (CI, no GPU) runs all of it but the engine: every variant is prepared (the patched
copies, the plugin and observer sites), its worker process builds the model and the engine's
arguments (and, with --server, the launch_server command line) and lists the plugin entry points
its PYTHONPATH makes visible, then reports that no request ran. The rows say ``"smoke": true``
and hold no tokens; the verdict is printed but not judged. Exit 0 when every worker answered and
saw the observer plugin (and the plugin variants this package's):

    python benchmark/dsa_row_overflow_e2e.py --smoke [--case llama-ngram-page1] [--output-file FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench_common import (
    REPO,
    WorkDir,
    WorkDirError,
    add_output_file_argument,
    append_jsonl,
    fail_work_dir,
    fetch_server_info,
    install_entry_point,
    install_plugin,
    jsonl_row,
    private_work_dir,
    run_metadata,
)
from long_gen_worker import (
    ServerClient,
    dummy_model_kwargs,
    engine_kwargs,
    server_command,
    variant_env,
    write_model,
)
from row_observer import observe

VARIANTS = ("bug1_only", "plugin", "apply", "plugin_off")
# plugin_off: the plugin installed with its kill switch (SGLANG_DSA_FIX=0): no fix, the watch
# (SGLANG_DSA_FIX_WATCH=1 in the caller's environment) still counts. Not in the default set.
DEFAULT_VARIANTS = VARIANTS[:3]
# The variants that must show the bug (the others must not).
UNFIXED = ("bug1_only", "plugin_off")
CASES = ("dsa-eagle", "llama-ngram-page1")
PLUGIN_GROUP = "sglang.srt.plugins"
OBSERVER_ENTRY_POINT = "dsa_row_observer"
LLAMA_CONFIG = Path(__file__).with_name("tiny_llama_model.json")


def prepare(variant: str, work: WorkDir) -> dict:
    """PYTHONPATH for a variant; the observer plugin is on it for every variant."""
    from sglang_dsa_fix import snapshot, source_patch
    from sglang_dsa_fix import tree as trees

    observer = work / "observer-site"
    if not observer.exists():
        install_entry_point(
            observer,
            OBSERVER_ENTRY_POINT,
            "0",
            [REPO / "benchmark" / "row_observer.py"],
            f"{OBSERVER_ENTRY_POINT} = row_observer:register",
        )
    paths = [str(observer)]
    # In-tree variants keep our plugin inert should an install of it be visible anyway.
    env = {"SGLANG_DSA_FIX": "1" if variant == "plugin" else "0"}
    if variant in ("bug1_only", "apply"):
        copy = work / f"{variant}-site"
        shutil.copytree(
            trees.find_tree(None).package, copy / "sglang", ignore=shutil.ignore_patterns("__pycache__")
        )
        outcome = source_patch.apply(trees.find_tree(str(copy)))
        if variant == "bug1_only":  # put the row sizing file back as it was
            row = next(s for s in outcome.states if s.bug.value == "req_to_token_row")
            backup = snapshot.backup_path(row.site.path)
            shutil.move(backup, row.site.path)
        paths.insert(0, str(copy))
    else:  # plugin, plugin_off
        site = work / "plugin-site"
        if not site.exists():
            install_plugin(site)
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
    return env


def long_gen_args(args) -> SimpleNamespace:
    """The long-generation benchmark's settings object, for its engine and server helpers."""
    return SimpleNamespace(
        context_length=args.context_length,
        speculative_num_steps=args.speculative_num_steps,
        concurrency=2,
        port=args.port,
        start_timeout=args.start_timeout,
    )


def llama_ngram_page1_kwargs(args, model: Path) -> dict:
    """sglang.Engine arguments of the page-1 case (0.5.17 ServerArgs names). NGRAM's D, topk and
    steps are left to sglang's defaults (arg_groups/speculative_hook.py _handle_ngram)."""
    return dict(
        **dummy_model_kwargs(model, args.context_length),
        speculative_algorithm="NGRAM",
        attention_backend="triton",
        page_size=1,
        sampling_backend="pytorch",
        cuda_graph_max_bs_decode=2,
        max_running_requests=2,
        max_total_tokens=16384,
        mem_fraction_static=0.5,
        disable_flashinfer_autotune=True,
        log_level="info",
    )


def worker(args) -> int:
    """One variant in its own process: two requests, then the outputs as one JSON line."""
    settings = long_gen_args(args)
    if args.case == "llama-ngram-page1":
        model = write_model(Path(args.model_dir), args.context_length, LLAMA_CONFIG)
        kwargs = llama_ngram_page1_kwargs(args, model)
    else:
        model = write_model(Path(args.model_dir), args.context_length)
        kwargs = engine_kwargs(settings, model)
    if args.metrics_wait is not None:
        kwargs["enable_metrics"] = True
    prompts = [[200 + i % 1000 for i in range(n)] for n in (100, 20)]
    params = [{"max_new_tokens": None, "ignore_eos": True, "temperature": 0} for _ in prompts]
    out = {"variant": args.worker}
    if args.smoke:
        # No engine: what a rename could break up to its start, and no request.
        if args.server:
            out["launch_server"] = server_command(kwargs, args.port)[1:]
        out["smoke"] = True
        out["plugins"] = sorted({e.name for e in importlib.metadata.entry_points(group=PLUGIN_GROUP)})
        results = [{"meta_info": {"completion_tokens": 0, "finish_reason": None}} for _ in prompts]
    elif args.server:
        import requests

        client = ServerClient(settings, model, sys.stderr, kwargs)
        try:
            base = f"http://127.0.0.1:{args.port}"
            body = {"input_ids": prompts, "sampling_params": params}  # one batch: both run together
            results = requests.post(f"{base}/generate", json=body, timeout=args.generate_timeout).json()
            info = fetch_server_info(base)
            out["server_info"] = info  # whole, as bench_serving stores it
            out["server_info_sglang_dsa_fix"] = [
                s.get("sglang_dsa_fix") for s in (info or {}).get("internal_states", [])
            ]
            status = subprocess.run(
                [sys.executable, "-m", "sglang_dsa_fix", "status", "--url", base],
                capture_output=True,
                text=True,
                timeout=60,
            )
            out["status_url"] = {
                "exit_code": status.returncode,
                "stdout": status.stdout,
                "stderr": status.stderr,
            }
            if args.metrics_wait is not None:
                out["metrics"] = scrape_dsa_fix_metrics(requests, base, args.metrics_wait)
        finally:
            client.process.terminate()
            client.process.wait(timeout=60)
    else:
        import sglang

        engine = sglang.Engine(**kwargs)
        results = engine.generate(input_ids=prompts, sampling_params=params)
        engine.shutdown()
    out["requests"] = request_summaries(prompts, results)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def scrape_dsa_fix_metrics(requests, base: str, wait: float) -> list:
    """The plugin's series on sglang's /metrics, after ``wait`` seconds: sglang logs its stats
    (and the plugin writes its series) every 30 s idle, and the device counters arrive one stats
    call late (sglang_dsa_fix.metrics)."""
    time.sleep(wait)
    text = requests.get(f"{base}/metrics", timeout=30).text
    return [line for line in text.splitlines() if line.startswith("sglang:dsa_fix_")]


def request_summaries(prompts, results) -> list:
    """Per request: prompt length, completion tokens and finish reason from the engine's output."""
    return [
        {
            "prompt_len": len(p),
            "completion_tokens": r["meta_info"]["completion_tokens"],
            "finish_reason": r["meta_info"]["finish_reason"],
        }
        for p, r in zip(prompts, results)
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)}; plugin_off = the "
        "plugin with its kill switch, for the watch)",
    )
    parser.add_argument(
        "--context-length", type=int, default=256, help="the engine's context_length (default 256)"
    )
    parser.add_argument(
        "--speculative-num-steps",
        type=int,
        default=7,
        help="EAGLE steps of the dsa-eagle case, topk 1, D = steps + 1 (default 7)",
    )
    parser.add_argument("--case", choices=CASES, default=CASES[0], help="model and speculative algorithm")
    parser.add_argument("--server", action="store_true", help="run the plugin variants under launch_server")
    parser.add_argument("--port", type=int, default=30123, help="--server: the server's port (default 30123)")
    parser.add_argument(
        "--start-timeout", type=float, default=420, help="--server: seconds for the server to get healthy"
    )
    parser.add_argument(
        "--generate-timeout", type=float, default=300, help="--server: seconds for the /generate request"
    )
    parser.add_argument(
        "--metrics-wait",
        type=float,
        metavar="SECONDS",
        help="--server: launch with --enable-metrics and, this long after the requests, keep the plugin's "
        "series from /metrics in the row (65: two idle stats calls)",
    )
    parser.add_argument(
        "--variant-timeout", type=float, default=540, help="seconds for one variant's whole process"
    )
    add_output_file_argument(parser, "--jsonl", what="variant")
    parser.add_argument(
        "--logs",
        help="keep the variants' logs in a new private directory under this one (default: the run's temp dir)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run without a GPU: every variant prepared and its worker run up to the engine, "
        'which does not start; rows say "smoke": true, hold no tokens, the verdict is not judged',
    )
    parser.add_argument(
        "--worker", metavar="VARIANT", help="internal: run one variant in this process (the parent passes it)"
    )
    parser.add_argument(
        "--model-dir", help="internal, with --worker: where to write the tiny model's config.json"
    )
    return parser


def build_row(variant: str, args, server: bool, rc, wall_s: float, result: dict, logs: Path, metadata=None):
    """A variant's JSONL row: provenance and, for the variant under launch_server, its whole
    /server_info (bench_common.jsonl_row), then the worker's result and the observer's log."""
    result = dict(result)
    server_info = result.pop("server_info", None)
    fields = {
        "variant": variant,
        **({"smoke": True} if getattr(args, "smoke", False) else {}),
        "case": args.case,
        "server": server,
        "rc": rc,
        "wall_s": wall_s,
        **result,
        **observe(logs / f"{variant}.rows.jsonl"),
    }
    log = logs / f"{variant}.log"
    log_text = log.read_text(errors="replace") if log.exists() else ""
    fields["plugin_lines"] = [x.strip() for x in log_text.splitlines() if "sglang-dsa-fix" in x][:6]
    return jsonl_row(fields, server_info=server_info if server else None, metadata=metadata)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {','.join(VARIANTS)}")
    try:  # --logs first: refused, it leaves no empty run directory behind
        logs = private_work_dir("dsa-row-e2e-logs-", args.logs) if args.logs else None
        work = private_work_dir("dsa-row-e2e-")
    except WorkDirError as exc:
        return fail_work_dir(parser.prog, exc)
    logs = logs or work
    rows = []
    metadata = run_metadata()
    for variant in variants:
        env = {
            **os.environ,
            **variant_env(args),
            **prepare(variant, work),
            "SGLANG_SIMULATE_ACC_LEN": "1",
            "ROW_OBSERVER_LOG": str(logs / f"{variant}.rows.jsonl"),
        }
        server = args.server and variant in ("plugin", "plugin_off")
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--model-dir",
            str(work / "model"),
            "--context-length",
            str(args.context_length),
            "--speculative-num-steps",
            str(args.speculative_num_steps),
            "--case",
            args.case,
            "--port",
            str(args.port),
            "--start-timeout",
            str(args.start_timeout),
            "--generate-timeout",
            str(args.generate_timeout),
        ] + (["--server"] if server else [])
        if server and args.metrics_wait is not None:
            cmd += ["--metrics-wait", str(args.metrics_wait)]
        if args.smoke:
            cmd.append("--smoke")
        began = time.perf_counter()
        with logs.open(f"{variant}.log", "w") as log:  # O_NOFOLLOW through the directory's fd
            try:
                proc = subprocess.run(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.variant_timeout
                )
                stdout, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                stdout, rc = exc.stdout or "", "timeout"
        result = next((json.loads(x[7:]) for x in (stdout or "").splitlines() if x.startswith("RESULT ")), {})
        wall_s = round(time.perf_counter() - began, 1)
        row = build_row(variant, args, server, rc, wall_s, result, logs, metadata)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "server_info"}), flush=True)
        if args.output_file:
            append_jsonl(args.output_file, [row])
    if args.smoke:
        verdict(rows, judged=False)
        return smoke_verdict(rows)
    return verdict(rows)


def smoke_verdict(rows) -> int:
    """--smoke: every worker answered, saw the observer plugin and (plugin variants) this package's."""
    from sglang_dsa_fix.plugin import ENTRY_POINT_NAMES

    ok = True
    for row in rows:
        want = {OBSERVER_ENTRY_POINT} | (
            {ENTRY_POINT_NAMES[0]} if row["variant"].startswith("plugin") else set()
        )
        seen = set(row.get("plugins") or [])
        answered = row["rc"] == 0 and row.get("requests") is not None
        print(f"{row['variant']:>10}: smoke worker answered {answered}, plugin entry points {sorted(seen)}")
        ok = ok and answered and want <= seen
    print("SMOKE RUN: no engine ran, nothing above is a result; the pipeline", "ran" if ok else "FAILED")
    return 0 if ok else 1


def verdict(rows, judged: bool = True) -> int:
    ok = True
    for row in rows:
        completed = [r for r in row.get("requests", []) if (r["finish_reason"] or {}).get("type") == "length"]
        print(
            f"{row['variant']:>10}: rc {row['rc']}, {len(completed)}/2 completed, row width {row['row_width']}, "
            f"furthest write end {row['furthest_end']}, past row end {len(row['past_row_end'])} writes, "
            f"neighbour rows changed {len(row['neighbour_changed'])}"
        )
        if len(completed) != 2:
            ok = False
        corrupted = bool(row["past_row_end"]) and bool(row["neighbour_changed"])
        if row["variant"] in UNFIXED and not corrupted:
            ok = False
        if row["variant"] not in UNFIXED and (
            row["past_row_end"] or row["neighbour_changed"] or not row["row_writes"]
        ):
            ok = False
    if not judged:
        print("RESULT: not judged (--smoke: no engine ran)")
        return 0
    print("RESULT:", "as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
