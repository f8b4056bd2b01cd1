"""``sglang-dsa-fix``: apply | check | revert | diff | status | demo.

The only module that renders text or JSON. Every failure is one line on stderr and exit 2
(``verdicts.EXIT_CANNOT_TELL``); with ``--json`` a JSON object with an ``error`` field is printed
on stdout too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang_dsa_fix import __version__, source_patch
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.tree import ToolError
from sglang_dsa_fix.verdicts import EXIT_CANNOT_TELL, EXIT_PROTECTED, Bug, combined_exit

PROG = "sglang-dsa-fix"


def _state_line(state: dict) -> str:
    where = f" ({state['file']}:{state['line']}: `{state['found']}`)" if "file" in state else ""
    detail = f"; {state['detail']}" if state.get("detail") else ""
    return f"{Bug(state['bug']).title}: {state['verdict']}{where}{detail}"


def run_check(args) -> tuple[dict, str, int]:
    states = source_patch.check(trees.find_tree(args.sglang_root))
    data = {"bugs": [s.to_dict() for s in states]}
    code = combined_exit(s.verdict.exit_code for s in states)
    data["exit_code"] = code
    return data, "\n".join(_state_line(s) for s in data["bugs"]), code


def _outcome_text(outcome) -> str:
    verb = {"apply": "applied", "revert": "reverted"}[outcome.action]
    lines = [f"{verb}: {path}" for path in outcome.changed] or [f"nothing to {outcome.action}"]
    lines += [f"removed: {path}" for path in outcome.removed]
    return "\n".join(lines + [_state_line(s) for s in outcome.to_dict()["bugs"]])


def run_apply(args) -> tuple[dict, str, int]:
    outcome = source_patch.apply(trees.find_tree(args.sglang_root))
    return outcome.to_dict(), _outcome_text(outcome), EXIT_PROTECTED


def run_revert(args) -> tuple[dict, str, int]:
    outcome = source_patch.revert(trees.find_tree(args.sglang_root))
    return outcome.to_dict(), _outcome_text(outcome), EXIT_PROTECTED


def run_diff(args) -> tuple[dict, str, int]:
    diff = source_patch.upstream_diff(trees.find_tree(args.sglang_root))
    return {"diff": diff.decode("utf-8", "surrogateescape")}, diff, EXIT_PROTECTED


def run_status(args) -> tuple[dict, str, int]:
    from sglang_dsa_fix import status, width

    if args.url:
        report = status.from_server(args.url)
    else:
        shape = None
        if args.context_length is not None:
            D = args.speculative_num_draft_tokens
            shape = width.SpecShape(
                context_length=args.context_length,
                speculative_num_draft_tokens=D,
                speculative_num_steps=args.speculative_num_steps or max(1, D - 1),
                speculative_eagle_topk=args.speculative_eagle_topk,
                page_size=args.page_size,
                has_draft_kv=args.speculative_algorithm != "NGRAM",
                overlap=not args.disable_overlap_schedule,
            )
        report = status.collect(args.sglang_root, shape)
    return report, render_status(report), report["exit_code"]


def render_status(report: dict) -> str:
    if "url" in report:
        lines = [f"server {report['url']} (sglang {report['sglang_version']})"]
        for i, rank in enumerate(report["ranks"]):
            lines.append(f"rank {i}: " + (rank or {}).get("summary", "plugin not running"))
        if "detail" in report:
            lines.append(report["detail"])
        return "\n".join(lines)
    lines = [f"sglang {report['sglang_version']} at {report['sglang_path']}"]
    p = report["plugin"]
    lines.append(
        f"plugin: {'installed' if p['installed'] else 'not installed'} in {p['where']}"
        + ("" if p["sglang_has_plugin_api"] else " (this sglang has no plugin API)")
        + (f"; {p['kill_switch']}" if p["live"] else "")
    )
    lines += [f"  plugin not loaded by {note}" for note in p["not_loaded_by"] if p["live"]]
    for bug in report["bugs"]:
        title = Bug(bug["bug"]).title
        where = f" ({bug['file']}:{bug['line']}: `{bug['found']}`)" if "file" in bug else ""
        live = f" — fix live: {bug['fix_live']}" if bug["fix_live"] else ""
        lines.append(f"{title}: {bug['verdict']}{live}{where}")
        if bug["detail"]:
            lines.append(f"  {bug['detail']}")
        shape = bug.get("shape")
        if shape and bug["bug"] == Bug.PAGE_TABLE.value:
            lines.append(
                f"  at this shape: req_to_token width {shape['req_to_token_width']}, graph "
                f"page_table width {shape['graph_page_table_width']} -> target_verify "
                + (
                    f"overflows for seq_len {shape['overflowing_seq_lens'][0]}.."
                    f"{shape['overflowing_seq_lens'][1]}"
                    if shape["overflows"]
                    else "cannot overflow"
                )
            )
        elif shape:
            lines.append(
                f"  at this shape: row headroom {shape['row_extra']}, needs "
                f"{shape['row_extra_needed']} -> "
                + (
                    f"the last decode reservation writes {shape['columns_past_row_end']} column(s) "
                    "into the next request's row"
                    if shape["overflows"]
                    else "no write past the row end"
                    + (
                        f" (without the fix: {shape['columns_past_row_end_without_fix']})"
                        if shape["columns_past_row_end_without_fix"]
                        else ""
                    )
                )
            )
        if "advice" in bug:
            lines.append(f"  advice: {bug['advice']}")
    return "\n".join(lines)


def run_demo(args) -> tuple[dict, str, int]:
    if args.sglang_root:
        raise ToolError("demo imports and runs the importable sglang; --sglang-root does not apply")
    import torch

    if args.device != "cuda" and not torch.cuda.is_available():
        # sglang's Triton kernels run on CPU under Triton's interpreter: set before triton loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang_dsa_fix.proof import demo

    code = demo.run(
        args.context_length,
        args.speculative_num_draft_tokens,
        args.page_size,
        args.bs,
        args.device or demo.default_device(),
    )
    return {"exit_code": code}, "", code


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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
    """argparse, but ``--json`` gets JSON for usage errors too."""

    json_requested = False

    def error(self, message):
        if _Parser.json_requested:
            print(json.dumps({"error": message, "exit_code": EXIT_CANNOT_TELL}))
        self.print_usage(sys.stderr)
        self.exit(EXIT_CANNOT_TELL, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Fix, check and undo the DSA/EAGLE req_to_token width "
        "bugs in an installed sglang or a checkout.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = _Parser(add_help=False)
    common.add_argument(
        "--sglang-root",
        metavar="DIR",
        type=_directory,
        help="sglang source checkout (holding python/sglang) or site-packages; "
        "default: the importable sglang",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parsers = {
        name: sub.add_parser(name, help=text, description=text, parents=[common])
        for name, (_, text) in COMMANDS.items()
    }
    status = parsers["status"]
    status.add_argument(
        "--url", help="a running server (http://HOST:PORT): read the plugin's state from /server_info"
    )
    status.add_argument("--context-length", type=_positive)
    status.add_argument("--speculative-num-draft-tokens", type=_positive)
    status.add_argument("--speculative-num-steps", type=_positive, help="default: draft tokens - 1")
    status.add_argument("--speculative-eagle-topk", type=_positive, default=1)
    status.add_argument("--page-size", type=_positive, default=1)
    status.add_argument(
        "--speculative-algorithm", choices=("EAGLE", "EAGLE3", "NEXTN", "NGRAM"), default="EAGLE"
    )
    status.add_argument("--disable-overlap-schedule", action="store_true")
    demo = parsers["demo"]
    demo.add_argument("--context-length", type=_positive, default=4096)
    demo.add_argument("--speculative-num-draft-tokens", type=_positive, default=5)
    demo.add_argument("--page-size", type=_positive, default=64)
    demo.add_argument("--bs", type=_positive, default=4)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    return parser


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `sglang-dsa-fix status | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PROTECTED


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_requested = "--json" in argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status" and (args.context_length is None) != (
        args.speculative_num_draft_tokens is None
    ):
        parser.error("status: --context-length and --speculative-num-draft-tokens go together")
    if args.command == "status" and args.url and args.sglang_root:
        parser.error("status: --url and --sglang-root are exclusive")
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
        print(json.dumps(data, indent=2))
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


def _fail(args, message: str) -> int:
    print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"command": args.command, "error": message, "exit_code": EXIT_CANNOT_TELL}))
    return EXIT_CANNOT_TELL


if __name__ == "__main__":
    sys.exit(main())
