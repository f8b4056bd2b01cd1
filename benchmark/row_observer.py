"""An SGLang plugin for the bug #2 benchmark only: watch every spec-v2 ``req_to_token`` row write.

It does not depend on any fix: an AROUND hook on ``assign_req_to_token_pool_func`` (0.5.13 -
0.5.15 ``speculative/spec_utils.py``, 0.5.16+ ``mem_cache/allocation.py``) records, per call and
per request row, the row width, the [start, end) written, and whether the first columns of the
next row changed across the call. One JSON line per call to ``$ROW_OBSERVER_LOG``.

``dsa_row_overflow_e2e.py`` installs it (alone: it imports nothing from benchmark/) and reads the
log with ``observe``; run as a script, it summarizes a log:

    python benchmark/row_observer.py VARIANT.rows.jsonl

``--smoke`` (CI, no GPU) registers the hook as the plugin does, applies it with sglang's
``HookRegistry.apply_hooks`` and calls the real writer once on a tiny CPU pool (Triton's
interpreter), one row written within its row and one 2 columns past it into the next row; it
prints the log's summary with ``"smoke": true`` and exits 1 unless the observer saw exactly that:

    python benchmark/row_observer.py --smoke [LOG]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def _hook(original, req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size, *rest):
    rows = req_pool_indices[:batch_size].tolist()
    width = req_to_token.shape[1]
    starts, ends = start[:batch_size].tolist(), end[:batch_size].tolist()
    # The columns a row could spill into: as many as the reservation can pass the row end.
    spill = max(1, max(ends, default=0) - width)
    neighbours = [r + 1 for r in rows if r + 1 < req_to_token.shape[0]]
    before = {r: req_to_token[r, :spill].tolist() for r in neighbours}
    result = original(req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size, *rest)
    after = {r: req_to_token[r, :spill].tolist() for r in neighbours}
    line = {
        "pid": os.getpid(),
        "width": width,
        "writes": [{"row": r, "start": s, "end": e} for r, s, e in zip(rows, starts, ends)],
        "past_row_end": [{"row": r, "columns": e - width} for r, e in zip(rows, ends) if e > width],
        "neighbour_changed": [
            {"row": r, "before": before[r], "after": after[r]} for r in neighbours if before[r] != after[r]
        ],
    }
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC  # never through a link
    with os.fdopen(os.open(os.environ["ROW_OBSERVER_LOG"], flags, 0o600), "a") as handle:
        handle.write(json.dumps(line) + "\n")
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dsa_fix.proof.row_overflow import writer_module

    module = writer_module()
    HookRegistry.register(f"{module.__name__}.assign_req_to_token_pool_func", _hook, HookType.AROUND)


def observe(log: Path) -> dict:
    """A log's summary: writes, row width, furthest end, writes past the row end, changed neighbours."""
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    writes = [w for line in lines for w in line["writes"]]
    return {
        "row_writes": len(writes),
        "row_width": lines[0]["width"] if lines else None,
        "furthest_end": max((w["end"] for w in writes), default=None),
        "past_row_end": [p for line in lines for p in line["past_row_end"]],
        "neighbour_changed": [c for line in lines for c in line["neighbour_changed"]],
    }


# --smoke: rows 0 and 1 of a 3 x 8 pool; row 1's write ends 2 columns into row 2.
SMOKE_WIDTH = 8
SMOKE_WRITES = ((0, 0, 4), (1, 4, SMOKE_WIDTH + 2))  # (row, start, end)


def smoke(log: Path) -> int:
    """The hook as the engine runs it (registered, applied by sglang) around the real writer."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
    os.environ["ROW_OBSERVER_LOG"] = str(log)
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsa_fix.proof.row_overflow import writer_module

    register()
    HookRegistry.apply_hooks()
    rows, starts, ends = (torch.tensor(column, dtype=torch.int64) for column in zip(*SMOKE_WRITES))
    pool = torch.zeros((3, SMOKE_WIDTH), dtype=torch.int32)
    out_cache_loc = torch.arange(100, 100 + int((ends - starts).sum()), dtype=torch.int64)
    writer_module().assign_req_to_token_pool_func(rows, pool, starts, ends, out_cache_loc, len(SMOKE_WRITES))
    summary = observe(log)
    print(json.dumps({"smoke": True, **summary}, indent=2))
    expected = {
        "row_writes": len(SMOKE_WRITES),
        "row_width": SMOKE_WIDTH,
        "furthest_end": SMOKE_WIDTH + 2,
        "past_row_end": [{"row": 1, "columns": 2}],
        "neighbour_rows_changed": [2],
    }
    seen = {**summary, "neighbour_rows_changed": [c["row"] for c in summary["neighbour_changed"]]}
    wrong = {k: seen[k] for k, v in expected.items() if seen[k] != v}
    if wrong:
        print(f"row_observer --smoke: the observer did not see the writes made: {wrong}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "log",
        type=Path,
        nargs="?",
        help="an observer log ($ROW_OBSERVER_LOG) to summarize as JSON (with --smoke: where the smoke "
        "run's log goes, default a temporary file)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run on CPU: the hook registered and applied through sglang's HookRegistry "
        "around the real writer, two tiny writes (one past its row); exit 1 unless both are seen",
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        if args.log:
            if args.log.exists():
                parser.error(f"--smoke writes a new log: {args.log} exists")
            return smoke(args.log)
        with tempfile.TemporaryDirectory(prefix="row-observer-smoke-") as work:
            return smoke(Path(work) / "smoke.rows.jsonl")
    if args.log is None:
        parser.error("the log to summarize is required (or --smoke)")
    print(json.dumps(observe(args.log), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
