"""Per bug, at a configuration: the widths, whether the bug is reached, its state and advice.

Pure: from the tree's states and form (``classify.read_tree``), the plugin report and the
resolved (or static) configuration (``resolve.configuration``) to one entry per bug and the exit
code (``judge``). The arithmetic is ``width``'s; the states and exit codes are ``verdicts``'.
"""

from __future__ import annotations

from typing import Optional

from sglang_dsa_fix import release, width
from sglang_dsa_fix.release import Form
from sglang_dsa_fix.verdicts import Bug, State, Verdict, combined_exit
from sglang_dsa_fix.verdicts import judge as judge_state


def judge(files, plugin_info: dict, resolved: Optional[dict]) -> tuple:
    """(one entry per bug, the exit code) for a tree read by ``classify.read_tree``."""
    entries = [_entry(state, plugin_info, files.form, resolved) for state in files.states]
    return entries, combined_exit(entry["exit_code"] for entry in entries)


# What the row arithmetic says beside the numbers, per decode prepare (``release.DECODE_PREPARE``).
PREPARE_NOTES = {
    release.DFLASH_PREPARE: (
        "DFLASH (and DSPARK, its family) reserves 2 x block in its own decode path "
        "(DFlashDraftInputV2.prepare_for_decode, speculative/dflash_info_v2.py 0.5.17:113, "
        "0.5.23:114) with no row check; judged from get_alloc_reserve_per_decode(), which equals "
        "that at steps = topk = 1; `--prove` drives that prepare itself on CPU; both fixes raise "
        "the row to it"
    ),
    release.UNO_PREPARE: (
        "UNO reserves 2 x (D + 1) in its own decode path and raises where it would pass the row "
        "(speculative/uno_info.py 0.5.20:141-146): a refused request, not a silent overflow; "
        "judged from sglang's own sizing, which holds that reservation from 0.5.20"
    ),
}


def decision_inputs(resolved: dict) -> dict:
    """What the per-bug arithmetic reads, from a resolved (or static) configuration."""
    config, widths = resolved["configuration"], resolved["widths"]
    algorithm = config.get("speculative_algorithm")
    inputs = {
        "context_len": config["context_length"],
        "num_draft_tokens": config.get("speculative_num_draft_tokens") or 0,
        "overlap": not config.get("disable_overlap_schedule"),
        "alloc_page_size": widths["alloc_page_size"],
        "row_extra": widths["row_extra"],
        "row_extra_with_plugin": widths.get("row_extra_with_plugin"),
        "decode_reserve": widths["decode_reserve"],
        "graph_page_table_width": widths.get("graph_page_table_width"),
        "graph_page_table_from": widths.get("graph_page_table_from"),
        "graph_page_table_error": widths.get("graph_page_table_error"),
        "resolved": resolved.get("basis") == "sglang",
    }
    prepare = release.DECODE_PREPARE.get("NONE" if not algorithm else str(algorithm).upper(), "unknown")
    inputs["preclaims_bonus"] = prepare != release.DFLASH_PREPARE
    if prepare in PREPARE_NOTES:
        inputs["row_note"] = PREPARE_NOTES[prepare]
    if prepare == "unknown":
        inputs["row_cannot_tell"] = (
            f"speculative algorithm {algorithm}: this tool has no rule for its decode path "
            "(release.DECODE_PREPARE)"
        )
    backend = release.decode_backend(config)
    if resolved.get("basis") == "sglang" and not algorithm:
        inputs["page_table_not_reachable"] = inputs["row_not_reachable"] = "no speculative decoding"
    elif config.get("disable_cuda_graph"):
        inputs["page_table_not_reachable"] = "CUDA graphs disabled"
    elif resolved.get("basis") == "sglang" and backend not in release.DSA_BACKENDS:
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


def row_at(state, form: Form, inputs: dict) -> dict:
    """Bug #2 at a configuration, from the row headroom and the decode reservation (sglang's own
    numbers where resolved): how far the last reservation writes past the row end, now and with
    either fix (``width.row_extra_floor``: the reservation plus the allocator page's rounding)."""
    if inputs.get("row_not_reachable"):
        return {"reachable": False, "why_not": inputs["row_not_reachable"]}
    extra, reserve, page = inputs["row_extra"], inputs["decode_reserve"], inputs["alloc_page_size"]
    need = width.required_row_extra(
        reserve, page, form, inputs["overlap"], inputs["preclaims_bonus"], inputs["context_len"]
    )
    align = page if form.page_aligns_reservation else 1
    # Resolved by sglang: the plugin's own hook ran on sglang's numbers (runtime_fix); the
    # in-tree form computes the same. Else the rule: the reservation and the page's rounding.
    with_fix = inputs["row_extra_with_plugin"] or max(extra, width.row_extra_floor(reserve, align))
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


def _entry(state, plugin_info: dict, form: Form, resolved: Optional[dict]) -> dict:
    entry = state.to_dict()
    plugin_fixes = plugin_info["live"] and state.site is not None and state.site.hookable
    reachable, fix_holds = None, True
    if resolved is not None and state.site is not None and state.verdict is not Verdict.NOT_COVERED:
        inputs = decision_inputs(resolved)
        if state.bug is Bug.PAGE_TABLE:
            at = page_table_at(state, inputs)
        elif "row_cannot_tell" in inputs:
            at = {"reachable": None, "cannot_tell": inputs["row_cannot_tell"]}
        else:
            at = row_at(state, form, inputs)
            if "prove" in resolved:
                at["measured"] = measured(at, resolved["prove"])
        entry["at_configuration"] = at
        reachable = at["reachable"]
        fix_holds = not at.get("columns_past_row_end_with_fix")
    verdict = judge_state(state.verdict, plugin_fixes, reachable, fix_holds)
    if entry.get("at_configuration", {}).get("cannot_tell"):
        verdict = State.CANNOT_TELL
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
