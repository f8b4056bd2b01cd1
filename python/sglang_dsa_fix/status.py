"""``check`` and ``status``: is THIS tree / deployment protected, per bug? One flow, one way:

    1. tree: ``classify.read_tree`` (what the files say, per bug, and which release's
       arithmetic they carry), and the plugin (the TARGET environment's own metadata, never the
       caller's Python unless that is it);
    2. configuration and widths (optional): ``resolve.configuration`` — sglang's own ServerArgs
       resolution and sizing functions in a child process, or the static rule for the old shape
       flags, labelled ``"basis": "static"``;
    3. per bug a ``verdicts.State`` (``verdicts.judge``) from 1 and 2;
    4. the exit code (``verdicts.combined_exit``).

``check`` is this flow without a configuration; ``status --url`` (``server_status``) judges what
a live server reports with the same states. Each step reads only what the steps before it
returned. Returns data; cli.py renders it.
"""

from __future__ import annotations

import configparser
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from sglang_dsa_fix import classify, plugin, release, resolve, width
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.verdicts import Bug, State, Verdict, combined_exit, judge

PLUGIN_VALUE_PREFIX = "sglang_dsa_fix."
KILL_SWITCH_NOTE = (
    f"enabled unless {plugin.KILL_SWITCH}=0 (or SGLANG_PLUGINS naming neither "
    f"{' nor '.join(plugin.ENTRY_POINT_NAMES)}) in the server's environment"
)


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
        try:
            lines = pth.read_text(errors="replace").splitlines()
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
        try:
            if _declares_plugin(entry_points.read_text(errors="replace")):
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


def plugin_report(files, own_environment: bool) -> dict:
    """Is the plugin installed where the server imports it, and does this release load it
    (``files``: the tree as ``snapshot.read`` read it)?"""
    tree = files.tree
    api = files.exists(release.PLUGIN_API_FILE)
    installed = plugin_installed_here() if own_environment else plugin_installed_in(tree.package_parent)
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
        "where": "this Python's environment" if own_environment else str(tree.package_parent),
        "sglang_has_plugin_api": api,
        "live": installed and api,
        "kill_switch": KILL_SWITCH_NOTE,
    }


# ------------------------------------------------------------------------------ per bug, per configuration


DFLASH_NOTE = (
    "DFLASH reserves 2 x block in its own decode path (DFlashDraftInputV2.prepare_for_decode, "
    "speculative/dflash_info_v2.py 0.5.17:113, 0.5.23:114) with no row check; judged from "
    "get_alloc_reserve_per_decode(), which equals that at steps = topk = 1; `--prove` drives that "
    "prepare itself on CPU; both fixes raise the row to it"
)


def decision_inputs(resolved: dict) -> dict:
    """What the per-bug arithmetic reads, from a resolved (or static) configuration."""
    config, widths = resolved["configuration"], resolved["widths"]
    algorithm = config.get("speculative_algorithm")
    inputs = {
        "context_len": config["context_length"],
        "num_draft_tokens": config.get("speculative_num_draft_tokens") or 0,
        "overlap": not config.get("disable_overlap_schedule"),
        "alloc_page_size": widths.get("alloc_page_size")
        or width.alloc_page_size(
            SimpleNamespace(
                page_size=config.get("page_size"),
                dcp_size=config.get("attn_dcp_size") or config.get("dcp_size"),
            )
        ),
        "row_extra": widths["row_extra"],
        "decode_reserve": widths["decode_reserve"],
        "graph_page_table_width": widths.get("graph_page_table_width"),
        "graph_page_table_from": widths.get("graph_page_table_from"),
        "graph_page_table_error": widths.get("graph_page_table_error"),
        "resolved": resolved.get("basis") == "sglang",
    }
    inputs["preclaims_bonus"] = str(algorithm).upper() != "DFLASH"
    if not inputs["preclaims_bonus"]:
        inputs["row_note"] = DFLASH_NOTE
    backend = resolve.decode_backend(config)
    if resolved.get("basis") == "sglang" and not algorithm:
        inputs["page_table_not_reachable"] = inputs["row_not_reachable"] = "no speculative decoding"
    elif config.get("disable_cuda_graph"):
        inputs["page_table_not_reachable"] = "CUDA graphs disabled"
    elif resolved.get("basis") == "sglang" and backend not in resolve.DSA_BACKENDS:
        inputs["page_table_not_reachable"] = (
            f"decode attention backend {backend}: no DSA/NSA graph page_table"
        )
    return inputs


