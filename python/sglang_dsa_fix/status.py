"""``sglang-dsa-fix status``: is THIS deployment protected, per bug?

Three sources, each reported as what it is:
- the tree (``source_patch.check``): affected / fixed in-tree / fixed upstream / not applicable;
- the plugin, read from the TARGET environment's own metadata (the ``*.dist-info`` beside its
  ``sglang/``), never from the caller's Python unless that is the target;
- optionally a shape (sglang's flag spellings): which target_verify seq_lens overflow the graph
  page_table (bug #1) and how many columns the decode reservation writes past the row (bug #2);
- or a live server (``--url``): the plugin's own state from ``/server_info``.
Returns data; cli.py renders it.
"""

from __future__ import annotations

import ast
import configparser
import json
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from sglang_dsa_fix import backends, plugin, source_patch, width
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.tree import ToolError
from sglang_dsa_fix.verdicts import (
    EXIT_AFFECTED,
    EXIT_CANNOT_TELL,
    EXIT_PROTECTED,
    Bug,
    Verdict,
    combined_exit,
)

# Nodes a width expression may use for us to evaluate it (e.g. ``self.max_context_len +
# (self.speculative_num_draft_tokens or 0)``); anything else is reported, not evaluated.
_SAFE_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.BoolOp,
    ast.Add,
    ast.Sub,
    ast.Or,
    ast.Attribute,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Subscript,
)
PLUGIN_VALUE_PREFIX = "sglang_dsa_fix."
KILL_SWITCH_NOTE = (
    f"enabled unless {plugin.KILL_SWITCH}=0 (or SGLANG_PLUGINS leaving out "
    f"{plugin.ENTRY_POINT_NAME}) in the server's environment"
)


def _declares_plugin(entry_points_text: str) -> bool:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    try:
        parser.read_string(entry_points_text)
    except configparser.Error:
        return False
    section = parser["sglang.srt.plugins"] if parser.has_section("sglang.srt.plugins") else {}
    value = section.get(plugin.ENTRY_POINT_NAME, "")
    return value.strip().startswith(PLUGIN_VALUE_PREFIX)


def plugin_installed_in(site_dir: Path) -> bool:
    """Does this site directory's metadata register our plugin (what sglang's load_plugins sees)?"""
    for entry_points in site_dir.glob("*.dist-info/entry_points.txt"):
        try:
            if _declares_plugin(entry_points.read_text(errors="replace")):
                return True
        except OSError:
            continue
    return False


def plugin_installed_here() -> bool:
    """The caller's own environment (all its site dirs), as load_plugins() would see it."""
    return any(
        ep.name == plugin.ENTRY_POINT_NAME and ep.value.startswith(PLUGIN_VALUE_PREFIX)
        for ep in metadata.entry_points(group="sglang.srt.plugins")
    )


def plugin_report(tree, own_environment: bool) -> dict:
    api = tree.file(backends.PLUGIN_API_FILE).is_file()
    installed = plugin_installed_here() if own_environment else plugin_installed_in(tree.package_parent)
    bypass = [
        name
        for relative, name in backends.PLUGINLESS_LAUNCHERS.items()
        if tree.file(relative).is_file() and b"load_plugins" not in tree.file(relative).read_bytes()
    ]
    return {
        "installed": installed,
        "not_loaded_by": [
            f"{name}: builds its schedulers without load_plugins(); use `sglang-dsa-fix apply`"
            for name in bypass
        ],
        "where": "this Python's environment" if own_environment else str(tree.package_parent),
        "sglang_has_plugin_api": api,
        "live": installed and api,
        "kill_switch": KILL_SWITCH_NOTE,
    }


def evaluate_width(expression: str, context_len: int, draft: int, pool_width: int) -> Optional[int]:
    """Evaluate the release's own page_table width expression for a shape (None if not plain)."""
    parsed = ast.parse(expression, mode="eval")
    if not all(isinstance(node, _SAFE_NODES) for node in ast.walk(parsed)):
        return None
    fake_self = SimpleNamespace(
        max_context_len=context_len,
        speculative_num_draft_tokens=draft,
        req_to_token=SimpleNamespace(shape=(None, pool_width)),
    )
    try:
        return int(eval(compile(parsed, "<width>", "eval"), {"__builtins__": {}}, {"self": fake_self}))
    except Exception:
        return None


def _fix_live(state, plugin_info) -> Optional[str]:
    if state.verdict is Verdict.FIXED_IN_TREE:
        return "in-tree"
    if state.verdict is Verdict.FIXED_UPSTREAM:
        return "upstream"
    if state.verdict is Verdict.AFFECTED and plugin_info["live"] and state.site.hookable:
        return "plugin"
    return None


