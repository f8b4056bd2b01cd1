"""Every benchmark and the GPU tier script in its CPU smoke mode, so that a rename in the package
or between the scripts fails here and not on the next GPU run (issue 26: ``dsa_replay_cost.py``
died on the H200 at ``Case.context_length``, which no CPU test ran).

Each script runs in its own process from the repository root with only ``python/`` on
PYTHONPATH, as ``python benchmark/X.py`` runs on the GPU host. They start when the module starts
(two at a time: most import sglang, ~10 s each on CPU), only those the selected tests read; each
test then checks its script's exit status and output.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARK = REPO / "benchmark"
PROVENANCE = ("sglang_version", "sglang_dsa_fix_version", "git_commit", "tool_source_sha256", "date")
LONG_GEN_VARIANTS = ["none", "none2", "apply", "plugin", "watch"]
E2E_VARIANTS = ["bug1_only", "plugin", "apply", "plugin_off"]
GPU_TIER_CLASSES = {
    "TestSeqlensExpandReference",
    "TestPristineBackendCUDA",
    "TestRuntimeFixCUDA",
    "TestInTreePatchCUDA",
    "TestMemoryCUDA",  # bug #3's fixed tables on the GPU (test/srt/test_fa3_cuda_graph.py)
}


def scratch(tmp: Path) -> Path:
    """Where a job's runs put their private work dirs (patched sglang copies, ~50 MB each)."""
    return tmp / "scratch"


def smoke_env(tmp: Path) -> dict:
    """As on the GPU host: this checkout's python/ on PYTHONPATH, nothing else of the test run's;
    TRITON_INTERPRET left to the scripts (each smoke mode sets it itself)."""
    drop = ("PYTHONPATH", "PYTHONHOME", "TRITON_INTERPRET", "SGLANG_DSA_FIX_FULL", "SGLANG_DSA_FIX_RESULTS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONPATH=str(REPO / "python"),
        PYTHON=sys.executable,  # run_gpu_tier.sh's interpreter
        TMPDIR=str(scratch(tmp)),
        PYTHONWARNINGS="ignore",
    )
    return env


