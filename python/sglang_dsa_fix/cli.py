"""``sglang-dsa-fix``: apply | check | revert | diff | demo."""

from __future__ import annotations

import argparse
import sys

from sglang_dsa_fix import source_patch
from sglang_dsa_fix.source_patch import PatchError, Verdict

EXIT_OK, EXIT_AFFECTED, EXIT_ERROR = 0, 1, 2


def _check(tree) -> int:
    status = source_patch.inspect(tree)
    print(status.describe())
    return EXIT_AFFECTED if status.verdict is Verdict.AFFECTED else EXIT_OK


def _diff(tree) -> int:
    text = source_patch.upstream_diff(tree)
    if text:
        sys.stdout.write(text)
    else:
        print(f"no change needed: {source_patch.inspect(tree).describe()}", file=sys.stderr)
    return EXIT_OK


def _status(args) -> int:
    import json

    from sglang_dsa_fix import status

    try:
        report = status.collect(
            args.sglang_root,
            args.context_length,
            args.speculative_num_draft_tokens,
            args.page_size,
            args.speculative_eagle_topk,
        )
    except (PatchError, ValueError) as exc:
        print(f"sglang-dsa-fix status: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    return EXIT_OK


TREE_COMMANDS = {
    "apply": lambda tree: print(source_patch.apply(tree)) or EXIT_OK,
    "check": _check,
    "revert": lambda tree: print(source_patch.revert(tree)) or EXIT_OK,
    "diff": _diff,
}
TREE_HELP = {
    "apply": "rewrite the backend file so the graph page_table is as wide as req_to_token",
    "check": "exit 0 fixed or not applicable, 1 affected, 2 not recognised",
    "revert": "restore the backend file's original bytes",
    "diff": "print the change as a unified diff for an sglang checkout (git apply)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang-dsa-fix",
        description="Fix for the DSA CUDA-graph page_table width crash (sglang 0.5.4 - 0.5.14).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in TREE_HELP.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--sglang-root",
            metavar="DIR",
            help="sglang source checkout (holding python/sglang) or site-packages; "
            "default: the importable sglang",
        )
    status = sub.add_parser("status", help="is this sglang affected, and is a fix live?")
    status.add_argument("--sglang-root", metavar="DIR")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--context-length", type=int)
    status.add_argument("--speculative-num-draft-tokens", type=int)
    status.add_argument("--page-size", type=int, default=1)
    status.add_argument("--speculative-eagle-topk", type=int, default=1)
    demo = sub.add_parser("demo", help="replay target_verify near context_len: pristine vs fixed")
    demo.add_argument("--context-len", type=int, default=4096)
    demo.add_argument("--speculative-num-draft-tokens", type=int, default=5)
    demo.add_argument("--page-size", type=int, default=64)
    demo.add_argument("--bs", type=int, default=4)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from sglang_dsa_fix import demo as demo_module

        return demo_module.run(
            args.context_len,
            args.speculative_num_draft_tokens,
            args.page_size,
            args.bs,
            args.device or demo_module.default_device(),
        )
    if args.command == "status":
        return _status(args)
    try:
        tree = source_patch.find_tree(args.sglang_root)
        return TREE_COMMANDS[args.command](tree)
    except PatchError as exc:
        print(f"sglang-dsa-fix {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
