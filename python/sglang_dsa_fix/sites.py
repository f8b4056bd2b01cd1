"""Find, in sglang's own source files, where bugs #1 and #2's in-tree fix goes (bug #3's:
``fa3_sites``, ``graph_tables``; each member's locator is named by its unit, ``members``).

Nothing of sglang's source is stored here: each file is parsed (``ast``) and the change is
computed from its bytes. A ``Site`` says where the change goes and what it inserts:

    patched = data[:line_start] + comment + data[line_start:start] + replacement + data[end:]

- bug #1: ``start:end`` is the width argument of the ``torch.zeros`` that allocates the graph
  ``page_table`` in ``<Backend>.init_cuda_graph_state``; ``replacement`` is
  ``width.PAGE_TABLE_WIDTH_EXPR``;
- bug #2: ``start == end`` is the final ``return extra`` of ``get_req_to_token_extra_context_len``;
  ``replacement`` is one line raising ``extra`` to ``width.row_extra_floor(reserve)``, the whole
  decode reservation.

A file already patched by this tool yields a ``Site`` with ``patched_here`` True. The row sizing
function is judged by its form (where sglang reserves ``get_alloc_reserve_per_decode``), never by
the version string: ``affected_when`` says at which configurations a pristine form is affected,
``fixed_upstream`` marks a form that already reserves it at every page size, and ``unknown``
explains a form this tool cannot judge.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import backend_layouts, release, width, width_source
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.pysource import Unclear, byte_offset, kept, kept_method, lines_above, live_nodes, parse
from sglang_dsa_fix.snapshot import TreeFiles
from sglang_dsa_fix.verdicts import Bug

# Comments the in-tree change adds (upstream style; check recognises the change by them).
PAGE_TABLE_COMMENT = (
    "# As wide as req_to_token: speculative decoding lets seq_len pass context_len and",
    "# replay copies req_to_token rows into this buffer (target_verify: seq_len + D).",
)


def row_comment(reserve: str = f"{release.RESERVE_FUNCTION}()") -> tuple[str, ...]:
    return (
        "# Hold the whole spec-v2 decode reservation at every page size: it writes this row",
        f"# up to kv_committed_len + {reserve}, and kv_committed_len approaches context_len.",
    )


# 0.5.16 - 0.5.18: the prepare rounds that end up to the allocator's page, which decode context
# parallel makes page_size x dcp_size (0.5.17 speculative/eagle_utils.py:889-907,
# mem_cache/kv_cache_builder.py:212), while these releases add only page_size - 1.
ROUNDED_ROW_COMMENT = (
    "# Hold the whole spec-v2 decode reservation at every page size: it writes this row up to",
    "# kv_committed_len + get_alloc_reserve_per_decode(), rounded up to the allocator's page",
    "# (page_size * dcp_size), and kv_committed_len approaches context_len.",
)


# What the 0.5.18 change reads the allocator page with, imported where it is used (as that module
# imports SpeculativeAlgorithm, allocation_sizing.py:27).
CONTEXT_IMPORT = "from sglang.srt.runtime_context import get_parallel"


# The first comment line of the margin form (sglang-dsa-fix 0.2: ``reserve - margin``).
LEGACY_ROW_COMMENT = "# Hold the spec-v2 decode reservation: it writes this row up to kv_committed_len +"


@dataclass(frozen=True)
class Site:
    bug: Bug
    path: Path  # the file inside the tree (may be a symlink; writes go to its target)
    data: bytes  # the file as read
    line_start: int
    start: int
    end: int
    lineno: int
    comment: tuple[str, ...]
    replacement: str
    found: str  # what sglang has at the site (the width expression, or ``return extra``)
    patched_here: bool  # the file already carries exactly this tool's change
    fixed_upstream: bool = False
    hookable: bool = True  # False: no function to hook (row sized inline): in-tree patch only
    affected_when: str = ""  # a pristine form: at which configurations it is affected
    unknown: str = ""  # a form this tool cannot judge: why (verdict "cannot tell")
    legacy: bool = False  # carries an older form of this tool's change (revert, then apply)
    marked = True  # (not a field) the change carries this tool's comment: the file tells it apart

    def unmarked_bytes(self) -> bytes:
        """The change as upstream would write it: without this tool's comment lines."""
        code = tuple(line for line in self.comment if not line.startswith("#"))
        return dataclasses.replace(self, comment=code).patched_bytes()

    def patched_bytes(self) -> bytes:
        data = self.data
        indent = data[self.line_start : self.start]
        indent = indent[: len(indent) - len(indent.lstrip())]
        newline = b"\r\n" if b"\r\n" in data[self.start : data.find(b"\n", self.start) + 1] else b"\n"
        comment = b"".join(indent + line.encode() + newline for line in self.comment)
        replacement = self.replacement.encode()
        if self.start == self.end:  # an inserted statement: own line, same indent
            replacement += newline + indent
        return (
            data[: self.line_start]
            + comment
            + data[self.line_start : self.start]
            + replacement
            + data[self.end :]
        )