def run(tmp: Path, *argv, timeout: float = 180, **kwargs):
    return subprocess.run(
        [str(a) for a in argv],
        cwd=REPO,
        env=smoke_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def script(name: str, *args):
    return [sys.executable, BENCHMARK / f"{name}.py", *args]


def jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the runs
# Each job runs one script's smoke path (or a short chain) in its own temporary directory.
# Listed slowest first: they start in this order.
def job_gpu_tier(tmp):
    results = tmp / "results"
    done = run(tmp, "bash", REPO / "scripts/gpu/run_gpu_tier.sh", "--smoke", results, timeout=300)
    return SimpleNamespace(done=done, results=results)


def job_watch_overhead(tmp):
    out = tmp / "watch.jsonl"
    done = [
        run(tmp, *script("watch_overhead", "--smoke", "--backend", b, "--output-file", out))
        for b in ("dsa", "triton")
    ]
    return SimpleNamespace(done=done, out=out)


def job_row_observer(tmp):
    log = tmp / "smoke.rows.jsonl"
    smoke = run(tmp, *script("row_observer", "--smoke", log))
    summary = run(tmp, *script("row_observer", log)) if log.exists() else None
    return SimpleNamespace(done=smoke, summary=summary, log=log)


def job_row_overflow_e2e(tmp):
    out = tmp / "e2e.jsonl"
    variants = ",".join(E2E_VARIANTS)
    dsa = run(tmp, *script("dsa_row_overflow_e2e", "--smoke", "--variants", variants, "--output-file", out))
    llama = run(
        tmp,
        *script(
            "dsa_row_overflow_e2e", "--smoke", "--case", "llama-ngram-page1", "--server", "--output-file", out
        ),
    )
    return SimpleNamespace(runs=[dsa, llama], out=out)


def job_long_gen(tmp):
    out = tmp / "long_gen.jsonl"
    done = run(
        tmp, *script("dsa_eagle_long_gen", "--smoke", "--work-dir", scratch(tmp), "--output-file", out)
    )
    report = run(tmp, *script("long_gen_report", out)) if out.exists() else None
    return SimpleNamespace(done=done, out=out, report=report)


def job_long_gen_worker(tmp):
    result = tmp / "worker.json"
    argv = script(
        "long_gen_worker",
        "--smoke",
        "--worker",
        "plugin",
        "--result",
        result,
        "--model-dir",
        tmp / "model",
        "--soak",
        "2",
        "--control-requests",
        "2",
    )
    # The parent's protocol on stdin: a control rep, then the boundary phase.
    done = run(tmp, *argv, input="control 0\nboundary\n")
    return SimpleNamespace(done=done, result=result, model=tmp / "model")


def job_status_cost(tmp):
    out = tmp / "status_cost.jsonl"
    return SimpleNamespace(done=run(tmp, *script("status_cost", "--smoke", "--output-file", out)), out=out)


def job_bench_common(tmp):
    return SimpleNamespace(done=run(tmp, *script("bench_common")))


JOBS = {
    "gpu_tier": job_gpu_tier,
    "watch_overhead": job_watch_overhead,
    "row_observer": job_row_observer,
    "row_overflow_e2e": job_row_overflow_e2e,
    "long_gen": job_long_gen,
    "long_gen_worker": job_long_gen_worker,
    "status_cost": job_status_cost,
    "bench_common": job_bench_common,
}
# Which smoke job exercises each script under benchmark/.
SCRIPT_JOB = {
    "dsa_replay_cost": "gpu_tier",  # run by the GPU tier script, as on the GPU host
    "watch_overhead": "watch_overhead",
    "watch_replay_calls": "watch_overhead",
    "decode_step": "watch_overhead",
    "hook_calls": "watch_overhead",
    "row_observer": "row_observer",
    "dsa_row_overflow_e2e": "row_overflow_e2e",
    "dsa_eagle_long_gen": "long_gen",
    "long_gen_report": "long_gen",
    "long_gen_worker": "long_gen_worker",
    "status_cost": "status_cost",
    "bench_common": "bench_common",
}


def uses(name: str):
    """Marks the job a test reads; the module starts only the jobs of the selected tests."""

    def mark(test):
        test.smoke_job = name
        return test

    return mark


def in_tmp(job, tmp: Path):
    """Run a job; its scratch (the copies) goes once it is done, its outputs stay for the test."""
    scratch(tmp).mkdir()
    try:
        return job(tmp)
    finally:
        shutil.rmtree(scratch(tmp), ignore_errors=True)


@pytest.fixture(scope="module")
def smoke(request, tmp_path_factory):
    selected = {
        getattr(getattr(item, "function", None), "smoke_job", None)
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__]
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(in_tmp, job, tmp_path_factory.mktemp(name))
            for name, job in JOBS.items()
            if name in selected
        }
        yield futures  # each test waits on its own; leaving the block waits for the rest


def ok(done):
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def check_provenance(row):
    for key in PROVENANCE:
        assert key in row, key
    assert isinstance(row["sglang_version"], str), "bench_common could not read the sglang version"
    assert re.fullmatch(r"[0-9a-f]{64}", row["tool_source_sha256"])


# ---------------------------------------------------------------------------- the tests
def test_every_benchmark_script_has_a_smoke_run():
    assert set(SCRIPT_JOB) == {p.stem for p in BENCHMARK.glob("*.py")}
    assert set(SCRIPT_JOB.values()) <= set(JOBS)


