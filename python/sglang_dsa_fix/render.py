"""The terminal text of every command: the only place the tool's data becomes words.

The first line of ``check``, ``status`` and ``status --url`` is the verdict (``headline``), then one
short line per member, the advice once, the notes; ``-v`` adds each member's file, line and
widths; ``-q`` prints the verdict alone. Colour only on a terminal, never with ``NO_COLOR``.
"""

from __future__ import annotations

import os
import re
import sys

from sglang_dsa_fix import members
from sglang_dsa_fix.verdicts import Bug, State

# What a terminal acts on instead of showing: C0 (escape sequences, newlines, carriage returns),
# DEL, C1, the Unicode line separators and the bidi embeddings / overrides / isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
MAX_LINE = 120  # characters of a member's line (the rest under -v)
RESTART = "restart the server: sglang reads its files when it starts"
# The words of the summary's next step (``bugs.ACTIONS``).
NEXT_STEP = {
    "revert_then_apply": "run `sglang-dsa-fix revert`, then `sglang-dsa-fix apply`, then restart the server",
    "apply": "run `sglang-dsa-fix apply`, then restart the server",
    "plugin_or_apply": "run `sglang-dsa-fix apply` (or install the plugin in the server's environment), "
    "then restart the server",
    "not_covered_by_fix": "this tool's fix does not cover this configuration: see `-v`",
}
_COLOUR = {1: "31", 2: "33", 0: "32"}  # by exit code: red affected, yellow cannot tell, green


def printable(text) -> str:
    """Text from outside the tool (a server's strings, a file's bytes, a path) as it is printed
    on a terminal: each control character as its escape (``\\x1b``, ``\\n``, ``\\u202e``), so
    what a line shows is what it holds and no input can start a line of its own. JSON output
    carries the exact strings."""
    return _CONTROL.sub(_escape, str(text))


def _escape(match) -> str:
    code = ord(match.group())
    return {10: "\\n", 13: "\\r", 9: "\\t"}.get(code) or (
        f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    )


def _text(lines) -> str:
    """The terminal text of a command: one printable line per entry."""
    return "\n".join(printable(line) for line in lines)


def _title(token: str) -> str:
    return members.of(Bug(token)).title


def _state_line(state: dict) -> str:
    where = f" ({state['file']}:{state['line']}: `{state['found']}`)" if "file" in state else ""
    detail = f"; {state['detail']}" if state.get("detail") else ""
    text = state.get("state_text") or State.of_token(state["tree_state"]).text
    return f"{_title(state['bug'])}: {text}{where}{detail}"


def render_server(report: dict) -> str:
    """``status --url``: one row per role and rank, one column per bug, then the notes."""
    names = list(dict.fromkeys(name for rank in report["ranks"] for name in rank["bugs"]))
    known = {member.bug.value: member.column for member in members.registry()}
    header = ["role", "rank", *(known.get(name, name) for name in names), "exit"]
    rows, notes = [], []
    for rank in report["ranks"]:
        role = rank["role"] if rank["role"] == "server" else f"{rank['role']}#{rank['server']}"
        notes += [f"{role} rank {rank['rank']}: {note}" for note in rank["notes"]]
        states = [rank["bugs"].get(name, {}).get("state", "-") for name in names]
        rows.append([role, str(rank["rank"]), *states, str(rank["exit_code"])])
    table = [[printable(cell) for cell in row] for row in [header, *rows]]  # aligned as shown
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"server {report['endpoint']} (sglang {report['sglang_version'] or 'version unknown'})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return _text(lines + notes + report["notes"])


def _configuration_lines(report: dict) -> list:
    config = report["configuration"]
    if report["basis"] == "static":
        head = "configuration (static rule from the shape flags; sglang's own resolution not used)"
    else:
        head = f"configuration resolved by sglang {report.get('resolved_with', '')}".rstrip()
    sources = report.get("sources", {})
    values = ", ".join(
        f"{name} {value}" + (f" ({sources[name]})" if name in sources else "")
        for name, value in config.items()
        if value is not None
    )
    return [f"{head}:", f"  {values}"]