# ------------------------------------------------------------------------------ bug #1


def _is_torch_zeros(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "zeros"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def _zeros_calls(value) -> list:
    """torch.zeros calls that an expression evaluates to (directly or via a conditional)."""
    if isinstance(value, ast.IfExp):
        return _zeros_calls(value.body) + _zeros_calls(value.orelse)
    return [value] if _is_torch_zeros(value) else []


def _page_table_allocations(method: ast.FunctionDef) -> list:
    calls = []
    for node in ast.walk(method):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "page_table":
                    calls += _zeros_calls(value)
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "page_table" for t in node.targets):
                calls += _zeros_calls(node.value)
    return calls


def unclear_site(bug: Bug, path: Path, data: bytes, why: str) -> Site:
    """A site this tool cannot judge (``unknown``: cannot tell), and so never patches."""
    return Site(bug, path, data, 0, 0, 0, 0, (), "", "", patched_here=False, unknown=why)


def backend_file(files: TreeFiles):
    """(layout, path) of the backend file this release uses, or None (no DSA/NSA backend).

    The newest layout whose file exists decides; 0.5.13 - 0.5.20 keep a class-less
    ``nsa_backend.py`` shim beside ``dsa_backend.py``, so a shim only counts when it is alone.
    """
    for layout in backend_layouts.LAYOUTS:
        if files.exists(layout.relative_path):
            return layout, files.path(layout.relative_path)
    return None


def page_table_site(files: TreeFiles, data: Optional[bytes] = None) -> Optional[Site]:
    """Bug #1's site, or None where sglang has no DSA/NSA backend. ToolError if unrecognised.

    ``data``: parse these bytes as the file's content (a backup) instead of reading it.
    """
    found = backend_file(files)
    if found is None:
        return None
    layout, path = found
    data = files.data(layout.relative_path) if data is None else data
    module = parse(path, data)
    try:
        cls = kept(module.body, layout.class_name, ast.ClassDef)
        method = cls and kept_method(module, cls, "init_cuda_graph_state")
    except Unclear as exc:
        return unclear_site(Bug.PAGE_TABLE, path, data, f"{layout.class_name}.init_cuda_graph_state: {exc}")
    if method is None:
        raise ToolError(f"{path}: not recognised: {layout.class_name}.init_cuda_graph_state not found")
    calls = _page_table_allocations(method)
    if len(calls) != 1 or len(calls[0].args) < 2:
        raise ToolError(
            f"{path}:{method.lineno}: not recognised: expected exactly one "
            f"torch.zeros(rows, width, ...) for page_table in "
            f"{layout.class_name}.init_cuda_graph_state, found {len(calls)}"
        )
    arg = calls[0].args[1]
    lines = data.splitlines(keepends=True)
    start = byte_offset(lines, arg.lineno, arg.col_offset)
    end = byte_offset(lines, arg.end_lineno, arg.end_col_offset)
    found_expr = data[start:end].decode("utf-8", "replace")
    patched_here = found_expr == width.PAGE_TABLE_WIDTH_EXPR and lines_above(
        lines, arg.lineno, len(PAGE_TABLE_COMMENT)
    ) == list(PAGE_TABLE_COMMENT)
    # sglang's own width, by what it evaluates to (0.5.15+: ``max_ctx_len =
    # self.req_to_token.shape[1]`` then ``max_ctx_len``, dsa_backend.py:1119).
    judged = width_source.judge(arg, cls, method, width_source.TOKENS)
    return Site(
        bug=Bug.PAGE_TABLE,
        path=path,
        data=data,
        line_start=byte_offset(lines, arg.lineno, 0),
        start=start,
        end=end,
        lineno=arg.lineno,
        comment=PAGE_TABLE_COMMENT,
        replacement=width.PAGE_TABLE_WIDTH_EXPR,
        found=found_expr,
        patched_here=patched_here,
        fixed_upstream=not patched_here and judged == width_source.HOLDS,
        unknown=""
        if patched_here or judged != width_source.UNKNOWN
        else f"the graph page_table's width `{found_expr}` does not evaluate from "
        f"{layout.class_name}'s own code: this tool cannot tell whether it holds req_to_token's row",
    )


