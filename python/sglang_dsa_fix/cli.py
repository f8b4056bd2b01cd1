"""``sglang-dsa-fix``: apply | check | revert | diff | status | demo.

The only module that renders text or JSON. Every failure is one line on stderr and exit 2
(``errors.EXIT_ERROR``); with ``--json`` a JSON object with an ``error`` field is printed
on stdout too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from sglang_dsa_fix import __version__, source_patch
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.errors import EXIT_ERROR, EXIT_OK, ToolError
from sglang_dsa_fix.resolve import GPU_PROFILE_NAMES
from sglang_dsa_fix.server_status import MAX_TIMEOUT
from sglang_dsa_fix.verdicts import Bug, State

PROG = "sglang-dsa-fix"
# What a terminal acts on instead of showing: C0 (escape sequences, newlines, carriage returns),
# DEL, C1, the Unicode line separators and the bidi embeddings / overrides / isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
MAX_ERROR_LINE = 500  # characters of an error message printed (the rest is cut, and said so)


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


def _state_line(state: dict) -> str:
    where = f" ({state['file']}:{state['line']}: `{state['found']}`)" if "file" in state else ""
    detail = f"; {state['detail']}" if state.get("detail") else ""
    text = state.get("state_text") or State.of_token(state["tree_state"]).text
    return f"{Bug(state['bug']).title}: {text}{where}{detail}"


def run_check(args) -> tuple[dict, str, int]:
    from sglang_dsa_fix import status

    report = status.collect(args.sglang_root)
    lines = [_state_line(b) for b in report["bugs"]]
    lines += [f"  advice: {b['advice']}" for b in report["bugs"] if "advice" in b]
    if report.get("version_note"):
        lines.append(f"note: {report['version_note']}")
    return report, _text(lines), report["exit_code"]


def _outcome_text(outcome) -> str:
    verb = {"apply": "applied", "revert": "reverted"}[outcome.action]
    lines = [f"{verb}: {path}" for path in outcome.changed] or [f"nothing to {outcome.action}"]
    lines += [f"removed: {path}" for path in outcome.removed]
    return _text(lines + [_state_line(s) for s in outcome.to_dict()["bugs"]])


def run_apply(args) -> tuple[dict, str, int]:
    tree = trees.find_tree(args.sglang_root)
    outcome = source_patch.apply(tree, args.allow_unsafe_dirs)
    return {"sglang_version": tree.version, **outcome.to_dict()}, _outcome_text(outcome), EXIT_OK


def run_revert(args) -> tuple[dict, str, int]:
    tree = trees.find_tree(args.sglang_root)
    outcome = source_patch.revert(tree, args.allow_unsafe_dirs)
    return {"sglang_version": tree.version, **outcome.to_dict()}, _outcome_text(outcome), EXIT_OK


def run_diff(args) -> tuple[dict, str, int]:
    tree = trees.find_tree(args.sglang_root)
    diff = source_patch.upstream_diff(tree)
    data = {"sglang_version": tree.version, "diff": diff.decode("utf-8", "surrogateescape")}
    return data, diff, EXIT_OK


def run_status(args) -> tuple[dict, str, int]:
    from sglang_dsa_fix import status, width

    if args.url is not None:
        from sglang_dsa_fix import server_status

        timeout = args.timeout or server_status.DEFAULT_TIMEOUT
        report = server_status.from_server(args.url, timeout=timeout, api_key=args.api_key)
        return report, render_server(report), report["exit_code"]
    from sglang_dsa_fix import resolve

    request = None
    if args.launch_args is not None:
        request = resolve.Request(
            args.launch_args,
            python=args.python,
            gpu=args.gpu,
            prove=args.prove,
            allow_unsafe_dirs=args.allow_unsafe_dirs,
        )
    elif args.context_length is not None:
        D = args.speculative_num_draft_tokens
        shape = width.SpecShape(
            context_length=args.context_length,
            speculative_num_draft_tokens=D,
            speculative_num_steps=args.speculative_num_steps or max(1, D - 1),
            speculative_eagle_topk=args.speculative_eagle_topk or 1,
            page_size=args.page_size or 1,
            has_draft_kv=args.speculative_algorithm != "NGRAM",
            overlap=not args.disable_overlap_schedule,
        )
        request = resolve.Request(shape=shape)
    report = status.collect(args.sglang_root, request)
    return report, render_status(report), report["exit_code"]


def render_server(report: dict) -> str:
    """``status --url``: one row per role and rank, one column per bug, then the notes."""
    names = list(dict.fromkeys(name for rank in report["ranks"] for name in rank["bugs"]))
    # Bugs #1 - #3 by title; bug #3's relatives by their (shorter) token.
    known = {
        bug.value: bug.title.split(" (")[0] for bug in (Bug.PAGE_TABLE, Bug.ROW_OVERFLOW, Bug.FA3_PAGE_TABLE)
    }
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
    at = bug["at_configuration"]
    # Reached, but the plugin holds it: the numbers below are sglang's own, without the plugin.
    where = "at this configuration" + (
        ", without the plugin" if bug["state"] == State.PROTECTED_BY_PLUGIN.token else ""
    )
    if at.get("why_not"):
        return [f"  at this configuration: not reachable ({at['why_not']})"]
    if at.get("cannot_tell"):
        return [f"  at this configuration: cannot tell ({at['cannot_tell']})"]
    if "draft_kv_indices_needed" in at:  # Triton's flat buffers
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
    if "graph_page_table_pages" in at:  # bug #3 and its relatives
        verdict = (
            f"reads {at['pages_past_table']} page(s) past its table row"
            if at["pages_past_table"]
            else "reads inside its table row"
        )
        name = "FA3 graph page tables" if bug["bug"] == Bug.FA3_PAGE_TABLE.value else "graph table"
        lines = [
            f"  {where}: {name} {at['graph_page_table_pages']} pages "
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
    if bug["bug"] == Bug.PAGE_TABLE.value:
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
    verdict = (
        f"the last decode reservation writes {at['columns_past_row_end']} column(s) into the next "
        "request's row"
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
        title = Bug(bug["bug"]).title
        where = f" ({bug['file']}:{bug['line']}: `{bug['found']}`)" if "file" in bug else ""
        lines.append(f"{title}: {bug['state_text']}{where}")
        if bug["detail"]:
            lines.append(f"  {bug['detail']}")
        if "at_configuration" in bug:
            lines += _at_configuration_lines(bug)
        if "advice" in bug:
            lines.append(f"  advice: {bug['advice']}")
    return _text(lines)


def run_demo(args) -> tuple[dict, str, int]:
    if args.sglang_root:
        raise ToolError("demo imports and runs the importable sglang; --sglang-root does not apply")
    try:
        import torch

        from sglang_dsa_fix.proof import demo
    except ImportError as exc:
        raise ToolError(
            f"demo runs the real sglang code and needs torch and sglang here ({exc}); `make demo` "
            "builds that environment"
        ) from None
    if args.device != "cuda" and not torch.cuda.is_available():
        # sglang's Triton kernels run on CPU under Triton's interpreter: set before triton loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    code = demo.run(
        args.context_length,
        args.speculative_num_draft_tokens,
        args.page_size,
        args.bs,
        args.device or demo.default_device(),
    )
    return {"exit_code": code}, "", code


# Integer options' range: sglang's token counts are int32 (req_to_token's dtype).
MAX_INT_OPTION = 2**31 - 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # also: more digits than int() converts
        value = 0
    if not 0 < value <= MAX_INT_OPTION:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_INT_OPTION}, got {text[:40]}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, got {text[:40]}"
        )
    return value


_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _human_int(text: str) -> int:
    """A positive int as sglang's flags take it (0.5.23 utils/common.py:3394): ``163840``,
    ``160Ki`` (IEC, integers only), ``25.6k`` (SI); suffixes are case-sensitive."""
    import re
    from decimal import Decimal

    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text.strip()[:64])
    if (
        len(text.strip()) > 64
        or not match
        or (match[2] in _IEC and "." in match[1])
        or (match[2] is None and "." in match[1])
    ):
        raise argparse.ArgumentTypeError(
            f"invalid integer {text[:40]!r}: a plain integer, SI (25.6k, 1M) or IEC (160Ki) suffixes"
        )
    number, suffix = match.groups()
    value = int(Decimal(number) * (_SI.get(suffix) or _IEC.get(suffix) or 1))
    if not 0 < value <= MAX_INT_OPTION:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_INT_OPTION}, got {text}")
    return value


def _directory(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


# name -> (handler, help); one table for every command.
COMMANDS = {
    "check": (
        run_check,
        "is this sglang affected? exit 0 protected / not applicable, 1 affected, 2 cannot tell",
    ),
    "apply": (run_apply, "fix every affected bug in the sglang files (keeps a backup of each)"),
    "revert": (run_revert, "restore the original bytes of every file apply changed"),
    "diff": (run_diff, "print the change as a unified diff for an sglang checkout (git apply)"),
    "status": (run_status, "is THIS deployment protected, per bug (and per shape, or for a live server)?"),
    "demo": (run_demo, "both bugs and both fixes on the real sglang code of this environment"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but ``--json`` gets JSON for usage errors too (``json_requested``: this run's
    command line has it; the subcommands' parsers get it from ``build_parser``)."""

    def __init__(self, *args, json_requested: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.json_requested = json_requested

    def error(self, message):
        message = _error_line(message)
        if self.json_requested:
            print(json.dumps(_contract({"error": message, "exit_code": EXIT_ERROR})))
        # One line, as every other failure (the usage is one `--help` away).
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(json_requested: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(
        json_requested=json_requested,
        prog=PROG,
        description="Fix, check and undo the DSA/EAGLE req_to_token width "
        "bugs in an installed sglang or a checkout.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    common = _Parser(add_help=False)
    common.add_argument(
        "--sglang-root",
        metavar="DIR",
        type=_directory,
        help="sglang source checkout (holding python/sglang) or site-packages; "
        "default: the importable sglang",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output (JSON on every path)")
    common.add_argument("--no-json", dest="json", action="store_false", default=False, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parsers = {
        name: sub.add_parser(
            name, help=text, description=text, parents=[common], json_requested=json_requested
        )
        for name, (_, text) in COMMANDS.items()
    }
    for name in ("apply", "revert"):
        parsers[name].add_argument(
            "--allow-unsafe-dirs",
            action="store_true",
            help="as root, write even where a directory on the way is writable by another user "
            "(refused by default, as sudo and sshd do); never outside the sglang tree",
        )
    status = parsers["status"]
    status.usage = (
        "%(prog)s [--sglang-root DIR] [--python PATH] [--gpu PROFILE] [--allow-unsafe-dirs] [--json] "
        "-- <launch_server args>\n"
        "       %(prog)s [--sglang-root DIR] [--json] [--context-length C --speculative-num-draft-tokens D ...]\n"
        "       %(prog)s --url URL [--timeout SECONDS] [--api-key KEY] [--json]"
    )
    status.add_argument(
        "--url",
        help="a running server (http://HOST:PORT, or HOST:PORT): read the plugin's state from /server_info",
    )
    status.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="with --url: deadline for the whole request (default 30)",
    )
    status.add_argument(
        "--api-key",
        metavar="KEY",
        help="with --url: sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, as sglang's clients)",
    )
    status.add_argument(
        "--python",
        metavar="PATH",
        help="with `--`: the interpreter of the server's environment, which imports sglang to resolve "
        "the launch arguments (default: the venv holding --sglang-root, else this Python)",
    )
    status.add_argument(
        "--allow-unsafe-dirs",
        action="store_true",
        help="with `--`, as root: run the interpreter, import from its sys.path (the sglang tree, "
        "site dirs, .pth targets, PYTHONPATH) and run a --trust-remote-code model's code even where a "
        "user other than root could change them (a file, a directory on the way, a link; refused by "
        "default)",
    )
    status.add_argument(
        "--gpu",
        metavar="PROFILE",
        help="with `--`: the GPU sglang's argument processing is answered for: "
        + ", ".join(GPU_PROFILE_NAMES)
        + " (default: the local GPU, else h200)",
    )
    status.add_argument(
        "--prove",
        action="store_true",
        help="with `--`: also drive sglang's real decode path on this machine (CPU: Triton's "
        "interpreter) for the resolved configuration and report the columns it writes past the row",
    )
    static = status.add_argument_group(
        "static rule (no sglang import; prefer `-- <launch_server args>`)",
        "sglang's flag spellings; --context-length and --speculative-num-draft-tokens go together",
    )
    static.add_argument(
        "--context-length",
        type=_human_int,
        help="the model's context length, e.g. 163840 or 160Ki (required)",
    )
    static.add_argument("--speculative-num-draft-tokens", type=_positive, help="D (required)")
    static.add_argument("--speculative-num-steps", type=_positive, help="default: D - 1")
    static.add_argument("--speculative-eagle-topk", type=_positive, help="default: 1")
    static.add_argument("--page-size", type=_positive, help="default: 1")
    static.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=("EAGLE", "EAGLE3", "NEXTN", "NGRAM", "STANDALONE"),
        help="default: EAGLE (any case; other algorithms: use `--`)",
    )
    static.add_argument(
        "--disable-overlap-schedule", action="store_true", default=None, help="default: overlap on"
    )
    demo = parsers["demo"]
    demo.add_argument("--context-length", type=_positive, default=4096)
    demo.add_argument("--speculative-num-draft-tokens", type=_positive, default=5)
    demo.add_argument("--page-size", type=_positive, default=64)
    demo.add_argument("--bs", type=_positive, default=4)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    return parser


def main(argv=None) -> int:
    # Paths are bytes on Linux: a non-UTF-8 name must not crash the report after apply wrote.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        return _main(argv)
    except BrokenPipeError:  # `sglang-dsa-fix status | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


SHAPE_FLAGS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "page_size",
    "speculative_algorithm",
    "disable_overlap_schedule",
)


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    launch_args = None
    if "--" in argv:  # `status [options] -- <launch_server args>`: sglang's, passed on untouched
        cut = argv.index("--")
        argv, launch_args = argv[:cut], argv[cut + 1 :]
    argv = [_json_flag(a) for a in argv]
    json_requested = "--json" in argv
    parser = build_parser(json_requested)
    if json_requested and argv[:1] in (["--version"], ["-V"]):
        print(json.dumps(_contract({"command": "version"})))
        return EXIT_OK
    args = parser.parse_args(argv)
    args.launch_args = launch_args
    if launch_args is not None and args.command != "status":
        parser.error(f"{args.command}: `-- <launch_server args>` is for `status`")
    if args.command == "status":
        _check_status_args(parser, args)
    handler = COMMANDS[args.command][0]
    try:
        data, text, code = handler(args)
    except ToolError as exc:
        return _fail(args, str(exc))
    except OSError as exc:  # anything the tool did not anticipate still gets one line
        return _fail(args, f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
    except UnicodeError as exc:
        return _fail(args, f"cannot decode a file ({exc})")
    if args.json:
        print(json.dumps(_contract({"command": args.command, **data}), indent=2))
    elif isinstance(text, bytes):  # a diff: the files' own bytes, whatever their encoding
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is None:
            sys.stdout.write(text.decode("utf-8", "surrogateescape"))
        else:
            sys.stdout.flush()
            buffer.write(text)
            buffer.flush()
        if not text:
            print(f"{PROG} diff: no change needed", file=sys.stderr)
    elif text:
        print(text)
    return code


def _check_status_args(parser, args) -> None:
    shape_given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if (args.context_length is None) != (args.speculative_num_draft_tokens is None):
        parser.error("status: --context-length and --speculative-num-draft-tokens go together")
    if shape_given and args.context_length is None:
        flag = "--" + shape_given[0].replace("_", "-")
        parser.error(f"status: {flag} needs --context-length and --speculative-num-draft-tokens")
    if args.url is not None and (args.sglang_root or args.context_length or args.launch_args is not None):
        parser.error(
            "status: --url judges the live server alone; leave out --sglang-root, shape flags and `--`"
        )
    if args.launch_args is not None and args.context_length is not None:
        parser.error(
            "status: shape flags are the static rule; with `-- <launch_server args>` sglang resolves them"
        )
    if args.url is None and (args.timeout, args.api_key) != (None, None):
        parser.error("status: --timeout and --api-key go with --url")
    if (args.python or args.gpu or args.prove or args.allow_unsafe_dirs) and args.launch_args is None:
        parser.error(
            "status: --python, --gpu, --prove and --allow-unsafe-dirs go with `-- <launch_server args>`"
        )
    if args.launch_args is not None and not args.launch_args:
        parser.error("status: `--` needs the launch_server arguments after it")


def _json_flag(arg: str) -> str:
    """``--json=1`` / ``--json=true`` as ``--json``; ``--json=0`` / ``false`` / ``no`` / ``off`` off."""
    if not arg.startswith("--json="):
        return arg
    value = arg.split("=", 1)[1].strip().lower()
    return "--no-json" if value in ("0", "false", "no", "off", "") else "--json"


def _error_line(message: str) -> str:
    """An error message as printed, on stderr and in JSON alike: one printable line of at most
    MAX_ERROR_LINE characters (a file or a child can put anything in an exception's text)."""
    message = printable(message)
    if len(message) > MAX_ERROR_LINE:
        message = f"{message[: MAX_ERROR_LINE - 40]}... ({len(message)} characters, cut)"
    return message


SCHEMA_VERSION = (
    2  # 2: per bug "tree_state" (a State token) replaces the prose "verdict"; the plugin reports State tokens
)


def _contract(data: dict) -> dict:
    """What every JSON output carries: schema_version, this tool's version, and (where a tree was
    read) the sglang version, ahead of the command's own fields."""
    return {"schema_version": SCHEMA_VERSION, "tool_version": __version__, **data}


def _fail(args, message: str) -> int:
    message = _error_line(message)
    print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps(_contract({"command": args.command, "error": message, "exit_code": EXIT_ERROR})))
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
