"""The benchmark scripts' interfaces, on CPU (the benchmarks themselves run on a GPU host):
``--help`` of every script without torch, every flag with help text, bench_serving's
``--output-file`` / ``--disable-tqdm``, the JSONL row's provenance fields, bench_serving's
``output_throughput``, and no import circle between the scripts."""

import ast
import asyncio
import contextlib
import datetime
import importlib
import importlib.util
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest

import sglang_dsa_fix

REPO = Path(__file__).resolve().parents[1]
BENCHMARK = REPO / "benchmark"
SCRIPTS = sorted(BENCHMARK.glob("*.py"))
MODULES = [p.stem for p in SCRIPTS]


def load_script(name: str):
    """benchmark/NAME.py as the module NAME, what the scripts' own ``import NAME`` then finds."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARK / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench_common = load_script("bench_common")


@pytest.fixture(scope="module", autouse=True)
def benchmark_on_path():
    """The scripts import each other by name (``python benchmark/X.py`` puts benchmark/ first on
    sys.path): so does this module's tests' ``importlib.import_module``, and only while they run."""
    sys.path.insert(0, str(BENCHMARK))
    yield
    sys.path.remove(str(BENCHMARK))


# Run in the torch-less interpreter: import a script by its path, build its parser, and report
# its flags and their help texts (as argparse expands them), and whether torch got imported.
DESCRIBE = r"""
import argparse, importlib.util, json, os, sys
assert importlib.util.find_spec("torch") is None, "this interpreter has torch"
path = sys.argv[1]
sys.path.insert(0, os.path.dirname(path))  # as `python benchmark/X.py` has it
spec = importlib.util.spec_from_file_location("script_under_test", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
parser = module.build_parser()
flags = []
for action in parser._actions:
    if isinstance(action, argparse._HelpAction):
        continue
    text = action.help
    if text and text is not argparse.SUPPRESS and "%" in text:
        text = text % dict(vars(action), prog=parser.prog)
    flags.append({"options": action.option_strings or [action.dest], "help": text})
print(json.dumps({"flags": flags, "heavy": sorted({"torch", "sglang"} & set(sys.modules))}))
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv with no packages at all (no torch, no tqdm, no requests)."""
    home = tmp_path_factory.mktemp("notorch")
    venv.create(home, with_pip=False, symlinks=True)
    return str(home / "bin" / "python")


def bare_run(python, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(REPO / "python")  # sglang_dsa_fix, as on the GPU host
    return subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def squeeze(text: str) -> str:
    return "".join(text.split())  # argparse rewraps (and may break at hyphens)


@pytest.mark.parametrize("script", SCRIPTS, ids=MODULES)
def test_help_without_torch_lists_every_flag_with_help(bare_python, script):
    shown = bare_run(bare_python, str(script), "--help")
    assert shown.returncode == 0, shown.stderr
    described = bare_run(bare_python, "-c", DESCRIBE, str(script))
    assert described.returncode == 0, described.stderr
    report = json.loads(described.stdout)
    assert report["heavy"] == [], f"{script.name} imports {report['heavy']} when building its parser"
    help_text = squeeze(shown.stdout)
    for flag in report["flags"]:
        assert flag["help"], f"{script.name}: {flag['options']} has no help text"
        for option in flag["options"]:
            assert squeeze(option) in help_text, f"{script.name}: {option} missing from --help"
        assert squeeze(flag["help"]) in help_text, f"{script.name}: help of {flag['options']} not shown"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_fresh_without_torch(bare_python, module):
    """A fresh interpreter per module: a circle (or a torch import) shows up as a failure here."""
    code = f"import sys; sys.path.insert(0, 'benchmark'); import {module}; print(sorted({{'torch', 'sglang'}} & set(sys.modules)))"
    done = bare_run(bare_python, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def local_imports(path: Path) -> set:
    """benchmark/ modules a script imports anywhere (top level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(MODULES)


def test_no_import_cycle_between_scripts():
    graph = {p.stem: local_imports(p) - {p.stem} for p in SCRIPTS}
    assert graph["bench_common"] == set(), "bench_common must import no other script"
    assert "long_gen_report" not in graph["dsa_eagle_long_gen"]
    assert "dsa_eagle_long_gen" not in graph["long_gen_report"]
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import cycle: " + " -> ".join(trail + [node])
        state[node] = "open"
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])
        state[node] = "done"

    for node in graph:
        visit(node, [])


