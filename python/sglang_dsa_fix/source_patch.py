"""In-tree form of the fixes: apply, revert and diff an sglang tree (``classify`` judges it).

``apply`` / ``revert`` return an ``Outcome``
(data; only the CLI renders it). The original of every file changed is kept beside it as
``<file>.sglang-dsa-fix.orig`` so ``revert`` restores the original bytes exactly. Writes are
atomic (temp file + rename) and keep owner, group, mode and extended attributes; a symlinked
file is written through to its target. A multi-file apply either changes every file or none, on
a full disk too (its undo renames each backup back: ``_apply_all``); where even that fails, the
error names each file's state, and the next apply or revert finishes from there. ``revert`` goes
file by file: a file it cannot revert is named and never keeps the others from being reverted.
Files are read and written through directory fds (``safe_files``): each path is resolved once,
and as root a place another user could redirect is refused (``--allow-unsafe-dirs``).
Commands on one tree are serialised with an flock on the ``sglang`` package directory.
Anything unexpected raises ``ToolError`` before a byte is written.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from sglang_dsa_fix import classify, members, release, safe_files, snapshot
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
    notes: list = field(default_factory=list)  # what the action leaves as it is, said

    def to_dict(self) -> dict:
        return {
            "action": self.action,
            "changed": [str(p) for p in self.changed],
            "removed": [str(p) for p in self.removed],
            "notes": list(self.notes),
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


def _remove_stale_temps(tree: SglangTree, package, allow_unsafe_dirs: bool) -> list:
    """Temp files an interrupted run (SIGKILL) left beside any file a fix may change or its
    backup (``safe_files.temps``' pattern takes both), whichever file that run was writing. The
    caller holds the tree's lock, so no run of this tool is writing one now. A place root may
    not write in (``check_place``) is left alone, as is a file that cannot be removed."""
    removed = []
    for relative in release.FILES_CHANGED:
        try:
            loc = _locate_checked(tree.file(relative), package, allow_unsafe_dirs)
        except (OSError, ToolError):
            continue  # no such directory, or not a place to remove files in
        for tmp in safe_files.temps(loc):
            with contextlib.suppress(OSError):
                if safe_files.unlink(tmp):
                    removed.append(tmp.path)
    return removed


def remove_stale_temps(tree: SglangTree) -> list:
    """``check``'s part: the temp files a killed run left (under the shared lock: a run that
    writes holds the exclusive one). The paths removed."""
    with locked(tree, exclusive=False) as package:
        return _remove_stale_temps(tree, package, allow_unsafe_dirs=False)


_BY_HAND = "remove that file by hand"


def _remove_each(files: list, failures: list) -> list:
    """Remove each of ``files``: the ones removed; a failure is added to ``failures``."""
    removed = []
    for loc in files:
        try:
            if safe_files.unlink(loc):
                removed.append(loc.path)
        except OSError as exc:
            failures.append(f"{loc.path}: cannot remove ({exc.strerror or exc})")
    return removed


def _names(paths) -> str:
    """Files in a message that names several: their names (no two files a fix changes share one;
    whole paths would pass the length an error line is cut at)."""
    return ", ".join(path.name for path in paths)


@dataclass
class _Change:
    """One file of an apply: where it and its backup are, its bytes before and after."""

    loc: snapshot.File
    backup: snapshot.File
    original: bytes
    new: bytes
    metadata: dict
    had_backup: bool  # a copy of the file an interrupted run left as its backup


def _apply_all(changes: list) -> None:
    """Every file or none, a full disk included. Each file's backup is written before the file;
    undoing a file renames its backup back over it (``safe_files.rename_over``: no new space
    needed), so a file is never patched without its backup. Where even the undo fails, the
    ToolError says which files carry the fix and which backups are left."""
    done = []  # (change, whether the file itself was written), in order
    for change in changes:
        target = change.backup
        try:
            _write(change.backup, change.original, change.metadata)
            done.append((change, False))
            target = change.loc
            _write(change.loc, change.new, change.metadata)
            done[-1] = (change, True)
        except OSError as exc:
            raise ToolError(_apply_failed(target, exc, *_undo(done))) from None


def _undo(done: list) -> tuple:
    """Undo an apply's writes, last first: (files still patched, each beside its backup; backups
    left beside pristine files; files whose backup an interrupted run had left went to restore
    them, as the rename takes the backup)."""
    patched, left, used = [], [], []
    for change, written in reversed(done):
        try:
            if written:
                safe_files.rename_over(change.backup, change.loc)
            elif not change.had_backup:
                safe_files.unlink(change.backup)
        except OSError:
            (patched if written else left).append(change.loc.path)
            continue
        if written and change.had_backup:
            used.append(change.loc.path)
    return patched, left, used


def _apply_failed(loc, exc: OSError, patched: list, left: list, used: list) -> str:
    said = f"{loc}: cannot write ({exc.strerror or exc})"
    if not patched and not left:
        if used:
            return f"{said}; no file changed (the backup an interrupted run had left beside {_names(used)} was used to restore it)"
        return f"{said}; nothing changed"
    parts = [said, "undoing what it wrote failed too"]
    if patched:
        parts.append(f"these carry the fix, beside their backups: {_names(patched)}")
    if left:
        parts.append(f"these are unchanged, with a copy left as their backup: {_names(left)}")
    parts += [
        "every other file is unchanged",
        "`sglang-dsa-fix apply` finishes the change, `revert` undoes it",
    ]
    return "; ".join(parts)


def _states(tree: SglangTree) -> list:
    """The states of the tree as it is now; the caller holds the exclusive lock."""
    return classify.states(snapshot.read(tree, lock=False))


def _change(state, package, allow_unsafe_dirs: bool) -> _Change:
    """What applying ``state``'s fix writes, checked before anything is written."""
    path = state.site.path
    loc, metadata = _locate_for_rewrite(path, state.site.data, package, allow_unsafe_dirs)
    new = state.site.patched_bytes()
    try:
        compile(new, str(path), "exec")  # never write a file that does not parse
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(
            f"{path}: not recognised: patched, it would not parse ({exc}); nothing changed"
        ) from None
    backup = loc.sibling(loc.name + BACKUP_SUFFIX)
    return _Change(loc, backup, state.site.data, new, metadata, backup.st is not None)


