"""Release matrix: the patch tool, the CPU regression tier and the plugin on real sglang releases.

Each release is installed from PyPI without dependencies into ``.matrix/sglang-<version>/`` (an
overlay put first on PYTHONPATH over the project's pinned 0.5.14 environment), then:

- patch tool, every release: on a temporary copy of the release's own backend file, ``check``
  gives the expected verdict; where affected, ``apply`` → ``check`` 0 → second ``apply`` changes
  nothing → ``revert`` restores the sha256 → ``diff`` passes ``git apply --check``; where fixed
  upstream, ``apply`` changes nothing;
- CPU regression tier (test/srt/test_dsa_cuda_graph.py) where the release imports on CPU;
- plugin in spawned processes (test/test_plugin.py) where the release has the plugin API, and
  ``plugin.decide()`` says "not needed (fixed upstream)" on fixed releases.

Prints one row per release saying what ran, what was skipped and why; exits 1 on any failure.
    python scripts/release_matrix.py [--only 0.5.12,0.5.13]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from sglang_dsa_fix import source_patch  # noqa: E402

NO_CPU_IMPORT = ("the release imports sgl_kernel at module import and the PyPI sgl-kernel wheel is a "
                 "CUDA build of several hundred MB (not tried in the CPU environment)")


@dataclass
class Release:
    version: str
    verdict: str  # expected check verdict
    cpu_tier: str | None = None  # None: run it; else the reason it cannot run on CPU
    plugin: bool = False  # plugin API present (0.5.11+)


RELEASES = [
    Release("0.5.4", "affected", cpu_tier=NO_CPU_IMPORT),
    Release("0.5.9", "affected", cpu_tier=NO_CPU_IMPORT),
    Release("0.5.10", "affected", cpu_tier=NO_CPU_IMPORT),
    Release("0.5.11", "affected", plugin=True),
    Release("0.5.12", "affected", plugin=True),
    Release("0.5.13", "affected", plugin=True),
    Release("0.5.14", "affected", plugin=True),  # the project's base environment
    Release("0.5.15", "fixed upstream", cpu_tier="fixed upstream: nothing to reproduce", plugin=True),
    Release("0.5.23", "fixed upstream", cpu_tier="fixed upstream: nothing to reproduce", plugin=True),
]
BASE_VERSION = "0.5.14"


@dataclass
class Row:
    version: str
    checks: list = field(default_factory=list)  # (name, ok, detail)

    def add(self, name, ok, detail=""):
        self.checks.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {self.version} {name}{': ' + detail if detail else ''}",
              flush=True)


def overlay(version: str) -> Path | None:
    """Site dir holding only that sglang release; None for the base environment's own."""
    if version == BASE_VERSION:
        return None
    target = REPO / ".matrix" / f"sglang-{version}"
    stamp = target / ".complete"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-compile", "--target", str(target), f"sglang=={version}"],
                       check=True)
        stamp.touch()
    return target


