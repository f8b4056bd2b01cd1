"""Release matrix: the patch tool, the CPU regression tiers and the plugin on real sglang releases.

Each release is installed from PyPI without dependencies into ``.matrix/sglang-<version>/`` (an
overlay put first on PYTHONPATH over the project's pinned 0.5.14 environment), then:

- patch tool, every release: on a temporary copy of the release's own files, ``check`` gives the
  expected verdict per bug; where a bug is affected, ``diff`` passes ``git apply --check``,
  ``apply`` fixes it, a second ``apply`` changes nothing, ``revert`` restores every sha256;
- bug #1 CPU tier (test/srt/test_dsa_cuda_graph.py) where the release imports on CPU and is
  affected;
- bug #2 CPU tier (test/srt/test_row_overflow.py) where the release imports on CPU (0.5.11 -
  0.5.23): the whole tier where a function sizes the row (0.5.13+), the pristine overflow where
  the row is sized inline (0.5.11 - 0.5.12);
- bug #3 CPU tier (test/srt/test_fa3_cuda_graph.py) on 0.5.17 and 0.5.23 (0.5.14 in the main
  suite): the real FlashAttentionBackend's graph tables, pristine and fixed; and the other
  backends' graph tables the watch flags (test/srt/test_graph_tables_other_backends.py,
  test_graph_tables_flat_buffers.py); FA3's topk > 1 tables (test/srt/test_fa3_topk_cuda_graph.py)
  and the topk > 1 rules of FA3 and Triton against the real backends (test/srt/test_topk_reach.py)
  on 0.5.13, 0.5.15, 0.5.16, 0.5.17, 0.5.23;
- plugin in spawned processes (test/test_plugin.py) on affected releases with the plugin API,
  and what ``plugin.decide()`` says on the others; the family watch's DSA / NSA replay check and
  hook targets (test/test_watch.py) where the bug #1 CPU tier runs (0.5.11 - 0.5.13), and its
  uniform verify reader (0.5.17+) on 0.5.17 and 0.5.23, its draft slot reader and row writes on 0.5.23;
- the member contract (``proof.contract``), every member on every release;
- the upstream-form tests (upstream/test/...) on the releases whose module layout each is
  written for (``UPSTREAM_TESTS``): pristine must fail, a copy patched by ``apply`` must pass.

Prints one row per release saying what ran, what was skipped and why; exits 1 on any failure.
    python scripts/release_matrix.py [--only 0.5.13,0.5.15] [--full]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_dsa_fix import classify, members, release, sites, source_patch
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.proof import contract
from sglang_dsa_fix.verdicts import Bug, Verdict

REPO = Path(__file__).resolve().parents[1]
NO_CPU_IMPORT = (
    "the release imports sgl_kernel at module import and the PyPI sgl-kernel wheel is a "
    "CUDA build of several hundred MB (not tried in the CPU environment)"
)
NO_UPSTREAM_TEST = "no upstream-form test is written for this release's module layout"
FA3_NOT_RUN = "bug #3's CPU tier is driven on 0.5.14 (the base), 0.5.17 and 0.5.23"
MLA_MASK_RUN = ("0.5.13", "0.5.16", "0.5.17", "0.5.23")  # each form of the mask, and the base 0.5.14
MLA_MASK_NOT_RUN = "the MLA verify mask tier runs on 0.5.13, 0.5.14 (the base), 0.5.16, 0.5.17, 0.5.23"
# FA3's topk > 1 tables: each form of their replay (host bound <= 0.5.15, CPU mirror 0.5.16+).
FA3_TOPK_RUN = ("0.5.13", "0.5.15", "0.5.16", "0.5.17", "0.5.23")
FA3_TOPK_NOT_RUN = "FA3's topk > 1 tiers run on 0.5.13, 0.5.14 (the base), 0.5.15, 0.5.16, 0.5.17, 0.5.23"
WATCH_TESTS = "test/test_watch.py::TestDsaReplay test/test_watch.py::TestSwitchAndSites"
# The watch's uniform verify reader (0.5.17+, EAGLE's verify read) and draft slot reader (0.5.23+),
# the real readers on CPU.
UNIFORM_READ_RUN = ("0.5.17", "0.5.23")
UNIFORM_READ_NOT_RUN = "the watch's uniform verify and draft slot readers run on 0.5.17 and 0.5.23"
UNIFORM_READ_TESTS = "test/test_watch.py::TestUniformRowReads test/test_watch.py::TestDraftSlotReads test/test_watch.py::TestSwitchAndSites"
# The watch's row write check on 0.5.23's writer (the pytest tier runs before the matrix installs
# that overlay, so this is where it runs on a fresh clone).
ROW_WRITES_0523_NOT_RUN = "the watch's row writes on 0.5.23 run there"
ROW_WRITES_0523_TESTS = "test/test_watch.py::TestRowWrites0523"
# Tiers the main suite skips on the base release (they need a newer one): its row says so.
NOT_RUN_ON_BASE = (UNIFORM_READ_TESTS, ROW_WRITES_0523_TESTS)
UPSTREAM = REPO / "upstream" / "test" / "registered" / "unit"
# Each upstream-form test and the releases whose module layout it is written for: bugs #1 / #2 in
# the 0.5.13 - 0.5.14 layout; bug #2 in the runtime-context ("bag") layout, 0.5.19+ (on 0.5.18
# Req.kv is set only at prefill); bug #3 where FA3's replay builds its tables with the bounded
# normal_decode_set_metadata, 0.5.22+ (on 0.5.19 - 0.5.21 the unbounded verify builder writes
# past the pristine buffer and the interpreter aborts instead of the test failing).
UPSTREAM_TESTS = {
    UPSTREAM / "layers/attention/test_dsa_cuda_graph_page_table_width.py": ("0.5.13", "0.5.14"),
    UPSTREAM / "layers/attention/test_req_to_token_row_overflow.py": ("0.5.13", "0.5.14"),
    UPSTREAM / "mem_cache/test_req_to_token_row_reservation.py": tuple(f"0.5.{n}" for n in range(19, 24)),
    UPSTREAM / "layers/attention/test_fa3_cuda_graph_page_table_width.py": ("0.5.22", "0.5.23"),
}
assert set(UPSTREAM_TESTS) == set((REPO / "upstream" / "test").rglob("test_*.py")), "a test without releases"
AFFECTED, FIXED_UPSTREAM, NOT_APPLICABLE, NOT_COVERED = (
    Verdict.AFFECTED.value,
    Verdict.FIXED_UPSTREAM.value,
    Verdict.NOT_APPLICABLE.value,
    Verdict.NOT_COVERED.value,
)


@dataclass
class Release:
    version: str
    page_table: str  # expected check verdict, bug #1
    row: str  # expected check verdict, bug #2
    fa3: str = AFFECTED  # expected check verdict, bug #3 (FA3's graph tables: every release so far)
    # Bug #3's relatives (TRT-LLM MHA / MLA, FlashMLA, Triton: every release so far; MiniMax NVFP4
    # from 0.5.23).
    relatives: str = AFFECTED
    minimax: str = NOT_APPLICABLE
    cpu_tier: str | None = None  # None: run bug #1's tier; else why not
    row_tier: str | None = None  # None: run bug #2's tier; else why not
    fa3_tier: str | None = FA3_NOT_RUN  # None: run bug #3's tier (FA3 on the real backend); else why not
    plugin: bool = False  # plugin API present (0.5.11+)
    row_inline: bool = False  # row sized inline (0.5.9 - 0.5.12): bug #2 in-tree only
    resolves: bool = False  # run `status -- <launch args>` cases (sglang resolves them)
    dcp_resolves: bool = False  # run the decode-context-parallel `status --prove` case
    spec_v1_case: bool = False  # run the case of an algorithm sglang runs on spec v1 (0.5.13)


RELEASES = [
    # 0.5.4 - 0.5.12 size the row inline: 0.5.4 bug #2 "not covered"; 0.5.9 - 0.5.12 in-tree patch
    # only, and on 0.5.11 / 0.5.12 the bug #2 tier runs the inline-width cases
    # (TestInlineSizedRowOverflow: pristine overflow, patched line clean).
    Release("0.5.4", AFFECTED, NOT_COVERED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT),
    # Post releases that change a file the tool reads (FILES_READ compared with their release's,
    # 2026-12-02): 0.5.4.post1 - post3, 0.5.5.post1 - post3, 0.5.6.post1 / post2, 0.5.15.post1
    # (0.5.8.post1, 0.5.10.post1, 0.5.12.post1 and 0.5.13.post1 change none).
    *(
        Release(version, AFFECTED, NOT_COVERED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT)
        for version in ("0.5.4.post1", "0.5.4.post2", "0.5.4.post3")
    ),
    # 0.5.5 - 0.5.8: the row sized inline beside a spec-v2 reservation without
    # get_alloc_len_per_decode (0.5.6 - 0.5.8: 2 x ALLOC_LEN_PER_DECODE set by the worker): not judged.
    *(
        Release(version, AFFECTED, NOT_COVERED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT)
        for version in (
            "0.5.5",
            "0.5.5.post1",
            "0.5.5.post2",
            "0.5.5.post3",
            "0.5.6",
            "0.5.6.post1",
            "0.5.6.post2",
        )
    ),
    Release("0.5.7", AFFECTED, NOT_COVERED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT),
    Release("0.5.8", AFFECTED, NOT_COVERED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT),
    Release("0.5.9", AFFECTED, AFFECTED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT, row_inline=True),
    Release("0.5.10", AFFECTED, AFFECTED, cpu_tier=NO_CPU_IMPORT, row_tier=NO_CPU_IMPORT, row_inline=True),
    Release("0.5.11", AFFECTED, AFFECTED, plugin=True, row_inline=True),
    Release("0.5.12", AFFECTED, AFFECTED, plugin=True, row_inline=True),
    Release("0.5.13", AFFECTED, AFFECTED, plugin=True, spec_v1_case=True),
    Release("0.5.14", AFFECTED, AFFECTED, plugin=True),  # the base environment
    Release("0.5.15", FIXED_UPSTREAM, AFFECTED, cpu_tier="bug #1 fixed upstream", plugin=True),
    Release("0.5.15.post1", FIXED_UPSTREAM, AFFECTED, cpu_tier="bug #1 fixed upstream", plugin=True),
    Release("0.5.16", FIXED_UPSTREAM, AFFECTED, cpu_tier="bug #1 fixed upstream", plugin=True),
    # 0.5.17 (the newest release the GPU host's torch 2.11 runs: its bug #2 end-to-end run) and
    # 0.5.23, every tier; 0.5.18 - 0.5.22 between them: the patch tool, the verdicts, the
    # plugin's decisions on the release's own files and the bug #2 tier, and the DCP case on
    # 0.5.18 (the last release whose row misses the allocator page) and 0.5.19 (the first that
    # sizes the row by it).
    *(
        Release(
            version,
            FIXED_UPSTREAM,
            AFFECTED,
            cpu_tier="bug #1 fixed upstream",
            fa3_tier=None if every_tier else FA3_NOT_RUN,
            plugin=True,
            resolves=every_tier,
            dcp_resolves=every_tier or version in ("0.5.18", "0.5.19"),
            minimax=AFFECTED if version == "0.5.23" else NOT_APPLICABLE,
        )
        for version in ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
        for every_tier in [version in ("0.5.17", "0.5.23")]
    ),
]
BASE_VERSION = "0.5.14"


def expected_verdicts(case: Release) -> tuple:
    """(bug, expected check verdict), in the tool's bug order."""
    expected = {Bug.PAGE_TABLE: case.page_table, Bug.ROW_OVERFLOW: case.row, Bug.FA3_PAGE_TABLE: case.fa3}
    expected.update(
        {
            Bug.TRTLLM_MHA_PAGE_TABLE: case.relatives,
            Bug.TRTLLM_MLA_KV_INDICES: case.relatives,
            Bug.FLASHMLA_KV_INDICES: case.relatives,
            Bug.MINIMAX_NVFP4_PAGE_TABLE: case.minimax,
            Bug.TRITON_KV_INDICES: case.relatives,
        }
    )
    return tuple((bug, expected[bug]) for bug in Bug)


