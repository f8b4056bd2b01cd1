"""Read a tree's files once: the one place the judging side touches the disk.

``read`` takes every file the tool judges (``release.FILES_READ``) and, beside each file a fix
may change (``release.FILES_CHANGED``), this tool's backup and the headers of Python's bytecode.
Under the shared lock (``classify.read``) that is one consistent view of the tree; the release's
form, the sites and the verdicts are then computed from it without another read.

Every read goes through ``safe_files`` (one fd per file, checked to be the inode looked up; a
FIFO never blocks). A directory the tool may not search is "cannot read" (exit 2), never "no such
file": it must not read as "no DSA backend".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import release, safe_files
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.tree import SglangTree

BACKUP_SUFFIX = ".sglang-dsa-fix.orig"
LOCK_TIMEOUT_S = 30.0
PYC_HEADER_BYTES = 16  # PEP 552: magic, flags, then the source hash (or mtime and size)


@dataclass(frozen=True)
class FileView:
    """One file as read: None for ``data`` where no regular file is there."""

    path: Path  # the file inside the tree (may be a symlink)
    data: Optional[bytes]
    backup: Optional[bytes] = None  # this tool's backup beside the file the path leads to
    # A backup that could not be read (planted FIFO, symlink, no permission): raised only where
    # the backup matters (``classify``), as the one-line error it has always been.
    backup_error: Optional[OSError] = None
    bytecode: tuple = ()  # (.pyc path, its first PYC_HEADER_BYTES) beside the file it leads to


@dataclass(frozen=True)
class TreeFiles:
    """A tree's files as read by ``read``, by path under ``sglang/``."""

    tree: SglangTree
    views: dict
    use_backups: bool = True  # False: backups were not read (the plugin judges each file alone)

    def view_of(self, path: Path) -> FileView:
        return next(view for view in self.views.values() if view.path == path)

    def view(self, relative: str) -> FileView:
        return self.views[relative]

    def exists(self, relative: str) -> bool:
        return self.views[relative].data is not None

    def data(self, relative: str) -> Optional[bytes]:
        return self.views[relative].data

    def path(self, relative: str) -> Path:
        return self.views[relative].path


def backup_path(path: Path) -> Path:
    """Where this tool keeps the original of the file ``path`` leads to."""
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + BACKUP_SUFFIX)


def read(tree: SglangTree, use_backups: bool = True, lock: bool = True) -> TreeFiles:
    """Every file of ``release.FILES_READ`` in ``tree``. ToolError where one cannot be read.

    ``lock``: under the shared lock (never sees a half-finished apply of another run). False: the
    caller holds the exclusive lock (apply, revert), or must never wait on one (the plugin,
    inside sglang's start-up): each file is then seen before or after a write (writes are atomic
    renames; a backup equal to its file reads as "affected"), only a multi-file apply may be seen
    between files. ``use_backups=False`` (the plugin): backups are not read; each file is judged
    by itself (a stale or foreign backup must not disable the runtime fix)."""
    if lock:
        with locked(tree, exclusive=False):
            return read(tree, use_backups, lock=False)
    views = {}
    for relative in release.FILES_READ:
        path = tree.file(relative)
        data = _read(path) if _is_file(path) else None
        if data is None or relative not in release.FILES_CHANGED:
            views[relative] = FileView(path, data)
            continue
        backup, error = None, None
        if use_backups:
            try:
                loc = safe_files.locate(path)
                backup = safe_files.read_existing(loc.sibling(loc.name + BACKUP_SUFFIX))
            except OSError as exc:
                error = exc
        views[relative] = FileView(path, data, backup, error, _bytecode_headers(path))
    return TreeFiles(tree, views, use_backups)


def _is_file(path: Path) -> bool:
    """Is there a regular file? Absent is an answer; unreadable is not: a directory the tool
    may not search (``attention/`` at 0700 as another user) must not read as "no DSA backend"."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise ToolError(f"{path}: cannot read ({exc.strerror})") from None


def _read(path: Path) -> bytes:
    try:
        return safe_files.read(path)  # through one fd, checked to be the file looked up
    except OSError as exc:
        raise ToolError(f"{path}: cannot read ({exc.strerror})") from None


def bytecode_files(path: Path) -> list:
    """``.pyc`` files of ``path`` in the ``__pycache__`` beside the file it leads to."""
    cache = Path(os.path.realpath(path)).parent / "__pycache__"
    try:
        return sorted(cache.glob(f"{path.stem}.*.pyc"))
    except OSError:
        return []


def _bytecode_headers(path: Path) -> tuple:
    headers = []
    for pyc in bytecode_files(path):
        try:
            # O_NONBLOCK: a FIFO planted as a .pyc must not hang the tool.
            with open(os.open(pyc, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as handle:
                headers.append((pyc, handle.read(PYC_HEADER_BYTES)))
        except OSError:
            continue
    return tuple(headers)


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
