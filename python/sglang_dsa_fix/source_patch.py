"""In-tree form of both fixes: classify, apply, revert and diff an sglang tree.

``inspect`` returns one ``BugState`` per bug; ``apply`` / ``revert`` return an ``Outcome``
(data; only the CLI renders it). The original of every file changed is kept beside it as
``<file>.sglang-dsa-fix.orig`` so ``revert`` restores the original bytes exactly. Writes are
atomic (temp file + rename) and keep owner, group, mode and extended attributes; a symlinked
file is written through to its target. A multi-file apply either changes every file or none.
Commands on one tree are serialised with an flock on the ``sglang`` package directory.
Anything unexpected raises ``ToolError`` before a byte is written.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import importlib.util
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import sites
from sglang_dsa_fix.sites import Site
from sglang_dsa_fix.tree import SglangTree, ToolError
from sglang_dsa_fix.verdicts import Bug, Verdict

BACKUP_SUFFIX = ".sglang-dsa-fix.orig"
LOCK_TIMEOUT_S = 30.0


@dataclass
class BugState:
    bug: Bug
    verdict: Verdict
    site: Optional[Site] = None
    original: Optional[bytes] = None  # pristine bytes of the site's file, when known
    stale_bytecode: list = field(default_factory=list)  # .pyc files Python loads instead
    detail: str = ""

    def to_dict(self) -> dict:
        out = {"bug": self.bug.value, "verdict": self.verdict.value, "detail": self.detail}
        if self.site is not None:
            out.update(file=str(self.site.path), line=self.site.lineno, found=self.site.found)
        if self.stale_bytecode:
            out["stale_bytecode"] = [str(p) for p in self.stale_bytecode]
        return out


@dataclass
class Outcome:
    """What apply / revert did."""

    action: str  # "apply" | "revert"
    changed: list  # files written
    removed: list  # backups and stale bytecode removed
    states: list  # BugState per bug, after the action

    def to_dict(self) -> dict:
        return {
            "action": self.action,
            "changed": [str(p) for p in self.changed],
            "removed": [str(p) for p in self.removed],
            "bugs": [s.to_dict() for s in self.states],
        }


def backup_path(path: Path) -> Path:
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + BACKUP_SUFFIX)


# ------------------------------------------------------------------------------ bytecode


def bytecode_files(path: Path) -> list:
    cache = Path(os.path.realpath(path)).parent / "__pycache__"
    try:
        return sorted(cache.glob(f"{path.stem}.*.pyc"))
    except OSError:
        return []


def stale_bytecode(path: Path, source: bytes) -> list:
    """``.pyc`` files Python would load without checking them against ``source``.

    Only unchecked hash-based pycs (``compileall --invalidation-mode unchecked-hash``, PEP 552
    flags == 0b01) are loaded as they are; timestamp and checked-hash pycs are revalidated.
    """
    stale = []
    expected = importlib.util.source_hash(source)
    for pyc in bytecode_files(path):
        try:
            with open(pyc, "rb") as handle:
                header = handle.read(16)
        except OSError:
            continue
        flags = int.from_bytes(header[4:8], "little")
        if flags == 0b01 and header[8:16] != expected:
            stale.append(pyc)
    return stale


# ------------------------------------------------------------------------------ classify


def _state(tree: SglangTree, bug: Bug) -> BugState:
    site = sites.LOCATORS[bug](tree)
    if site is None:
        if bug is Bug.ROW_OVERFLOW and sites.has_spec_v2_reservation(tree):
            return BugState(
                bug,
                Verdict.NOT_COVERED,
                detail=(
                    "this release sizes the req_to_token row inline in model_runner.py beside an "
                    "opt-in spec-v2 decode reservation of another form (0.5.4: --enable-beta-spec, "
                    "seq_lens + A instead of kv_committed_len + 2A); this tool neither judges nor "
                    "fixes it"
                ),
            )
        what = "no DSA/NSA backend" if bug is Bug.PAGE_TABLE else "no spec-v2 decode reservation"
        return BugState(bug, Verdict.NOT_APPLICABLE, detail=what)
    if site.patched_here:
        backup = backup_path(site.path)
        original = backup.read_bytes() if backup.is_file() else None
        if original is not None:
            original_site = sites.site_in(site, tree, original)
            matches = original_site is not None and (
                site.legacy or original_site.patched_bytes() == site.data
            )
            if not matches or original_site.patched_here:
                raise ToolError(
                    f"{site.path}: changed since sglang-dsa-fix applied it ({backup.name} no "
                    "longer matches): not touching it; reinstall sglang or restore the file by hand"
                )
        stale = stale_bytecode(site.path, site.data)
        verdict = Verdict.STALE_BYTECODE if stale else Verdict.FIXED_IN_TREE
        detail = "" if original is not None else "no backup (patched by `git apply`?)"
        if site.legacy:
            detail = (
                "the margin form of an older sglang-dsa-fix (headroom reserve - margin): run "
                "`sglang-dsa-fix revert` then `apply` to hold the whole reservation"
            )
        return BugState(bug, verdict, site, original, stale, detail)
    if site.fixed_upstream:
        return BugState(
            bug, Verdict.FIXED_UPSTREAM, site, detail="reserves the decode reservation at every page size"
        )
    if site.unknown:
        return BugState(bug, Verdict.NOT_COVERED, site, detail=site.unknown)
    backup = backup_path(site.path)
    if backup.is_file() and backup.read_bytes() != site.data:
        # (A backup equal to the file is what an interrupted apply leaves: apply rewrites it.)
        raise ToolError(
            f"{site.path}: {backup.name} exists but the file neither carries the fix nor "
            "matches it: changed since sglang-dsa-fix applied it; not touching it"
        )
    detail = f"this row sizing is affected {site.affected_when}" if site.affected_when else ""
    return BugState(bug, Verdict.AFFECTED, site, site.data, detail=detail)


def inspect(tree: SglangTree) -> list:
    """One BugState per bug. ToolError when a file is not recognised or was hand-edited."""
    try:
        return [_state(tree, bug) for bug in Bug]
    except OSError as exc:
        raise ToolError(f"{exc.filename or tree.package}: cannot read ({exc.strerror})") from None


def check(tree: SglangTree) -> list:
    """``inspect`` under the shared lock (never sees a half-finished apply of another run)."""
    with locked(tree, exclusive=False):
        return inspect(tree)


# ------------------------------------------------------------------------------ writing


@contextlib.contextmanager
def locked(tree: SglangTree, exclusive: bool):
    """flock on the ``sglang`` directory itself: serialises runs, creates no file."""
    try:
        fd = os.open(tree.package, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ToolError(f"{tree.package}: cannot open ({exc.strerror})") from None
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ToolError(
                        f"{tree.package}: another sglang-dsa-fix run holds the lock; try again"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _metadata(path: Path) -> dict:
    st = os.stat(path)
    xattrs = {}
    for name in os.listxattr(path) if hasattr(os, "listxattr") else ():
        with contextlib.suppress(OSError):
            xattrs[name] = os.getxattr(path, name)
    return {"uid": st.st_uid, "gid": st.st_gid, "mode": stat.S_IMODE(st.st_mode), "xattrs": xattrs}


def _ensure_writable(path: Path) -> None:
    real = Path(os.path.realpath(path))
    for target in (real, real.parent):
        st = target.stat()
        # Checked on mode bits too: as root, os.access says yes to a chmod a-w file.
        if not os.access(target, os.W_OK) or not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise ToolError(f"{target}: read-only; nothing changed")
    st = real.stat()
    if os.geteuid() != 0 and st.st_uid != os.geteuid():
        raise ToolError(
            f"{real}: owned by uid {st.st_uid}; rewriting it as uid {os.geteuid()} would change "
            "its owner: run as that user or as root; nothing changed"
        )


def _write(path: Path, data: bytes, metadata: dict) -> None:
    """Atomically replace ``path``'s target with ``data`` and the given owner/mode/xattrs."""
    real = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if os.geteuid() == 0:
            os.chown(tmp, metadata["uid"], metadata["gid"])
        os.chmod(tmp, metadata["mode"])
        for name, value in metadata["xattrs"].items():
            try:
                os.setxattr(tmp, name, value)
            except OSError:
                if name.startswith("user."):
                    raise
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temps(paths) -> list:
    """Temp files an interrupted run (SIGKILL) left beside the files we write."""
    removed = []
    for path in paths:
        real = Path(os.path.realpath(path))
        for tmp in real.parent.glob(f".{real.name}.*.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def _remove(paths) -> list:
    removed = []
    for path in paths:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _transaction(writes) -> None:
    """``writes``: (path, new bytes, metadata). All or nothing: on failure undo what was written."""
    done = []
    try:
        for path, new, metadata in writes:
            old = Path(os.path.realpath(path)).read_bytes() if Path(path).exists() else None
            _write(path, new, metadata)
            done.append((path, old, metadata))
    except OSError as exc:
        for path, old, metadata in reversed(done):
            with contextlib.suppress(OSError):
                if old is None:
                    Path(path).unlink()
                else:
                    _write(path, old, metadata)
        raise ToolError(f"{exc.filename or path}: cannot write ({exc.strerror}); nothing changed") from None


def apply(tree: SglangTree) -> Outcome:
    """Fix every affected bug in the tree; remove stale bytecode of the files it fixed."""
    with locked(tree, exclusive=True):
        states = inspect(tree)
        todo = [s for s in states if s.verdict is Verdict.AFFECTED]
        stale = [s for s in states if s.verdict is Verdict.STALE_BYTECODE]
        writes = []
        for state in todo:
            path = state.site.path
            _ensure_writable(path)
            new = state.site.patched_bytes()
            compile(new, str(path), "exec")  # never write a file that does not parse
            metadata = _metadata(path)
            # Backup first: a crash between the two leaves a pristine file and a spare backup.
            writes += [(backup_path(path), state.site.data, metadata), (path, new, metadata)]
        for state in stale:
            _ensure_writable(state.stale_bytecode[0])
        temps = _remove_stale_temps([s.site.path for s in states if s.site is not None])
        _transaction(writes)
        changed = [state.site.path for state in todo]
        removed = temps + _remove([pyc for s in todo + stale for pyc in bytecode_files(s.site.path)])
        return Outcome("apply", changed, removed, inspect(tree))


def revert(tree: SglangTree) -> Outcome:
    """Restore the original bytes of every file this tool changed."""
    with locked(tree, exclusive=True):
        states = inspect(tree)
        ours = [s for s in states if s.verdict in (Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE)]
        missing = [s for s in ours if s.original is None]
        if missing:
            raise ToolError(
                f"{missing[0].site.path}: carries the fix but has no {BACKUP_SUFFIX} backup "
                "(applied with `git apply`?): restore it with `git checkout` or by reinstalling "
                "sglang; nothing changed"
            )
        writes = []
        for state in ours:
            _ensure_writable(state.site.path)
            writes.append((state.site.path, state.original, _metadata(state.site.path)))
        temps = _remove_stale_temps([s.site.path for s in states if s.site is not None])
        _transaction(writes)
        removed = temps + _remove(
            [backup_path(s.site.path) for s in ours]
            + [pyc for s in ours for pyc in bytecode_files(s.site.path)]
        )
        return Outcome("revert", [s.site.path for s in ours], removed, inspect(tree))


def upstream_diff(tree: SglangTree) -> bytes:
    """Unified diff (git-apply-able in an sglang checkout) of every file the fix changes.

    Empty when nothing needs changing or the change is already there without a backup.
    """
    chunks = []
    states = check(tree)
    for state in states:
        if state.verdict not in (Verdict.AFFECTED, Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE):
            continue
        if state.original is None:
            continue
        original_site = sites.site_in(state.site, tree, state.original)
        name = tree.repo_relative(state.site.path).encode()
        chunks += difflib.diff_bytes(
            difflib.unified_diff,
            state.original.splitlines(keepends=True),
            original_site.patched_bytes().splitlines(keepends=True),
            b"a/" + name,
            b"b/" + name,
        )
    return b"".join(chunks)
