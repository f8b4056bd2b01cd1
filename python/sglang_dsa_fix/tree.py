"""Find the sglang tree to work on, its version and this plugin beside it, importing neither.

``find_tree`` / ``read_version``: which sglang, from its files. ``plugin_report``: is this
package's plugin installed where that tree's server imports from (its entry-point metadata and
its code, as sglang's ``load_plugins()`` finds them), and does the release load plugins at all.
"""

from __future__ import annotations

import configparser
import errno
import importlib.util
import os
import re
import stat
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import release, switch
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


# ------------------------------------------------------------------------------ the plugin beside it
# Is this package's plugin installed where the tree's server imports from? Found on disk, as
# sglang's load_plugins() would find it (entry-point metadata and the package's code), without
# importing it; read with ``read_text`` (bounded, never waits on a FIFO).

PLUGIN_VALUE_PREFIX = "sglang_dsa_fix."
MAX_METADATA_FILE = 1 << 20  # bytes read of an entry_points.txt or a .pth
KILL_SWITCH_NOTE = (
    f"enabled unless {switch.KILL_SWITCH}=0 / false / no / off (or SGLANG_PLUGINS naming neither "
    f"{' nor '.join(switch.ENTRY_POINT_NAMES)}) in the server's environment; any other value but "
    "1 / true / yes / on is taken as enabled, with a warning in the server's log"
)


def kill_switch_note() -> str:
    """KILL_SWITCH_NOTE, and how this environment's value (where set) would be taken: the
    server's environment decides, this one is only said."""
    value = os.environ.get(switch.KILL_SWITCH)
    if value is None:
        return KILL_SWITCH_NOTE
    return f"{KILL_SWITCH_NOTE}; here {switch.kill_switch_text(value)}"


def _declares_plugin(entry_points_text: str) -> bool:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    try:
        parser.read_string(entry_points_text)
    except configparser.Error:
        return False
    section = parser["sglang.srt.plugins"] if parser.has_section("sglang.srt.plugins") else {}
    return any(
        section.get(name, "").strip().startswith(PLUGIN_VALUE_PREFIX) for name in switch.ENTRY_POINT_NAMES
    )


def _package_in(site_dir: Path) -> bool:
    """Is the plugin's code importable from this site dir: the package itself, or an editable
    install's ``.pth`` pointing at a directory that holds it? Metadata alone loads nothing."""
    if (site_dir / "sglang_dsa_fix" / "plugin.py").is_file():
        return True
    for pth in site_dir.glob("*.pth"):
        try:  # a FIFO / device there is skipped at once, never waited on
            lines = read_text(pth, MAX_METADATA_FILE).splitlines()
        except OSError:
            continue
        for line in lines:
            if line and not line.startswith(("#", "import")):
                if (Path(line.strip()) / "sglang_dsa_fix" / "plugin.py").is_file():
                    return True
    return False


def plugin_installed_in(site_dir: Path) -> bool:
    """Does this site directory register our plugin and hold its code (what load_plugins sees)?"""
    for entry_points in site_dir.glob("*.dist-info/entry_points.txt"):
        try:  # a FIFO / device there is skipped at once, never waited on
            if _declares_plugin(read_text(entry_points, MAX_METADATA_FILE)):
                return _package_in(site_dir)
        except OSError:
            continue
    return False


def plugin_installed_here() -> bool:
    """The caller's own environment (all its site dirs), as load_plugins() would see it."""
    return any(
        ep.name in switch.ENTRY_POINT_NAMES and ep.value.startswith(PLUGIN_VALUE_PREFIX)
        for ep in importlib_metadata.entry_points(group="sglang.srt.plugins")
    )


def plugin_search_dirs(package_parent: Path, sys_path: list) -> list:
    """The directories a server whose interpreter has ``sys_path`` imports from, the tree's parent
    (where it imports sglang from) first; each once, absolute, in order."""
    dirs = []
    for entry in [str(package_parent), *sys_path]:
        path = Path(os.path.abspath(entry))
        if path not in dirs:
            dirs.append(path)
    return dirs


def plugin_found_on(dirs: list) -> Optional[Path]:
    """The first of ``dirs`` that registers the plugin and holds its code
    (``plugin_installed_in``), or None. A zip or a missing entry holds none."""
    for directory in dirs:
        try:
            if directory.is_dir() and plugin_installed_in(directory):
                return directory
        except OSError:  # unreadable: the server could not import from it either
            continue
    return None


def plugin_report(files, own_environment: bool, target: Optional[dict] = None) -> dict:
    """Is the plugin installed where the server imports it, and does this release load it
    (``files``: the tree as ``snapshot.read`` read it)? ``target``: the target interpreter and
    its own sys.path (``resolve.PLUGIN_SEARCH``, from the resolution child), where the plugin is
    looked for when given; else this Python's environment (``own_environment``) or the tree's
    site dir."""
    tree = files.tree
    api = files.exists(release.PLUGIN_API_FILE)
    searched = {}
    if target is not None:
        dirs = plugin_search_dirs(tree.package_parent, target["sys_path"])
        found = plugin_found_on(dirs)
        installed = found is not None
        on = f"the sys.path of {target['interpreter']}"
        where = f"{found} (on {on})" if installed else on
        searched = {"interpreter": target["interpreter"], "looked_in": [str(d) for d in dirs]}
    elif own_environment:
        installed, where = plugin_installed_here(), "this Python's environment"
    else:
        installed, where = plugin_installed_in(tree.package_parent), str(tree.package_parent)
    bypass = [
        name
        for relative, name in release.PLUGINLESS_LAUNCHERS.items()
        if files.exists(relative) and b"load_plugins" not in files.data(relative)
    ]
    return {
        "installed": installed,
        "not_loaded_by": [
            f"{name}: builds its schedulers without load_plugins(); use `sglang-dsa-fix apply`"
            for name in bypass
        ],
        "where": where,
        **searched,
        "sglang_has_plugin_api": api,
        "live": installed and api,
        "kill_switch": kill_switch_note(),
    }
