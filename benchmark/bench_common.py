"""Helpers the benchmarks in benchmark/ share; run alone, it prints a JSONL row's provenance.

The JSONL row's provenance, bench_serving's figures, the --output-file flag, the progress-bar
policy, the paired-ratio statistics and plot, and the plugin install.

One module that the scripts import and that imports none of them (no import circle); stdlib only
at import time, so every script's ``--help`` works without torch or sglang. Run it to print the
provenance fields a row gets here (sglang and this tool's versions, git commit, UTC date):

    python benchmark/bench_common.py
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# sglang's serving benchmark ("bench_serving" below). It lives in sglang/benchmark/serving.py: in
# 0.5.23 `python -m sglang.bench_serving` still runs but warns (FutureWarning: "`sglang.bench_serving`
# is deprecated and will be removed in a future release; use `sglang.benchmark.serving` instead");
# releases from before the move have only the old module. The JSONL fields below follow its names
# and meanings (0.5.23: --output-file, --disable-tqdm, output_throughput, server_info).
BENCH_SERVING = (
    "python -m sglang.benchmark.serving (sglang 0.5.23 deprecates python -m sglang.bench_serving "
    "with a FutureWarning; older releases have only that)"
)


# ---------------------------------------------------------------------------- row provenance
def sglang_version():
    """The sglang version as pip reports it, read from the installed files without importing
    sglang (``sglang_dsa_fix.tree``); None where sglang (or this package) is not importable."""
    try:
        from sglang_dsa_fix import tree

        return tree.find_tree(None).version
    except Exception:  # noqa: BLE001 - ToolError (no sglang), ImportError (no sglang_dsa_fix)
        return None


def tool_version():
    """``sglang_dsa_fix.__version__``; None where the package is not importable."""
    try:
        from sglang_dsa_fix import __version__
    except ImportError:
        return None
    return __version__


def git_commit(repo: Path = REPO):
    """``git rev-parse HEAD`` of the checkout the benchmark runs from; None without git or
    outside a git checkout (an unpacked bundle on a GPU host)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def tool_source_sha256(repo: Path = REPO):
    """sha256 over this checkout's ``python/sglang_dsa_fix`` sources (path and bytes of every .py,
    sorted): which code ran, also where the checkout's ``.git`` lags or there is none (a copy of
    a working tree on a GPU host). None where the sources are not there."""
    package = repo / "python" / "sglang_dsa_fix"
    files = sorted(package.rglob("*.py"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def utc_now_iso(now: datetime.datetime | None = None) -> str:
    """The date as ISO 8601 in UTC, e.g. 2026-05-01T12:34:56+00:00."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.astimezone(datetime.timezone.utc).isoformat(timespec="seconds")


def run_metadata(now: datetime.datetime | None = None, repo: Path = REPO) -> dict:
    """The provenance every JSONL row carries."""
    return {
        "sglang_version": sglang_version(),
        "sglang_dsa_fix_version": tool_version(),
        "git_commit": git_commit(repo),
        "tool_source_sha256": tool_source_sha256(repo),
        "date": utc_now_iso(now),
    }


NO_SERVER = object()


def jsonl_row(fields: dict, server_info=NO_SERVER, metadata: dict | None = None) -> dict:
    """One JSONL row: the provenance (``run_metadata()`` unless given), then ``fields``. Where a
    server is used, pass its ``/server_info`` JSON (None where it could not be read): bench_serving
    stores that whole, under ``server_info``, so does this."""
    row = {**(run_metadata() if metadata is None else metadata), **fields}
    if server_info is not NO_SERVER:
        row["server_info"] = server_info
    return row


def fetch_server_info(base_url: str, timeout: float = 10):
    """``GET {base_url}/server_info`` as bench_serving reads it: the JSON on 200, else None (also
    None on a connection error or timeout, e.g. a server whose scheduler died)."""
    import requests

    try:
        response = requests.get(base_url + "/server_info", timeout=timeout)
    except requests.RequestException:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def append_jsonl(path, rows) -> None:
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------- bench_serving's figures
def output_throughput(total_output_tokens: int, duration: float) -> float:
    """bench_serving's ``output_throughput``: the output tokens of one run's completed requests
    over that run's duration (first request sent to last one done), in tok/s."""
    return total_output_tokens / duration if duration > 0 else 0.0


def itl_percentiles(itls) -> dict:
    """Median and p99 inter-token latency in ms, as bench_serving's ``median_itl_ms`` /
    ``p99_itl_ms`` (numpy's default linear interpolation = statistics' "inclusive" method)."""
    if len(itls) < 2:
        return {"p50": None, "p99": None}
    return {
        "p50": 1e3 * statistics.median(itls),
        "p99": 1e3 * statistics.quantiles(itls, n=100, method="inclusive")[98],
    }


# ---------------------------------------------------------------------------- flags
def add_output_file_argument(
    parser: argparse.ArgumentParser, *aliases: str, what: str = "run", extra: str = ""
) -> None:
    """``--output-file`` as bench_serving spells it (append JSONL), plus the script's old name."""
    old = f"; {', '.join(aliases)} is the old name" if aliases else ""
    parser.add_argument(
        "--output-file",
        *aliases,
        dest="output_file",
        metavar="FILE",
        help=f"append one JSON line per {what} to FILE (JSONL, as bench_serving's --output-file{old}){extra}",
    )


def add_disable_tqdm_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--disable-tqdm",
        action="store_true",
        help="no progress bars (as bench_serving's --disable-tqdm); they are off anyway when "
        "stderr is not a terminal, so a log file gets no carriage-return lines",
    )


def tqdm_disabled(disable_flag: bool, stream=None) -> bool:
    """Progress bars only for a person watching: off with --disable-tqdm or when stderr (where
    tqdm writes) is not a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(disable_flag) or not stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return True


# ---------------------------------------------------------------------------- paired-rep statistics
def per_rep_throughput(row) -> list:
    """Control output_throughput per rep; also from JSONL written before the bench_serving names."""
    return row.get("output_throughput_per_rep", row.get("control_tok_per_s")) or []


def bootstrap_median_ci(values, reps: int = 10000, seed: int = 0, level: float = 0.95):
    """Percentile bootstrap interval of the median (seeded: the same data gives the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    tail = (1 - level) / 2
    return medians[int(tail * reps)], medians[int((1 - tail) * reps) - 1]


# Each variant's control reps are paired with its baseline's, same round: the A/A control ``none2``
# (a second pristine engine) with ``none``, a fix with ``none``, the watch with the fix it runs
# beside (``plugin``; ``none`` when no plugin variant ran).
BASELINE = {"none2": "none", "plugin": "none", "apply": "none", "watch": "plugin"}


def baseline_of(name: str, present) -> str | None:
    base = BASELINE.get(name)
    if base == "plugin" and "plugin" not in present:
        base = "none"
    return base if base in present else None


def reps_for_precision(ratios, precision: float = 0.01) -> int | None:
    """Paired reps for the 95 % CI of the median ratio to be +-``precision`` wide, from these
    ratios' spread: the median of n normal log-ratios with sd s has standard error
    sqrt(pi / 2) * s / sqrt(n)."""
    if len(ratios) < 2:
        return None
    s = statistics.stdev(math.log(r) for r in ratios)
    return max(1, math.ceil((1.96 * math.sqrt(math.pi / 2) * s / math.log1p(precision)) ** 2))


def ratio_summary(pairs) -> dict:
    """variant / baseline tok/s over (variant, baseline) pairs of reps."""
    ratios = [f / p for f, p in pairs]
    deciles = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) > 1 else ratios * 9
    return {
        "per_rep": ratios,
        "median": statistics.median(ratios),
        "p10": deciles[0],
        "p90": deciles[8],
        "median_ci95": list(bootstrap_median_ci(ratios)),
        "of_medians": statistics.median(f for f, _ in pairs) / statistics.median(p for _, p in pairs),
        "log_ratio_sd": statistics.stdev(math.log(r) for r in ratios) if len(ratios) > 1 else None,
        "reps_for_1pct": reps_for_precision(ratios),
    }


def _log(x):
    return math.log(x) if x else None


def _r2(xs, ys) -> float | None:
    """Share of ys' variance a straight line in xs explains (None where either is constant)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
        return None
    return statistics.correlation(*zip(*pairs)) ** 2


def noise_breakdown(a_reps, b_reps) -> dict:
    """What the rep-to-rep noise of two identical engines (an A/A pair, rounds in order) is made of.

    Each rep is a control summary (output_throughput, itl_median_ms, stall_share, sm_clock_mhz).
    ``rep_log_sd``: the spread of one engine's rep throughput (log); ``common_mode_share``: the part
    of that variance the two engines share round by round (host or GPU drift; pairing cancels it);
    ``paired_log_sd``: the spread of log(a / b), what a paired ratio still carries. Then, over all
    reps of both, the share of the log-throughput variance explained by the steady decode speed
    (median inter-token gap), by stalls (share of streamed time in gaps > 5x the median) and by
    the mean SM clock during the rep.
    """
    n = min(len(a_reps), len(b_reps))
    a, b = a_reps[:n], b_reps[:n]
    la = [math.log(r["output_throughput"]) for r in a]
    lb = [math.log(r["output_throughput"]) for r in b]
    if n < 3:
        return {"reps": n}
    var = (statistics.variance(la) + statistics.variance(lb)) / 2
    both = a + b
    logs = la + lb
    return {
        "reps": n,
        "rep_log_sd": math.sqrt(var),
        "common_mode_share": statistics.covariance(la, lb) / var if var else None,
        "paired_log_sd": statistics.stdev(x - y for x, y in zip(la, lb)),
        # log gap: tok/s goes as 1 / gap, so its log is a straight line in the gap's log
        "r2_steady_speed": _r2([_log(r.get("itl_median_ms")) for r in both], logs),
        "r2_stalls": _r2([r.get("stall_share") for r in both], logs),
        "r2_sm_clock": _r2([r.get("sm_clock_mhz") for r in both], logs),
    }


def pooled(runs) -> dict:
    """variant -> ratio_summary (with its ``baseline``) over every (variant, baseline) pair of reps
    in every run; ``runs`` is a list of (label, {variant: row})."""
    pairs, bases = {}, {}
    for _, rows in runs:
        for name, row in rows.items():
            base = baseline_of(name, rows)
            if base is not None:
                bases[name] = base
                pairs.setdefault(name, []).extend(
                    zip(per_rep_throughput(row), per_rep_throughput(rows[base]))
                )
    return {name: {"baseline": bases[name], **ratio_summary(p)} for name, p in pairs.items() if p}


def plot(runs, summaries, out: Path) -> None:
    """Per-rep tok/s per variant and the fixed/pristine ratios as a PNG (ImportError without
    matplotlib)."""
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
        base = summary.get("baseline", "none")
        bottom.plot(range(position, position + len(ratios)), ratios, marker="s", label=f"{name} / {base}")
        low, high = summary["median_ci95"]
        bottom.axhspan(low, high, alpha=0.15, label=f"bootstrap 95 % CI of the median {low:.3f} - {high:.3f}")
        bottom.axhline(summary["median"], linestyle="--", label=f"median {summary['median']:.3f}")
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("variant / its baseline")
    bottom.set_xlabel("control rep (runs laid end to end)")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# ---------------------------------------------------------------------------- plugin install
class WorkDirError(Exception):
    """A work directory another user could redirect, or one that cannot be made: the script says
    this one line and exits 2 (``EXIT_BAD_WORK_DIR``)."""


EXIT_BAD_WORK_DIR = 2
_OPEN_MODES = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


class WorkDir:
    """A run's private directory (mode 0700, a fresh name), held open. ``work / name`` is its
    path (for child processes and reads); ``open`` creates a file through the directory's fd with
    O_NOFOLLOW, so neither the directory renamed away and replaced by a symlink nor a symlink
    planted under the file's name is written through."""

    def __init__(self, directory):  # a sglang_dsa_fix.snapshot.Dir
        self.dir = directory
        self.path = Path(directory.path)

    def __truediv__(self, name) -> Path:
        return self.path / name

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"WorkDir({str(self.path)!r})"

    def open(self, name: str, mode: str = "w"):
        """A text file ``name`` (one path component) in this directory, for writing ("w") or
        appending ("a")."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a file name: {name!r}")
        fd = os.open(name, _OPEN_MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.dir.fd)
        return os.fdopen(fd, mode)


def private_work_dir(prefix: str, parent: str | None = None) -> WorkDir:
    """A new directory only this user can write (mode 0700, a fresh name) for everything a run
    writes (logs, model config, patched copies, plugin sites), under ``parent`` (created if
    missing) or the system temporary directory.

    The parent is refused (``WorkDirError``) unless no other user could rename the new directory
    and put a symlink in its place: it and every directory and symlink on its way from ``/`` must
    be owned by this user or root and writable by no one else, except a directory as /tmp is
    (sticky and owned by root). The rule is ``sglang_dsa_fix.safe_files.changeable_by_others``,
    the one ``apply`` and ``status`` hold as root. Then every step goes through directory fds:
    the missing parents and the new directory are made with mkdirat and opened with O_NOFOLLOW."""
    from sglang_dsa_fix import safe_files, snapshot

    trusted = {0, os.geteuid()}
    given = parent or tempfile.gettempdir()
    base, missing = os.path.abspath(given), []
    while not os.path.lexists(base):
        base, name = os.path.split(base)
        missing.append(name)

    def refuse(found) -> WorkDirError:
        return WorkDirError(
            f"{given}: {found.path} is {found.reason}, so another user could swap this run's "
            "directory for a symlink and have it write elsewhere; use a directory that only you "
            "(or root) can write, or one like /tmp (sticky, owned by root)"
        )

    try:
        found, directory = safe_files.resolve_checked(base, trusted, want_dir=True)
        if found:
            raise refuse(found)
        for name in [*reversed(missing), None]:
            for _ in range(100):
                made = name or f"{prefix}{secrets.token_hex(4)}"
                try:
                    os.mkdir(made, 0o700 if name is None else 0o755, dir_fd=directory.fd)
                    break
                except FileExistsError:
                    if name is not None:  # made meanwhile: checked below like any other
                        break
            else:
                raise WorkDirError(f"{given}: no free directory name for {prefix}*")
            sub = snapshot.subdir(directory, made)
            if sub is None:
                raise WorkDirError(f"{given}: {directory.path}/{made} is not a directory (a symlink?)")
            found = safe_files.resolve_checked(sub.path, trusted, want_dir=True)[0]
            if found:
                raise refuse(found)
            directory = sub
    except OSError as exc:
        raise WorkDirError(f"{given}: cannot make the run's directory ({exc.strerror or exc})") from None
    if directory.st.st_uid != os.geteuid() or directory.st.st_mode & 0o077:
        raise WorkDirError(f"{given}: {directory.path} is not this run's own private directory")
    return WorkDir(directory)


def write_no_follow(path, text: str, mode: str = "w") -> None:
    """Write (or append) ``text`` to ``path`` in a run's private directory without following a
    symlink at its name or at the directory's (what a worker process writes there)."""
    path = Path(path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        flags = _OPEN_MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path.name, flags, 0o600, dir_fd=directory), mode) as handle:
            handle.write(text)
    finally:
        os.close(directory)


def fail_work_dir(prog: str, exc: WorkDirError) -> int:
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return EXIT_BAD_WORK_DIR


def install_entry_point(site: Path, dist: str, version: str, sources: list, entry_points: str) -> None:
    """Make ``site`` hold a package with an ``sglang.srt.plugins`` entry point, as pip would,
    without building anything: the GPU host has no index, and building in the checkout would
    leave python/sglang_dsa_fix.egg-info there, whose entry point would reach every variant."""
    site.mkdir(parents=True, exist_ok=True)
    for source in sources:
        if source.is_dir():
            shutil.copytree(source, site / source.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, site / source.name)
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{entry_points}\n")


def install_plugin(site: Path) -> None:
    """This checkout's sglang_dsa_fix with its plugin entry point, into ``site``."""
    from sglang_dsa_fix import __version__, plugin

    install_entry_point(
        site,
        "sglang_dsa_fix",
        __version__,
        [REPO / "python" / "sglang_dsa_fix"],
        f"{plugin.ENTRY_POINT_NAMES[0]} = sglang_dsa_fix.plugin:register",
    )


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__.splitlines()[0])


def main(argv=None) -> int:
    build_parser().parse_args(argv)
    print(json.dumps(run_metadata(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
