"""Write the files of an sglang tree through directory file descriptors, and say where root may.

Why: ``apply`` / ``revert`` may run as root on a tree another user can write to (a shared venv,
a group-writable checkout). A path looked up again at every step (realpath, read, a temp file in
the parent, rename) lets that user flip a symlink between two steps so that root's write lands on
a file of their choosing. Here a path is resolved once, one component at a time from ``/`` with
O_NOFOLLOW (symlinks are followed by hand, so every directory that decided where the path leads is
known and open: ``snapshot.locate``); after that, reading, the temp file, the rename and
unlinking all happen relative to the directory fd it led to, and a file read is checked to be the
inode that was looked up (``snapshot.read_at``). Nothing is ever written in place: a new file (O_CREAT|O_EXCL|O_NOFOLLOW) is renamed over the name.

As root, ``check_place`` refuses, like sudo and sshd, a write whose place a user other than root
or the tree's owner could have chosen (``--allow-unsafe-dirs`` accepts it inside the tree), and
never writes outside the sglang package through such a place.

The same rule (``changeable_by_others``) decides what root may run: ``foreign_code`` finds the
first part of an interpreter, or of the tree it imports, that a user other than root could
change (``status --`` refuses to start the child then), and the benchmarks' work directories
(``benchmark/bench_common.private_work_dir``) are held to it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.snapshot import Dir, File, lstat_at, matching, replaced_error, subdir, walk

# ------------------------------------------------------------------------------ writing


def _ident(st: Optional[os.stat_result]):
    return None if st is None else (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode))


def _expect(loc: File) -> None:
    """The name still holds the inode looked up (or still nothing): checked before each change."""
    if _ident(lstat_at(loc.dir, loc.name)) != _ident(loc.st):
        raise replaced_error(loc)


def replace(loc: File, data: bytes, metadata: dict) -> None:
    """Atomically put ``data`` with the given owner, group, mode and xattrs at ``loc``'s name."""
    directory = loc.dir.fd
    for _ in range(100):
        tmp = f".{loc.name}.{secrets.token_hex(4)}.tmp"  # the pattern temps() finds
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=directory,
            )
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", str(loc))
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            if os.geteuid() == 0:
                os.fchown(fd, metadata["uid"], metadata["gid"])
            os.fchmod(fd, metadata["mode"])  # after chown, which clears set-id bits
            for name, value in metadata["xattrs"].items():
                try:
                    os.setxattr(fd, name, value)
                except OSError:
                    if name.startswith("user."):  # security.* etc. may be refused; user.* must not
                        raise
            st = os.fstat(fd)
        finally:
            os.close(fd)
        _expect(loc)
        os.replace(tmp, loc.name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise
    loc.st = st
    with contextlib.suppress(OSError):
        os.fsync(directory)


def unlink(loc: File) -> bool:
    """Remove the name (never what a symlink there points to). False when it was already gone."""
    if loc.st is None:
        return False
    _expect(loc)
    try:
        os.unlink(loc.name, dir_fd=loc.dir.fd)
    except FileNotFoundError:
        return False
    loc.st = None
    return True


def rename_over(source: File, target: File) -> None:
    """Put the file at ``source``'s name (a backup) under ``target``'s name in the same directory,
    as one rename: how a rollback restores a file on a full disk (a rename needs no new data
    blocks), the backup gone in the same step that restores its file."""
    _expect(source)
    _expect(target)
    os.replace(source.name, target.name, src_dir_fd=source.dir.fd, dst_dir_fd=target.dir.fd)
    target.st, source.st = source.st, None
    with contextlib.suppress(OSError):
        os.fsync(target.dir.fd)


def temps(loc: File) -> list:
    """Temp files an interrupted run (SIGKILL) left beside ``loc``."""
    return matching(loc.dir, f".{loc.name}.*.tmp")


# ------------------------------------------------------------------------------ checks


# The inode flags (``chattr``) under which a new file can be made beside ``loc`` but not renamed
# over it nor removed again: asked first, so that a refusal leaves no temp file behind.
FS_IOC_GETFLAGS = 0x80086601
INODE_FLAGS = {0x10: "immutable (chattr +i)", 0x20: "append-only (chattr +a)"}


def _inode_flags_error(name: str, directory: Dir) -> Optional[str]:
    """``loc``'s or its directory's immutable / append-only flag, where the filesystem has them."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory.fd)
    except OSError:
        return None  # what the write then says
    try:
        flags = int.from_bytes(fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))[:4], sys.byteorder)
    except OSError:  # no such flags on this filesystem
        return None
    finally:
        os.close(fd)
    return next((what for bit, what in INODE_FLAGS.items() if flags & bit), None)


def writable_error(loc: File) -> Optional[str]:
    """Why the tool cannot rewrite ``loc`` (read-only, immutable or append-only file or
    directory, other owner), or None."""
    for path, st, name, directory in (
        (loc.path, loc.st, loc.name, loc.dir),
        (Path(loc.dir.path), loc.dir.st, ".", loc.dir),
    ):
        # Checked on mode bits too: as root, os.access says yes to a chmod a-w file.
        if not os.access(name, os.W_OK, dir_fd=directory.fd) or not st.st_mode & (
            stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        ):
            return f"{path}: read-only; nothing changed"
        flagged = _inode_flags_error(name, directory)
        if flagged:
            return f"{path}: {flagged}; nothing changed"
    if os.geteuid() != 0 and loc.st.st_uid != os.geteuid():
        return (
            f"{loc.path}: owned by uid {loc.st.st_uid}; rewriting it as uid {os.geteuid()} would "
            "change its owner: run as that user or as root; nothing changed"
        )
    return None


def user_name(uid: int) -> str:
    """``uid 65534 (nobody)``; the number alone where no account has it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)