def _at_configuration_lines(bug: dict) -> list:
    """A member's numbers at a configuration, by the shape of what its rule returned."""
    at = bug["at_configuration"]
    # Reached, but the plugin holds it: the numbers below are sglang's own, without the plugin.
    where = "at this configuration" + (
        ", without the plugin" if bug["state"] == State.PROTECTED_BY_PLUGIN.token else ""
    )
    if at.get("why_not"):
        return [f"  at this configuration: not reachable ({at['why_not']})"]
    if at.get("cannot_tell"):
        return [f"  at this configuration: cannot tell ({at['cannot_tell']})"]
    if "draft_kv_indices_needed" in at:
        return _flat_buffer_lines(at, where)
    if "graph_page_table_pages" in at:
        return _graph_table_lines(at, where)
    if "req_to_token_width" in at:
        return _page_table_lines(at, where)
    return _row_lines(at, where)


def _flat_buffer_lines(at: dict, where: str) -> list:
    """Triton's flat buffers: the draft decode's kv_indices and the verify mask per request."""
    verdict = "they read (and write) past the buffers" if at["reachable"] else "they fit"
    mask = (
        f" and the verify needs {at['verify_mask_cells_needed']} mask cells per request of "
        f"{at['verify_mask_cells_per_request']}"
        if "verify_mask_cells_needed" in at
        else ""
    )
    return [
        f"  {where}: with {at['when']}, the draft decode writes {at['draft_kv_indices_needed']} "
        f"kv_indices per request into {at['draft_kv_indices_per_request']}{mask} ({at['from']}) -> {verdict}"
    ]


def _graph_table_lines(at: dict, where: str) -> list:
    """A graph table in pages (FA3 and its relatives), and a verify tree mask where there is one."""
    verdict = (
        f"reads {at['pages_past_table']} page(s) past its table row"
        if at["pages_past_table"]
        else "reads inside its table row"
    )
    lines = [
        f"  {where}: graph table {at['graph_page_table_pages']} pages "
        f"({at['graph_page_table_from']}); the longest target_verify reads "
        f"{at['longest_verify_pages_read']} -> {verdict} (with the fix: "
        f"{at['graph_page_table_pages_with_fix']} pages)"
    ]
    if "verify_mask_cells_needed" in at:  # TRT-LLM MLA / FlashMLA's verify tree mask
        over = at["verify_mask_cells_needed"] > at["verify_mask_cells_per_request"]
        lines.append(
            "  and with every request of the largest captured batch at the longest verify, the tree "
            f"builder writes {at['verify_mask_cells_needed']} mask cells per request of "
            f"{at['verify_mask_cells_per_request']} -> {'past the mask' if over else 'they fit'} "
            f"(with the fix: {at['verify_mask_cells_with_fix']})"
        )
    return lines


def _page_table_lines(at: dict, where: str) -> list:
    """A graph page_table in tokens against req_to_token's width (bug #1's shape)."""
    verdict = (
        f"target_verify overflows for seq_len {at['overflowing_seq_lens'][0]}.."
        f"{at['overflowing_seq_lens'][1]}"
        if at["reachable"]
        else "cannot overflow"
        if at["reachable"] is False
        else "width expression not evaluated"
    )
    return [
        f"  {where}: req_to_token width {at['req_to_token_width']}, graph "
        f"page_table width {at['graph_page_table_width']} ({at['graph_page_table_from']}), longest "
        "target_verify seq_len "
        f"{at['longest_verify_seq_len']} -> {verdict}"
    ]


