"""Byte offsets, parsing and edits of sglang's Python source, for the locators (sites, fa3_sites, graph_tables).

A change is a byte range of the file as read; ``ast`` gives UTF-8 columns, these helpers turn
them into byte offsets of the file's own encoding. No torch, no sglang.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
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


def by_source(locate):
    """``locate`` (a member's locator over one file's bytes: a pure function of its hashable
    arguments, the bytes among them, returning a frozen ``EditSite``) remembered for the last
    few contents, as ``parse`` remembers trees: one run asks a site more than once (the tree,
    its backups, apply's re-read before writing) and the tests ask it of the same bytes
    hundreds of times; the bytes alone decide the answer. A ToolError is not remembered."""
    remembered = functools.lru_cache(maxsize=_PARSED_MAX)(locate)
    _REMEMBERED.append(remembered)
    return remembered


_REMEMBERED: list = []  # the locators by_source made (forget_parsed clears them too)


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
    should not hold sglang's parsed files for its whole life), and the locators' answers, which
    hold the files' bytes."""
    with _PARSED_LOCK:
        _PARSED.clear()
    for remembered in _REMEMBERED:
        remembered.cache_clear()


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
    # The change carries a mark of this tool's own (its comment): False where the file alone
    # cannot tell it from upstream's same spelling (``classify`` then asks the backup).
    marked: bool = True

    def as_upstream(self) -> EditSite:
        """These bytes as sglang's own code (no backup shows this tool wrote them): every edit
        done is sglang's fix; some left, the rest of the change is still to make."""
        done = all(e.done for e in self.edits)
        return dataclasses.replace(self, patched_here=False, legacy=False, fixed_upstream=done)

    def unmarked_bytes(self) -> bytes:
        """The change as upstream would write it: without this tool's ``comment`` edits."""
        return dataclasses.replace(
            self, edits=tuple(e for e in self.edits if e.kind != "comment")
        ).patched_bytes()

    def of(self, kind: str) -> list:
        return [e for e in self.edits if e.kind == kind]

    def patched_bytes(self) -> bytes:
        data = self.data
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            if edit.done:
                continue
            data = data[: edit.start] + edit.replacement.encode() + data[edit.end :]
        return data


# ------------------------------------------------------------------------------ definitions
# A name defined twice is Python's last definition: the class body (or module) runs top to
# bottom and each ``def`` / ``class`` rebinds the name. Every locator judges, patches and
# hooks that one; where other code binds the name last (an ``if`` / ``try`` around a
# definition, an assignment, an import), which one runs is not in the source: ``Unclear``.


class Unclear(Exception):
    """Which definition of a name Python keeps is not clear from the source (the locators make
    that member ``cannot_tell``, with this message as the reason)."""


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Does running ``stmt`` bind ``name`` in its own scope (not in a nested function's)?"""
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
            continue  # its body runs in a scope of its own
        if isinstance(node, (ast.Lambda, ast.comprehension)):
            continue
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
        if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == name:
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def _same_object(stmt: ast.stmt, name: str) -> bool:
    """``name = name``: the same object again (0.5.14 dsa_backend.py:2765-2766 keep such lines
    as "backward-compat aliases" of a renamed class)."""
    return (
        isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Name)
        and stmt.value.id == name
        and all(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    )


def kept(body: list, name: str, kind: type):
    """The definition of ``name`` (an ``ast.ClassDef`` or ``ast.FunctionDef``, ``kind``) that
    Python keeps once ``body`` (a module's or a class's) has run: the last statement binding the
    name, where that statement is such a definition. None where nothing binds the name;
    ``Unclear`` where other code binds it last."""
    binding = [stmt for stmt in body if _binds(stmt, name) and not _same_object(stmt, name)]
    if not binding:
        return None
    last = binding[-1]
    if isinstance(last, kind) and last.name == name:
        return last
    raise Unclear(
        f"line {last.lineno} binds `{name}` after (or instead of) its definition: which one Python "
        "keeps is not in the source"
    )


def kept_method(module: ast.Module, cls: ast.ClassDef, name: str):
    """The method ``cls.name`` Python keeps (``kept`` over the class body), or None. ``Unclear``
    also where the module assigns ``<class>.<name>`` itself."""
    line = _attribute_stores(module).get((cls.name, name))
    if line is not None:
        raise Unclear(f"line {line} rebinds `{cls.name}.{name}`: which one runs is not in the source")
    return kept(cls.body, name, ast.FunctionDef)


def _attribute_stores(module: ast.Module) -> dict:
    """{(name, attribute): line} of each ``<name>.<attribute> = ...`` (or ``del``) in the module,
    found once per parsed tree (kept on its node, as ``graph_tables`` keeps its matches)."""
    if "_sglang_dsa_fix_attribute_stores" not in module.__dict__:
        module.__dict__["_sglang_dsa_fix_attribute_stores"] = {
            (node.value.id, node.attr): node.lineno
            for node in ast.walk(module)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.value, ast.Name)
        }
    return module.__dict__["_sglang_dsa_fix_attribute_stores"]


def first_line(node) -> int:
    """The line a definition's code object starts at (``co_firstlineno``): its first decorator's."""
    return node.decorator_list[0].lineno if node.decorator_list else node.lineno


def live_nodes(module: ast.Module):
    """Every node of ``module`` but those inside a definition that a later one of the same name
    replaces (in the module or a class body): the code Python keeps, for a locator that walks."""
    replaced = []
    for owner in (module, *(n for n in ast.walk(module) if isinstance(n, ast.ClassDef))):
        defs = [n for n in owner.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        replaced += [d for i, d in enumerate(defs) if any(e.name == d.name for e in defs[i + 1 :])]
    spans = [(first_line(d), d.end_lineno) for d in replaced]
    for node in ast.walk(module):
        line = getattr(node, "lineno", None)
        if line is None or not any(start <= line <= end for start, end in spans):
            yield node
