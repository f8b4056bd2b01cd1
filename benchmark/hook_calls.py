"""An SGLang plugin for ``watch_overhead.py`` only: count the calls of every function the family
watch would hook, in a pristine engine.

The watch's cost per decode step is its cost per call times the calls a real step makes, which
differ by backend and speculative algorithm (draft-decode replays, draft_extend, verify). This
plugin registers, for each target ``watch.select`` picks for the running release (the watch's own
choice, resolved as the watch resolves it), an AROUND hook that appends one byte per call to
``$HOOK_CALLS_DIR/<kind>`` (a file opened once, O_APPEND) and calls sglang's function: a file's
size is that kind's call count, exact and readable from outside the scheduler at any time. It
checks nothing and installs no watch; one ``os.write`` (about 1 us) per call is what it adds.

    calls = read_counts(directory)   # {kind: calls so far}
    python benchmark/hook_calls.py DIR   # the same, as JSON
"""

from __future__ import annotations

import argparse
import json
import os

ENTRY_POINT = "watch_hook_calls"
DIRECTORY_ENV = "HOOK_CALLS_DIR"


def _counter(fd: int):
    def count_call(original_fn, *args, **kwargs):
        os.write(fd, b".")
        return original_fn(*args, **kwargs)

    return count_call


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dsa_fix import tree, watch

    directory = os.environ[DIRECTORY_ENV]
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    for candidate in watch.select(tree.find_tree(None).version):
        fd = os.open(os.path.join(directory, candidate.kind), flags, 0o600)
        HookRegistry.register(candidate.target, _counter(fd), HookType.AROUND)


def read_counts(directory) -> dict:
    """{kind: calls so far} of every kind the plugin hooked (0 for one never called)."""
    return {name: os.stat(os.path.join(directory, name)).st_size for name in sorted(os.listdir(directory))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory", help="a $HOOK_CALLS_DIR the plugin counted into: print its counts as JSON"
    )
    return parser


def main(argv=None) -> int:
    print(json.dumps(read_counts(build_parser().parse_args(argv).directory)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