@pytest.mark.parametrize("path", sorted((REPO / "scripts/gpu").glob("*.sh")), ids=lambda p: p.name)
def test_gpu_shell_scripts_parse(path):
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@uses("gpu_tier")
def test_gpu_tier_script_runs_its_tiers_and_dsa_replay_cost(smoke):
    """run_gpu_tier.sh --smoke: the tiers' pytest node ids (the CUDA classes skip on CPU; a renamed
    one is an error) and dsa_replay_cost.py --smoke, the real backend on CPU at tiny sizes."""
    out = smoke["gpu_tier"].result()
    ok(out.done)
    results = out.results
    env = (results / "env.txt").read_text()
    assert "smoke: CPU run" in env and re.search(r"^sglang \d", env, re.M), env
    suite = next(ET.parse(results / "junit-smoke.xml").getroot().iter("testsuite"))
    assert int(suite.get("errors")) == 0 and int(suite.get("failures")) == 0
    ran = {case.get("classname").rsplit(".", 1)[-1] for case in suite.iter("testcase")}
    assert ran == GPU_TIER_CLASSES, ran
    rows = jsonl(results / "replay_cost.jsonl")
    assert len(rows) == 1
    row = rows[0]
    check_provenance(row)
    assert row["benchmark"] == "dsa_replay_cost" and row["smoke"] is True and row["device"] == "cpu"
    assert (row["context_length"], row["page_size"], row["bs"]) == (256, 64, 2)
    D = row["speculative_num_draft_tokens"]
    pristine, fixed = row["pristine"], row["fixed"]
    assert pristine["page_table_width"] == row["context_length"] + D  # the pristine expression
    assert fixed["page_table_width"] > pristine["page_table_width"]  # as wide as req_to_token
    assert row["page_table_bytes_difference"] == fixed["page_table_bytes"] - pristine["page_table_bytes"] > 0
    for variant in (pristine, fixed):  # a smoke row holds no timing
        assert variant["gpu_us"] is None and variant["host_us"] is None
        assert variant["kernel_launches_per_update"] is None
    assert row["ratio_fixed_over_pristine_gpu"] is None and row["ratio_fixed_over_pristine_host"] is None
    assert "SMOKE RUN on CPU" in (results / "replay_cost.txt").read_text()


@uses("watch_overhead")
def test_watch_overhead(smoke):
    out = smoke["watch_overhead"].result()
    for done in out.done:
        ok(done)
        assert "SMOKE RUN" in done.stdout
    dsa, triton = jsonl(out.out)
    for row, replay in ((dsa, "dsa_replay"), (triton, "triton_replay")):
        check_provenance(row)
        assert row["benchmark"] == "watch_overhead" and row["smoke"] is True and row["device"] == "cpu"
        assert row["backend"] == replay.split("_")[0] and row["batch_size"] == 2
        # every hook the backend calls, each timed on the real sglang function it wraps
        assert set(row["hooks"]) == {"row_write", "row_read", replay}
        assert set(row["hooks"]) <= set(row["installed_hooks"])
        for hook in row["hooks"].values():
            assert hook["target"].startswith("sglang.srt.")
            assert all(value is None for key, value in hook.items() if key != "target")
        assert row["decode_step"] is None  # no engine on CPU
        # the engine's call counter, applied by sglang's HookRegistry: one real row write seen
        counted = row["smoke_counted_calls"]
        assert counted["row_write"] == 1 and set(counted) == set(row["installed_hooks"])
        assert sum(counted.values()) == 1
        assert row["added_us_per_decode_step"] is None and row["share_of_step"] is None
    assert triton["hooks"]["triton_replay"]["target"].endswith(
        "TritonAttnBackend.init_forward_metadata_out_graph"
    )


@uses("row_observer")
def test_row_observer_sees_the_real_writer_through_sglangs_hook_registry(smoke):
    out = smoke["row_observer"].result()
    ok(out.done)
    summary = json.loads(out.done.stdout)
    assert summary["smoke"] is True
    assert summary["past_row_end"] == [{"row": 1, "columns": 2}]
    assert [c["row"] for c in summary["neighbour_changed"]] == [2]
    (line,) = jsonl(out.log)
    assert set(line) == {"pid", "width", "writes", "past_row_end", "neighbour_changed"}
    ok(out.summary)  # run as a script on that log, as dsa_row_overflow_e2e reads it
    assert json.loads(out.summary.stdout) == {k: v for k, v in summary.items() if k != "smoke"}


