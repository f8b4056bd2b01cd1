"""As root, what the resolution child would run and import, checked before it starts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from sglang_dsa_fix import safe_files
from sglang_dsa_fix.child_process import OutputCapExceeded, run_child
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.tree import SglangTree

# As root (``import_path``), the target's sys.path is asked first, without the site module
# (``-S``: no .pth file runs): its standard library entries and its site directories; each of
# those, every directory a .pth line there adds, the PYTHONPATH entries and the tree's parent are
# checked (``safe_files.import_dir_foreign``) before the child starts, and the child refuses to
# go on (``BOOT``) when its sys.path holds an entry that was not checked.
PATH_MARK = "@@sglang-dsa-fix-path@@ "
PROBE = (
    "import json, site, sys; venv, system = sys.argv[1], sys.argv[2] == '1'; "
    "dirs = site.getsitepackages([venv]) if venv else []; "
    "dirs += site.getsitepackages() if system or not venv else []; "
    f"print({PATH_MARK!r} + json.dumps({{'path': sys.path, 'site': dirs}}))"
)
PROBE_TIMEOUT_S = 30.0


def refuse_foreign_code(interpreter: Path, tree: SglangTree) -> None:
    """As root, ToolError when the child would run an interpreter, or import a tree, that a user
    other than root could change (``safe_files.foreign_code``: the file, its directories up to
    ``/``, the links on the way; the package parent and everything under ``sglang/``)."""
    if os.geteuid() != 0:
        return  # an unprivileged run executes nothing its user could not run anyway
    try:
        found = safe_files.foreign_code(interpreter, tree.package_parent)
    except OSError as exc:
        raise ToolError(f"{exc.filename or interpreter}: cannot check ({exc.strerror or exc})") from None
    if found is None:
        return
    what, where = found
    doing = "run an interpreter" if what == "interpreter" else "import code"
    named = interpreter if what == "interpreter" else tree.package
    said = f"{named}: " + ("" if where.path == str(named) else f"{where.path} is ") + where.reason
    raise ToolError(
        f"{said}; as root sglang-dsa-fix does not {doing} another user can change (pass "
        "--allow-unsafe-dirs to override)"
    )


def _pth_dirs(site_dir: str) -> list:
    """The directories the .pth files of ``site_dir`` add to sys.path, as ``site.addpackage``
    reads them (``import`` lines run code from what is already on the path: checked there)."""
    from sglang_dsa_fix.tree import MAX_METADATA_FILE, read_text

    dirs = []
    for pth in sorted(Path(site_dir).glob("*.pth")):
        try:
            lines = read_text(pth, MAX_METADATA_FILE).splitlines()
        except OSError:  # what site cannot read adds nothing
            continue
        for line in lines:
            if line.startswith("#") or not line.strip() or line.startswith(("import ", "import\t")):
                continue
            target = os.path.abspath(os.path.join(site_dir, line.rstrip()))
            if os.path.exists(target):
                dirs.append((target, f"a line of {pth}"))
    return dirs


def _venv_system_site(venv: Path) -> bool:
    """Does the venv's pyvenv.cfg include the base interpreter's site-packages?"""
    from sglang_dsa_fix.tree import MAX_METADATA_FILE, read_text

    try:
        text = read_text(venv / "pyvenv.cfg", MAX_METADATA_FILE)
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip().lower() == "include-system-site-packages":
            return value.strip().lower() == "true"
    return False


def import_path(interpreter: Path, tree: SglangTree, handed_on: list, env: dict) -> list:
    """As root, the directories the child imports from, each checked (``import_dir_foreign``):
    ToolError naming the first one another user could change. ``handed_on``: the PYTHONPATH
    entries the child gets."""
    venv = safe_files.venv_of(interpreter)
    system = "1" if venv is None or _venv_system_site(venv) else "0"
    command = [str(interpreter), "-I", "-S", "-c", PROBE, str(venv or ""), system]
    try:
        returncode, stdout, stderr = run_child(command, env, PROBE_TIMEOUT_S)
        line = next(line for line in reversed(stdout.splitlines()) if line.startswith(PATH_MARK))
        probed = json.loads(line[len(PATH_MARK) :])
        stdlib, sites = probed["path"], probed["site"]
        if not all(isinstance(e, str) for e in [*stdlib, *sites]):
            raise ValueError("not a list of paths")
    except (StopIteration, ValueError, KeyError, TypeError, OutputCapExceeded, subprocess.TimeoutExpired):
        raise ToolError(
            f"{interpreter}: did not report its sys.path, so as root sglang-dsa-fix cannot check "
            "what it would import (pass --allow-unsafe-dirs to override)"
        ) from None
    except OSError as exc:
        raise ToolError(f"{interpreter}: cannot run ({exc.strerror})") from None
    entries = [(str(tree.package_parent), "the tree's parent")]
    entries += [(e, "PYTHONPATH") for e in handed_on]
    entries += [(os.path.abspath(e), "its standard library") for e in stdlib]
    for site_dir in sites:
        entries.append((os.path.abspath(site_dir), "a site directory"))
        if os.path.isdir(site_dir):
            entries += _pth_dirs(site_dir)
    checked = []
    for entry, why in entries:
        if entry in checked:
            continue
        try:
            found = safe_files.import_dir_foreign(entry)
        except OSError as exc:
            raise ToolError(f"{exc.filename or entry}: cannot check ({exc.strerror or exc})") from None
        if found is not None:
            said = f"{entry}: " + ("" if found.path == entry else f"{found.path} is ") + found.reason
            raise ToolError(
                f"{said} ({why}, on the import path of {interpreter}); as root sglang-dsa-fix does not "
                "import code another user can change (pass --allow-unsafe-dirs to override)"
            )
        checked.append(entry)
    return checked