def changeable_by_others(st: os.stat_result, trusted) -> Optional[str]:
    """THE rule, for every place root writes through or runs code from: why a user whose uid is
    not in ``trusted`` could change this file, directory or symlink (its lstat), or None.

    Its owner must be trusted; it must be writable by no group and no one else, except a
    directory as /tmp is (sticky, so others cannot rename or remove the entries they do not own,
    and owned by root): what such a directory holds is then safe only when it is owned by a
    trusted user too, which this rule asks of that entry in turn. A symlink's own mode means
    nothing (its directory decides who may replace it); its owner still counts (in a sticky
    directory, the owner may replace it)."""
    if st.st_uid not in trusted:
        return f"owned by {user_name(st.st_uid)}"
    mode = st.st_mode
    if stat.S_ISLNK(mode) or not mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    if stat.S_ISDIR(mode) and mode & stat.S_ISVTX and st.st_uid == 0:
        return None
    return "writable by " + ("others" if mode & stat.S_IWOTH else f"group {_group_name(st.st_gid)}")


def _unsafe(directory: Dir, owners: set) -> Optional[str]:
    why = changeable_by_others(directory.st, owners)
    return None if why is None else f"{directory.path} is {why}"


def _first_unsafe(loc: File, links, owners: set) -> Optional[str]:
    """Why another user than ``owners`` could have chosen ``loc``: a directory on the way, or a
    link followed on the way, that such a user owns or may write; None when none."""
    unsafe = next((why for d in loc.via if (why := _unsafe(d, owners))), None)
    if unsafe is None:
        unsafe = next(
            (f"the link {path} is {why}" for path, st in links if (why := changeable_by_others(st, owners))),
            None,
        )
    return unsafe


def check_place(shown, loc: File, package: Dir, allow_unsafe_dirs: bool, links=()) -> None:
    """As root: refuse to write at ``loc`` when another user could have chosen it.

    ``loc.via`` is every directory whose entries led ``shown`` (the path in the tree) to ``loc``,
    from ``/`` down, symlinks' directories included; ``links`` the (path, lstat) of every symlink
    followed on the way (``snapshot.walk``). Inside the sglang package (``package``) each
    directory must be owned by root or the tree's owner and writable by no one else, and each
    link owned by one of them (a link another user owns, in a sticky directory above all, is
    theirs to point: the kernel's protected_symlinks rule); ``allow_unsafe_dirs`` accepts
    otherwise. A place outside the package is root's alone to choose: every directory and link on
    the way, and the file, root's (the tree's owner chose what its links point to), whatever the
    flag.
    """
    if os.geteuid() != 0:
        return  # an unprivileged run can only write where its user can anyway
    inside = loc.dir.path == package.path or loc.dir.path.startswith(package.path.rstrip("/") + "/")
    if not inside:
        unsafe = _first_unsafe(loc, links, {0})
        if unsafe is None and loc.st is not None and loc.st.st_uid != 0:
            unsafe = f"{loc.path} is owned by {user_name(loc.st.st_uid)}"
        if unsafe:
            raise ToolError(
                f"{shown}: leads to {loc.path}, outside the sglang tree, and {unsafe}: another user "
                "could have chosen it; not writing there as root, even with --allow-unsafe-dirs; "
                "nothing changed"
            )
        return
    unsafe = _first_unsafe(loc, links, {0, package.st.st_uid})
    if unsafe and not allow_unsafe_dirs:
        raise ToolError(
            f"{shown}: {unsafe}, so another user could redirect a write made as root; refusing "
            "(pass --allow-unsafe-dirs to accept it); nothing changed"
        )