# ------------------------------------------------------------------------------ bug #2


def row_sizing_file(files: TreeFiles):
    """(path, bytes) of the file that defines the row sizing function, or (None, None)."""
    for relative in release.ROW_SIZING_FILES:
        data = files.data(relative)
        if data is not None and f"def {release.ROW_SIZING_FUNCTION}(".encode() in data:
            return files.path(relative), data
    return None, None


def has_spec_v2_reservation(files: TreeFiles) -> bool:
    """Releases before the sizing function: is the spec-v2 decode reservation there at all?"""
    return files.exists(release.SPEC_V2_DECODE_FILE)


def row_site(files: TreeFiles, data: Optional[bytes] = None) -> Optional[Site]:
    """Bug #2's site, or None where this tool has none. ToolError if unrecognised."""
    path, read = row_sizing_file(files)
    if path is None:
        return inline_row_site(files, data)
    data = read if data is None else data
    module = parse(path, data)
    functions = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    try:
        function = kept(module.body, release.ROW_SIZING_FUNCTION, ast.FunctionDef)
    except Unclear as exc:
        return unclear_site(Bug.ROW_OVERFLOW, path, data, f"{release.ROW_SIZING_FUNCTION}: {exc}")
    last = function.body[-1] if function and function.body else None
    if (
        release.RESERVE_FUNCTION not in functions
        or not isinstance(last, ast.Return)
        or not isinstance(last.value, ast.Name)
    ):
        raise ToolError(
            f"{path}: not recognised: expected {release.ROW_SIZING_FUNCTION} ending in "
            f"`return <name>` beside {release.RESERVE_FUNCTION}"
        )
    variable = last.value.id
    # 0.5.13 - 0.5.17 pass server_args along; 0.5.18+ read sglang's runtime context, no argument.
    params = [a.arg for a in function.args.args]
    call_args = "server_args" if "server_args" in params else ""
    reserve_only = f"{variable} = max({variable}, {release.RESERVE_FUNCTION}({call_args}))"
    comment, replacement, older = row_comment(), reserve_only, ()
    if path.name == "allocation_sizing.py" and "get_alloc_page_size" not in functions:
        # 0.5.16 - 0.5.18 round nxt up to the allocator's page but size by page_size alone
        # (width.row_extra_floor): the allocator page read where the function reads its
        # configuration, the server args (0.5.16 - 0.5.17) or the runtime context (0.5.18, whose
        # module does not import get_parallel). The reservation-only form (sglang-dsa-fix 0.3;
        # 0.4 on 0.5.18) is older.
        comment, older = ROUNDED_ROW_COMMENT, ((row_comment(), reserve_only),)
        page = width.alloc_page_source("server_args" if call_args else "runtime_context")
        if not call_args:
            comment += (CONTEXT_IMPORT,)
        replacement = f"{variable} = max({variable}, {release.RESERVE_FUNCTION}({call_args}) + {page} - 1)"
    site = _row_statement_before(path, data, last, comment, replacement, f"return {variable}", older=older)
    gates = _reserve_gates(function, variable)
    if site.patched_here:
        return site
    if not gates:
        return dataclasses.replace(
            site,
            unknown=f"{release.ROW_SIZING_FUNCTION} does not raise `{variable}` by "
            f"{release.RESERVE_FUNCTION}() in a form this tool knows",
        )
    if any(not _mentions(tests, "page_size") for tests in gates):
        # Some path reserves it whatever the page size: held at page 1 too.
        return dataclasses.replace(site, fixed_upstream=True)
    margin = width.committed_margin(release_form(files)[0])
    topk_gated = all(_mentions(tests, "topk") for tests in gates)
    when = (
        f"with topk 1 at any page size from D {margin + 5} (D - {margin + 4} columns), and with "
        "topk > 1 at page 1"
        if topk_gated
        else f"at page 1 only: topk 1 from D {margin + 5} (D - {margin + 4} columns), topk > 1, "
        "NGRAM at its defaults"
    )
    if older:  # 0.5.16 - 0.5.18: the row misses the allocator page's rounding under DCP
        when += "; at any page size with decode context parallel (--dcp-size > 1)"
    return dataclasses.replace(site, affected_when=when)


