"""Pool the control-group figures of one or more ``dsa_eagle_long_gen.py`` JSONL files.

Pairs each fixed variant's control reps with pristine's (the same round of reps, same file),
pools the fixed / pristine tok/s ratios over the files, and prints the median, p10 - p90 and a
seeded bootstrap 95 % interval of the median (``dsa_eagle_long_gen.ratio_summary``, the code the
benchmark itself reports with). ``--plot PNG`` draws per-rep tok/s per variant and the ratios
(needs matplotlib: ``pip install matplotlib``).

    python benchmark/long_gen_report.py docs/gpu-results/long-gen-engine-s2-run3.jsonl ... [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsa_eagle_long_gen import per_rep_throughput, ratio_summary


def load_runs(paths) -> list:
    """One {variant: row} per file (a file is one benchmark run)."""
    runs = []
    for path in paths:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        runs.append((Path(path).name, {row["variant"]: row for row in rows}))
    return runs


def pooled(runs) -> dict:
    """variant -> ratio_summary over every (fixed, pristine) pair of reps in every run."""
    pairs = {}
    for _, rows in runs:
        pristine = rows.get("none")
        for name, row in rows.items():
            if pristine is not None and name != "none":
                pairs.setdefault(name, []).extend(zip(per_rep_throughput(row), per_rep_throughput(pristine)))
    return {name: ratio_summary(p) for name, p in pairs.items() if p}


def plot(runs, summaries, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    offset = 0
    for label, rows in runs:
        for name, row in rows.items():
            rates = per_rep_throughput(row)
            top.plot(range(offset, offset + len(rates)), rates, marker="o", label=f"{name} ({label})")
        n = max((len(per_rep_throughput(r)) for r in rows.values()), default=0)
        offset += n
    top.set_ylabel("control output tok/s")
    top.legend(fontsize=7)
    position = 0
    for name, summary in summaries.items():
        ratios = summary["per_rep"]
        bottom.plot(range(position, position + len(ratios)), ratios, marker="s", label=f"{name} / none")
        low, high = summary["median_ci95"]
        bottom.axhspan(low, high, alpha=0.15, label=f"bootstrap 95 % CI of the median {low:.3f} - {high:.3f}")
        bottom.axhline(summary["median"], linestyle="--", label=f"median {summary['median']:.3f}")
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("fixed / pristine")
    bottom.set_xlabel("control rep (runs laid end to end)")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--plot", type=Path, help="write a PNG here")
    args = parser.parse_args(argv)
    runs = load_runs(args.jsonl)
    summaries = pooled(runs)
    for name, s in summaries.items():
        low, high = s["median_ci95"]
        print(
            f"{name}/none over {len(s['per_rep'])} paired reps: median {s['median']:.3f} "
            f"[p10 {s['p10']:.3f}, p90 {s['p90']:.3f}], bootstrap 95 % CI of the median "
            f"{low:.3f} - {high:.3f}, ratio of medians {s['of_medians']:.3f}"
        )
    if args.plot:
        plot(runs, summaries, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
