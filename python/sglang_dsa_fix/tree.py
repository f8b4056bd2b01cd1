"""Find the sglang tree to work on and read its version, without importing sglang."""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.release import VERSION_FILES

MAX_VERSION_FILE = 1 << 16  # bytes read of a _version.py / version.py (a few hundred in sglang)


@dataclass(frozen=True)
class SglangTree:
    package_parent: Path  # checkout/python or site-packages: the directory holding ``sglang/``
    version: Optional[str]

    @property
    def package(self) -> Path:
        return self.package_parent / "sglang"

    def file(self, relative: str) -> Path:
        """A file under ``sglang/``, e.g. ``srt/mem_cache/common.py``."""
        return self.package / relative

    def repo_relative(self, path: Path) -> str:
        """Path as it appears in an sglang git checkout (for diffs)."""
        return "python/" + path.relative_to(self.package_parent).as_posix()


def find_tree(root: Optional[str]) -> SglangTree:
    """An sglang source checkout, a site-packages directory, or (None) the importable sglang."""
    if root is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ToolError("sglang is not importable here; pass --sglang-root DIR")
        package_parent = Path(list(spec.submodule_search_locations)[0]).parent
    else:
        base = Path(root)
        try:
            if not base.is_dir():
                raise ToolError(f"{root}: no such directory")
            candidates = [base / "python", base]
            package_parent = next((c for c in candidates if (c / "sglang" / "srt").is_dir()), None)
        except PermissionError as exc:
            raise ToolError(f"{root}: cannot read ({exc.strerror})") from None
        if package_parent is None:
            raise ToolError(
                f"{root}: not an sglang tree (expected python/sglang/srt/ for a checkout or "
                "sglang/srt/ for site-packages)"
            )
    package_parent = package_parent.resolve()
    _refuse_leftovers(package_parent / "sglang")
    return SglangTree(package_parent, read_version(package_parent / "sglang"))


BACKUP_SUFFIX = ".sglang-dsa-fix.orig"
# How far _refuse_leftovers looks: sglang's own tree is 8 levels and some 3000 entries deep.
MAX_LEFTOVER_DEPTH = 64
MAX_LEFTOVER_ENTRIES = 200_000


def _refuse_leftovers(package: Path) -> None:
    """After ``pip uninstall sglang`` pip leaves what it did not install: this tool's backups
    (and bytecode). Say what is left and how to remove it, instead of judging a ghost tree."""
    try:
        if (package / "__init__.py").exists():
            return
        backups, capped = _leftover_backups(package)
    except OSError as exc:
        raise ToolError(f"{package}: cannot read ({exc.strerror})") from None
    if backups:
        count = f"{'at least ' if capped else ''}{len(backups)}"
        raise ToolError(
            f"{package}: sglang is not installed here any more; only {count} sglang-dsa-fix "
            f"backup(s) remain (e.g. {backups[0]}): remove them with "
            f"`find {package} -name '*{BACKUP_SUFFIX}' -delete`"
        )


def _leftover_backups(package: Path) -> tuple:
    """(the backups under ``package``, sorted; whether the walk stopped at MAX_LEFTOVER_DEPTH
    levels or MAX_LEFTOVER_ENTRIES entries). Iterative (no recursion over directory depth), links
    not followed, a subdirectory that cannot be read skipped; OSError for ``package`` itself."""
    found, entries, capped = [], 0, False
    pending = [(package, 0)]
    while pending:
        directory, depth = pending.pop()
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    entries += 1
                    if entries > MAX_LEFTOVER_ENTRIES:
                        return sorted(found), True
                    if not entry.is_dir(follow_symlinks=False):
                        if entry.name.endswith(BACKUP_SUFFIX):
                            found.append(Path(entry.path))
                    elif depth + 1 < MAX_LEFTOVER_DEPTH:
                        pending.append((Path(entry.path), depth + 1))
                    else:
                        capped = True
        except OSError:
            if directory == package:
                raise
    return sorted(found), capped


def read_text(path, limit: int) -> str:
    """At most ``limit`` bytes of the regular file at ``path`` (links followed), as text with
    undecodable bytes replaced. OSError for anything else: a FIFO, a device or a directory is
    refused at once (opened with O_NONBLOCK, checked with fstat), never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, size = [], 0
        while size < limit and (chunk := os.read(fd, min(1 << 16, limit - size))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def read_version(package: Path) -> Optional[str]:
    """The installed distribution's version (``sglang-*.dist-info/METADATA`` beside the package,
    what pip reports), else the package's own ``_version.py`` (setuptools-scm, 0.5.9+) or
    ``version.py`` (older), as a checkout has it. A file that cannot be read, or is not a
    regular file (``read_text``), is skipped."""
    for metadata in sorted(package.parent.glob("sglang-*.dist-info/METADATA")):
        try:
            head = read_text(metadata, 4096)
        except OSError:
            continue
        match = re.search(r"^Name:\s*sglang\s*$.*?^Version:\s*(\S+)", head, re.M | re.S | re.I)
        if match:
            return match.group(1)
    for name in VERSION_FILES:
        try:
            text = read_text(package / name, MAX_VERSION_FILE)
        except OSError:
            continue
        match = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?[\"']([^\"']+)", text, re.M)
        if match:
            return match.group(1)
    return None