@dataclass
class Row:
    version: str
    checks: list = field(default_factory=list)  # (name, ok, detail)

    def add(self, name, ok, detail=""):
        self.checks.append((name, ok, detail))
        print(
            f"  [{'ok' if ok else 'FAIL'}] {self.version} {name}{': ' + detail if detail else ''}", flush=True
        )


def overlay(version: str) -> Path | None:
    """Site dir holding only that sglang release; None for the base environment's own."""
    if version == BASE_VERSION:
        return None
    target = REPO / ".matrix" / f"sglang-{version}"
    stamp = target / ".complete"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-compile",
                "--target",
                str(target),
                f"sglang=={version}",
            ],
            check=True,
        )
        stamp.touch()
    return target


# Report files a GPU-tier run may name in the environment: the matrix writes none (two releases
# run side by side, and each tier's tearDownModule rewrites the file).
REPORT_VARIABLES = ("SGLANG_DSA_FIX_FA3_REPORT", "SGLANG_DSA_FIX_OTHER_REPORT")


def env_for(site: Path | None, full: bool = False) -> dict:
    env = {name: value for name, value in os.environ.items() if name not in REPORT_VARIABLES}
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(REPO / "python"), str(REPO / "test")])
    if full:
        env["SGLANG_DSA_FIX_FULL"] = "1"
    return env


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_patch_tool(row: Row, case: Release, tree) -> None:
    """On a temporary checkout-layout copy of the release's own files."""
    with tempfile.TemporaryDirectory() as tmp:
        for rel in release.FILES_READ:
            if (tree.package / rel).exists():
                (Path(tmp) / "python/sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tree.package / rel, Path(tmp) / "python/sglang" / rel)
        copy = trees.find_tree(tmp)
        states = {s.bug: s for s in classify.check(copy)}
        for bug, expected in expected_verdicts(case):
            state = states[bug]
            where = (
                f" ({state.site.path.name}:{state.site.lineno} `{state.site.found}`)" if state.site else ""
            )
            row.add(f"check {bug.value}", state.verdict.value == expected, f"{state.verdict.value}{where}")
        files = [s.site.path for s in states.values() if s.site is not None]
        before = {p: sha(p) for p in files}
        if not any(s.verdict.value == AFFECTED for s in states.values()):
            source_patch.apply(copy)
            row.add("apply changes nothing", {p: sha(p) for p in files} == before)
            return
        (Path(tmp) / "fix.patch").write_bytes(source_patch.upstream_diff(copy))
        git = subprocess.run(
            ["git", "apply", "--check", "fix.patch"], cwd=tmp, capture_output=True, text=True
        )
        row.add("diff: git apply --check", git.returncode == 0, git.stderr.strip())
        outcome = source_patch.apply(copy)
        fixed = bool(outcome.changed) and all(s.verdict.value != AFFECTED for s in outcome.states)
        row.add("apply fixes every affected bug", fixed, ", ".join(p.name for p in outcome.changed))
        once = {p: sha(p) for p in files}
        source_patch.apply(copy)
        row.add("apply again changes nothing", {p: sha(p) for p in files} == once)
        source_patch.revert(copy)
        row.add("revert restores every sha256", {p: sha(p) for p in files} == before)
        row_state = states[Bug.ROW_OVERFLOW]
        if row_state.site is not None and row_state.site.comment[: len(sites.ROUNDED_ROW_COMMENT)] == (
            sites.ROUNDED_ROW_COMMENT
        ):
            check_older_row_form(row, tmp, row_state.site)


def check_members(row: Row, tree) -> None:
    """Every member keeps the contract on this release's own files (``proof.contract``: texts,
    watch, its state with no site, its change alone applied and reverted byte for byte, the
    plugin's hook, an answer at every point of the rule's grid)."""
    for member in members.registry():
        failed = contract.violations(member, tree.package)
        row.add(f"member contract {member.bug.value}", not failed, "; ".join(failed) or "kept")


def check_older_row_form(row: Row, tmp: str, site) -> None:
    """0.5.16 - 0.5.18: a file carrying the reservation-only change an older sglang-dsa-fix applied
    there (0.3 on 0.5.16 - 0.5.17, 0.4 on 0.5.18; with its backup) reads as fixed in tree in an
    older form; revert restores sglang's bytes, and apply then writes the allocator page's form."""
    variable = site.found.removeprefix("return ")
    call = "server_args" if "(server_args)" in site.replacement else ""
    older = dataclasses.replace(
        site,
        comment=sites.row_comment(),
        replacement=f"{variable} = max({variable}, {release.RESERVE_FUNCTION}({call}))",
    ).patched_bytes()
    backup = site.path.with_name(site.path.name + trees.BACKUP_SUFFIX)
    backup.write_bytes(site.data)
    site.path.write_bytes(older)
    state = {s.bug: s for s in classify.check(trees.find_tree(tmp))}[Bug.ROW_OVERFLOW]
    row.add(
        "an older form of the row change: fixed in tree, older",
        (state.verdict, state.site.legacy) == (Verdict.FIXED_IN_TREE, True),
        f"{state.verdict.value}, legacy {state.site.legacy}",
    )
    source_patch.revert(trees.find_tree(tmp))
    restored = site.path.read_bytes() == site.data and not backup.exists()
    source_patch.apply(trees.find_tree(tmp))
    row.add(
        "... revert restores sglang's bytes, apply writes the allocator page's form",
        restored and site.path.read_bytes() == site.patched_bytes(),
        f"restored {restored}",
    )
    source_patch.revert(trees.find_tree(tmp))


def run_pytest(row: Row, name: str, site: Path | None, target: str, full: bool) -> None:
    """``target``: pytest node ids, space-separated."""
    began = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
            *target.split(),
        ],
        cwd=REPO,
        env=env_for(site, full),
        capture_output=True,
        text=True,
    )
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    row.add(name, proc.returncode == 0, f"{last} [{time.time() - began:.0f}s]")
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")


