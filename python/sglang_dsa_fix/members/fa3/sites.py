"""Bug #3's in-tree change, located in sglang's own ``flashattention_backend.py`` by ``ast``.

As ``sites.page_table_site`` does for bug #1, nothing of sglang's source is stored here: the
file's bytes are parsed and each change is a byte range plus the text that replaces it.

In ``FlashAttentionBackend`` (``fa3_width`` says why each is needed):

- ``width``: the width argument of every ``torch.zeros(max_bs, max_num_pages, ...)`` in
  ``init_cuda_graph_state`` (the local ``max_num_pages = ceil(max_context_len / page_size)``):
  the decode, draft-decode, target_verify and draft_extend page tables and their SWA siblings,
  seven in 0.5.14 (:1623, :1671, :1744, :1765, :1788, :1800, :1806), 0.5.17 (:2074, :2122,
  :2195, :2216, :2250, :2262, :2268) and 0.5.23 (:2445, :2471, :2544, :2565, :2599, :2611,
  :2617) -> ``fa3_width.WIDTH_EXPR``;
- ``strided_stop``: the stop of each ``strided_indices = torch.arange(0, self.max_context_len,
  self.page_size)`` there (0.5.14 :1628, :1770, :1793; 0.5.17 :2079, :2221, :2255; 0.5.23 :2450,
  :2570, :2604): the page-start gather that bounds the <= 0.5.14 verify replay (it slices
  decode's, :2308-2311), so a wider table alone would get zeros in its new columns ->
  ``fa3_width.STRIDED_STOP_EXPR``;
- ``init_bound``: the right-hand side of ``self.max_num_pages = ...`` in ``__init__`` where the
  release has it (0.5.17 :180-182, 0.5.23 :196-198), the clamp of the device-side builders
  (0.5.17 draft decode via ``normal_decode_set_metadata`` :2649; 0.5.23 verify and draft decode via
  ``_set_decode_page_metadata`` :2973) -> ``fa3_width.WIDTH_EXPR`` (``self.req_to_token`` is
  set a few lines above: :173 / :189);
- ``topk_width``: the width argument of the topk > 1 prefix tables, ``torch.zeros(rows,
  self.max_context_len, ...)`` under ``"page_table"`` of ``self.draft_decode_metadata_topk_normal``,
  ``self.target_verify_metadata_topk_normal`` and ``self.target_verify_metadata_topk_swa`` (0.5.14
  :1699, :1826, :1877; 0.5.23 :2499, :2637): they are filled through the widened gather (or,
  0.5.16+, the verify's device-side builder), so they are widened with it ->
  ``fa3_width.TOPK_WIDTH_EXPR`` (without it ``apply`` turned sglang's silent over-read at page 1
  into a size-mismatch crash);
- ``host_bound``: in ``_apply_cuda_graph_metadata``, the fallback of each ``metadata.max_seq_len_k
  = (seq_lens_cpu.max().item() if seq_lens_cpu is not None else self.max_context_len)`` that a
  following ``max_seq_pages`` is computed from (0.5.15+: the topk > 1 draft decode and the draft
  extend, 0.5.23 :3059, :3289; without a CPU mirror, sglang's default there since 0.5.16, the
  gather stops at ceil(C / page) pages and the kernel reads the rest of the row unfilled) ->
  ``fa3_width.STRIDED_STOP_EXPR``;
- ``comment``: two comment lines inserted above the local ``max_num_pages`` assignment.

The topk > 1 expand tables (``D`` or ``decode_length + 1`` wide, the draft tokens only) are not
touched. A file carrying every edit but ``topk_width`` / ``host_bound`` is what this tool wrote
before it had them (``legacy``: revert, then apply). No torch, no sglang imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import sglang_dsa_fix.members.fa3.tables as fa3_width
from sglang_dsa_fix import backend_layouts, width_source
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.pysource import (
    Edit,
    EditSite,
    Unclear,
    by_source,
    byte_offset,
    kept,
    kept_method,
    lines_above,
    parse,
)
from sglang_dsa_fix.verdicts import Bug
from sglang_dsa_fix.width_source import PAGES, TOKENS

RELATIVE_PATH = backend_layouts.FA3_LAYOUT.relative_path
CLASS_NAME = backend_layouts.FA3_LAYOUT.class_name
LOCAL_PAGES = "max_num_pages"

COMMENT = (
    "# FA3 graph page tables as wide as req_to_token, in pages: a verify reads seq_len + D keys,",
    "# a draft decode seq_len + step + 1, and speculative decoding lets seq_len pass context_len.",
)


AFFECTED_WHEN = (
    "where FA3 (--attention-backend fa3 / fa4) runs a speculative verify or draft decode in CUDA "
    "graphs, topk 1: near context_len the kernel reads past the graph page tables"
)


# Edit kinds this tool added after its first FA3 form: a file with all the others done and only
# these pending carries that earlier form (check says so; revert restores its backup).
LATER_KINDS = ("topk_width", "host_bound")
LEGACY_DETAIL = (
    "an earlier sglang-dsa-fix form of this change (the topk > 1 tables and the replay's host bound "
    "left as sglang wrote them): run `sglang-dsa-fix revert` then `apply` to widen those too"
)


def _torch_call(node, attr: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def _text(data: bytes, lines: list, node) -> tuple:
    start = byte_offset(lines, node.lineno, node.col_offset)
    end = byte_offset(lines, node.end_lineno, node.end_col_offset)
    return start, end, data[start:end].decode("utf-8", "replace")


def _self_attr_target(node: ast.Assign, attr: str) -> bool:
    return any(
        isinstance(t, ast.Attribute)
        and t.attr == attr
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
        for t in node.targets
    )


def _strided_aranges(method: ast.FunctionDef) -> list:
    """torch.arange calls stored under "strided_indices" (a dict entry or a subscript target)."""
    calls = []
    for node in ast.walk(method):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "strided_indices"
                    and _torch_call(value, "arange")
                ):
                    calls.append(value)
        elif isinstance(node, ast.Assign) and _torch_call(node.value, "arange"):
            if any(
                isinstance(t, ast.Subscript)
                and isinstance(t.slice, ast.Constant)
                and t.slice.value == "strided_indices"
                for t in node.targets
            ):
                calls.append(node.value)
    return calls


def _topk_widths(method: ast.FunctionDef) -> list:
    """The width argument of each ``torch.zeros`` stored under "page_table" of a topk > 1 dict."""
    attributes = {attribute for attribute, _ in fa3_width.TOPK_TABLES}
    out = []
    for node in ast.walk(method):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
            continue
        if not any(_self_attr_target(node, attribute) for attribute in attributes):
            continue
        for key, value in zip(node.value.keys, node.value.values):
            if isinstance(key, ast.Constant) and key.value == "page_table" and _torch_call(value, "zeros"):
                if len(value.args) >= 2:
                    out.append(value.args[1])
    return out


def _assigns(node, attr: str) -> bool:
    return isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets
    )


def _host_bounds(method: ast.FunctionDef) -> list:
    """The ``else self.max_context_len`` of each ``metadata.max_seq_len_k = (... if seq_lens_cpu
    is not None else ...)`` that a later ``max_seq_pages = ...`` of the same block reads."""
    out = []
    for block in ast.walk(method):
        for name in ("body", "orelse"):
            stmts = getattr(block, name, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                value = getattr(stmt, "value", None)
                if not (_assigns(stmt, "max_seq_len_k") and isinstance(value, ast.IfExp)):
                    continue
                if "seq_lens_cpu" not in ast.unparse(value.test):
                    continue
                if any(
                    isinstance(later, ast.Assign)
                    and [getattr(t, "id", None) for t in later.targets] == ["max_seq_pages"]
                    and "max_seq_len_k" in ast.unparse(later.value)
                    for later in stmts[i + 1 :]
                ):
                    out.append(value.orelse)
    return out


def _local_pages(path, method: ast.FunctionDef) -> ast.Assign:
    """``max_num_pages = ...`` in init_cuda_graph_state (the tables' width in pages)."""
    for node in method.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [LOCAL_PAGES]:
            return node
    raise ToolError(
        f"{path}:{method.lineno}: not recognised: no `{LOCAL_PAGES} = ...` in init_cuda_graph_state"
    )


def _comment_edit(data: bytes, lines: list, local: ast.Assign) -> Edit:
    """This change's comment above the local page count; where it is there already, its lines
    are the range (found == replacement)."""
    line_start = byte_offset(lines, local.lineno, 0)
    indent = lines[local.lineno - 1][: local.col_offset].decode()
    newline = "\r\n" if lines[local.lineno - 1].endswith(b"\r\n") else "\n"
    has_comment = lines_above(lines, local.lineno, len(COMMENT)) == list(COMMENT)
    comment_text = "".join(indent + line + newline for line in COMMENT)
    above = line_start - len(comment_text.encode()) if has_comment else line_start
    return Edit("comment", above, line_start, local.lineno, data[above:line_start].decode(), comment_text)


def _edit(data, lines, kind: str, node, replacement: str, method, unit: str) -> tuple:
    """(the Edit of ``node``, the node, the method it is in, its unit: what ``width_source`` judges)."""
    start, end, text = _text(data, lines, node)
    return Edit(kind, start, end, node.lineno, text, replacement), node, method, unit


def _width_edits(data, lines, path, methods: dict) -> list:
    """Every width this change rewrites, as ``_edit`` tuples. ToolError if unrecognised."""
    method, apply_method = methods["init_cuda_graph_state"], methods["_apply_cuda_graph_metadata"]
    out = []
    # Width arguments: torch.zeros(rows, max_num_pages | WIDTH_EXPR, ...).
    for node in ast.walk(method):
        if _torch_call(node, "zeros") and len(node.args) >= 2:
            if _text(data, lines, node.args[1])[2] in (LOCAL_PAGES, fa3_width.WIDTH_EXPR):
                out.append(_edit(data, lines, "width", node.args[1], fa3_width.WIDTH_EXPR, method, PAGES))
    if not out:
        raise ToolError(
            f"{path}:{method.lineno}: not recognised: no torch.zeros(rows, {LOCAL_PAGES}, ...) "
            "in init_cuda_graph_state"
        )
    # The topk > 1 prefix tables (token-wide), fed by the same gather.
    for arg in _topk_widths(method):
        if _text(data, lines, arg)[2] in ("self.max_context_len", fa3_width.TOPK_WIDTH_EXPR):
            out.append(_edit(data, lines, "topk_width", arg, fa3_width.TOPK_WIDTH_EXPR, method, TOKENS))
    # The replay's host bound where no CPU mirror is handed over (0.5.15+).
    for arg in _host_bounds(apply_method) if apply_method is not None else ():
        if _text(data, lines, arg)[2] in ("self.max_context_len", fa3_width.STRIDED_STOP_EXPR):
            out.append(
                _edit(data, lines, "host_bound", arg, fa3_width.STRIDED_STOP_EXPR, apply_method, TOKENS)
            )
    # The strided_indices stops: torch.arange(0, <stop>, self.page_size).
    for call in _strided_aranges(method):
        if len(call.args) < 2:
            raise ToolError(f"{path}:{call.lineno}: not recognised: strided_indices arange without a stop")
        out.append(
            _edit(data, lines, "strided_stop", call.args[1], fa3_width.STRIDED_STOP_EXPR, method, TOKENS)
        )
    return out + _init_bound(data, lines, path, methods["__init__"])


def _init_bound(data, lines, path, init) -> list:
    """__init__'s self.max_num_pages (0.5.17+), after self.req_to_token."""
    if init is None:
        return []
    bounds = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and _self_attr_target(n, LOCAL_PAGES)]
    if len(bounds) > 1:
        raise ToolError(
            f"{path}:{init.lineno}: not recognised: self.{LOCAL_PAGES} assigned {len(bounds)} times"
        )
    if not bounds:
        return []
    pool = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and _self_attr_target(n, "req_to_token")]
    if not pool or min(n.lineno for n in pool) > bounds[0].lineno:
        raise ToolError(
            f"{path}:{bounds[0].lineno}: not recognised: self.{LOCAL_PAGES} is set before self.req_to_token"
        )
    return [_edit(data, lines, "init_bound", bounds[0].value, fa3_width.WIDTH_EXPR, init, PAGES)]