def _row_lines(at: dict, where: str) -> list:
    """A request's req_to_token row against its decode reservation, and --prove's measurement."""
    verdict = (
        f"the last decode reservation writes up to {at['columns_past_row_end']} column(s) into the next "
        "request's row (the worst case: a decode step with the request's committed length at "
        "context_len - 4)"
        if at["reachable"]
        else "no write past the row end"
    )
    lines = [f"  note: {at['note']}"] if "note" in at else []
    lines.append(
        f"  {where}: row headroom {at['row_extra']}, decode reservation "
        f"{at['decode_reserve']}, allocator page {at['alloc_page_size']}, needs {at['row_extra_needed']} -> "
        f"{verdict} (with the fix: headroom {at['row_extra_with_fix']})"
    )
    proof = at.get("measured")
    if proof is None:
        return lines
    if "columns_past_row_end" not in proof:
        return lines + [f"  --prove: {proof.get('error') or proof.get('skipped')}"]
    return lines + [
        f"  --prove (sglang's decode path on {proof.get('device', 'cpu')}, context {proof['context_length']}): "
        f"{proof['columns_past_row_end']} column(s) past the row end, "
        f"{proof['neighbour_cells_changed']} neighbour cell(s) changed, {proof['leaked_slots']} slot(s) leaked"
        + (
            ""
            if proof.get("agrees_with_arithmetic", True)
            else " — DISAGREES with the arithmetic above: the drive ran sglang's own decode path, so "
            "its number is sglang's behaviour (please report the difference)"
        )
    ]


def render_status(report: dict) -> str:
    from sglang_dsa_fix import width

    lines = [f"sglang {report['sglang_version']} at {report['sglang_path']}"]
    if report.get("version_note"):
        lines.append(f"note: {report['version_note']}")
    p = report["plugin"]
    lines.append(
        f"plugin: {'installed' if p['installed'] else 'not installed'} in {p['where']}"
        + ("" if p["sglang_has_plugin_api"] else " (this sglang has no plugin API)")
        + (f"; {p['kill_switch']}" if p["live"] else "")
    )
    lines += [f"  plugin not loaded by {note}" for note in p["not_loaded_by"] if p["live"]]
    if report.get("basis") == width.UNRESOLVED:
        lines.append(f"configuration: cannot tell ({report['basis_note']})")
    elif "configuration" in report:
        lines += _configuration_lines(report)
    for bug in report["bugs"]:
        title = _title(bug["bug"])
        where = f" ({bug['file']}:{bug['line']}: `{bug['found']}`)" if "file" in bug else ""
        lines.append(f"{title}: {bug['state_text']}{where}")
        if bug["detail"]:
            lines.append(f"  {bug['detail']}")
        if "at_configuration" in bug:
            lines += _at_configuration_lines(bug)
        if "advice" in bug:
            lines.append(f"  advice: {bug['advice']}")
    return _text(lines)


# ------------------------------------------------------------------------------ the first screen


def colour_wanted(stream=None) -> bool:
    """Colour only on a terminal, and never with NO_COLOR (no-color.org) or TERM=dumb."""
    stream = sys.stdout if stream is None else stream
    return (
        hasattr(stream, "isatty")
        and stream.isatty()
        and not os.environ.get("NO_COLOR")
        and os.environ.get("TERM") != "dumb"
    )


_MEMBER_LINE = re.compile(r"^(  )([a-z_]+)(?= )")


def _paint(line: str) -> str:
    """A member line's state token in its exit code's colour (after ``printable``: the escape
    sequences are the tool's own)."""

    def paint(match):
        state = State.of_token(match[2])
        if state is None:
            return match[0]
        return f"{match[1]}\x1b[{_COLOUR[state.exit_code]}m{match[2]}\x1b[0m"

    return _MEMBER_LINE.sub(paint, line, count=1)


def screen(lines, colour: bool = False) -> str:
    """The terminal text: printable lines, member states coloured where asked."""
    lines = [printable(line) for line in lines]
    return "\n".join(_paint(line) for line in lines) if colour else "\n".join(lines)


def _clip(line: str, limit: int = MAX_LINE) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


def headline(subject: str, summary: dict, next_step: str = "") -> str:
    """The verdict in one line (``bugs.summary``'s data): how many members are affected and what
    to run, else what cannot be told, else that nothing is to be done and why."""
    n, counts = summary["members"], summary["counts"]
    affected = counts.get(State.AFFECTED.token, 0) + counts.get(State.STALE_BYTECODE.token, 0)
    if affected:
        step = next_step or NEXT_STEP.get(summary.get("next_step"), "see the lines below")
        return f"{subject}: {affected} of {n} affected — {step}"
    unknown = counts.get(State.CANNOT_TELL.token, 0)
    if unknown:
        return _clip(f"{subject}: cannot tell for {unknown} of {n} — {summary['cannot_tell_reason']}", 200)
    parts = ", ".join(f"{count} {token.replace('_', ' ')}" for token, count in counts.items())
    return f"{subject}: nothing to do — none of {n} affected ({parts})"


