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


def parse(path: Path, data: bytes) -> ast.Module:
    with _PARSED_LOCK:
        module = _PARSED.pop(data, None)
        if module is not None:
            _PARSED[data] = module  # the most recently used last
    if module is not None:
        return module
    try:
        module = ast.parse(data, filename=str(path))
    except (SyntaxError, ValueError) as exc:
        detail = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, SyntaxError) else str(exc)
        raise ToolError(f"{path}: not recognised: does not parse ({detail})") from None
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