def page_table_at(state, inputs: dict) -> dict:
    """Bug #1 at a configuration: the pool and graph buffer widths, and whether the longest
    target_verify the scheduler can run reads past the buffer (``width.verify_seq_len_bound``,
    observed on the H200 at D 5, checked by the CPU driver on 0.5.14: test/srt/test_verify_reach.py)."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    pool = C + inputs["row_extra"]
    buffer, source = inputs.get("graph_page_table_width"), inputs.get("graph_page_table_from")
    if buffer is None:  # the static rule: the file's own expression at this shape
        source = "static rule: the file's width expression"
        if inputs.get("graph_page_table_error"):
            source += f" (init_cuda_graph_state could not run here: {inputs['graph_page_table_error']})"
        if state.verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE):
            buffer = pool
        else:
            buffer = width.evaluate_page_table_expression(state.site.found, C, D, pool)
    longest = width.verify_seq_len_bound(C, D, inputs["overlap"])
    out = {
        "req_to_token_width": pool,
        "graph_page_table_width": buffer,
        "graph_page_table_from": source,
        "longest_verify_seq_len": longest,
    }
    if inputs.get("page_table_not_reachable"):
        out.update(reachable=False, why_not=inputs["page_table_not_reachable"])
    elif buffer is None:
        out["reachable"] = None
    else:
        out["reachable"] = longest + D > buffer
        out["overflowing_seq_lens"] = [buffer - D + 1, min(longest, pool - D)] if out["reachable"] else None
    return out


def row_at(state, version: str, inputs: dict) -> dict:
    """Bug #2 at a configuration, from the row headroom and the decode reservation (sglang's own
    numbers where resolved): how far the last reservation writes past the row end, now and with
    either fix (``width.row_extra_floor``: the reservation plus the allocator page's rounding)."""
    if inputs.get("row_not_reachable"):
        return {"reachable": False, "why_not": inputs["row_not_reachable"]}
    extra, reserve, page = inputs["row_extra"], inputs["decode_reserve"], inputs["alloc_page_size"]
    need = width.required_row_extra(
        reserve, page, version, inputs["overlap"], inputs["preclaims_bonus"], inputs["context_len"]
    )
    align = page if width.page_aligns_reservation(version) else 1
    with_fix = max(extra, width.row_extra_floor(reserve, align))
    # Resolved by sglang, the headroom is the tree's own function, an in-tree change included;
    # the static rule mirrors the pristine function, so a patched tree gets the fix's number.
    now = with_fix if state.verdict is Verdict.FIXED_IN_TREE and not inputs["resolved"] else extra
    columns = max(0, need - now)
    return {
        **({"note": inputs["row_note"]} if "row_note" in inputs else {}),
        "row_extra": now,
        "decode_reserve": reserve,
        "alloc_page_size": page,
        "row_extra_needed": need,
        "row_extra_with_fix": with_fix,
        "columns_past_row_end": columns,
        "columns_past_row_end_with_fix": max(0, need - with_fix),
        "reachable": columns > 0,
    }


def measured(at: dict, prove: dict) -> dict:
    """``status --prove``: what sglang's real decode path wrote, beside the arithmetic."""
    if "columns_past_row_end" not in prove or "columns_past_row_end" not in at:
        return prove
    return {**prove, "agrees_with_arithmetic": prove["columns_past_row_end"] == at["columns_past_row_end"]}


# ------------------------------------------------------------------------------ the flow


def collect(root: Optional[str], request: Optional[resolve.Request] = None) -> dict:
    """The whole report for a tree, and for a configuration when ``request`` names one.
    ToolError when the tree cannot be judged or sglang rejects the arguments."""
    files = classify.read_tree(trees.find_tree(root))
    tree = files.tree
    plugin_info = plugin_report(files.files, own_environment=root is None)
    resolved = None
    if request is not None:
        resolved = resolve.configuration(tree, files.arithmetic_version, request)
    report = {"sglang_version": tree.version, "sglang_path": str(tree.package), "plugin": plugin_info}
    if files.version_note:
        report["version_note"] = files.version_note
    if resolved is not None:
        report.update(resolved)
    report["bugs"] = [
        _bug_entry(state, plugin_info, files.arithmetic_version, resolved) for state in files.states
    ]
    report["exit_code"] = combined_exit(b["exit_code"] for b in report["bugs"])
    return report


def _bug_entry(state, plugin_info: dict, version: str, resolved: Optional[dict]) -> dict:
    entry = state.to_dict()
    plugin_fixes = plugin_info["live"] and state.site is not None and state.site.hookable
    reachable, fix_holds = None, True
    if resolved is not None and state.site is not None and state.verdict is not Verdict.NOT_COVERED:
        inputs = decision_inputs(resolved)
        if state.bug is Bug.PAGE_TABLE:
            at = page_table_at(state, inputs)
        else:
            at = row_at(state, version, inputs)
            if "prove" in resolved:
                at["measured"] = measured(at, resolved["prove"])
        entry["at_configuration"] = at
        reachable = at["reachable"]
        fix_holds = not at.get("columns_past_row_end_with_fix")
    verdict = judge(state.verdict, plugin_fixes, reachable, fix_holds)
    entry.update(state=verdict.token, state_text=verdict.text, exit_code=verdict.exit_code)
    if verdict in (State.AFFECTED, State.STALE_BYTECODE):
        entry["advice"] = _advice(plugin_info, state, fix_holds)
    return entry


def _advice(plugin_info, state, fix_holds: bool = True) -> str:
    if state.site is not None and state.site.legacy:
        return "the change in the files is an older form: run `sglang-dsa-fix revert`, then `apply`"
    if state.verdict is Verdict.FIXED_IN_TREE or not fix_holds:
        return "this tool's fix does not cover what this configuration needs: see the widths above"
    if state.verdict is Verdict.STALE_BYTECODE:
        return "run `sglang-dsa-fix apply` again: it removes the stale bytecode"
    if state.site is not None and not state.site.hookable:
        return "the plugin cannot fix this on this release (row sized inline): run `sglang-dsa-fix apply`"
    if not plugin_info["sglang_has_plugin_api"]:
        return "this release has no plugin API (sglang < 0.5.11): run `sglang-dsa-fix apply`"
    return "install sglang-dsa-fix into the server's environment (the plugin), or run `sglang-dsa-fix apply`"
