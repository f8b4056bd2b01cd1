"""Bug #3's relatives: the rule and the locator of their in-tree change (their widths: ``width``).

TRT-LLM MHA, TRT-LLM MLA, FlashMLA and MiniMax sparse NVFP4 size a CUDA-graph table from
``self.max_context_len`` (``release.GRAPH_TABLE_LAYOUTS`` has each one's expression), while a
target_verify near the context limit asks the kernel for ``seq_len + D`` keys and speculative
decoding lets ``seq_len`` pass context_len (``width.verify_seq_len_bound``). Measured on the real
classes: each reads past its table at sglang's own sizes (docs/graph-tables-other-backends.md).

The rule, as for FA3 (``fa3_width``) and bug #1: the table covers ``req_to_token``'s row. Here it
is one substitution inside sglang's own width expression: ``self.max_context_len`` becomes
``self.req_to_token.shape[1]``, so each backend keeps its own rounding (TRT-LLM MLA's padded
blocks, FlashMLA's spare page). The in-tree change writes it (``locate``: byte ranges, no stored
source); the plugin compiles the same edits into the live class (``live_edit``). Pure: no torch,
no sglang.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import release
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.pysource import Edit, EditSite, byte_offset, parse
from sglang_dsa_fix.verdicts import Bug

REPLACED = "self.max_context_len"
REPLACEMENT = "self.req_to_token.shape[1]"

LAYOUTS = {Bug(layout.key): layout for layout in release.GRAPH_TABLE_LAYOUTS}


def affected_when(layout: release.GraphTableLayout) -> str:
    chosen = f"--attention-backend {' / '.join(layout.backends)}" if layout.backends else "the model picks it"
    return (
        f"where {layout.name} ({chosen}) runs a speculative verify or draft decode in CUDA graphs: "
        "near context_len the kernel reads past the graph table"
    )


def _class(module: ast.Module, name: str) -> Optional[ast.ClassDef]:
    return next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _width_nodes(cls: ast.ClassDef, layout: release.GraphTableLayout) -> list:
    """(method, node) of each width expression in the class, pristine or as the rule writes it."""
    forms = set(layout.width_exprs) | {e.replace(REPLACED, REPLACEMENT) for e in layout.width_exprs}
    found = []
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        for node in ast.walk(method):
            if isinstance(node, (ast.expr, ast.keyword)) and ast.unparse(node) in forms:
                found.append((method.name, node))
    return found


def locate(bug: Bug, data: bytes, path: Path) -> EditSite:
    """The bug's edits in these bytes of the backend's file. ToolError if it does not parse or
    the class is missing; a width written in another form is ``unknown`` (cannot tell)."""
    layout = LAYOUTS[bug]
    module = parse(path, data)
    cls = _class(module, layout.class_name)
    if cls is None:
        raise ToolError(f"{path}: not recognised: no class {layout.class_name}")
    lines = data.splitlines(keepends=True)
    edits, methods = [], []
    for method, node in _width_nodes(cls, layout):
        inner = next(
            n for n in ast.walk(node) if isinstance(n, ast.expr) and ast.unparse(n) in (REPLACED, REPLACEMENT)
        )
        start = byte_offset(lines, inner.lineno, inner.col_offset)
        end = byte_offset(lines, inner.end_lineno, inner.end_col_offset)
        edits.append(Edit(method, start, end, inner.lineno, data[start:end].decode(), REPLACEMENT))
        methods.append(method)
    edits.sort(key=lambda e: e.start)
    common = dict(bug=bug, path=path, data=data, affected_when=affected_when(layout))
    if not edits:
        unknown = (
            f"{layout.class_name} sizes its CUDA-graph table in a form this tool does not know "
            f"(none of: {'; '.join(layout.width_exprs)})"
        )
        return EditSite(edits=(), patched_here=False, unknown=unknown, lineno=cls.lineno, **common)
    first = edits[0]
    return EditSite(
        edits=tuple(edits),
        patched_here=all(e.done for e in edits),
        lineno=first.lineno,
        found=lines[first.lineno - 1].decode("utf-8", "replace").strip(),
        **common,
    )


def site_for(bug: Bug):
    """The locator ``sites.LOCATORS`` calls for this bug: (files, data=None) -> EditSite or None
    where the release has no such file."""
    relative = LAYOUTS[bug].relative_path

    def site(files, data: Optional[bytes] = None) -> Optional[EditSite]:
        if data is None:
            if not files.exists(relative):
                return None
            data = files.data(relative)
        return locate(bug, data, files.path(relative))

    return site


def methods(site: EditSite) -> list:
    """The class's methods the change edits, in file order (the plugin recompiles these)."""
    return list(dict.fromkeys(e.kind for e in site.edits))