# ------------------------------------------------------------------------------ code root runs


@dataclass(frozen=True)
class Foreign:
    """Something root would run or import that another user could change: where, and why."""

    path: str
    why: str  # changeable_by_others' reason
    st: os.stat_result

    @property
    def reason(self) -> str:
        """``owned by uid 65534 (nobody)``, or ``writable by others (owner uid 0 (root))``."""
        owner = "" if self.why.startswith("owned by") else f" (owner {user_name(self.st.st_uid)})"
        return self.why + owner


def _first_foreign(entries, trusted) -> Optional[Foreign]:
    for path, st in entries:
        why = changeable_by_others(st, trusted)
        if why:
            return Foreign(str(path), why, st)
    return None


def resolve_checked(path, trusted, want_dir: bool):
    """Resolve ``path`` by hand: (the first Foreign among every directory and symlink that decided
    where it leads and what it leads to, or None; the Dir it leads to when ``want_dir``)."""
    links = []
    if want_dir:
        target, via = walk(path, True, links)
        last = (target.path, target.st)
    else:
        loc = walk(path, False, links)
        target, via = None, loc.via
        if loc.st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(loc))
        last = (str(loc.path), loc.st)
    entries = [(d.path, d.st) for d in via] + links + [last]
    return _first_foreign(entries, trusted), target


def _entries(directory: Dir):
    """(path, lstat) of every name in ``directory`` (one that vanished meanwhile left out)."""
    for name in sorted(os.listdir(directory.fd)):
        st = lstat_at(directory, name)
        if st is not None:
            yield name, os.path.join(directory.path, name), st


def _flat(directory: Dir, trusted, skip=()) -> Optional[Foreign]:
    """``directory``'s own entries (what ``import NAME`` or a ``.pth`` finds there), one level."""
    for name, path, st in _entries(directory):
        if name in skip:
            continue
        found = _first_foreign([(path, st)], trusted)
        if found is None and stat.S_ISLNK(st.st_mode):
            with _unless_dangling():
                found = resolve_checked(path, trusted, want_dir=False)[0]
        if found:
            return found
    return None


@contextlib.contextmanager
def _unless_dangling():
    """A link that leads nowhere (or in a loop) imports nothing: skipped, not an error."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise


def _link(directory: Dir, name: str, trusted, places: dict):
    """``resolve_checked`` for the symlink ``name`` in ``directory``, as (Foreign or None, Dir or None);
    the directory its target names is resolved once per walk (a tree linked file by file)."""
    path = os.path.join(directory.path, name)
    head, tail = os.path.split(os.readlink(name, dir_fd=directory.fd))
    if tail in ("", ".", ".."):
        st = os.stat(name, dir_fd=directory.fd)
        return resolve_checked(path, trusted, want_dir=stat.S_ISDIR(st.st_mode))
    where = os.path.join(directory.path, head)  # head absolute: head itself
    if where not in places:
        places[where] = resolve_checked(where, trusted, want_dir=True)
    found, holder = places[where]
    st = lstat_at(holder, tail)
    if found or st is None:
        return found, None
    if stat.S_ISLNK(st.st_mode):  # a chain of links: resolved whole
        st = os.stat(name, dir_fd=directory.fd)
        return resolve_checked(path, trusted, want_dir=stat.S_ISDIR(st.st_mode))
    found = _first_foreign([(os.path.join(holder.path, tail), st)], trusted)
    return found, (subdir(holder, tail) if stat.S_ISDIR(st.st_mode) else None)


def _deep(top: Dir, trusted) -> Optional[Foreign]:
    """Every directory and file under ``top`` (symlinks followed, each followed place checked),
    with an explicit stack: no recursion over the tree's depth."""
    stack, seen, places = [top], {(top.st.st_dev, top.st.st_ino)}, {}
    while stack:
        directory = stack.pop()
        for name, path, st in _entries(directory):
            found, sub = _first_foreign([(path, st)], trusted), None
            if found is None and stat.S_ISLNK(st.st_mode):
                with _unless_dangling():
                    found, sub = _link(directory, name, trusted, places)
            elif stat.S_ISDIR(st.st_mode):
                sub = subdir(directory, name)
            if found:
                return found
            if sub is not None and (sub.st.st_dev, sub.st.st_ino) not in seen:
                seen.add((sub.st.st_dev, sub.st.st_ino))
                stack.append(sub)
    return None


