"""``check`` and ``status``: is THIS tree / deployment protected, per bug? The one verdict flow.

One flow, one way:

    1. tree: ``classify.read_tree`` (what the files say, per bug, and which release's
       arithmetic they carry);
    2. configuration and widths (optional): ``resolve.configuration`` — sglang's own ServerArgs
       resolution and sizing functions in a child process, or the static rule for the old shape
       flags, labelled ``"basis": "static"``; and the plugin, looked for where the server would
       import it: with ``-- <launch args>`` on the sys.path of the target interpreter (the
       resolution child's own: its site dirs, PYTHONPATH as this environment hands it on, the
       tree's parent), else in this Python's environment (no --sglang-root) or the tree's site
       dir (``plugin_report``);
    3. per bug a ``verdicts.State`` and the exit code (``bugs.judge``, pure) from 1 and 2.

``check`` is this flow without a configuration; ``status --url`` (``server_status``) judges what
a live server reports with the same states. Each step reads only what the steps before it
returned. Returns data; cli.py renders it.
"""

from __future__ import annotations

import configparser
import os
from importlib import metadata
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import bugs, classify, plugin, release, resolve
from sglang_dsa_fix import tree as trees

PLUGIN_VALUE_PREFIX = "sglang_dsa_fix."
MAX_METADATA_FILE = 1 << 20  # bytes read of an entry_points.txt or a .pth
KILL_SWITCH_NOTE = (
    f"enabled unless {plugin.KILL_SWITCH}=0 / false / no / off (or SGLANG_PLUGINS naming neither "
    f"{' nor '.join(plugin.ENTRY_POINT_NAMES)}) in the server's environment; any other value but "
    "1 / true / yes / on is taken as enabled, with a warning in the server's log"
)


def kill_switch_note() -> str:
    """KILL_SWITCH_NOTE, and how this environment's value (where set) would be taken: the
    server's environment decides, this one is only said."""
    value = os.environ.get(plugin.KILL_SWITCH)
    if value is None:
        return KILL_SWITCH_NOTE
    return f"{KILL_SWITCH_NOTE}; here {plugin.kill_switch_text(value)}"


def _declares_plugin(entry_points_text: str) -> bool:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    try:
        parser.read_string(entry_points_text)
    except configparser.Error:
        return False
    section = parser["sglang.srt.plugins"] if parser.has_section("sglang.srt.plugins") else {}
    return any(
        section.get(name, "").strip().startswith(PLUGIN_VALUE_PREFIX) for name in plugin.ENTRY_POINT_NAMES
    )


def _package_in(site_dir: Path) -> bool:
    """Is the plugin's code importable from this site dir: the package itself, or an editable
    install's ``.pth`` pointing at a directory that holds it? Metadata alone loads nothing."""
    if (site_dir / "sglang_dsa_fix" / "plugin.py").is_file():
        return True
    for pth in site_dir.glob("*.pth"):
        try:  # a FIFO / device there is skipped at once, never waited on
            lines = trees.read_text(pth, MAX_METADATA_FILE).splitlines()
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
            if _declares_plugin(trees.read_text(entry_points, MAX_METADATA_FILE)):
                return _package_in(site_dir)
        except OSError:
            continue
    return False


def plugin_installed_here() -> bool:
    """The caller's own environment (all its site dirs), as load_plugins() would see it."""
    return any(
        ep.name in plugin.ENTRY_POINT_NAMES and ep.value.startswith(PLUGIN_VALUE_PREFIX)
        for ep in metadata.entry_points(group="sglang.srt.plugins")
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


# ------------------------------------------------------------------------------ the flow


def collect(root: Optional[str], request: Optional[resolve.Request] = None) -> dict:
    """The whole report for a tree, and for a configuration when ``request`` names one.
    ToolError when the tree cannot be judged or sglang rejects the arguments."""
    files = classify.read_tree(trees.find_tree(root))
    resolved = None if request is None else resolve.configuration(files.tree, files.form, request)
    target = None if resolved is None else resolved.pop(resolve.PLUGIN_SEARCH, None)
    plugin_info = plugin_report(files.files, own_environment=root is None, target=target)
    report = {
        "sglang_version": files.tree.version,
        "sglang_path": str(files.tree.package),
        "plugin": plugin_info,
    }
    if files.version_note:
        report["version_note"] = files.version_note
    report.update(resolved or {})
    report["bugs"], report["exit_code"] = bugs.judge(files, plugin_info, resolved)
    return report