def check_upstream_tests(row: Row, tree, site: Path | None, tests: list) -> None:
    """Each upstream-form test must fail on the pristine release and pass on a patched copy."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(tree.package, Path(tmp) / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
        source_patch.apply(trees.find_tree(tmp))
        for test in tests:
            for label, path, want in (("pristine fails", site, 1), ("patched passes", Path(tmp), 0)):
                env = {**env_for(path), "TRITON_INTERPRET": "1"}
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pytest",
                        "-q",
                        "-p",
                        "no:cacheprovider",
                        "-p",
                        "no:warnings",
                        str(test),
                    ],
                    cwd=REPO,  # not tmp: the copy there must only be reached through PYTHONPATH
                    env=env,
                    capture_output=True,
                    text=True,
                )
                last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
                row.add(f"upstream {test.stem}: {label}", proc.returncode == want, last)


def status_prove(site: Path, model: str, launch: list) -> tuple:
    """``status --json --gpu h200 --prove -- --model-path <tiny model> <launch> --device cuda``
    against the release: (the report, or None, and the process). ``{model}`` in ``launch`` is
    the model's directory (it holds an empty ``lora/`` too)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((REPO / "benchmark" / f"tiny_{model}_model.json").read_text())
        config["max_position_embeddings"] = 8192
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        (Path(tmp) / "lora").mkdir()
        launch = ["--model-path", tmp, *(a.format(model=tmp) for a in launch), "--device", "cuda"]
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_dsa_fix", "status", "--json", "--sglang-root", str(site)]
            + ["--gpu", "h200", "--prove", "--", *launch],
            env=env_for(site),
            capture_output=True,
            text=True,
        )
    try:
        return json.loads(proc.stdout), proc
    except ValueError:
        return None, proc


