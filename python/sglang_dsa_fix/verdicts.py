"""One verdict model for ``check``, ``status`` and the plugin: per bug, and the exit codes."""

from __future__ import annotations

import enum

# Exit codes of every command (README has the table).
EXIT_PROTECTED = 0  # every bug protected (fixed, or fix live) or not applicable
EXIT_AFFECTED = 1  # some bug affected and not protected
EXIT_CANNOT_TELL = 2  # error, unrecognised tree, or a bug this tool cannot judge here


class Bug(enum.Enum):
    PAGE_TABLE = "page_table"  # bug #1: CUDA-graph page_table narrower than req_to_token (crash)
    ROW_OVERFLOW = "req_to_token_row"  # bug #2: spec-v2 row write past the row end (corruption)

    @property
    def title(self) -> str:
        return {
            Bug.PAGE_TABLE: "bug #1 CUDA-graph page_table width (crash)",
            Bug.ROW_OVERFLOW: "bug #2 req_to_token row overflow (silent corruption)",
        }[self]


class Verdict(enum.Enum):
    AFFECTED = "affected"
    STALE_BYTECODE = "fixed in source, but Python loads stale bytecode"
    FIXED_IN_TREE = "fixed in-tree by sglang-dsa-fix"
    FIXED_UPSTREAM = "fixed upstream"
    NOT_APPLICABLE = "not applicable"
    NOT_COVERED = "not covered by this tool"

    @property
    def exit_code(self) -> int:
        if self in (Verdict.AFFECTED, Verdict.STALE_BYTECODE):
            return EXIT_AFFECTED
        if self is Verdict.NOT_COVERED:
            return EXIT_CANNOT_TELL
        return EXIT_PROTECTED


def combined_exit(codes) -> int:
    """1 if any bug is affected and unprotected (actionable), else 2 if any cannot be told, else 0."""
    codes = set(codes)
    if EXIT_AFFECTED in codes:
        return EXIT_AFFECTED
    return EXIT_CANNOT_TELL if EXIT_CANNOT_TELL in codes else EXIT_PROTECTED