def _reach(at: dict) -> str:
    """An affected member's numbers at a configuration, in a few words (-v has them all)."""
    if at.get("columns_past_row_end"):
        return f"up to {at['columns_past_row_end']} column(s) written into the next request's row"
    if at.get("pages_past_table"):
        return f"the longest verify reads {at['pages_past_table']} page(s) past its table"
    if at.get("verify_mask_cells_needed", 0) > at.get("verify_mask_cells_per_request", 1 << 62):
        return "the verify tree mask overflows"
    if at.get("draft_kv_indices_needed", 0) > at.get("draft_kv_indices_per_request", 1 << 62):
        return "the draft decode writes past its kv_indices buffer"
    if at.get("overflowing_seq_lens"):
        low, high = at["overflowing_seq_lens"]
        return f"target_verify crashes for seq_len {low}..{high}"
    return ""


def _why(entry: dict) -> str:
    at = entry.get("at_configuration") or {}
    if (entry.get("state") or entry["tree_state"]) == State.PROTECTED_BY_PLUGIN.token:
        return ""  # the detail says where the files are affected: the plugin holds it
    return at.get("why_not") or at.get("cannot_tell") or _reach(at) or entry.get("detail") or ""


def member_line(entry: dict) -> str:
    """``  <state token>  <title>: <why>``, at most MAX_LINE characters."""
    token = entry.get("state") or entry["tree_state"]
    why = _why(entry)
    return _clip(f"  {token:<19} {_title(entry['bug'])}" + (f": {why}" if why else ""))


def _first_actionable(entries: list) -> list:
    """Affected members first, then those that cannot be told, then the rest, each in registry
    order: the line that needs the operator is never lost among the others."""
    order = {1: 0, 2: 1, 0: 2}
    return sorted(entries, key=lambda e: order[State.of_token(e.get("state") or e["tree_state"]).exit_code])


def advice_lines(entries: list) -> list:
    lines = [f"advice: {advice}" for advice in dict.fromkeys(e["advice"] for e in entries if "advice" in e)]
    if any(e.get("state") == State.PROTECTED_BY_PLUGIN.token for e in entries):
        lines.append("confirm on the running server: `sglang-dsa-fix status --url HOST:PORT` (exit 0)")
    return lines


def render_check(report: dict, verbosity: int = 0, colour: bool = False) -> str:
    lines = [headline(f"sglang {report['sglang_version']}", report["summary"])]
    if verbosity < 0:
        return screen(lines)
    if verbosity > 0:
        lines += [_state_line(b) for b in report["bugs"]]
    else:
        lines += [member_line(b) for b in _first_actionable(report["bugs"])]
    lines += advice_lines(report["bugs"])
    if report.get("version_note"):
        lines.append(f"note: {report['version_note']}")
    return screen(lines, colour)


def render_outcome(data: dict, colour: bool = False) -> str:
    """``apply`` / ``revert``: what was written, each member's state after it, and the restart."""
    verb = {"apply": "applied", "revert": "reverted"}[data["action"]]
    lines = [f"{verb}: {path}" for path in data["changed"]] or [f"nothing to {data['action']}"]
    lines += [f"removed: {path}" for path in data["removed"]]
    lines += [f"note: {note}" for note in data.get("notes", ())]
    lines += [member_line(b) for b in _first_actionable(data["bugs"])]
    if data["changed"]:
        lines.append(RESTART)
    return screen(lines, colour)


