"""``check`` and ``status``: is THIS tree / deployment protected, per bug? The one verdict flow.

One flow, one way:

    1. tree: ``classify.read_tree`` (what the files say, per bug, and which release's
       arithmetic they carry);
    2. configuration and widths (optional): ``resolve.configuration`` — sglang's own ServerArgs
       resolution and sizing functions in a child process, or the static rule for the old shape
       flags, labelled ``"basis": "static"``, or none where sglang cannot be imported
       (``"basis": "unresolved"``: every bug the configuration decides is ``cannot_tell``); and
       the plugin, looked for where the server would import it: with ``-- <launch args>`` on the
       sys.path of the target interpreter (the resolution child's own, started isolated: its site
       dirs, PYTHONPATH's absolute entries, the tree's parent), else in this Python's environment
       (no --sglang-root) or the tree's site dir (``tree.plugin_report``);
    3. per bug a ``verdicts.State`` and the exit code (``bugs.judge``, pure) from 1 and 2.

``check`` is this flow without a configuration; ``status --url`` (``server_status``) judges what
a live server reports with the same states. Each step reads only what the steps before it
returned. Returns data; cli.py renders it.
"""

from __future__ import annotations

from typing import Optional

from sglang_dsa_fix import bugs, classify, resolve, source_patch
from sglang_dsa_fix import tree as trees

# ------------------------------------------------------------------------------ the flow


def collect(root: Optional[str], request: Optional[resolve.Request] = None) -> dict:
    """The whole report for a tree, and for a configuration when ``request`` names one.
    ToolError when the tree cannot be judged or sglang rejects the arguments."""
    tree = trees.find_tree(root)
    removed = source_patch.remove_stale_temps(tree)  # a killed apply's or revert's temp files
    files = classify.read_tree(tree)
    resolved = None if request is None else resolve.configuration(files.tree, files.form, request)
    target = None if resolved is None else resolved.pop(resolve.PLUGIN_SEARCH, None)
    plugin_info = trees.plugin_report(files.files, own_environment=root is None, target=target)
    report = {
        "sglang_version": files.tree.version,
        "sglang_path": str(files.tree.package),
        "plugin": plugin_info,
    }
    if files.version_note:
        report["version_note"] = files.version_note
    if removed:
        report["removed"] = [str(path) for path in removed]
    report.update(resolved or {})
    report["bugs"], report["exit_code"] = bugs.judge(files, plugin_info, resolved)
    report["summary"] = bugs.summary(report["bugs"])
    return report