def row_bug(report: dict) -> dict:
    return next(b for b in report["bugs"] if b["bug"] == Bug.ROW_OVERFLOW.value)


def check_uno_prove(row: Row, site: Path) -> None:
    """UNO (its own prepare, which raises before it would pass the row): ``status --prove`` drives
    it through sglang's own decode dispatch; sglang's sizing holds it (0 columns, agreeing). The
    LoRA path is required by sglang and not read by the resolution."""
    launch = ["--speculative-algorithm", "UNO", "--uno-lora-path", "{model}/lora"]
    report, proc = status_prove(
        site, "llama", [*launch, "--speculative-num-draft-tokens", "4", "--attention-backend", "fa3"]
    )
    try:
        at = row_bug(report)["at_configuration"]
        got = (row_bug(report)["state"], at["columns_past_row_end"], at["measured"]["columns_past_row_end"])
        got += (at["measured"]["agrees_with_arithmetic"],)
    except (TypeError, KeyError, StopIteration):
        got = proc.stderr.strip()[-300:]
    row.add(
        "status --prove -- llama h200 UNO 4 (state, columns, measured, agrees)",
        got == ("not_reachable", 0, 0, True),
        str(got),
    )


def check_spec_v1(row: Row, site: Path) -> None:
    """0.5.13 runs NGRAM on spec v1 (its ScheduleBatch.is_spec_v2 is the algorithm's
    supports_spec_v2: EAGLE and STANDALONE only): no spec-v2 reservation, so bug #2 is not
    reached, and ``--prove`` has nothing to drive."""
    report, proc = status_prove(
        site, "llama", ["--speculative-algorithm", "NGRAM", "--context-length", "4096"]
    )
    try:
        why = row_bug(report)["at_configuration"]["why_not"]
        got = (
            report["configuration"]["speculative_runs_spec_v2"],
            row_bug(report)["state"],
            "spec-v1" in why,
        )
    except (TypeError, KeyError, StopIteration):
        got = proc.stderr.strip()[-300:]
    row.add(
        "status --prove -- llama h200 NGRAM (spec v1 here: runs v2, state, why)",
        got == (False, "not_reachable", True),
        str(got),
    )