# ---------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "module, old",
    [("dsa_eagle_long_gen", "--jsonl"), ("dsa_row_overflow_e2e", "--jsonl"), ("dsa_replay_cost", "--json")],
)
def test_output_file_as_bench_serving_spells_it_and_the_old_alias(module, old):
    parser = importlib.import_module(module).build_parser()
    assert parser.parse_args(["--output-file", "a.jsonl"]).output_file == "a.jsonl"
    assert parser.parse_args([old, "b.jsonl"]).output_file == "b.jsonl"
    assert parser.parse_args([]).output_file is None


def test_disable_tqdm_flag_and_terminal_policy():
    parser = importlib.import_module("dsa_eagle_long_gen").build_parser()
    assert parser.parse_args(["--disable-tqdm"]).disable_tqdm is True
    assert parser.parse_args([]).disable_tqdm is False

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert bench_common.tqdm_disabled(False, Terminal()) is False
    assert bench_common.tqdm_disabled(True, Terminal()) is True
    assert bench_common.tqdm_disabled(False, io.StringIO()) is True  # a log file: no bars
    closed = io.StringIO()
    closed.close()
    assert bench_common.tqdm_disabled(False, closed) is True


def test_progress_is_a_no_op_when_stderr_is_not_a_terminal(monkeypatch):
    long_gen = importlib.import_module("dsa_eagle_long_gen")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with long_gen.progress("x", 10) as bar:
        assert bar is None
    assert sys.stderr.getvalue() == ""


# ---------------------------------------------------------------------------- row provenance
PROVENANCE = ("sglang_version", "sglang_dsa_fix_version", "git_commit", "tool_source_sha256", "date")


