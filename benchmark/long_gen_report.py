"""Pool the control-group figures of one or more ``dsa_eagle_long_gen.py`` JSONL files.

Pairs each variant's control reps with its baseline's (``bench_common.BASELINE``: the fixes and the
A/A control ``none2`` with pristine ``none``, the watch with ``plugin``; the same round of reps,
same file), pools the tok/s ratios over the files, and prints the median, p10 - p90 and a
seeded bootstrap 95 % interval of the median (``bench_common.ratio_summary``, the code the
benchmark itself reports with). ``--plot PNG`` draws per-rep tok/s per variant and the ratios
(needs matplotlib: ``pip install matplotlib``). Rows of a ``--smoke`` run (``"smoke": true``, no
engine ran) are pooled only with each other, and every line then says so.

    python benchmark/long_gen_report.py docs/gpu-results/long-gen-engine-s2-run3.jsonl ... [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_common import plot, pooled


def load_runs(paths) -> list:
    """One {variant: row} per file (a file is one benchmark run)."""
    runs = []
    for path in paths:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        runs.append((Path(path).name, {row["variant"]: row for row in rows}))
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "jsonl", nargs="+", help="JSONL files written by dsa_eagle_long_gen.py --output-file (one run each)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="PNG", help="write a PNG here (per-rep tok/s, ratios; needs matplotlib)"
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    runs = load_runs(args.jsonl)
    smoke = {bool(row.get("smoke")) for _, rows in runs for row in rows.values()}
    if smoke == {True, False}:
        print("long_gen_report: will not pool rows of a --smoke run with measured ones", file=sys.stderr)
        return 2
    tag = "SMOKE (no engine ran, not a figure): " if True in smoke else ""
    summaries = pooled(runs)
    for name, s in summaries.items():
        low, high = s["median_ci95"]
        print(
            f"{tag}{name}/{s['baseline']} over {len(s['per_rep'])} paired reps: median {s['median']:.3f} "
            f"[p10 {s['p10']:.3f}, p90 {s['p90']:.3f}], bootstrap 95 % CI of the median "
            f"{low:.3f} - {high:.3f}, ratio of medians {s['of_medians']:.3f}"
        )
    if args.plot:
        try:
            plot(runs, summaries, args.plot)
        except ImportError:
            print("long_gen_report: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