def _shape_page_table(state, shape: width.SpecShape, pool: int, fixed: bool) -> dict:
    C, D = shape.context_length, shape.speculative_num_draft_tokens
    buffer = pool if state.verdict is Verdict.FIXED_UPSTREAM else evaluate_width(state.site.found, C, D, pool)
    effective = pool if fixed else buffer
    overflows = None if effective is None else effective < pool
    return {
        "req_to_token_width": pool,
        "graph_page_table_width": effective,
        "overflows": overflows,
        "overflowing_seq_lens": [effective - D + 1, pool - D] if overflows else None,
    }


def _shape_row(version, shape: width.SpecShape, fixed: bool) -> dict:
    columns = width.row_overflow_columns(version, shape)
    return {
        "row_extra": width.pristine_row_extra(version, shape),
        "row_extra_needed": width.required_row_extra(
            width.reserve_per_decode(shape, version), shape.page_size, version, shape.overlap
        ),
        "columns_past_row_end": 0 if fixed else columns,
        "columns_past_row_end_without_fix": columns,
        "overflows": bool(columns) and not fixed,
    }


def collect(root: Optional[str], shape: Optional[width.SpecShape] = None) -> dict:
    """The whole report for a tree (and a shape). ToolError when the tree cannot be judged."""
    tree = trees.find_tree(root)
    states = source_patch.check(tree)
    plugin_info = plugin_report(tree, own_environment=root is None)
    row_state = next(s for s in states if s.bug is Bug.ROW_OVERFLOW)
    row_fixed = _fix_live(row_state, plugin_info) is not None
    bugs = []
    for state in states:
        entry = state.to_dict()
        live = _fix_live(state, plugin_info)
        entry["fix_live"] = live
        code = EXIT_PROTECTED if live else state.verdict.exit_code
        if shape is not None and state.site is not None and state.verdict is not Verdict.NOT_COVERED:
            if state.bug is Bug.PAGE_TABLE:
                row = width.fixed_row_extra if row_fixed else width.pristine_row_extra
                extra = row(tree.version, shape)
                entry["shape"] = _shape_page_table(
                    state, shape, shape.context_length + extra, live is not None
                )
            else:
                entry["shape"] = _shape_row(tree.version, shape, live is not None)
            if entry["shape"]["overflows"] is False:
                code = EXIT_PROTECTED
        entry["exit_code"] = code
        if code == EXIT_AFFECTED:
            entry["advice"] = _advice(plugin_info, state.site)
        bugs.append(entry)
    report = {
        "sglang_version": tree.version,
        "sglang_path": str(tree.package),
        "plugin": plugin_info,
        "bugs": bugs,
    }
    if shape is not None:
        report["shape"] = vars(shape)
    report["exit_code"] = combined_exit(b["exit_code"] for b in bugs)
    return report


def _advice(plugin_info, site) -> str:
    if site is not None and not site.hookable:
        return "the plugin cannot fix this on this release (row sized inline): run `sglang-dsa-fix apply`"
    if not plugin_info["sglang_has_plugin_api"]:
        return "this release has no plugin API (sglang < 0.5.11): run `sglang-dsa-fix apply`"
    return "install sglang-dsa-fix into the server's environment (the plugin), or run `sglang-dsa-fix apply`"


def from_server(url: str, timeout: float = 10.0) -> dict:
    """What a live server's plugin reports, per rank, from ``/server_info``."""
    endpoint = url.rstrip("/") + "/server_info"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as response:
            info = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ToolError(f"{endpoint}: cannot read server info ({getattr(exc, 'reason', exc)})") from None
    ranks = [s.get(plugin.STATE_KEY) for s in info.get("internal_states") or [] if isinstance(s, dict)]
    report = {"url": url, "sglang_version": info.get("version"), "ranks": ranks}
    if not ranks or not all(ranks):
        report["detail"] = (
            "the server does not run the plugin on every rank: run "
            "`sglang-dsa-fix check` in the server's environment"
        )
        report["exit_code"] = EXIT_CANNOT_TELL
        return report
    codes = []
    for rank in ranks:
        for info_bug in rank.get("bugs", {}).values():
            state = info_bug.get("state", "")
            if state.startswith(("applied", "not needed", "hooked", Verdict.NOT_APPLICABLE.value)):
                codes.append(EXIT_PROTECTED)
            elif state.startswith(Verdict.NOT_COVERED.value):
                codes.append(EXIT_CANNOT_TELL)
            else:  # disabled, unsupported, failed
                codes.append(EXIT_AFFECTED)
    report["exit_code"] = combined_exit(codes)
    return report