def check_provenance(row, now=None):
    for key in PROVENANCE:
        assert key in row, key
    assert row["sglang_dsa_fix_version"] == sglang_dsa_fix.__version__
    assert row["sglang_version"] is None or isinstance(row["sglang_version"], str)
    commit = row["git_commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit), commit
    assert re.fullmatch(r"[0-9a-f]{64}", row["tool_source_sha256"]), row["tool_source_sha256"]
    date = datetime.datetime.fromisoformat(row["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    if now is not None:
        assert abs((date - now).total_seconds()) < 120


def test_row_builder_records_versions_commit_date_and_server_info():
    now = datetime.datetime.now(datetime.timezone.utc)
    row = bench_common.jsonl_row({"variant": "plugin"}, server_info={"version": "0.5.23"})
    check_provenance(row, now)
    assert row["variant"] == "plugin"
    assert row["server_info"] == {"version": "0.5.23"}  # whole, as bench_serving stores it
    from sglang_dsa_fix import errors, tree

    try:
        expected = tree.find_tree(None).version
    except errors.ToolError:
        expected = None
    assert row["sglang_version"] == expected
    inside_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert row["git_commit"] == (inside_git.stdout.strip() if inside_git.returncode == 0 else None)
    assert "server_info" not in bench_common.jsonl_row({"benchmark": "replay"})  # no server used
    assert bench_common.jsonl_row({}, server_info=None)["server_info"] is None  # unreadable


def test_git_commit_is_null_outside_git_or_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert bench_common.git_commit(tmp_path) is None

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench_common.subprocess, "run", no_git)
    assert bench_common.git_commit(REPO) is None


def test_date_is_utc_iso():
    local = datetime.datetime(2026, 5, 1, 14, 0, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert bench_common.utc_now_iso(local) == "2026-05-01T12:00:00+00:00"


def fake_variant(tmp_path, result, name="plugin"):
    log = tmp_path / f"{name}.log"
    log.write_text("sglang-dsa-fix: CUDA-graph page_table widened\n" if name == "plugin" else "")
    return SimpleNamespace(
        name=name,
        crash=None,
        log_path=log,
        process=SimpleNamespace(returncode=-9),
        wall_s=12.5,
        start_mib=100,
        peak_mib=200,
        clocks=[1980, 1975, 1990, 1985],
        result=lambda: result,
    )


def long_gen_args(server, warmup_reps=0):
    return SimpleNamespace(server=server, soak=4, warmup_reps=warmup_reps)


def test_long_gen_row_carries_provenance_server_info_and_bench_serving_throughput(tmp_path):
    long_gen = importlib.import_module("dsa_eagle_long_gen")
    control = [
        {"completed": 8, "failed": 0, "duration": 2.0, "total_output_tokens": 1000, "accept_length": 5.0},
        {"completed": 8, "failed": 0, "duration": 4.0, "total_output_tokens": 1000, "accept_length": 5.0},
        {"completed": 8, "failed": 0, "duration": 5.0, "total_output_tokens": 1500, "accept_length": 4.0},
    ]
    for c in control:
        c["output_throughput"] = bench_common.output_throughput(c["total_output_tokens"], c["duration"])
    boundary = {"requests": 4, "completed": 4, "failed": 0, "duration": 2.0, "total_output_tokens": 28}
    boundary["output_throughput"] = bench_common.output_throughput(28, 2.0)
    result = {
        "start_s": 30.0,
        "control": control,
        "control_itl_ms": {"p50": 1.0, "p99": 2.0},
        "boundary": boundary,
        "server_info": {"version": "0.5.23", "internal_states": [{"avg_spec_accept_length": 4.9}]},
    }
    now = datetime.datetime.now(datetime.timezone.utc)
    row = long_gen.build_row(fake_variant(tmp_path, result), long_gen_args(server=True), 4096)
    check_provenance(row, now)
    assert row["server_info"] == result["server_info"]
    assert row["output_throughput_per_rep"] == [500.0, 250.0, 300.0]
    assert row["total_output_tokens_per_rep"] == [1000, 1000, 1500]
    assert row["duration_per_rep"] == [2.0, 4.0, 5.0]
    assert row["output_throughput_median"] == 300.0
    assert "output_throughput" not in row  # a median over reps is not bench_serving's figure
    assert row["boundary_output_throughput"] == 14.0
    assert row["plugin_widened"] is True
    engine_row = long_gen.build_row(fake_variant(tmp_path, result), long_gen_args(server=False), 4096)
    assert engine_row["server_info"] is None  # Engine mode: no server
    warm = long_gen.build_row(fake_variant(tmp_path, result), long_gen_args(False, warmup_reps=1), 4096)
    assert warm["warmup_output_throughput"] == [500.0]  # run, shown, not counted
    assert warm["output_throughput_per_rep"] == [250.0, 300.0] and warm["control_reps"] == 2
    assert warm["sm_clock_mhz_per_rep"] == [1975, 1990]  # each counted rep keeps its own clock


# ---------------------------------------------------------------------------- A/A and noise
def test_reps_for_one_percent_follow_the_spread_of_the_log_ratios():
    # sd of log ratios 0.02: the median's CI half-width 1.96 * 1.2533 * 0.02 / sqrt(n) <= log(1.01)
    # needs n = ceil((1.96 * 1.2533 * 0.02 / 0.00995) ** 2) = 25
    ratios = [math.exp(x) for x in (0.02, -0.02, 0.02, -0.02)]
    sd = statistics.stdev(math.log(r) for r in ratios)
    expected = math.ceil((1.96 * math.sqrt(math.pi / 2) * sd / math.log(1.01)) ** 2)
    assert bench_common.reps_for_precision(ratios) == expected
    assert bench_common.reps_for_precision([1.0, 1.0]) == 1  # no spread: one pair says it all
    assert bench_common.reps_for_precision([1.0]) is None
    summary = bench_common.ratio_summary([(101.0, 100.0), (99.0, 100.0), (100.0, 100.0)])
    assert summary["reps_for_1pct"] == bench_common.reps_for_precision(summary["per_rep"])


def test_each_variant_is_paired_with_its_baseline():
    present = {"none", "none2", "plugin", "watch"}
    assert bench_common.baseline_of("none2", present) == "none"  # the A/A control
    assert bench_common.baseline_of("plugin", present) == "none"
    assert bench_common.baseline_of("watch", present) == "plugin"  # the watch's own cost
    assert bench_common.baseline_of("watch", {"none", "watch"}) == "none"
    assert bench_common.baseline_of("none", present) is None
    rows = {
        "none": {"output_throughput_per_rep": [100.0, 100.0]},
        "plugin": {"output_throughput_per_rep": [200.0, 200.0]},
        "watch": {"output_throughput_per_rep": [190.0, 190.0]},
    }
    pooled = bench_common.pooled([("run", rows)])
    assert pooled["watch"]["baseline"] == "plugin" and pooled["watch"]["median"] == 0.95
    assert pooled["plugin"]["baseline"] == "none" and pooled["plugin"]["median"] == 2.0


def test_noise_breakdown_separates_shared_drift_from_pair_noise():
    drift = [1.0, 1.2, 0.9, 1.1, 1.0, 0.8]  # both engines move together, round by round
    a = [
        {"output_throughput": 100 * d, "itl_median_ms": 10 / d, "stall_share": 0.0, "sm_clock_mhz": 1980}
        for d in drift
    ]
    b = [dict(r) for r in a]
    noise = bench_common.noise_breakdown(a, b)
    assert noise["reps"] == 6
    assert noise["common_mode_share"] == pytest.approx(1.0)  # all of it shared: pairing cancels it
    assert noise["paired_log_sd"] == pytest.approx(0.0)
    assert noise["r2_steady_speed"] == pytest.approx(1.0)  # the steady gap explains every rep
    assert noise["r2_stalls"] is None and noise["r2_sm_clock"] is None  # constant: explains nothing
    b = [
        dict(r, output_throughput=r["output_throughput"] * (1.05 if i % 2 else 0.95)) for i, r in enumerate(a)
    ]
    assert bench_common.noise_breakdown(a, b)["paired_log_sd"] > 0.05
    assert bench_common.noise_breakdown(a[:2], b[:2]) == {"reps": 2}


def test_gap_profile_counts_stalls_beyond_five_medians():
    worker = importlib.import_module("long_gen_worker")
    gaps = [0.01] * 9 + [0.11]  # one stall: 0.10 s beyond the median
    profile = worker.gap_profile(gaps)
    assert profile["itl_median_ms"] == pytest.approx(10.0)
    assert profile["stall_share"] == pytest.approx(0.10 / 0.2)
    assert worker.gap_profile([]) == {"itl_median_ms": None, "stall_share": None}


def test_long_gen_variants_include_the_aa_control_and_the_watch():
    long_gen = importlib.import_module("dsa_eagle_long_gen")
    assert {"none2", "watch"} <= set(long_gen.VARIANTS)
    env = long_gen.prepare_variant("none2", Path("/nonexistent"))
    assert env["SGLANG_DSA_FIX"] == "0"  # a second pristine engine
    with pytest.raises(SystemExit):
        long_gen.main(["--variants", "none,bogus"])


def test_row_overflow_row_carries_provenance_and_server_info(tmp_path):
    e2e = importlib.import_module("dsa_row_overflow_e2e")
    (tmp_path / "plugin.log").write_text("sglang-dsa-fix: plugin registered\n")
    (tmp_path / "plugin.rows.jsonl").write_text(
        json.dumps(
            {
                "width": 270,
                "writes": [{"row": 1, "start": 0, "end": 260}],
                "past_row_end": [],
                "neighbour_changed": [],
            }
        )
        + "\n"
    )
    args = SimpleNamespace(case="dsa-eagle")
    result = {"variant": "plugin", "server_info": {"version": "0.5.23"}, "requests": []}
    row = e2e.build_row("plugin", args, True, 0, 1.0, result, tmp_path)
    check_provenance(row)
    assert row["server_info"] == {"version": "0.5.23"}
    assert row["row_width"] == 270 and row["furthest_end"] == 260
    assert row["plugin_lines"] == ["sglang-dsa-fix: plugin registered"]
    in_process = e2e.build_row("plugin", args, False, 0, 1.0, {"variant": "plugin"}, tmp_path)
    assert in_process["server_info"] is None


# ---------------------------------------------------------------------------- bench_serving's figures
def test_output_throughput_is_output_tokens_over_one_runs_duration():
    assert bench_common.output_throughput(1000, 4.0) == 250.0
    assert bench_common.output_throughput(0, 0.0) == 0.0


class FakeClient:
    """Streams a fixed number of tokens per request; one request fails."""

    async def stream(self, input_ids, params):
        await asyncio.sleep(0.01)
        if input_ids == [0]:
            raise RuntimeError("boom")
        times = [1.0, 1.002, 1.004]
        return times, {"completion_tokens": len(input_ids) * 10, "finish_reason": {"type": "length"}}


def test_worker_run_group_reports_bench_serving_output_throughput():
    worker = importlib.import_module("long_gen_worker")
    requests = [([1], {}), ([1, 2], {}), ([1, 2, 3], {}), ([0], {})]
    summary = asyncio.run(worker.run_group(FakeClient(), requests, 2, 10))
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 60  # completed requests only, as bench_serving
    assert summary["duration"] > 0
    assert summary["output_throughput"] == summary["total_output_tokens"] / summary["duration"]


def test_itl_percentiles_as_bench_serving_numpy_linear():
    itls = [i / 1000 for i in range(1, 101)]  # 1 ms .. 100 ms
    got = bench_common.itl_percentiles(itls)
    assert got["p50"] == pytest.approx(50.5)  # np.median
    assert got["p99"] == pytest.approx(99.01)  # np.percentile(.., 99), linear
    assert bench_common.itl_percentiles([0.1]) == {"p50": None, "p99": None}


def test_report_pools_new_and_old_rows(tmp_path, capsys):
    report = importlib.import_module("long_gen_report")
    new = tmp_path / "new.jsonl"
    new.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"variant": "none", "output_throughput_per_rep": [100.0, 200.0]},
                {"variant": "plugin", "output_throughput_per_rep": [110.0, 180.0]},
            )
        )
    )
    old = tmp_path / "old.jsonl"  # rows from before the bench_serving names
    old.write_text(
        json.dumps({"variant": "none", "control_tok_per_s": [100.0]})
        + "\n"
        + json.dumps({"variant": "plugin", "control_tok_per_s": [100.0]})
    )
    assert report.main([str(new), str(old)]) == 0
    out = capsys.readouterr().out
    assert "plugin/none over 3 paired reps: median 1.000" in out


