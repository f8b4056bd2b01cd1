"""In-tree form of the fixes: apply, revert and diff an sglang tree (``classify`` judges it).

``apply`` / ``revert`` return an ``Outcome``
(data; only the CLI renders it). The original of every file changed is kept beside it as
``<file>.sglang-dsa-fix.orig`` so ``revert`` restores the original bytes exactly. Writes are
atomic (temp file + rename) and keep owner, group, mode and extended attributes; a symlinked
file is written through to its target. A multi-file apply either changes every file or none.
Files are read and written through directory fds (``safe_files``): each path is resolved once,
and as root a place another user could redirect is refused (``--allow-unsafe-dirs``).
Commands on one tree are serialised with an flock on the ``sglang`` package directory.
Anything unexpected raises ``ToolError`` before a byte is written.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass
from pathlib import Path

from sglang_dsa_fix import classify, members, safe_files, snapshot
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.snapshot import BACKUP_SUFFIX, locked
from sglang_dsa_fix.tree import SglangTree
from sglang_dsa_fix.verdicts import Verdict


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


# ------------------------------------------------------------------------------ writing
# Every file written is located once (safe_files: a name in an open directory, symlinks resolved
# by hand) and then read, replaced and removed only through that directory's fd.


@contextlib.contextmanager
def _reading(fallback):
    """An OS error while planning the writes: one line, before anything is written."""
    try:
        yield
    except OSError as exc:
        raise ToolError(
            f"{exc.filename or fallback}: cannot read ({exc.strerror}); nothing changed"
        ) from None


def _locate_checked(path: Path, package, allow_unsafe_dirs: bool):
    """The File ``path`` leads to, located once, in a place root may write
    (``safe_files.check_place``, with the links followed on the way)."""
    links = []
    loc = snapshot.walk(path, False, links)
    safe_files.check_place(path, loc, package, allow_unsafe_dirs, links)
    return loc


def _locate_for_rewrite(path: Path, expected: bytes, package, allow_unsafe_dirs: bool) -> tuple:
    """(File, metadata) of the file ``path`` leads to: located once, a place root may write,
    writable, and still holding ``expected`` (what inspect judged)."""
    loc = _locate_checked(path, package, allow_unsafe_dirs)
    data, metadata = snapshot.read_at(loc)
    problem = safe_files.writable_error(loc)
    if problem:
        raise ToolError(problem)
    if data != expected:
        raise ToolError(f"{path}: changed while sglang-dsa-fix ran; nothing changed")
    return loc, metadata


def _bytecode_beside(loc, path: Path) -> list:
    """``path``'s .pyc files in the ``__pycache__`` beside the file it leads to (not through a symlink)."""
    cache = snapshot.subdir(loc.dir, "__pycache__")
    return [] if cache is None else snapshot.matching(cache, f"{path.stem}.*.pyc")


def _write(loc, data: bytes, metadata: dict) -> None:
    """Atomically replace the file at ``loc`` with ``data`` and the given owner/mode/xattrs."""
    safe_files.replace(loc, data, metadata)


def _remove_stale_temps(locs) -> list:
    """Temp files an interrupted run (SIGKILL) left beside the files we write."""
    removed = []
    for loc in locs:
        for tmp in safe_files.temps(loc):
            with contextlib.suppress(OSError):
                if safe_files.unlink(tmp):
                    removed.append(tmp.path)
    return removed


def _remove(files, action: str) -> list:
    """Remove backups and bytecode once the files are written. A failure names the file and says
    that the action itself is done (exit 2 all the same: something is left to clean up)."""
    removed = []
    for loc in files:
        try:
            if safe_files.unlink(loc):
                removed.append(loc.path)
        except OSError as exc:
            raise ToolError(
                f"{loc.path}: cannot remove ({exc.strerror}); the {action} itself succeeded: remove "
                "that file by hand"
            ) from None
    return removed


def _transaction(writes) -> None:
    """``writes``: (File, new bytes, metadata). All or nothing: on failure undo what was written."""
    done = []
    for loc, new, metadata in writes:
        try:
            old = snapshot.read_existing(loc)
            _write(loc, new, metadata)
        except OSError as exc:
            # Own names in this loop: the error is about ``loc``, the file that failed.
            for undo_loc, undo_old, undo_metadata in reversed(done):
                with contextlib.suppress(OSError):
                    if undo_old is None:
                        safe_files.unlink(undo_loc)
                    else:
                        _write(undo_loc, undo_old, undo_metadata)
            raise ToolError(f"{loc}: cannot write ({exc.strerror or exc}); nothing changed") from None
        done.append((loc, old, metadata))