def check_plugin_decisions(row: Row, case: Release, site: Path | None) -> None:
    """What the plugin would do on this release (found, not imported), and status --json."""
    code = (
        "import json; from sglang_dsa_fix import plugin; "
        "print(json.dumps({p.bug.value: [p.state.token, p.hook.value] for p in plugin.decide()}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(site), capture_output=True, text=True)
    try:
        said = json.loads(proc.stdout)
    except ValueError:
        said = {"error": proc.stderr[-300:]}
    # Affected: hooked (installed; protected once it runs); else the files' own state, no hook.
    expected = {
        bug.value: ["protected_by_plugin", "installed"] if verdict == AFFECTED else [verdict, "none"]
        for bug, verdict in expected_verdicts(case)
    }
    if case.row_inline:  # nothing to hook: apply
        expected[Bug.ROW_OVERFLOW.value] = [AFFECTED, "none"]
    row.add("plugin decides", said == expected, json.dumps(said))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_dsa_fix", "status", "--json"],
        env=env_for(site),
        capture_output=True,
        text=True,
    )
    try:
        verdicts = [b["tree_state"] for b in json.loads(proc.stdout)["bugs"]]
    except (ValueError, KeyError):
        verdicts = [proc.stderr[-300:]]
    row.add("status --json verdicts", verdicts == [v for _, v in expected_verdicts(case)], str(verdicts))