def test_watch_overhead_report_signs_a_negative_estimate_once(capsys):
    # On a noisy host the median of (watched - plain) per block can be below zero (the 17:19 UTC
    # DSA row of docs/gpu-results/watch-overhead-dsa-0514-h100-2026-12-07-1714.jsonl, bs 32).
    rows = (REPO / "docs/gpu-results/watch-overhead-dsa-0514-h100-2026-12-07-1714.jsonl").read_text()
    row = json.loads(rows.splitlines()[1])
    importlib.import_module("watch_overhead").report(row)
    out = capsys.readouterr().out
    assert "watched -> -12.7 us per call" in out and "+-" not in out, out
    assert "the watch +6.6 us of host time = 0.04 % of it" in out, out


def test_watch_overhead_alternates_which_variant_runs_first():
    # Neither variant always runs second in a block pair (A B, B A, ...), and each block is
    # `calls` calls between two syncs.
    ran = []
    variants = {"plain": lambda: ran.append("plain"), "watched": lambda: ran.append("watched")}
    timed = importlib.import_module("watch_overhead")._timed_blocks(
        variants, calls=2, blocks=3, sync=lambda: ran.append("sync")
    )
    blocks = "".join(ran).split("syncsync")
    plain, watched = "plain" * 2, "watched" * 2
    assert [b.replace("sync", "") for b in blocks if b.strip("sync")] == [
        plain,
        watched,
        watched,
        plain,
        plain,
        watched,
    ], ran
    assert {name: len(per_block) for name, per_block in timed.items()} == {"plain": 3, "watched": 3}