def apply(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Fix every affected bug in the tree; remove stale bytecode of the files it fixed."""
    with locked(tree, exclusive=True) as package:
        found = _states(tree)
        todo = [s for s in found if s.verdict is Verdict.AFFECTED]
        stale = [s for s in found if s.verdict is Verdict.STALE_BYTECODE]
        changes, pycs = [], []
        with _reading(tree.package):
            for state in todo:
                changes.append(_change(state, package, allow_unsafe_dirs))
                pycs += _bytecode_beside(changes[-1].loc, state.site.path)
            for state in stale:
                loc = _locate_checked(state.site.path, package, allow_unsafe_dirs)
                for pyc in _bytecode_beside(loc, state.site.path):
                    problem = safe_files.writable_error(pyc)
                    if problem:
                        raise ToolError(problem)
                    pycs.append(pyc)
            temps = _remove_stale_temps(tree, package, allow_unsafe_dirs)
        _apply_all(changes)
        cleanup = []
        removed = temps + _remove_each(pycs, cleanup)
        if cleanup:
            raise ToolError(f"{'; '.join(cleanup)}; the apply itself succeeded: {_BY_HAND}")
        return Outcome("apply", [state.site.path for state in todo], removed, _states(tree))


@dataclass
class _Revert:
    """One file of a revert: where it and its backup are, the bytes it gets back."""

    path: Path  # the file in the tree (may be a symlink)
    loc: snapshot.File
    original: bytes
    metadata: dict
    backup: snapshot.File
    pycs: list


def _revert_plan(state, package, allow_unsafe_dirs: bool) -> _Revert:
    """What reverting ``state``'s file writes, checked before it is written; ToolError if it
    cannot be reverted."""
    path = state.site.path
    if state.original is None:
        raise ToolError(
            f"{path}: carries the fix but has no {BACKUP_SUFFIX} backup (applied with `git apply`?): "
            "restore it with `git checkout` or by reinstalling sglang"
        )
    with _reading(path):
        loc, metadata = _locate_for_rewrite(path, state.site.data, package, allow_unsafe_dirs)
        backup = loc.sibling(loc.name + BACKUP_SUFFIX)
        if snapshot.read_existing(backup) != state.original:
            raise ToolError(f"{backup.path}: changed while sglang-dsa-fix ran")
        return _Revert(path, loc, state.original, metadata, backup, _bytecode_beside(loc, path))


def _leftover_backups(states: list) -> list:
    """Backups equal to their (pristine) file: what a revert killed before removing them, or an
    apply that could not undo everything, leaves. Nothing to restore; they are removed too."""
    backups = []
    for state in states:
        if state.verdict is Verdict.AFFECTED and state.site is not None:
            with contextlib.suppress(OSError):  # then it stays, and `check` still reads the tree
                loc = snapshot.locate(state.site.path)
                backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                if snapshot.read_existing(backup) == state.site.data:
                    backups.append(backup)
    return backups


def _nothing_said(error: ToolError) -> str:
    """A file's own error, less the "nothing changed" it says of the whole run."""
    return str(error).removesuffix("; nothing changed")


def revert(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Restore the original bytes of every file this tool changed, file by file: a file that
    cannot be reverted is named (exit 2) and never keeps the others from being reverted."""
    with locked(tree, exclusive=True) as package:
        judged = classify.each_state(snapshot.read(tree, lock=False))
        failed = [(u.path, _nothing_said(u.error)) for u in judged if isinstance(u, classify.Unjudged)]
        states = [s for s in judged if not isinstance(s, classify.Unjudged)]
        plans = []
        for state in states:
            if state.verdict in (Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE):
                try:
                    plans.append(_revert_plan(state, package, allow_unsafe_dirs))
                except ToolError as exc:
                    failed.append((state.site.path, _nothing_said(exc)))
        total = len(plans) + len(failed)
        removed = _remove_stale_temps(tree, package, allow_unsafe_dirs)
        reverted, cleanup = [], []
        for plan in plans:
            try:
                _write(plan.loc, plan.original, plan.metadata)
            except OSError as exc:
                failed.append((plan.path, f"{plan.loc}: cannot write ({exc.strerror or exc})"))
                continue
            reverted.append(plan.path)
            removed += _remove_each([plan.backup, *plan.pycs], cleanup)
        removed += _remove_each(_leftover_backups(states), cleanup)
        if failed or cleanup:
            raise ToolError(_revert_failed(failed, cleanup, len(reverted), total, bool(removed)))
        return Outcome("revert", reverted, removed, _states(tree), _bytecode_note(plans))


def _bytecode_note(plans: list) -> list:
    """Say what revert does not restore: the bytecode apply removed (it cannot be told apart from
    a file that never had any, so: every reverted file without a ``.pyc`` beside it)."""
    bare = [plan.path for plan in plans if not _bytecode_beside(plan.loc, plan.path)]
    if not bare:
        return []
    return [
        f"no bytecode in __pycache__ for {_names(bare)} (apply removes it, revert does not restore it): "
        "Python compiles each at its next import, and writes the .pyc where it may "
        "(`python -m compileall` writes it now)"
    ]


def _revert_failed(failed: list, cleanup: list, reverted: int, total: int, removed: bool) -> str:
    """The one line a revert that could not do everything ends with: the tree's state first (the
    line is cut past MAX_ERROR_LINE), then why the first file was not reverted."""
    if not failed:
        return f"{'; '.join(cleanup)}; the revert itself succeeded: {_BY_HAND}"
    done = f"reverted {reverted} of {total} file(s)" if reverted or removed or cleanup else "nothing changed"
    return "; ".join([done, f"not reverted: {_names(p for p, _ in failed)}", failed[0][1], *cleanup])


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