# (0.5.23's own EAGLE hook reads --speculative-eagle-topk unguarded when steps and D are given:
# without it sglang fails with a TypeError, which status reports as sglang's rejection.)
EAGLE_3_4 = "--speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4".split()
EAGLE_8_9 = "--speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps 8 --speculative-num-draft-tokens 9".split()
# (model, GPU profile, launch args, expected: page_size, bug #2 state (bug #3's too where given),
# exit code). sglang runs DSA at page 64 on CUDA (0.5.23 arg_groups/model_overrides/deepseek_v2.py
# :171) and page 1 on the legacy ROCm DSA path (:155); NGRAM fills its own D 12 / topk 10
# (speculative_hook.py); Llama on FA3 (bug #3: a verify at the bound reads D pages past, page 1).
FA3_EAGLE = [*EAGLE_3_4, "--attention-backend", "fa3", "--speculative-draft-model-path", "{llama}"]
RESOLUTION_CASES = (
    ("dsa", "h200", EAGLE_3_4, 64, "not_reachable", 0),
    ("dsa", "mi300", EAGLE_3_4, 1, "not_reachable", 0),  # page 1, but D 4: 2·4 <= 4 + 4
    ("dsa", "mi300", EAGLE_8_9, 1, "affected", 1),
    # NGRAM's topk 10 on FA3 (sglang's default for Llama on sm90): bug #3's topk > 1 rule, the verify
    # prefix reads past the table (test/srt/test_topk_reach.py drives it).
    ("llama", "h200", ["--speculative-algorithm", "NGRAM"], 1, ("affected", "affected"), 1),
    # DFLASH (spec v2 from 0.5.14; resolved here on 0.5.17 / 0.5.23): block 16 from the draft's config; its own 2 x block reservation.
    (
        "llama",
        "h200",
        ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "{dflash}"],
        1,
        "affected",
        1,
    ),
    ("llama", "h200", FA3_EAGLE, 1, ("not_reachable", "affected"), 1),
    ("llama", "h200", [*FA3_EAGLE, "--page-size", "16"], 16, ("not_reachable", "affected"), 1),
)


def check_dcp_resolution(row: Row, site: Path | None, version: str) -> None:
    """DSA (page 64) under decode context parallel 2, EAGLE 3 / 1 / 4, context 2048: sglang's own
    sizing with the widths a server's DCP group gives (allocator page 128), and ``--prove``
    driving the same configuration (dcp included) agrees with the arithmetic: 57 columns where the
    row misses the allocator page (0.5.16 - 0.5.18), none where it holds it (0.5.19+)."""
    holds = release.form_for(version).row_holds_alloc_page
    launch = [*EAGLE_3_4, "--context-length", "2048", "--dcp-size", "2", "--tp-size", "2"]
    report, proc = status_prove(site, "dsa", launch)
    live = False  # the plugin found on the target's sys.path (this environment has it): it holds it
    try:
        live = report["plugin"]["live"]
        bug = row_bug(report)
        at, widths = bug["at_configuration"], report["widths"]
        got = (
            widths["alloc_page_size"],
            widths["row_extra"],
            at["columns_past_row_end"],
            at["measured"]["columns_past_row_end"],
            at["measured"]["agrees_with_arithmetic"],
            bug["state"],
            proc.returncode,
        )
    except (TypeError, KeyError, StopIteration):
        got = proc.stderr.strip()[-300:]
    reached = ("protected_by_plugin", 0) if live else ("affected", 1)
    want = (128, 135, 0, 0, True, "not_reachable", 0) if holds else (128, 71, 57, 57, True, *reached)
    row.add(
        "status --prove -- dsa h200 EAGLE 1 3 4 --dcp-size 2 (page, row, columns, measured, ...)",
        got == want,
        str(got),
    )