def test_runs_write_into_a_private_directory_even_under_a_shared_work_dir(tmp_path):
    # A --work-dir others can write to, with a symlink planted where a log or the model would go:
    # the run gets a fresh 0700 directory below it, so nothing is written through the plant.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    for name in ("none.log", "model", "apply-site"):
        (shared / name).symlink_to(victim)
    runs = {bench_common.private_work_dir("dsa-eagle-long-gen-", str(shared)).path for _ in range(2)}
    assert len(runs) == 2
    for run in runs:
        assert run.parent == shared and run.is_dir() and not run.is_symlink()
        assert (run.stat().st_mode & 0o777) == 0o700 and not any(run.iterdir())
    assert victim.read_text() == "untouched"
    made = bench_common.private_work_dir("x-", str(tmp_path / "new" / "parent"))
    assert made.path.parent == tmp_path / "new" / "parent"
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_work_dir_others_can_rename_in_is_refused(tmp_path, mode):
    # Not sticky: another user (or the group) could rename the run's directory and put a symlink
    # in its place (test_root_safety.TestBenchmarkWorkDir has that attack as nobody).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(
        bench_common.WorkDirError, match=re.escape(f"{shared / 'below'}: {shared} is writable by ")
    ):
        bench_common.private_work_dir("x-", str(shared / "below"))
    assert not any(shared.iterdir())  # nothing made there
    long_gen = importlib.import_module("dsa_eagle_long_gen")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert long_gen.main(["--variants", "none", "--work-dir", str(shared)]) == 2
    assert len(err.getvalue().strip().splitlines()) == 1 and "is writable by" in err.getvalue()