@uses("row_overflow_e2e")
def test_row_overflow_e2e_prepares_every_variant_and_runs_its_worker(smoke):
    out = smoke["row_overflow_e2e"].result()
    for done in out.runs:
        ok(done)
        assert "SMOKE RUN" in done.stdout and "RESULT: not judged" in done.stdout
    rows = jsonl(out.out)
    assert [r["variant"] for r in rows] == E2E_VARIANTS + ["bug1_only", "plugin", "apply"]
    for row in rows:
        check_provenance(row)
        assert row["smoke"] is True and row["rc"] == 0
        assert "dsa_row_observer" in row["plugins"]
        assert [r["prompt_len"] for r in row["requests"]] == [100, 20]
        assert all(r["completion_tokens"] == 0 for r in row["requests"])  # no engine, no tokens
        assert row["row_writes"] == 0
    llama_plugin = rows[len(E2E_VARIANTS) + 1]
    assert llama_plugin["case"] == "llama-ngram-page1" and llama_plugin["server"] is True
    argv = llama_plugin["launch_server"]
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "NGRAM"


@uses("long_gen")
def test_dsa_eagle_long_gen_runs_every_variant_through_its_worker(smoke):
    out = smoke["long_gen"].result()
    ok(out.done)
    assert out.done.stdout.startswith("SMOKE RUN")
    rows = jsonl(out.out)
    assert [r["variant"] for r in rows] == LONG_GEN_VARIANTS
    for row in rows:
        check_provenance(row)
        assert row["smoke"] is True
        assert row["control_reps"] == 3 and len(row["output_throughput_per_rep"]) == 3
        assert len(row["warmup_output_throughput"]) == 1
        assert row["boundary_completed"] == row["boundary_requests"] == 2
        assert row["page_table_bytes_computed"] > 0
    by_name = {r["variant"]: r for r in rows}
    assert by_name["none"]["page_table_bytes_computed"] < by_name["plugin"]["page_table_bytes_computed"]
    for name, base in (("none2", "none"), ("apply", "none"), ("plugin", "none"), ("watch", "plugin")):
        assert by_name[name]["control_ratio"]["baseline"] == base
    assert by_name["none2"]["noise"]["reps"] == 3


@uses("long_gen")
def test_long_gen_report_pools_the_smoke_rows_and_says_so(smoke, tmp_path):
    out = smoke["long_gen"].result()
    ok(out.report)
    lines = out.report.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("SMOKE (no engine ran") for line in lines)
    mixed = tmp_path / "measured.jsonl"
    mixed.write_text(json.dumps({"variant": "none", "output_throughput_per_rep": [100.0]}) + "\n")
    refused = run(tmp_path, *script("long_gen_report", out.out, mixed))
    assert refused.returncode == 2 and "will not pool" in refused.stderr


@uses("long_gen_worker")
def test_long_gen_worker_answers_the_parents_phases(smoke):
    out = smoke["long_gen_worker"].result()
    ok(out.done)
    result = json.loads(out.result.read_text())
    assert result["variant"] == "plugin" and result["smoke"] is True and result["ready"] is True
    (control,) = result["control"]
    assert control["completed"] == 2 and control["failed"] == 0
    boundary = result["boundary"]
    assert boundary["completed"] == boundary["requests"] == 2
    assert result["boundary_prompt_len"] + result["boundary_max_new"] == 512 - 2  # the clamp
    config = json.loads((out.model / "config.json").read_text())
    assert config["max_position_embeddings"] >= 512


@uses("status_cost")
def test_status_cost_times_status_against_sglangs_own_import(smoke):
    out = smoke["status_cost"].result()
    ok(out.done)
    assert "SMOKE RUN" in out.done.stdout
    (row,) = jsonl(out.out)
    check_provenance(row)
    assert row["benchmark"] == "status_cost" and row["smoke"] is True and row["reps"] == 1
    assert row["import_command"][1:] == ["-c", "import sglang.srt.server_args"]
    assert row["status_command"][:3] == ["-m", "sglang_dsa_fix", "status"]
    assert len(row["import_s"]) == len(row["status_s"]) == 1 and min(row["import_s"] + row["status_s"]) > 0
    assert row["ratio_of_medians"] == row["status_median_s"] / row["import_median_s"]
    assert row["goal"] == 2.5 and row["status_basis"] == "sglang" and row["exit_code"] in (0, 1, 2)


@uses("bench_common")
def test_bench_common_prints_the_provenance(smoke):
    out = smoke["bench_common"].result()
    ok(out.done)
    check_provenance(json.loads(out.done.stdout))
