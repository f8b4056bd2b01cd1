"""In-tree form of both fixes: classify, apply, revert and diff an sglang tree.

``inspect`` returns one ``BugState`` per bug; ``apply`` / ``revert`` return an ``Outcome``
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
import fcntl
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import safe_files, sites
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


def read_backup(path: Path) -> Optional[bytes]:
    """The backup beside the file ``path`` leads to, or None. Read through one fd: a symlink
    planted under the backup's name is an error, not followed."""
    loc = safe_files.locate(path)
    return safe_files.read_existing(loc.sibling(loc.name + BACKUP_SUFFIX))


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
            # O_NONBLOCK: a FIFO planted as a .pyc must not hang the tool.
            with open(os.open(pyc, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as handle:
                header = handle.read(16)
        except OSError:
            continue
        flags = int.from_bytes(header[4:8], "little")
        if flags == 0b01 and header[8:16] != expected:
            stale.append(pyc)
    return stale


# ------------------------------------------------------------------------------ classify


def _stale_backup_advice(site: Site) -> str:
    return (
        f"if sglang was upgraded or reinstalled since, that backup is stale: `rm "
        f"{backup_path(site.path)}` and run `sglang-dsa-fix check` again"
    )


def _state(tree: SglangTree, bug: Bug, use_backups: bool = True) -> BugState:
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
        original = read_backup(site.path) if use_backups else None
        if original is not None:
            original_site = sites.site_in(site, tree, original)
            matches = original_site is not None and (
                site.legacy or original_site.patched_bytes() == site.data
            )
            if not matches or original_site.patched_here:
                raise ToolError(
                    f"{site.path}: changed since sglang-dsa-fix applied it ({backup.name} no "
                    f"longer matches): not touching it; {_stale_backup_advice(site)}"
                )
        stale = stale_bytecode(site.path, site.data)
        verdict = Verdict.STALE_BYTECODE if stale else Verdict.FIXED_IN_TREE
        detail = "" if original is not None or not use_backups else "no backup (patched by `git apply`?)"
        if site.legacy:
            detail = (
                "an older sglang-dsa-fix form of this change (0.2: headroom reserve - margin; 0.3 on "
                "0.5.16 - 0.5.22: without the allocator page's rounding): run `sglang-dsa-fix revert` "
                "then `apply` to hold the whole reservation"
            )
        return BugState(bug, verdict, site, original, stale, detail)
    if site.fixed_upstream:
        held = {
            Bug.PAGE_TABLE: "sizes the graph page_table as wide as req_to_token",
            Bug.ROW_OVERFLOW: "reserves the decode reservation at every page size",
        }[bug]
        return BugState(bug, Verdict.FIXED_UPSTREAM, site, detail=held)
    if site.unknown:
        return BugState(bug, Verdict.NOT_COVERED, site, detail=site.unknown)
    backup = backup_path(site.path)
    if use_backups and read_backup(site.path) not in (None, site.data):
        # (A backup equal to the file is what an interrupted apply or revert leaves: apply
        # rewrites it, revert removes it.)
        raise ToolError(
            f"{site.path}: {backup.name} exists but the file neither carries the fix nor "
            f"matches it: changed since sglang-dsa-fix applied it; not touching it; {_stale_backup_advice(site)}"
        )
    detail = f"this row sizing is affected {site.affected_when}" if site.affected_when else ""
    return BugState(bug, Verdict.AFFECTED, site, site.data, detail=detail)


def inspect(tree: SglangTree, use_backups: bool = True) -> list:
    """One BugState per bug. ToolError when a file is not recognised or was hand-edited.

    ``use_backups=False`` (the plugin): judge each file by itself; the runtime fix must not depend
    on the in-tree tool's backups (a stale or foreign one would otherwise disable it)."""
    try:
        return [_state(tree, bug, use_backups) for bug in Bug]
    except OSError as exc:
        raise ToolError(f"{exc.filename or tree.package}: cannot read ({exc.strerror})") from None


@dataclass
class TreeReport:
    """What one tree's files say, read once: per bug a ``BugState``, and the release whose
    pristine arithmetic applies (its label, unless the files' shape contradicts it; then the
    files win and ``version_note`` says so)."""

    tree: SglangTree
    states: list
    arithmetic_version: str
    version_note: str = ""


def read_tree(tree: SglangTree) -> TreeReport:
    """The tree step of the verdict flow (``status.collect``): ``check`` and the release the
    files say, under one shared lock."""
    with locked(tree, exclusive=False):
        states = inspect(tree)
        version, note = sites.arithmetic_version(tree)
    return TreeReport(tree, states, version, note)


def check(tree: SglangTree, wait: bool = True, use_backups: bool = True) -> list:
    """``inspect`` under the shared lock (never sees a half-finished apply of another run).

    ``wait=False`` (the plugin, inside sglang's start-up): never wait on another run's lock; read
    without it. Each file is then seen before or after a write (writes are atomic renames; a
    backup equal to its file reads as "affected"), only a multi-file apply may be seen between files.
    """
    if not wait:
        return inspect(tree, use_backups)
    with locked(tree, exclusive=False):
        return inspect(tree, use_backups)


# ------------------------------------------------------------------------------ writing
# Every file written is located once (safe_files: a name in an open directory, symlinks resolved
# by hand) and then read, replaced and removed only through that directory's fd.


@contextlib.contextmanager
def locked(tree: SglangTree, exclusive: bool):
    """flock on the ``sglang`` directory itself: serialises runs, creates no file. Yields that
    directory, open (what ``safe_files.check_place`` calls inside the tree)."""
    try:
        package = safe_files.open_dir(tree.package)
    except OSError as exc:
        raise ToolError(f"{tree.package}: cannot open ({exc.strerror})") from None
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    while True:
        try:
            fcntl.flock(package.fd, mode)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ToolError(
                    f"{tree.package}: another sglang-dsa-fix run holds the lock; try again"
                ) from None
            time.sleep(0.05)
    try:
        yield package
    finally:
        fcntl.flock(package.fd, fcntl.LOCK_UN)  # the fd itself closes with its last reference


@contextlib.contextmanager
def _reading(fallback):
    """An OS error while planning the writes: one line, before anything is written."""
    try:
        yield
    except OSError as exc:
        raise ToolError(
            f"{exc.filename or fallback}: cannot read ({exc.strerror}); nothing changed"
        ) from None


def _locate_for_rewrite(path: Path, expected: bytes, package, allow_unsafe_dirs: bool) -> tuple:
    """(File, metadata) of the file ``path`` leads to: located once, a place root may write,
    writable, and still holding ``expected`` (what inspect judged)."""
    loc = safe_files.locate(path)
    safe_files.check_place(path, loc, package, allow_unsafe_dirs)
    data, metadata = safe_files.read_at(loc)
    problem = safe_files.writable_error(loc)
    if problem:
        raise ToolError(problem)
    if data != expected:
        raise ToolError(f"{path}: changed while sglang-dsa-fix ran; nothing changed")
    return loc, metadata


def _bytecode_beside(loc, path: Path) -> list:
    """``path``'s .pyc files in the ``__pycache__`` beside the file it leads to (not through a symlink)."""
    cache = safe_files.subdir(loc.dir, "__pycache__")
    return [] if cache is None else safe_files.matching(cache, f"{path.stem}.*.pyc")


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
            old = safe_files.read_existing(loc)
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


def apply(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Fix every affected bug in the tree; remove stale bytecode of the files it fixed."""
    with locked(tree, exclusive=True) as package:
        states = inspect(tree)
        todo = [s for s in states if s.verdict is Verdict.AFFECTED]
        stale = [s for s in states if s.verdict is Verdict.STALE_BYTECODE]
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
                loc = safe_files.locate(state.site.path)
                safe_files.check_place(state.site.path, loc, package, allow_unsafe_dirs)
                for pyc in _bytecode_beside(loc, state.site.path):
                    problem = safe_files.writable_error(pyc)
                    if problem:
                        raise ToolError(problem)
                    pycs.append(pyc)
            temps = _remove_stale_temps([loc for loc, _, _ in writes[1::2]])
        _transaction(writes)
        removed = temps + _remove(pycs, "apply")
        return Outcome("apply", [state.site.path for state in todo], removed, inspect(tree))


def revert(tree: SglangTree, allow_unsafe_dirs: bool = False) -> Outcome:
    """Restore the original bytes of every file this tool changed."""
    with locked(tree, exclusive=True) as package:
        states = inspect(tree)
        ours = [s for s in states if s.verdict in (Verdict.FIXED_IN_TREE, Verdict.STALE_BYTECODE)]
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
            for state in states:
                if state.verdict is Verdict.AFFECTED and state.site is not None:
                    loc = safe_files.locate(state.site.path)
                    backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                    if safe_files.read_existing(backup) == state.site.data:
                        backups.append(backup)
            for state in ours:
                path = state.site.path
                loc, metadata = _locate_for_rewrite(path, state.site.data, package, allow_unsafe_dirs)
                backup = loc.sibling(loc.name + BACKUP_SUFFIX)
                if safe_files.read_existing(backup) != state.original:
                    raise ToolError(f"{backup.path}: changed while sglang-dsa-fix ran; nothing changed")
                writes.append((loc, state.original, metadata))
                backups.append(backup)
                pycs += _bytecode_beside(loc, path)
            temps = _remove_stale_temps([loc for loc, _, _ in writes])
        _transaction(writes)
        removed = temps + _remove(backups + pycs, "revert")
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