def test_row_overflow_logs_dir_others_can_rename_in_is_refused(tmp_path, monkeypatch, capsys):
    e2e = importlib.import_module("dsa_row_overflow_e2e")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(e2e, "prepare", lambda *a: pytest.fail("ran with an unsafe --logs"))
    assert e2e.main(["--variants", "plugin", "--logs", str(shared)]) == 2
    assert f"{shared} is writable by others" in capsys.readouterr().err
    assert not any(shared.iterdir())


def test_files_open_through_the_run_directory_never_through_a_link(tmp_path):
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "none.log"
    victim.write_text("untouched")
    work = bench_common.private_work_dir("x-", str(tmp_path / "runs"))
    # A symlink planted under the log's name: refused (ELOOP), not written through.
    (work / "none.log").symlink_to(victim)
    with pytest.raises(OSError):
        work.open("none.log", "w")
    with pytest.raises(OSError):
        bench_common.write_no_follow(work / "none.log", "x")
    (work / "none.log").unlink()
    # The directory renamed away and a link put in its place: the fd still names the real one.
    moved = work.path.with_name("moved")
    work.path.rename(moved)
    work.path.symlink_to(victim_dir)
    with work.open("none.log", "w") as log:
        log.write("run's log")
    with pytest.raises(OSError):  # a worker's write through the swapped directory: refused too
        bench_common.write_no_follow(work / "none.log", "x")
    assert victim.read_text() == "untouched"
    assert (moved / "none.log").read_text() == "run's log"


def test_source_hash_changes_with_the_code_that_runs(tmp_path):
    package = tmp_path / "python" / "sglang_dsa_fix"
    package.mkdir(parents=True)
    (package / "watch.py").write_text("A = 1\n")
    first = bench_common.tool_source_sha256(tmp_path)
    (package / "watch.py").write_text("A = 2\n")
    assert bench_common.tool_source_sha256(tmp_path) != first
    assert bench_common.tool_source_sha256(tmp_path / "elsewhere") is None