def venv_of(interpreter) -> Optional[Path]:
    """The venv ``interpreter`` starts in, or None: CPython looks for ``pyvenv.cfg`` beside the
    interpreter's path as given (links not resolved) and one level up."""
    here = Path(os.path.abspath(interpreter)).parent
    return next((d for d in (here, here.parent) if os.path.lexists(d / "pyvenv.cfg")), None)


def foreign_code(interpreter, package_parent, package: str = "sglang", trusted=frozenset({0})):
    """As root, before running ``interpreter`` with ``package_parent`` first on ``sys.path`` to
    import ``package``: (what, Foreign) for the first thing a user outside ``trusted`` could
    change, or None. ``what`` is "interpreter" or "code".

    Checked (one pass, lstat, symlinks resolved by hand): the interpreter file and every directory
    and symlink on its way from ``/``; for a venv's interpreter its ``pyvenv.cfg`` and the entries
    of its ``lib/python*/site-packages`` (``.pth`` files run at start-up); the directories on the way
    to ``package_parent`` and its entries (``sys.path[0]``: any module name is looked up there
    first); every directory and file under ``package_parent/package``."""
    found = resolve_checked(interpreter, trusted, want_dir=False)[0]
    venv = venv_of(interpreter)
    if found is None and venv is not None:
        found = resolve_checked(venv / "pyvenv.cfg", trusted, want_dir=False)[0]
        for site in sorted(venv.glob("lib*/python*/site-packages")):
            if found is None:
                found = import_dir_foreign(site, trusted)
    if found:
        return "interpreter", found
    found, parent = resolve_checked(package_parent, trusted, want_dir=True)
    # sys.path[0] in the child: sticky is not enough (another user adds ``platform.py`` after
    # this check, and it is imported ahead of the standard library).
    if found is None and (why := _group_or_others(parent.st)):
        found = Foreign(parent.path, why, parent.st)
    found = found or _flat(parent, trusted, skip=(package,))
    if found is None:
        top = None  # nothing there to import where the package's name leads nowhere
        with _unless_dangling():
            found, top = resolve_checked(os.path.join(parent.path, package), trusted, want_dir=True)
        if found is None and top is not None:
            found = _deep(top, trusted)
    return None if found is None else ("code", found)


def _group_or_others(st: os.stat_result) -> Optional[str]:
    """Who besides its owner may add entries to this directory, sticky or not (in a sticky
    directory anyone may still create a NEW name: a module an import looks up there)."""
    if st.st_mode & stat.S_IWOTH:
        return "writable by others"
    if st.st_mode & stat.S_IWGRP:
        return f"writable by group {_group_name(st.st_gid)}"
    return None


def import_dir_foreign(path, trusted=frozenset({0})) -> Optional[Foreign]:
    """As root, before an interpreter imports from the sys.path entry ``path``: the first thing a
    user outside ``trusted`` could change, or None. Every directory and link on the way
    (``resolve_checked``); the directory itself writable by no one else, not even sticky; its
    entries (``_flat``: each module or package name found there). A missing entry is safe when
    its nearest existing directory is (no one else can create it); a file (a zip) by itself."""
    path = os.path.abspath(path)
    probe = path
    while True:
        try:
            found, directory = resolve_checked(probe, trusted, want_dir=True)
            break
        except FileNotFoundError:
            if probe == "/":
                raise
            probe = os.path.dirname(probe)
        except NotADirectoryError:  # a file on the way: a zip entry is imported from the file
            return resolve_checked(probe, trusted, want_dir=False)[0]
    if found is None and (why := _group_or_others(directory.st)):
        found = Foreign(directory.path, why, directory.st)
    if found is None and probe == path:
        found = _flat(directory, trusted)
    return found


def code_tree_foreign(path, trusted=frozenset({0})) -> Optional[Foreign]:
    """As root, before code under the directory ``path`` runs (a model directory's
    ``trust_remote_code`` modules): the way there, the directory and everything under it."""
    found, directory = resolve_checked(path, trusted, want_dir=True)
    if found is None and (why := _group_or_others(directory.st)):
        found = Foreign(directory.path, why, directory.st)
    return found or _deep(directory, trusted)
