"""Per bug, at a configuration: the widths, whether the bug is reached, its state and advice.

Pure: from the tree's states and form (``classify.read_tree``), the plugin report and the
resolved (or static) configuration (``resolve.configuration``) to one entry per bug and the exit
code (``judge``). The arithmetic is each member's (``members``); the states and exit codes are ``verdicts``'.
"""

from __future__ import annotations

from typing import Optional

from sglang_dsa_fix import members
from sglang_dsa_fix.release import Form
from sglang_dsa_fix.verdicts import State, Verdict, combined_exit
from sglang_dsa_fix.verdicts import judge as judge_state


def judge(files, plugin_info: dict, resolved: Optional[dict]) -> tuple:
    """(one entry per bug, the exit code) for a tree read by ``classify.read_tree``."""
    entries = [_entry(state, plugin_info, files.form, resolved) for state in files.states]
    return entries, combined_exit(entry["exit_code"] for entry in entries)


def _entry(state, plugin_info: dict, form: Form, resolved: Optional[dict]) -> dict:
    entry = state.to_dict()
    plugin_fixes = plugin_info["live"] and state.site is not None and state.site.hookable
    # An older form of this tool's change holds only part of the width (its member's `legacy`
    # text says what): without a configuration's numbers, that is no fix.
    reachable, fix_holds = None, not (state.site is not None and state.site.legacy)
    if resolved is not None and state.site is not None and state.verdict is not Verdict.NOT_COVERED:
        at = members.at_configuration(state.bug, state.verdict, state.site.found, form, resolved)
        entry["at_configuration"] = at
        reachable = at["reachable"]
        if state.verdict is Verdict.AFFECTED and state.site.affected_when:
            entry["detail"] = ""  # the form's general range: the configuration's numbers decide
        fix_holds = not (
            at.get("columns_past_row_end_with_fix")
            or at.get("pages_past_table_with_fix")
            or at.get("reachable_with_fix")
        )
    verdict = judge_state(state.verdict, plugin_fixes, reachable, fix_holds)
    if entry.get("at_configuration", {}).get("cannot_tell"):
        verdict = State.CANNOT_TELL
    entry.update(state=verdict.token, state_text=verdict.text, exit_code=verdict.exit_code)
    if verdict in (State.AFFECTED, State.STALE_BYTECODE):
        entry["action"], entry["advice"] = _advice(plugin_info, state, fix_holds)
    return entry


# What an affected member's owner does next (``entry["action"]``), most specific first: the
# summary's next step is the first of these any member needs.
ACTIONS = ("revert_then_apply", "apply", "plugin_or_apply", "not_covered_by_fix")


def _advice(plugin_info, state, fix_holds: bool = True) -> tuple:
    """(action, advice): one of ``ACTIONS`` and its words for this member."""
    if state.site is not None and state.site.legacy:
        return ACTIONS[
            0
        ], "the change in the files is an older form: run `sglang-dsa-fix revert`, then `apply`"
    if state.verdict is Verdict.FIXED_UPSTREAM:
        return ACTIONS[
            3
        ], "sglang's own width does not hold what this configuration needs: see the widths above"
    if state.verdict is Verdict.FIXED_IN_TREE or not fix_holds:
        return ACTIONS[
            3
        ], "this tool's fix does not cover what this configuration needs: see the widths above"
    if state.verdict is Verdict.STALE_BYTECODE:
        return ACTIONS[1], "run `sglang-dsa-fix apply` again: it removes the stale bytecode"
    if state.site is not None and not state.site.hookable:
        return ACTIONS[
            1
        ], "the plugin cannot fix this on this release (row sized inline): run `sglang-dsa-fix apply`"
    if not plugin_info["sglang_has_plugin_api"]:
        return ACTIONS[1], "this release has no plugin API (sglang < 0.5.11): run `sglang-dsa-fix apply`"
    return ACTIONS[2], (
        "install sglang-dsa-fix into the server's environment (the plugin), or run `sglang-dsa-fix apply`"
    )


def summary(entries: list) -> dict:
    """The report in one line's data: how many members, how many in each state (``State``
    tokens), the next step (the first of ``ACTIONS`` an affected member needs, None where none
    is) and the first reason a member cannot be told."""
    counts: dict = {}
    for entry in entries:
        counts[entry["state"]] = counts.get(entry["state"], 0) + 1
    actions = {entry["action"] for entry in entries if "action" in entry}
    unknown = [entry for entry in entries if entry["state"] == State.CANNOT_TELL.token]
    return {
        "members": len(entries),
        "counts": counts,
        "next_step": next((action for action in ACTIONS if action in actions), None),
        "cannot_tell_reason": _reason(unknown[0]) if unknown else None,
    }


def _reason(entry: dict) -> str:
    at = entry.get("at_configuration") or {}
    return at.get("cannot_tell") or entry.get("detail") or "see -v"
