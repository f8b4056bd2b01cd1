"""``sglang-dsa-fix``: check | apply | revert | diff | status | explain | demo.

The command line: parses, dispatches, prints (the words are ``render``'s). Every failure is one
line on stderr and exit 2 (``errors.EXIT_ERROR``); with ``--json`` a JSON object with an
``error`` field is printed on stdout too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang_dsa_fix import __version__, render, source_patch
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.errors import EXIT_CANNOT_TELL, EXIT_ERROR, EXIT_OK, ToolError
from sglang_dsa_fix.option_types import directory, human_int, positive, seconds
from sglang_dsa_fix.render import printable
from sglang_dsa_fix.resolve import GPU_PROFILE_NAMES

PROG = "sglang-dsa-fix"
MAX_ERROR_LINE = 500  # characters of an error message printed (the rest is cut, and said so)


def run_check(args) -> tuple[dict, str, int]:
    from sglang_dsa_fix import status

    report = status.collect(args.sglang_root)
    return report, render.render_check(report, args.verbosity, args.colour), report["exit_code"]


def run_apply(args) -> tuple[dict, str, int]:
    tree = trees.find_tree(args.sglang_root)
    data = {"sglang_version": tree.version, **source_patch.apply(tree, args.allow_unsafe_dirs).to_dict()}
    return data, render.render_outcome(data, args.colour), EXIT_OK


def run_revert(args) -> tuple[dict, str, int]:
    tree = trees.find_tree(args.sglang_root)
    data = {"sglang_version": tree.version, **source_patch.revert(tree, args.allow_unsafe_dirs).to_dict()}
    return data, render.render_outcome(data, args.colour), EXIT_OK


def run_explain(args) -> tuple[dict, str, int]:
    from sglang_dsa_fix import explain

    data = explain.explain(" ".join(args.message))
    if not data["matches"]:
        known = "; ".join(f"`{message}`" for message in explain.known_messages())
        text = f"not a message this tool knows (it knows {known}); `sglang-dsa-fix check` says what this sglang has"
        return data, printable(text), EXIT_CANNOT_TELL
    lines = []
    for match in data["matches"]:
        lines += [f"{match['title']}: {match['means']}", f"  releases: {match['releases']}"]
    return data, "\n".join(printable(line) for line in [*lines, f"next: {data['next']}"]), EXIT_OK


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
        return report, render.render_server_short(report, args.verbosity, args.colour), report["exit_code"]
    from sglang_dsa_fix import launch_line, resolve

    request = None
    if args.launch_args is not None:
        request = resolve.Request(
            launch_line.server_arguments(args.launch_args),
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
    return report, render.render_status_short(report, args.verbosity, args.colour), report["exit_code"]


def run_demo(args) -> tuple[dict, str, int]:
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
    "explain": (run_explain, "which bug is this line of sglang's log, on which releases, and what to run"),
    "demo": (run_demo, "the bugs and both fixes on the real sglang code of this environment (CPU or GPU)"),
}
# The commands that read an sglang tree (--sglang-root); explain and demo read none.
TREE_COMMANDS = ("check", "apply", "revert", "diff", "status")


# Words of a launch line given to ``status`` without the ``--`` before it.
LAUNCH_WORDS = ("--model", "launch_server", "serve", "--tp", "--attention-backend", "-m ")


class _Parser(argparse.ArgumentParser):
    """argparse, but ``--json`` gets JSON for usage errors too (``json_requested``: this run's
    command line has it; the subcommands' parsers get it from ``build_parser``)."""

    def __init__(self, *args, json_requested: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.json_requested = json_requested

    def error(self, message):
        if "unrecognized arguments" in message and any(word in message for word in LAUNCH_WORDS):
            message += (
                "; the launch line goes after `--`: `sglang-dsa-fix status -- python -m "
                "sglang.launch_server --model-path ...`"
            )
        message = _error_line(message)
        if self.json_requested:
            print(json.dumps(_contract({"error": message, "exit_code": EXIT_ERROR})))
        # One line, as every other failure (the usage is one `--help` away).
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(json_requested: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(
        json_requested=json_requested,
        prog=PROG,
        description="Find, fix and undo SGLang's req_to_token width bugs under speculative decoding "
        "(bug #1 DSA graph page_table, bug #2 row overflow, bug #3 FA3 graph page tables and their "
        "relatives) in an installed sglang or a checkout, and judge a deployment or a live server.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    output = _Parser(add_help=False)
    output.add_argument("--json", action="store_true", help="machine-readable output (JSON on every path)")
    output.add_argument("--no-json", dest="json", action="store_false", default=False, help=argparse.SUPPRESS)
    loud = output.add_mutually_exclusive_group()
    loud.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=0,
        help="each bug's file, line, widths and advice",
    )
    loud.add_argument(
        "-q", "--quiet", dest="verbosity", action="store_const", const=-1, help="the verdict line alone"
    )
    common = _Parser(add_help=False, parents=[output])
    common.add_argument(
        "--sglang-root",
        metavar="DIR",
        type=directory,
        help="sglang source checkout (holding python/sglang) or site-packages; "
        "default: the importable sglang",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parsers = {
        name: sub.add_parser(
            name,
            help=text,
            description=text,
            parents=[common if name in TREE_COMMANDS else output],
            json_requested=json_requested,
        )
        for name, (_, text) in COMMANDS.items()
    }
    parsers["explain"].add_argument(
        "message", nargs="+", help="a line of sglang's log (quote it), e.g. 'pool memory leak detected'"
    )
    for name in ("apply", "revert"):
        parsers[name].add_argument(
            "--allow-unsafe-dirs",
            action="store_true",
            help="as root, write even where a directory on the way is writable by another user "
            "(refused by default, as sudo and sshd do); never outside the sglang tree",
        )
    _status_options(parsers["status"])
    _static_shape_options(parsers["status"])
    _demo_options(parsers["demo"])
    return parser


def _status_options(status) -> None:
    """status's own options: the live server, the target interpreter, the GPU profile, --prove."""
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
        type=seconds,
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


def _static_shape_options(status) -> None:
    """status's shape flags: the static rule, for a machine without the server's environment."""
    static = status.add_argument_group(
        "static rule (no sglang import; prefer `-- <launch_server args>`)",
        "sglang's flag spellings; --context-length and --speculative-num-draft-tokens go together",
    )
    static.add_argument(
        "--context-length",
        type=human_int,
        help="the model's context length, e.g. 163840 or 160Ki (required)",
    )
    static.add_argument("--speculative-num-draft-tokens", type=positive, help="D (required)")
    static.add_argument("--speculative-num-steps", type=positive, help="default: D - 1")
    static.add_argument("--speculative-eagle-topk", type=positive, help="default: 1")
    static.add_argument("--page-size", type=positive, help="default: 1")
    static.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=("EAGLE", "EAGLE3", "NEXTN", "NGRAM", "STANDALONE"),
        help="default: EAGLE (any case; other algorithms: use `--`)",
    )
    static.add_argument(
        "--disable-overlap-schedule", action="store_true", default=None, help="default: overlap on"
    )


def _demo_options(demo) -> None:
    """demo's options: bug #1's shape and the device."""
    demo.add_argument(
        "--context-length", type=positive, default=4096, help="bug #1's context length (default 4096)"
    )
    demo.add_argument(
        "--speculative-num-draft-tokens", type=positive, default=5, help="bug #1's D (default 5)"
    )
    demo.add_argument("--page-size", type=positive, default=64, help="bug #1's page size (default 64)")
    demo.add_argument("--bs", type=positive, default=4, help="bug #1's captured batch size (default 4)")
    demo.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present, else cpu"
    )


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
    args.colour = render.colour_wanted() and not args.json
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
    except (RecursionError, MemoryError) as exc:  # a bound the tool missed (pysource sets them)
        return _fail(args, f"input too large or nested too deeply to judge ({type(exc).__name__})")
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