def _states(tree: SglangTree) -> list:
    """The states of the tree as it is now; the caller holds the exclusive lock."""
    return classify.states(snapshot.read(tree, lock=False))


def apply(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Fix every affected bug in the tree; remove stale bytecode of the files it fixed."""
    with locked(tree, exclusive=True) as package:
        found = _states(tree)
        todo = [s for s in found if s.verdict is Verdict.AFFECTED]
        stale = [s for s in found if s.verdict is Verdict.STALE_BYTECODE]
        writes, pycs = [], []
        with _reading(tree.package):
            for state in todo:
                path = state.site.path
                loc, metadata = _locate_for_rewrite(path, state.site.data, package, allow_unsafe_dirs)
                new = state.site.patched_bytes()
                try:
                    compile(new, str(path), "exec")  # never write a file that does not parse
                except (SyntaxError, ValueError) as exc:
                    raise ToolError(
                        f"{path}: not recognised: patched, it would not parse ({exc}); nothing changed"
                    ) from None
                # Backup first: a crash between the two leaves a pristine file and a spare backup.
                backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                writes += [(backup, state.site.data, metadata), (loc, new, metadata)]
                pycs += _bytecode_beside(loc, path)
            for state in stale:
                loc = _locate_checked(state.site.path, package, allow_unsafe_dirs)
                for pyc in _bytecode_beside(loc, state.site.path):
                    problem = safe_files.writable_error(pyc)
                    if problem:
                        raise ToolError(problem)
                    pycs.append(pyc)
            temps = _remove_stale_temps([loc for loc, _, _ in writes[1::2]])
        _transaction(writes)
        removed = temps + _remove(pycs, "apply")
        return Outcome("apply", [state.site.path for state in todo], removed, _states(tree))


def revert(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Restore the original bytes of every file this tool changed."""
    with locked(tree, exclusive=True) as package:
        found = _states(tree)
        ours = [s for s in found if s.verdict in (Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE)]
        missing = [s for s in ours if s.original is None]
        if missing:
            raise ToolError(
                f"{missing[0].site.path}: carries the fix but has no {BACKUP_SUFFIX} backup "
                "(applied with `git apply`?): restore it with `git checkout` or by reinstalling "
                "sglang; nothing changed"
            )
        writes, backups, pycs = [], [], []
        with _reading(tree.package):
            # Backups equal to their (pristine) file: what a revert killed before removing them
            # leaves. Nothing to restore; remove them too.
            for state in found:
                if state.verdict is Verdict.AFFECTED and state.site is not None:
                    loc = snapshot.locate(state.site.path)
                    backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                    if snapshot.read_existing(backup) == state.site.data:
                        backups.append(backup)
            for state in ours:
                path = state.site.path
                loc, metadata = _locate_for_rewrite(path, state.site.data, package, allow_unsafe_dirs)
                backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                if snapshot.read_existing(backup) != state.original:
                    raise ToolError(f"{backup.path}: changed while sglang-dsa-fix ran; nothing changed")
                writes.append((loc, state.original, metadata))
                backups.append(backup)
                pycs += _bytecode_beside(loc, path)
            temps = _remove_stale_temps([loc for loc, _, _ in writes])
        _transaction(writes)
        removed = temps + _remove(backups + pycs, "revert")
        return Outcome("revert", [s.site.path for s in ours], removed, _states(tree))


def upstream_diff(tree: SglangTree) -> bytes:
    """Unified diff (git-apply-able in an sglang checkout) of every file the fix changes.

    Empty when nothing needs changing or the change is already there without a backup.
    """
    chunks = []
    files = snapshot.read(tree)
    for state in classify.states(files):
        if state.verdict not in (Verdict.AFFECTED, Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE):
            continue
        if state.original is None:
            continue
        original_site = members.site_in(state.site, files, state.original)
        name = tree.repo_relative(state.site.path).encode()
        chunks += difflib.diff_bytes(
            difflib.unified_diff,
            state.original.splitlines(keepends=True),
            original_site.patched_bytes().splitlines(keepends=True),
            b"a/" + name,
            b"b/" + name,
        )
    return b"".join(chunks)