def _methods(module: ast.Module) -> tuple:
    """(the class Python keeps, {name: the method it keeps}). ``Unclear`` where either is not clear."""
    cls = kept(module.body, CLASS_NAME, ast.ClassDef)
    names = ("init_cuda_graph_state", "_apply_cuda_graph_metadata", "__init__")
    return cls, {name: cls and kept_method(module, cls, name) for name in names}


@by_source
def locate(data: bytes, path: Path = Path(RELATIVE_PATH)) -> EditSite:
    """Bug #3's edits in these bytes of flashattention_backend.py. ToolError if unrecognised.

    sglang's own widths are judged by what they evaluate to (``width_source``): all at least
    req_to_token's row (in pages, or tokens), however spelt, is ``fixed_upstream``; one narrower
    is affected; one that does not evaluate, with none narrower, is ``unknown``."""
    module = parse(path, data)
    common = dict(bug=Bug.FA3_PAGE_TABLE, affected_when=AFFECTED_WHEN, path=path, data=data)
    try:
        cls, methods = _methods(module)
    except Unclear as exc:
        return EditSite(edits=(), patched_here=False, unknown=f"{CLASS_NAME}: {exc}", **common)
    method = methods["init_cuda_graph_state"]
    if method is None:
        raise ToolError(f"{path}: not recognised: {CLASS_NAME}.init_cuda_graph_state not found")
    lines = data.splitlines(keepends=True)
    local = _local_pages(path, method)
    widths = _width_edits(data, lines, path, methods)
    edits = sorted([_comment_edit(data, lines, local), *(w[0] for w in widths)], key=lambda e: e.start)
    pending = {e.kind for e in edits if not e.done}
    legacy = bool(pending) and pending <= set(LATER_KINDS)
    patched_here = legacy or not pending
    # Each width where it is used (a table's ``max_num_pages`` through the local).
    judged = {width_source.judge(node, cls, scope, unit) for _, node, scope, unit in widths}
    local_text = _text(data, lines, local.value)[2]
    unknown = ""
    if not patched_here and width_source.NARROW not in judged and width_source.UNKNOWN in judged:
        unknown = (
            f"sglang's widths in {CLASS_NAME} (`{LOCAL_PAGES} = {local_text}` and the tables' own) do "
            "not all evaluate from the class's own code: this tool cannot tell whether they hold "
            "req_to_token's row"
        )
    return EditSite(
        edits=tuple(edits),
        patched_here=patched_here,
        fixed_upstream=not patched_here and judged == {width_source.HOLDS},
        unknown=unknown,
        lineno=local.lineno,
        found=f"{LOCAL_PAGES} = {local_text}",
        legacy=legacy,
        **common,
    )


def fa3_page_table_site(files, data: Optional[bytes] = None) -> Optional[EditSite]:
    """Bug #3's site in a tree (``snapshot.TreeFiles``), or None where sglang has no FA3 backend
    file. ``data``: parse these bytes (a backup) instead. ToolError if unrecognised."""
    if data is None:
        if not files.exists(RELATIVE_PATH):
            return None
        data = files.data(RELATIVE_PATH)
    return locate(data, files.path(RELATIVE_PATH))
