"""``sglang-dsa-fix status``: is this sglang affected, and is a fix live?"""

from __future__ import annotations

import ast
import os
from importlib import metadata
from types import SimpleNamespace
from typing import Optional

from sglang_dsa_fix import plugin, source_patch, width

# Nodes a width expression may use for us to evaluate it (e.g. ``self.max_context_len +
# (self.speculative_num_draft_tokens or 0)``); anything else is reported, not evaluated.
_SAFE_NODES = (ast.Expression, ast.BinOp, ast.BoolOp, ast.Add, ast.Sub, ast.Or, ast.Attribute,
               ast.Name, ast.Load, ast.Constant, ast.Subscript)


def _entry_point_installed() -> bool:
    return any(
        ep.name == plugin.ENTRY_POINT_NAME and ep.value.startswith("sglang_dsa_fix.")
        for ep in metadata.entry_points(group="sglang.srt.plugins")
    )


def _plugin_state(tree) -> dict:
    installed = _entry_point_installed()
    allow = os.environ.get("SGLANG_PLUGINS", "").strip()
    allowed = not allow or plugin.ENTRY_POINT_NAME in {x.strip() for x in allow.split(",")}
    api = (tree.package_parent / "sglang" / "srt" / "plugins" / "hook_registry.py").is_file()
    return {
        "installed": installed,
        "sglang_has_plugin_api": api,
        "enabled": installed and api and allowed and plugin.enabled(),
        "kill_switch": f"{plugin.KILL_SWITCH}={os.environ.get(plugin.KILL_SWITCH, '')}",
        "SGLANG_PLUGINS": allow or None,
    }


def _evaluate_width(expression: str, context_len: int, draft: int, pool_width: int) -> Optional[int]:
    tree = ast.parse(expression, mode="eval")
    if not all(isinstance(node, _SAFE_NODES) for node in ast.walk(tree)):
        return None
    fake_self = SimpleNamespace(
        max_context_len=context_len,
        speculative_num_draft_tokens=draft,
        req_to_token=SimpleNamespace(shape=(None, pool_width)),
    )
    try:
        return int(eval(compile(tree, "<width>", "eval"), {"__builtins__": {}}, {"self": fake_self}))
    except Exception:
        return None


def collect(root: Optional[str], context_length=None, num_draft_tokens=None, page_size=1, topk=1) -> dict:
    tree = source_patch.find_tree(root)
    report = {"sglang_version": tree.version, "sglang_path": str(tree.package_parent / "sglang")}
    try:
        status = source_patch.inspect(tree)
        verdict, site = status.verdict.value, status.site
    except source_patch.PatchError as exc:
        verdict, site = f"not recognised: {exc}", None
    report["verdict"] = verdict
    if site is not None:
        report.update(
            backend_module=site.layout.module,
            backend_class=site.layout.class_name,
            backend_file=f"{site.path}:{site.lineno}",
            width_expression=site.expression,
        )
    report["plugin"] = _plugin_state(tree)
    affected = verdict == source_patch.Verdict.AFFECTED.value
    report["fix_live"] = (
        ("plugin" if report["plugin"]["enabled"] else None) if affected
        else {source_patch.Verdict.FIXED_IN_TREE.value: "in-tree",
              source_patch.Verdict.FIXED_UPSTREAM.value: "upstream"}.get(verdict)
    )
    if affected and not report["fix_live"]:
        plugin_state = report["plugin"]
        if not plugin_state["sglang_has_plugin_api"]:
            report["advice"] = "this release has no plugin API (sglang < 0.5.11): run `sglang-dsa-fix apply`"
        elif plugin_state["installed"]:
            report["advice"] = (
                f"the plugin is installed but not enabled ({plugin.KILL_SWITCH}=0 or SGLANG_PLUGINS "
                "leaves it out): enable it, or run `sglang-dsa-fix apply`"
            )
        else:
            report["advice"] = "install this package (the plugin), or run `sglang-dsa-fix apply`"
    if context_length is not None and num_draft_tokens is not None and site is not None:
        pool = context_length + width.req_to_token_extra(num_draft_tokens, page_size, topk)
        buffer = _evaluate_width(site.expression, context_length, num_draft_tokens, pool)
        if report["verdict"] == source_patch.Verdict.FIXED_UPSTREAM.value:
            buffer = pool
        effective = pool if report["fix_live"] else buffer
        first_bad = None if effective is None or effective >= pool else effective - num_draft_tokens + 1
        report["shape"] = {
            "context_length": context_length,
            "speculative_num_draft_tokens": num_draft_tokens,
            "page_size": page_size,
            "speculative_eagle_topk": topk,
            "req_to_token_width": pool,
            "graph_page_table_width_in_source": buffer,
            "graph_page_table_width_effective": effective,
            "target_verify_can_overflow": None if effective is None else effective < pool,
            "overflowing_seq_lens": None if first_bad is None
            else [first_bad, pool - num_draft_tokens],
        }
    return report


def render(report: dict) -> str:
    lines = [f"sglang {report['sglang_version']} at {report['sglang_path']}"]
    if "backend_class" in report:
        lines.append(f"backend: {report['backend_module']}.{report['backend_class']} ({report['backend_file']})")
        lines.append(f"page_table width expression: {report['width_expression']}")
    live = report["fix_live"]
    lines.append(f"verdict: {report['verdict']}" + (f" (fix live: {live})" if live else ""))
    p = report["plugin"]
    lines.append(
        f"plugin: {'installed' if p['installed'] else 'not installed'}, "
        f"{'enabled' if p['enabled'] else 'not enabled'}"
        f"{'' if p['sglang_has_plugin_api'] else ' (this sglang has no plugin API)'}"
    )
    if "advice" in report:
        lines.append(f"advice: {report['advice']}")
    shape = report.get("shape")
    if shape:
        lines.append(
            f"with context_length={shape['context_length']} D={shape['speculative_num_draft_tokens']}: "
            f"req_to_token width {shape['req_to_token_width']}, graph page_table width "
            f"{shape['graph_page_table_width_effective']} -> target_verify "
            + (f"overflows for seq_len {shape['overflowing_seq_lens'][0]}..{shape['overflowing_seq_lens'][1]}"
               if shape["target_verify_can_overflow"] else "cannot overflow")
        )
    return "\n".join(lines)
