"""Cost of ``sglang-dsa-fix status -- <launch line>`` against sglang's own ``import sglang.srt.server_args``.

Issue 27 (g): ``status --`` costs at most 2.5 x a fresh ``python -c "import sglang.srt.server_args"``
in the same interpreter. Both are whole processes, timed by the host clock from spawn to exit,
interleaved over ``--reps`` rounds (the order alternates: A B, B A, ...), with the same
environment (this checkout's ``python/`` first on PYTHONPATH, so its code is what runs):

- ``import``: ``<python> -c "import sglang.srt.server_args"`` (the target interpreter);
- ``status``: ``<this python> -m sglang_dsa_fix status --json [--python <python>] -- <launch line>``,
  the launch line of a tiny dummy-weight Llama (``tiny_llama_model.json``), NGRAM, triton
  attention, page 1 (``--case llama-ngram``); ``--case dsa-eagle`` is the tiny DeepSeek-V3.2
  (``tiny_dsa_model.json``), EAGLE 3/1/4, whose resolution also builds the DSA backend's graph
  state (bug #1's width) on CPU.

The row holds each rep's seconds, the medians, the ratio of the medians (the figure), the
paired per-round ratios (median, min, max: the spread) and the load average around the run (a
loaded machine slows both alike; interleaving and medians are what make the ratio usable). A
status exit code other than 0 / 1 (a verdict) fails the run.

``--smoke`` (CI) is one round of the llama case; its row says ``"smoke": true`` (one round on a
shared CI machine is no figure).

    python benchmark/status_cost.py [--reps 7] [--case llama-ngram] [--python PATH] [--output-file FILE]
    python benchmark/status_cost.py --smoke [--output-file FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import REPO, add_output_file_argument, append_jsonl, jsonl_row

GOAL = 2.5  # issue 27 (g): status -- <= 2.5 x sglang's own server_args import
BENCHMARK = Path(__file__).resolve().parent
CASES = {
    "llama-ngram": (
        "tiny_llama_model.json",
        ["--speculative-algorithm", "NGRAM", "--attention-backend", "triton", "--page-size", "1"],
    ),
    "dsa-eagle": (
        "tiny_dsa_model.json",
        [
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
            "--context-length",
            "2048",
        ],
    ),
}
IMPORT = "import sglang.srt.server_args"
TIMEOUT_S = 600


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--case", choices=sorted(CASES), default="llama-ngram", help="the launch line")
    parser.add_argument(
        "--python",
        default=None,
        help="the target interpreter (imports sglang; passed to status as --python); default: this one",
    )
    parser.add_argument("--gpu", default="h200", help="status --gpu (default h200: no nvidia-smi probe)")
    add_output_file_argument(parser, what="run")
    parser.add_argument("--smoke", action="store_true", help="CI: one round of the llama case")
    return parser


def timed(argv: list, env: dict) -> tuple:
    """(seconds, exit code, stdout, stderr) of one whole process."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return time.perf_counter() - started, done.returncode, done.stdout, done.stderr


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.reps, args.case = 1, "llama-ngram"
    target = args.python or sys.executable
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    model_json, launch = CASES[args.case]
    work = Path(tempfile.mkdtemp(prefix="status-cost-"))
    try:
        model = work / "model"
        model.mkdir()
        shutil.copyfile(BENCHMARK / model_json, model / "config.json")
        launch = ["--model-path", str(model), *launch, "--device", "cuda"]
        status_argv = [sys.executable, "-m", "sglang_dsa_fix", "status", "--json", "--gpu", args.gpu]
        if args.python:
            status_argv += ["--python", args.python]
        status_argv += ["--", *launch]
        runs = {"import": [target, "-c", IMPORT], "status": status_argv}
        seconds = {"import": [], "status": []}
        load_before = os.getloadavg()
        report = None
        for rep in range(args.reps):
            for name in ("import", "status") if rep % 2 == 0 else ("status", "import"):
                took, rc, out, err = timed(runs[name], env)
                if name == "import" and rc != 0:
                    print(
                        f"status_cost: `{IMPORT}` failed (exit {rc}): {err.strip()[-500:]}", file=sys.stderr
                    )
                    return 2
                if name == "status":
                    # 0 / 1 / 2 (a bug it cannot tell, e.g. NGRAM's topk 10 on Triton): a verdict;
                    # an error is exit 2 with "error" in the JSON.
                    report = json.loads(out) if out.strip().startswith("{") else {"error": err.strip()}
                    if rc not in (0, 1, 2) or "error" in report:
                        print(f"status_cost: status exited {rc}: {err.strip()[-500:]}", file=sys.stderr)
                        return 2
                seconds[name].append(took)
                print(f"rep {rep + 1}/{args.reps} {name}: {took:.2f} s", file=sys.stderr)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    paired = [s / i for s, i in zip(seconds["status"], seconds["import"])]
    ratio = medians["status"] / medians["import"]
    row = jsonl_row(
        {
            "benchmark": "status_cost",
            **({"smoke": True} if args.smoke else {}),
            "case": args.case,
            "reps": args.reps,
            "python": target,
            "import_command": [target, "-c", IMPORT],
            "status_command": status_argv[1:],
            "import_s": seconds["import"],
            "status_s": seconds["status"],
            "import_median_s": medians["import"],
            "status_median_s": medians["status"],
            "ratio_of_medians": ratio,
            "paired_ratio": spread(paired),
            "goal": GOAL,
            "within_goal": ratio <= GOAL,
            "status_basis": report.get("basis"),
            "resolved_with": report.get("resolved_with"),
            "exit_code": report.get("exit_code"),
            "cpu_count": os.cpu_count(),
            "loadavg_before": list(load_before),
            "loadavg_after": list(load_after),
        }
    )
    if args.output_file:
        append_jsonl(args.output_file, [row])
    label = "SMOKE RUN (one round; no figure): " if args.smoke else ""
    print(
        f"{label}status -- {args.case}: median {medians['status']:.2f} s, import sglang.srt.server_args "
        f"median {medians['import']:.2f} s, ratio {ratio:.2f} (paired per round {paired and min(paired):.2f}"
        f" - {paired and max(paired):.2f}; goal <= {GOAL})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