def _reserve_gates(function: ast.FunctionDef, variable: str) -> list:
    """For each ``variable = ...`` that calls the reserve function: the ``if`` tests around it."""
    gates = []

    def visit(body, tests):
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body, [*tests, node.test])
                visit(node.orelse, [*tests, node.test])
            elif isinstance(node, (ast.For, ast.While, ast.With)):
                visit(node.body, tests)
            elif (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == [variable]
                and any(
                    isinstance(n, ast.Call) and _name_of(n.func) == release.RESERVE_FUNCTION
                    for n in ast.walk(node.value)
                )
            ):
                gates.append(tests)

    visit(function.body, [])
    return gates


def _name_of(node) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _mentions(tests: list, word: str) -> bool:
    """Does any of these conditions read a name or attribute containing ``word``?"""
    return any(word in _name_of(n) for test in tests for n in ast.walk(test))


def preclaims_bonus_slot(files: TreeFiles) -> bool:
    """Does the spec-v2 prepare pre-claim the bonus slot (``kv_committed_len += 1``)? The file
    shape of 0.5.11 - 0.5.14 (0.5.14 speculative/eagle_info_v2.py:62); 0.5.15 moved the
    reservation to eagle_utils.py and commits the bonus in resolve."""
    data = files.data(release.SPEC_V2_DECODE_FILE)
    if data is None:
        return False
    for node in ast.walk(parse(files.path(release.SPEC_V2_DECODE_FILE), data)):
        if (
            isinstance(node, ast.AugAssign)
            and _name_of(node.target) == "kv_committed_len"
            and isinstance(node.op, ast.Add)
        ):
            return True
    return False


def release_form(files: TreeFiles) -> tuple:
    """(the release's ``release.Form``, note): the label's form, unless the files' shape says
    otherwise (a 0.5.14 tree labelled 0.5.15 keeps 0.5.14's margin): the files win
    (``release.detected_form``)."""
    sizing, data = row_sizing_file(files)
    preclaims = preclaims_bonus_slot(files)
    kind = None if sizing is None else sizing.stem
    holds_alloc_page = data is not None and b"def get_alloc_page_size(" in data
    return release.detected_form(files.tree.version, preclaims, kind, holds_alloc_page)