def check_resolution(row: Row, site: Path | None) -> None:
    """``status -- <launch args>`` against this release: sglang's own resolution decides."""
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("dsa", "llama", "dflash"):
            source = "llama" if model == "dflash" else model
            config = json.loads((REPO / "benchmark" / f"tiny_{source}_model.json").read_text())
            config["max_position_embeddings"] = 8192
            if model == "dflash":  # a DFLASH draft (0.5.23 speculative/dflash_utils.py:588)
                config.update(architectures=["DFlashDraftModel"], block_size=16)
                config["dflash_config"] = {"block_size": 16, "target_layer_ids": [0], "mask_token_id": 2047}
            (Path(tmp) / model).mkdir()
            (Path(tmp) / model / "config.json").write_text(json.dumps(config))
        for model, gpu, args, page, state, code in RESOLUTION_CASES:
            label = f"status -- {model} {gpu} {' '.join(a for a in args[1::2] if '{' not in a)}"
            args = [a.format(dflash=Path(tmp) / "dflash", llama=Path(tmp) / "llama") for a in args]
            state = state if isinstance(state, tuple) else (state,)
            launch = [
                "--model-path",
                str(Path(tmp) / model),
                *args,
                "--context-length",
                "4096",
                "--device",
                "cuda",
            ]
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "sglang_dsa_fix",
                    "status",
                    "--json",
                    "--sglang-root",
                    str(site),
                    "--gpu",
                    gpu,
                    *(["--prove"] if "DFLASH" in args else []),  # DFLASH's own prepare, driven
                    "--",
                    *launch,
                ],
                env=env_for(site),
                capture_output=True,
                text=True,
            )
            expected = (page, state, code)
            try:
                report = json.loads(proc.stdout)
                if report["plugin"]["live"]:
                    # The target interpreter (this environment) has the plugin installed, and
                    # status finds it on its sys.path: what is reached is then protected by it.
                    held = tuple("protected_by_plugin" if s == "affected" else s for s in state)
                    code = 1 if "affected" in held else 2 if "cannot_tell" in held else 0
                    expected = (page, held, code)
                states = {b["bug"]: b for b in report["bugs"]}
                bug = states[Bug.ROW_OVERFLOW.value]
                said = (bug["state"], states[Bug.FA3_PAGE_TABLE.value]["state"])[: len(state)]
                got = (report["configuration"]["page_size"], said, proc.returncode)
                detail = f"{got} columns {bug.get('at_configuration', {}).get('columns_past_row_end')}"
                if len(state) > 1:
                    fa3 = states[Bug.FA3_PAGE_TABLE.value].get("at_configuration", {})
                    detail += f", FA3 pages past the table {fa3.get('pages_past_table')}"
            except (ValueError, KeyError, StopIteration):
                got, detail = None, proc.stderr.strip()[-300:]
            row.add(label, got == expected, detail)
            if "DFLASH" in args and got is not None:
                measured = bug["at_configuration"].get("measured", {})
                row.add(
                    f"{label}: --prove (DFLASH's own prepare on CPU)",
                    measured.get("agrees_with_arithmetic") is True
                    and measured.get("neighbour_cells_changed", 0) > 0,
                    str(measured),
                )
            if model == "dsa" and got is not None:
                # Bug #1's buffer as the release's own init_cuda_graph_state allocates it (these
                # releases size it from req_to_token).
                at = next(b for b in report["bugs"] if b["bug"] == Bug.PAGE_TABLE.value)["at_configuration"]
                widths = (at.get("graph_page_table_width"), at.get("req_to_token_width"))
                row.add(
                    f"{label}: graph page_table from init_cuda_graph_state",
                    str(at.get("graph_page_table_from")).endswith(".init_cuda_graph_state")
                    and widths[0] == widths[1],
                    f"{widths} {at.get('graph_page_table_from')}",
                )


def run_release(case: Release, full: bool) -> Row:
    """Every check of one release (one process: the matrix runs releases side by side); an
    error in one is that release's FAIL row, and the others go on."""
    print(f"sglang {case.version}", flush=True)
    row = Row(case.version)
    try:
        check_release(row, case, full)
    except Exception as exc:
        row.add("the release's checks ran to the end", False, f"{type(exc).__name__}: {exc}")
    return row


