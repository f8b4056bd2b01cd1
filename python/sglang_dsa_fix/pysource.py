"""Byte offsets, parsing and edits of sglang's Python source, for the locators (sites, fa3_sites, graph_tables).

A change is a byte range of the file as read; ``ast`` gives UTF-8 columns, these helpers turn
them into byte offsets of the file's own encoding. No torch, no sglang.
"""

from __future__ import annotations

import ast
import threading
import tokenize
from dataclasses import dataclass
from pathlib import Path

from sglang_dsa_fix.errors import ToolError


def byte_offset(lines: list[bytes], lineno: int, col: int) -> int:
    # ast columns are UTF-8 byte offsets into the source as Python decodes it (PEP 263: a coding
    # cookie may say latin-1 etc.); lines split like the tokenizer (\n, \r\n, \r).
    before = sum(map(len, lines[: lineno - 1]))
    encoding = tokenize.detect_encoding(iter(lines[:2]).__next__)[0]
    if col == 0 or encoding in ("utf-8", "utf-8-sig"):
        return before + col
    text = lines[lineno - 1].decode(encoding).encode("utf-8")[:col].decode("utf-8")
    return before + len(text.encode(encoding))


def lines_above(lines: list[bytes], lineno: int, count: int) -> list[str]:
    above = lines[max(0, lineno - 1 - count) : lineno - 1]
    return [line.strip().decode("utf-8", "replace") for line in above]


# The trees of the last few contents parsed: one run locates several sites in the same file
# (a CLI run parses dsa_backend.py and flashattention_backend.py two to three times each, and
# the tests run the tool over the same bytes hundreds of times). Shared: callers only read them.
_PARSED: dict = {}
_PARSED_MAX = 32
_PARSED_LOCK = threading.Lock()


# Bounded work on any file (issue 34 item 8: a 10 MB file took more than 3 GiB to parse, a
# 900-term expression overflowed the stack of the locators' ast.unparse). What sglang has, in
# the files the tool reads of 0.5.4 - 0.5.17 (.matrix and the pinned 0.5.14, 2026-12-07): at
# most 168 KB (0.5.17 flashattention_backend.py) and 21 levels of nesting (0.5.15
# model_runner_kv_cache_mixin.py). On CPython 3.11.7, parsing 1 MiB of code peaked at 685 MiB
# and ast.unparse overflowed the stack from 350 levels.
MAX_SOURCE_BYTES = 1 << 20
MAX_NESTING = 100


def _nesting_over(module: ast.AST, limit: int) -> bool:
    """Does the tree nest deeper than ``limit`` nodes? (Iterative: no recursion of its own.)"""
    stack = [(module, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return False


def parse(path: Path, data: bytes) -> ast.Module:
    with _PARSED_LOCK:
        module = _PARSED.pop(data, None)
        if module is not None:
            _PARSED[data] = module  # the most recently used last
    if module is not None:
        return module
    if len(data) > MAX_SOURCE_BYTES:
        raise ToolError(f"{path}: not recognised: {len(data)} bytes, more than {MAX_SOURCE_BYTES}")
    try:
        module = ast.parse(data, filename=str(path))
    except (SyntaxError, ValueError) as exc:
        detail = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, SyntaxError) else str(exc)
        raise ToolError(f"{path}: not recognised: does not parse ({detail})") from None
    except (RecursionError, MemoryError):  # CPython's parser on deep nesting
        module = None
    if module is None or _nesting_over(module, MAX_NESTING):
        raise ToolError(f"{path}: not recognised: nested more than {MAX_NESTING} levels deep")
    with _PARSED_LOCK:
        _PARSED[data] = module
        while len(_PARSED) > _PARSED_MAX:
            del _PARSED[next(iter(_PARSED))]  # the oldest
    return module


def forget_parsed() -> None:
    """Drop the kept trees (the plugin calls it once its decisions are made: a scheduler process
    should not hold sglang's parsed files for its whole life)."""
    with _PARSED_LOCK:
        _PARSED.clear()


@dataclass(frozen=True)
class Edit:
    """One byte range of a file and the text that replaces it."""

    kind: str  # fa3_sites: what it changes ("width", "comment", ...); graph_tables: the method
    start: int
    end: int  # == start for an insertion
    lineno: int
    found: str  # what the file has there ("" for an insertion)
    replacement: str

    @property
    def done(self) -> bool:
        return self.found == self.replacement


@dataclass(frozen=True)
class EditSite:
    """A change of several edits in one file: the questions ``sites.Site`` answers (what
    classify, apply, revert and diff ask). Bug #3's sites (``fa3_sites``, ``graph_tables``)."""

    bug: object  # verdicts.Bug
    path: Path
    data: bytes
    edits: tuple  # Edit, in file order
    patched_here: bool  # the file carries exactly this change
    affected_when: str = ""
    fixed_upstream: bool = False  # sglang sizes them from req_to_token by itself
    lineno: int = 0  # the first edit's line (what check names)
    found: str = ""  # what sglang has there
    hookable: bool = True
    unknown: str = ""  # a form this tool cannot judge: why (verdict "cannot tell")
    legacy: bool = False

    def of(self, kind: str) -> list:
        return [e for e in self.edits if e.kind == kind]

    def patched_bytes(self) -> bytes:
        data = self.data
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            if edit.done:
                continue
            data = data[: edit.start] + edit.replacement.encode() + data[edit.end :]
        return data