def _row_statement_before(
    path, data, anchor: ast.stmt, comment, replacement, found, hookable=True, older=()
) -> Site:
    """Bug #2's change: ``comment`` and the ``replacement`` statement inserted right above
    ``anchor``, at its indent; the file carries it already when exactly those lines are there.
    ``legacy``: an older form of this tool's change is there instead (the margin form of 0.2,
    or one of ``older``: (comment, statement) pairs), which ``revert`` undoes."""
    lines = data.splitlines(keepends=True)
    start = byte_offset(lines, anchor.lineno, anchor.col_offset)
    if data[byte_offset(lines, anchor.lineno, 0) : start].strip():
        # (``pass; return extra``: a line above would land mid-statement, and the change would
        # then read as sglang's own form.)
        raise ToolError(f"{path}:{anchor.lineno}: not recognised: `{found}` shares its line with other code")
    above = lines_above(lines, anchor.lineno, 3)
    variable = replacement.split(" = ", 1)[0]
    legacy = (
        len(above) == 3
        and above[0] == LEGACY_ROW_COMMENT
        and above[2].startswith(f"{variable} = max({variable}, ")
    ) or any(
        lines_above(lines, anchor.lineno, len(old_comment) + 1) == [*old_comment, old_statement]
        for old_comment, old_statement in older
    )
    return Site(
        bug=Bug.ROW_OVERFLOW,
        path=path,
        data=data,
        line_start=byte_offset(lines, anchor.lineno, 0),
        start=start,
        end=start,
        lineno=anchor.lineno,
        comment=comment,
        replacement=replacement,
        found=found,
        patched_here=legacy or lines_above(lines, anchor.lineno, len(comment) + 1) == [*comment, replacement],
        hookable=hookable,
        legacy=legacy,
    )


def inline_row_site(files: TreeFiles, data: Optional[bytes] = None) -> Optional[Site]:
    """0.5.9 - 0.5.12 size the row inline in ModelRunner (0.5.12 model_runner_kv_cache_mixin.py
    :245-247: ``extra_max_context_len = 4``, then ``+= speculative_num_draft_tokens`` under an
    ``if``). The change goes right after that ``if``: raise the variable to
    ``width.row_extra_floor(2·A)`` = 2·A with A = max(steps, D), what ``get_alloc_len_per_decode``
    gives at topk 1 (0.5.12 managers/utils.py:232-233), the only topk spec v2 runs there. Not a
    call to it: it raises for page > 1 with topk > 1, which a spec-v1 deployment may use.
    None where the release has no such block or no ``get_alloc_len_per_decode``."""
    path = files.path(release.INLINE_ROW_FILE)
    alloc = files.data(release.INLINE_ALLOC_FILE)
    if not (has_spec_v2_reservation(files) and files.exists(release.INLINE_ROW_FILE) and alloc is not None):
        return None
    if f"def {release.INLINE_ALLOC_FUNCTION}(".encode() not in alloc:
        return None
    data = files.data(release.INLINE_ROW_FILE) if data is None else data
    variable = release.INLINE_ROW_VARIABLE
    args = "self.server_args"
    alloc_len = f"max({args}.speculative_num_steps or 1, {args}.speculative_num_draft_tokens or 0)"
    replacement = f"{variable} = max({variable}, 2 * {alloc_len})"
    comment = row_comment(f"2 * {release.INLINE_ALLOC_FUNCTION}()")
    ours = f"{variable} = max({variable}, 2 * "  # this form and the older margin form
    lines = data.splitlines(keepends=True)
    module = parse(path, data)
    for body in (n.body for n in live_nodes(module) if isinstance(getattr(n, "body", None), list)):
        for i, node in enumerate(body):
            grows = (
                isinstance(node, ast.If)
                and not node.orelse
                and len(node.body) == 1
                and isinstance(node.body[0], ast.AugAssign)
                and isinstance(node.body[0].target, ast.Name)
                and node.body[0].target.id == variable
            )
            if not grows:
                continue
            # The statement after the `if`, past what this tool inserted there.
            after = [n for n in body[i + 1 :] if not _source_line(lines, n).startswith(ours)][:1]
            if not after:
                continue
            found = f"{variable} += …"
            site = _row_statement_before(path, data, after[0], comment, replacement, found, hookable=False)
            # The same statement without this tool's comment: sglang's own (it holds 2·A).
            held = any(_source_line(lines, n) == replacement for n in body[i + 1 :])
            return dataclasses.replace(site, fixed_upstream=held and not site.patched_here)
    return None


def _source_line(lines: list[bytes], node: ast.stmt) -> str:
    return lines[node.lineno - 1].strip().decode("utf-8", "replace")