def check_release(row: Row, case: Release, full: bool) -> None:
    site = overlay(case.version)
    tree = trees.find_tree(str(site) if site else None)
    row.add("installed version", tree.version == case.version, str(tree.version))
    check_patch_tool(row, case, tree)
    check_members(row, tree)
    base = case.version == BASE_VERSION
    for name, reason, target in (
        ("bug #1 CPU tier", case.cpu_tier, "test/srt/test_dsa_cuda_graph.py"),
        ("bug #2 CPU tier", case.row_tier, "test/srt/test_row_overflow.py"),
        ("bug #3 CPU tier", case.fa3_tier, "test/srt/test_fa3_cuda_graph.py"),
        # Bug #3's other graph tables: each backend's measured verdict (reads past or not).
        ("other backends' graph tables", case.fa3_tier, "test/srt/test_graph_tables_other_backends.py"),
        ("triton / flashinfer flat buffers", case.fa3_tier, "test/srt/test_graph_tables_flat_buffers.py"),
        (
            "FA3 topk > 1 tables",
            None if case.version in FA3_TOPK_RUN else FA3_TOPK_NOT_RUN,
            "test/srt/test_fa3_topk_cuda_graph.py",
        ),
        # topk > 1 judged: FA3's and Triton's rules against the real backends (EAGLE 4 / 3 / 8, NGRAM).
        (
            "topk > 1 reach (FA3, Triton)",
            None if case.version in FA3_TOPK_RUN else FA3_TOPK_NOT_RUN,
            "test/srt/test_topk_reach.py",
        ),
        # TRT-LLM MLA / FlashMLA's verify tree mask: 0.5.13 - 0.5.16 sized from C, QLEN_ONLY after.
        (
            "MLA verify tree mask",
            None if case.version in MLA_MASK_RUN else MLA_MASK_NOT_RUN,
            "test/srt/test_graph_tables_mla_mask.py",
        ),
        (
            "watch: uniform verify and draft slot reads",
            None if case.version in UNIFORM_READ_RUN else UNIFORM_READ_NOT_RUN,
            UNIFORM_READ_TESTS,
        ),
        (
            "watch: row writes (0.5.23)",
            None if case.version == "0.5.23" else ROW_WRITES_0523_NOT_RUN,
            ROW_WRITES_0523_TESTS,
        ),
    ):
        if base and target in NOT_RUN_ON_BASE:
            row.add(name, True, f"skipped: {reason}")
        elif base:
            row.add(name, True, "run by the main test suite (base environment)")
        elif reason is None:
            run_pytest(row, name, site, target, full)
        else:
            row.add(name, True, f"skipped: {reason}")
    if case.resolves:
        check_resolution(row, site)
        if site is not None and (site / "sglang/srt/speculative/uno_info.py").exists():  # UNO: 0.5.20+
            check_uno_prove(row, site)
    if case.spec_v1_case and site is not None:
        check_spec_v1(row, site)
    if case.dcp_resolves:
        check_dcp_resolution(row, site, case.version)
    tests = [test for test, versions in UPSTREAM_TESTS.items() if case.version in versions]
    if tests:
        check_upstream_tests(row, tree, site, tests)
    else:
        row.add("upstream-form tests", True, f"skipped: {NO_UPSTREAM_TEST}")
    if base:
        row.add("plugin in spawned processes", True, "run by the main test suite (base environment)")
    elif case.plugin:
        check_plugin_decisions(row, case, site)
        if case.cpu_tier is None:  # the watch's DSA/NSA replay check on the real backend
            run_pytest(row, "watch: graph replays and hook targets", site, WATCH_TESTS, full)
        if case.page_table == AFFECTED:
            run_pytest(row, "plugin in spawned processes", site, "test/test_plugin.py", full)
    else:
        row.add("plugin", True, "skipped: no plugin API before 0.5.11 (use apply)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="sglang release matrix")
    parser.add_argument("--only", help="comma list of versions")
    parser.add_argument("--full", action="store_true", help="the full sweeps in every tier")
    parser.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("MATRIX_WORKERS", "2")),
        help="releases checked side by side, each in its own process (default 2, MATRIX_WORKERS)",
    )
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    cases = [case for case in RELEASES if not wanted or case.version in wanted]
    if args.workers > 1:
        # A release's checks are mostly child processes (pytest, status, pip): two releases at
        # once keep both cores of the CI machine busy. Lines interleave, each names its release;
        # the table below keeps the releases' order.
        # Newest first: they run the most tiers, and the light old releases fill the end.
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
            rows = list(pool.map(run_release, cases[::-1], [args.full] * len(cases)))[::-1]
    else:
        rows = [run_release(case, args.full) for case in cases]

    print("\n| sglang | checks run | result | skipped (why) |\n|---|---|---|---|")
    passed = failed = 0
    for row in rows:
        ran = [name for name, _, detail in row.checks if not detail.startswith("skipped")]
        skipped = [
            f"{name}: {detail[len('skipped: ') :]}"
            for name, _, detail in row.checks
            if detail.startswith("skipped")
        ]
        bad = [name for name, ok, _ in row.checks if not ok]
        passed += sum(ok for _, ok, detail in row.checks if not detail.startswith("skipped"))
        failed += len(bad)
        print(
            f"| {row.version} | {'; '.join(ran)} | {'FAIL: ' + ', '.join(bad) if bad else 'ok'} "
            f"| {'; '.join(skipped) or '-'} |"
        )
    print(f"release matrix: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
