"""The pure tests (verdicts, width, the release table) run where neither torch nor sglang is
installed: an interpreter with no packages at all runs them with the standard library's unittest."""

import os
import subprocess
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PURE_MODULES = ("test_release", "test_verdicts")


def test_pure_tests_run_without_torch_or_sglang(tmp_path):
    venv.create(tmp_path / "bare", with_pip=False, symlinks=True)
    python = str(tmp_path / "bare" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), str(REPO / "test")])
    check = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'sglang')))"
    assert subprocess.run([python, "-c", check], env=env).returncode == 0, "the bare interpreter has torch"
    done = subprocess.run(
        [python, "-m", "unittest", "-q", *PURE_MODULES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "OK" in done.stderr, done.stderr[-500:]
