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
import errno
import fcntl
import fnmatch
import os
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import release
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.pysource import MAX_SOURCE_BYTES
from sglang_dsa_fix.tree import BACKUP_SUFFIX, SglangTree

LOCK_TIMEOUT_S = 30.0
PYC_HEADER_BYTES = 16  # PEP 552: magic, flags, then the source hash (or mtime and size)


@dataclass(frozen=True)
class FileView:
    """One file as read: None for ``data`` where no regular file is there."""

    path: Path  # the file inside the tree (may be a symlink)
    data: Optional[bytes]
    backup: Optional[bytes] = None  # this tool's backup beside the file the path leads to
    backup_path: Optional[Path] = None  # where that backup is (or would be)
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
        data = _read(path) if _is_file(path, relative) else None
        if data is None or relative not in release.FILES_CHANGED:
            views[relative] = FileView(path, data)
            continue
        backup, error = None, None
        if use_backups:
            try:
                backup = backup_of(path)
            except OSError as exc:
                error = exc
        views[relative] = FileView(path, data, backup, backup_path(path), error, _bytecode_headers(path))
    return TreeFiles(tree, views, use_backups)


def backup_of(path: Path) -> Optional[bytes]:
    """The bytes of the backup beside ``path`` (None: there is none). OSError where it cannot
    be read."""
    loc = locate(path)
    return read_existing(loc.sibling(loc.name + BACKUP_SUFFIX))


def _is_file(path: Path, relative: str) -> bool:
    """Is there a regular file? Absent is an answer; unreadable is not: a directory the tool
    may not search (``attention/`` at 0700 as another user) must not read as "no DSA backend",
    nor a FIFO, device or directory under a source file's name as "this release has no such
    file" (a FIFO at ``eagle_info_v2.py`` read as 0.5.4's form). The version files alone are
    read for the label only and skipped as ``tree.read_version`` skips them."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise ToolError(f"{path}: cannot read ({exc.strerror})") from None
    if stat.S_ISREG(st.st_mode) or relative in release.VERSION_FILES:
        return stat.S_ISREG(st.st_mode)
    raise ToolError(f"{path}: cannot read (not a regular file)")


def _read(path: Path) -> bytes:
    try:
        return read_file(path)  # through one fd, checked to be the file looked up
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
        package = open_dir(tree.package)
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


# ------------------------------------------------------------------------------ reading through fds
# A path is resolved once, one component at a time from ``/`` with O_NOFOLLOW (symlinks are
# followed by hand, so every directory that decided where the path leads is known and open); a
# file is then read through one fd, checked to be the inode that was looked up. ``safe_files``
# writes through the same ``Dir`` / ``File``.


MAX_SYMLINKS = 40  # the kernel's limit before ELOOP
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a file's name must not hang the tool (it is refused below).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Dir:
    """An open directory: its fd, the path it was reached by (no symlink in it) and its fstat."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.st = os.fstat(fd)
        weakref.finalize(self, os.close, fd)  # closed with the last reference


@dataclass
class File:
    """A name in an open directory; ``st`` is its lstat when looked up (None: nothing there)."""

    dir: Dir
    name: str
    st: Optional[os.stat_result]
    via: tuple  # every Dir whose entries decided where the path led (for check_place)

    @property
    def path(self) -> Path:
        return Path(self.dir.path) / self.name

    def __str__(self) -> str:
        return str(self.path)

    def sibling(self, name: str) -> File:
        """Another name in the same directory (a backup beside the file)."""
        return File(self.dir, name, lstat_at(self.dir, name), self.via)


def lstat_at(directory: Dir, name: str) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _parts(path: str) -> list:
    return [p for p in path.split("/") if p not in ("", ".")][::-1]  # reversed: pop() is next


def walk(path, want_dir: bool, links_seen: Optional[list] = None):
    """Resolve ``path`` as the kernel would, but by hand: (final Dir, via) or a File.
    ``links_seen`` collects (path, lstat) of each symlink followed."""
    path = os.fspath(path)
    if not path.startswith("/"):
        path = os.path.join(os.getcwd(), path)
    root = Dir(os.open("/", _DIR_FLAGS), "/")
    stack, via, todo, links = [root], [root], _parts(path), 0
    while todo:
        part = todo.pop()
        if part == "..":
            if len(stack) > 1:
                stack.pop()
            continue
        here = stack[-1]
        st = lstat_at(here, part)
        if st is not None and stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            if links_seen is not None:
                links_seen.append((os.path.join(here.path, part), st))
            target = os.readlink(part, dir_fd=here.fd)
            if target.startswith("/"):
                del stack[1:]
            todo += _parts(target)
            continue
        if not todo and not want_dir:
            return File(here, part, st, tuple(via))
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        # O_NOFOLLOW: swapped for a symlink since the lstat above -> ELOOP/ENOTDIR, not followed.
        sub = Dir(os.open(part, _DIR_FLAGS, dir_fd=here.fd), os.path.join(here.path, part))
        stack.append(sub)
        via.append(sub)
    return stack[-1], tuple(via)


def locate(path) -> File:
    """Where ``path`` leads now (symlinks followed once): a name in an open directory."""
    return walk(path, want_dir=False)


def open_dir(path) -> Dir:
    return walk(path, want_dir=True)[0]


def subdir(directory: Dir, name: str) -> Optional[Dir]:
    """``name`` inside ``directory`` when it is a real directory (a symlink is not followed)."""
    try:
        return Dir(os.open(name, _DIR_FLAGS, dir_fd=directory.fd), os.path.join(directory.path, name))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


def matching(directory: Dir, pattern: str) -> list:
    """Files (not directories) in ``directory`` whose name matches a glob ``pattern``."""
    found = []
    for name in sorted(os.listdir(directory.fd)):
        if fnmatch.fnmatchcase(name, pattern):
            st = lstat_at(directory, name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                found.append(File(directory, name, st, (directory,)))
    return found


def read_at(loc: File) -> tuple:
    """(bytes, metadata) of the regular file at ``loc``, read through one fd that is checked to
    be the inode looked up (a file swapped in between is refused, not read)."""
    fd = os.open(loc.name, _READ_FLAGS, dir_fd=loc.dir.fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(loc))
        if loc.st is None or (st.st_dev, st.st_ino) != (loc.st.st_dev, loc.st.st_ino):
            raise replaced_error(loc)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_SOURCE_BYTES + 1)  # bounded: a huge file is refused, not read
        if len(data) > MAX_SOURCE_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_SOURCE_BYTES} bytes", str(loc))
        xattrs, names = {}, []
        with contextlib.suppress(OSError):  # a filesystem without xattrs
            names = os.listxattr(fd)
        for name in names:
            with contextlib.suppress(OSError):
                xattrs[name] = os.getxattr(fd, name)
        metadata = {"uid": st.st_uid, "gid": st.st_gid, "mode": stat.S_IMODE(st.st_mode), "xattrs": xattrs}
        return data, metadata
    finally:
        os.close(fd)


def read_file(path) -> bytes:
    return read_at(locate(path))[0]


def read_existing(loc: File) -> Optional[bytes]:
    """The bytes at ``loc`` now, or None when nothing is there."""
    return None if loc.st is None else read_at(loc)[0]


def replaced_error(loc: File) -> OSError:
    # An OSError like any other I/O failure: callers say "cannot read / write / remove (...)".
    return OSError(errno.ESTALE, "replaced by another file while sglang-dsa-fix ran", str(loc))