def _configuration_line(report: dict) -> str:
    from sglang_dsa_fix import width

    config = report["configuration"]
    algorithm = config.get("speculative_algorithm")
    parts = [f"context {config.get('context_length')}"]
    if algorithm:
        parts.append(
            f"{algorithm} D {config.get('speculative_num_draft_tokens')} topk "
            f"{config.get('speculative_eagle_topk') or 1}"
        )
    else:
        parts.append("no speculative decoding")
    parts += [f"attention {width.decode_backend(config)}", f"page {config.get('page_size') or 1}"]
    if (config.get("dcp_size") or 1) > 1:
        parts.append(f"dcp {config['dcp_size']}")
    if config.get("disable_cuda_graph"):
        parts.append("CUDA graphs off")
    how = "static rule" if report["basis"] == "static" else "resolved by sglang"
    return _clip(f"configuration ({how}): " + ", ".join(parts))


def render_status_short(report: dict, verbosity: int = 0, colour: bool = False) -> str:
    from sglang_dsa_fix import width

    configured = "configuration" in report or report.get("basis") == width.UNRESOLVED
    subject = (
        f"this deployment (sglang {report['sglang_version']})"
        if configured
        else f"sglang {report['sglang_version']}"
    )
    lines = [headline(subject, report["summary"])]
    if verbosity < 0:
        return screen(lines)
    if verbosity > 0:
        return screen(lines + render_status(report).split("\n"), colour)
    p = report["plugin"]
    lines.append(
        _clip(
            f"plugin: {'installed' if p['installed'] else 'not installed'}"
            + ("" if p["sglang_has_plugin_api"] else " (this sglang has no plugin API)")
            + (f", {p['kill_switch']}" if p["live"] else "")
        )
    )
    if report.get("basis") == width.UNRESOLVED:
        lines.append(f"configuration: cannot tell ({report['basis_note']})")
    elif "configuration" in report:
        lines.append(_configuration_line(report))
    lines += [member_line(b) for b in _first_actionable(report["bugs"])]
    lines += advice_lines(report["bugs"])
    if report.get("version_note"):
        lines.append(f"note: {report['version_note']}")
    return screen(lines, colour)


def _member_across_ranks(member: dict, total: int) -> list:
    """A member on a server: one line where every rank says the same, else a line per state
    with the ranks in it."""
    title = _title(member["member"]) if member["member"] in {b.value for b in Bug} else member["member"]
    head = f"  {member['state']:<19} {title}"
    by_state = member["ranks"]
    if len(by_state) == 1:
        [(state, ranks)] = by_state.items()
        return [_clip(f"{head}: {state} on " + (f"all {total} ranks" if total > 1 else ranks[0]))]
    return [_clip(head)] + [_clip(f"{'':22}{state}: {', '.join(ranks)}") for state, ranks in by_state.items()]


def render_server_short(report: dict, verbosity: int = 0, colour: bool = False) -> str:
    """``status --url``: the verdict, then one line per member across the ranks, then the notes."""
    from sglang_dsa_fix import bugs
    from sglang_dsa_fix.server_status import rank_label

    ranks, members = report["ranks"], report["members"]
    subject = (
        f"server {report['endpoint']} (sglang {report['sglang_version'] or 'version unknown'}, "
        f"{len(ranks)} rank(s))"
    )
    summary = bugs.summary([{"state": m["state"]} for m in members])
    summary["cannot_tell_reason"] = (
        next(
            (
                rank["bugs"].get(m["member"], {}).get("detail") or "no plugin state"
                for m in members
                if m["state"] == State.CANNOT_TELL.token
                for rank in ranks
            ),
            None,
        )
        or (report["notes"] or ["see the lines below"])[0]
    )
    lines = [
        headline(subject, summary, next_step="see the ranks below, and `sglang-dsa-fix check` in its image")
    ]
    if report["exit_code"] == 1 and not summary["counts"].get(State.AFFECTED.token):
        lines = [f"{subject}: the family watch counted width violations — see the rank notes below"]
    if verbosity < 0:
        return screen(lines)
    for member in members:
        lines += _member_across_ranks(member, len(ranks))
    notes = [f"{rank_label(rank)}: {note}" for rank in ranks for note in rank["notes"]]
    lines += notes + report["notes"]
    if verbosity > 0:
        lines += render_server(report).split("\n")[1:]
    return screen(lines, colour)