def env_for(site: Path | None) -> dict:
    env = dict(os.environ)
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(REPO / "python")])
    return env


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_patch_tool(row: Row, release: Release, tree: source_patch.SglangTree) -> None:
    """On a temporary checkout-layout copy of the release's backend file and version files."""
    with tempfile.TemporaryDirectory() as tmp:
        src = tree.package_parent / "sglang"
        for rel in ("_version.py", "version.py", "srt/layers/attention/dsa_backend.py",
                    "srt/layers/attention/nsa_backend.py"):
            if (src / rel).exists():
                (Path(tmp) / "python/sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, Path(tmp) / "python/sglang" / rel)
        copy = source_patch.find_tree(tmp)
        status = source_patch.inspect(copy)
        where = f"{status.site.path.name}:{status.site.lineno} `{status.site.expression}`" if status.site else ""
        row.add("check verdict", status.verdict.value == release.verdict,
                f"{status.verdict.value} ({where})")
        path = status.site.path
        before = sha(path)
        if release.verdict == "fixed upstream":
            source_patch.apply(copy)
            row.add("apply changes nothing", sha(path) == before)
            return
        diff = source_patch.upstream_diff(copy)
        (Path(tmp) / "fix.patch").write_text(diff)
        git = subprocess.run(["git", "apply", "--check", "fix.patch"], cwd=tmp,
                             capture_output=True, text=True)
        row.add("diff: git apply --check", git.returncode == 0, git.stderr.strip())
        source_patch.apply(copy)
        fixed = source_patch.inspect(copy).verdict is source_patch.Verdict.FIXED_IN_TREE
        once = sha(path)
        source_patch.apply(copy)
        row.add("apply; check fixed; apply again idempotent", fixed and sha(path) == once)
        source_patch.revert(copy)
        row.add("revert restores sha256", sha(path) == before)


def run_pytest(row: Row, name: str, site: Path | None, target: str) -> None:
    began = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:warnings", target], cwd=REPO, env=env_for(site),
                          capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    row.add(name, proc.returncode == 0, f"{last} [{time.time() - began:.0f}s]")
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")


def check_fixed_upstream_reports(row: Row, site: Path | None) -> None:
    """What the plugin and ``status --json`` say about the release (found, not imported)."""
    code = "from sglang_dsa_fix import plugin; print(plugin.decide()[0])"
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(site),
                          capture_output=True, text=True)
    said = proc.stdout.strip()
    row.add("plugin decides", said == "not needed (fixed upstream)", said or proc.stderr[-300:])
    proc = subprocess.run([sys.executable, "-m", "sglang_dsa_fix.cli", "status", "--json"],
                          env=env_for(site), capture_output=True, text=True)
    try:
        verdict = json.loads(proc.stdout)["verdict"]
    except (ValueError, KeyError):
        verdict = proc.stderr[-300:]
    row.add("status --json verdict", verdict == "fixed upstream", verdict)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="sglang release matrix")
    parser.add_argument("--only", help="comma list of versions")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    rows = []
    for release in RELEASES:
        if wanted and release.version not in wanted:
            continue
        print(f"sglang {release.version}", flush=True)
        row = Row(release.version)
        rows.append(row)
        site = overlay(release.version)
        tree = source_patch.find_tree(str(site) if site else None)
        row.add("installed version", tree.version == release.version, str(tree.version))
        check_patch_tool(row, release, tree)
        if release.cpu_tier is None and release.version != BASE_VERSION:
            run_pytest(row, "CPU regression tier", site, "test/srt/test_dsa_cuda_graph.py")
        elif release.version == BASE_VERSION:
            row.add("CPU regression tier", True, "run by the main test suite (base environment)")
        else:
            row.add("CPU regression tier", True, f"skipped: {release.cpu_tier}")
        if release.version == BASE_VERSION:
            row.add("plugin in spawned processes", True, "run by the main test suite (base environment)")
        elif release.verdict == "fixed upstream":
            check_fixed_upstream_reports(row, site)
        elif release.plugin and release.version != BASE_VERSION:
            run_pytest(row, "plugin in spawned processes", site, "test/test_plugin.py")
        elif not release.plugin:
            row.add("plugin", True, "skipped: no plugin API before 0.5.11 (use apply)")

    print("\n| sglang | checks run | result | skipped (why) |\n|---|---|---|---|")
    passed = failed = 0
    for row in rows:
        ran = [name for name, _, detail in row.checks if not detail.startswith("skipped")]
        skipped = [f"{name}: {detail[len('skipped: '):]}" for name, _, detail in row.checks
                   if detail.startswith("skipped")]
        bad = [name for name, ok, _ in row.checks if not ok]
        passed += sum(ok for _, ok, detail in row.checks if not detail.startswith("skipped"))
        failed += len(bad)
        print(f"| {row.version} | {'; '.join(ran)} | {'FAIL: ' + ', '.join(bad) if bad else 'ok'} "
              f"| {'; '.join(skipped) or '-'} |")
    print(f"release matrix: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
