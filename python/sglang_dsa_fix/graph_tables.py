"""Bug #3's relatives: the rule and the locator of their in-tree change (their widths: ``width``).

TRT-LLM MHA, TRT-LLM MLA, FlashMLA and MiniMax sparse NVFP4 size a CUDA-graph table from
``self.max_context_len`` (``backend_layouts.GRAPH_TABLE_LAYOUTS`` has each one's expression), while a
target_verify near the context limit asks the kernel for ``seq_len + D`` keys and speculative
decoding lets ``seq_len`` pass context_len (``width.verify_seq_len_bound``). Measured on the real
classes: each reads past its table at sglang's own sizes (docs/graph-tables-other-backends.md).
TRT-LLM MLA (0.5.13 - 0.5.16) and FlashMLA (0.5.16) also size their verify tree mask from it,
which the tree builder writes past once every request of the largest batch is there (D >= 5).

The rule, as for FA3 (``fa3_width``) and bug #1: the table covers ``req_to_token``'s row. Here it
is one substitution inside sglang's own width expression: ``self.max_context_len`` becomes
the row's width as the class holds it (``self.req_to_token.shape[1]``; the Triton draft backend's
``self.pool_len``), so each backend keeps its own rounding (TRT-LLM MLA's padded
blocks, FlashMLA's spare page). The in-tree change writes it (``locate``: byte ranges, no stored
source); the plugin compiles the same edits into the live class (``live_edit``). Pure: no torch,
no sglang.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import backend_layouts, width_source
from sglang_dsa_fix.pysource import Edit, EditSite, Unclear, by_source, byte_offset, kept, kept_method, parse
from sglang_dsa_fix.verdicts import Bug
from sglang_dsa_fix.width_source import HOLDS

REPLACED = "self.max_context_len"

LAYOUTS = {Bug(layout.key): layout for layout in backend_layouts.GRAPH_TABLE_LAYOUTS}


def affected_when(layout: backend_layouts.GraphTableLayout) -> str:
    chosen = f"--attention-backend {' / '.join(layout.backends)}" if layout.backends else "the model picks it"
    if layout.reach == "batch":
        return (
            f"where {layout.name} ({chosen}) runs speculative decoding: once every request of the "
            "largest batch is near context_len, its verify and draft decode read (and write) past "
            "these buffers"
        )
    return (
        f"where {layout.name} ({chosen}) runs a speculative verify or draft decode in CUDA graphs: "
        "near context_len the kernel reads past the graph table"
    )


# What a width expression's ``self.max_context_len`` holds, as found: sglang's (the edit to
# make), the rule's spelling (this tool's change, or upstream's in the same words), or another
# spelling that evaluates to at least the row (``width_source``: upstream's fix).
PENDING, DONE, HELD = "pending", "done", "held"


def _template(expr: str) -> ast.AST:
    """A width expression as a tree (``name=value``: the keyword)."""
    if "=" in expr.split("(")[0]:
        return ast.parse(f"f({expr})", mode="eval").body.keywords[0]
    return ast.parse(expr, mode="eval").body


def _holes(node: ast.AST, template: ast.AST) -> Optional[list]:
    """The sub-expressions of ``node`` where ``template`` has ``self.max_context_len``, if
    ``node`` is ``template`` everywhere else; None if it is not."""
    if isinstance(template, ast.Attribute) and ast.unparse(template) == REPLACED:
        return [node] if isinstance(node, ast.expr) else None
    if type(node) is not type(template):
        return None
    holes = []
    for field, want in ast.iter_fields(template):
        have = getattr(node, field, None)
        wants, haves = (want, have) if isinstance(want, list) else ([want], [have])
        if not isinstance(haves, list) or len(haves) != len(wants):
            return None
        for w, h in zip(wants, haves):
            if isinstance(w, ast.expr_context):
                continue
            found = _holes(h, w) if isinstance(w, ast.AST) and isinstance(h, ast.AST) else None
            if found is None and w != h:
                return None
            holes += found or []
    return holes


def _width_nodes(module: ast.Module, cls: ast.ClassDef, exprs: tuple, row_width: str) -> list:
    """(method, node, hole, PENDING | DONE | HELD) of each width expression in the methods
    Python keeps of the class. ``Unclear`` where which definition runs is not. Kept on the
    class's node: ``pysource.parse`` hands out one tree per content, and matching every
    expression of the class was most of an apply / revert run's time."""
    memo = cls.__dict__.setdefault("_sglang_dsa_fix_width_nodes", {})
    key = (tuple(exprs), row_width)
    if key not in memo:
        memo[key] = _scan_width_nodes(module, cls, exprs, row_width)
    return list(memo[key])


def _scan_width_nodes(module: ast.Module, cls: ast.ClassDef, exprs: tuple, row_width: str) -> tuple:
    templates = [_template(e) for e in exprs]
    found = []
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        in_method = []
        for node in ast.walk(method):
            if not isinstance(node, (ast.expr, ast.keyword)):
                continue
            holes = [h for t in templates for h in _holes(node, t) or ()]
            # sglang's or the rule's spelling first: the fixed verify mask is also ``max_num_tokens
            # * <a width that holds the row>``, one of Triton's forms.
            hole = next((h for h in holes if ast.unparse(h) in (REPLACED, row_width)), None)
            if hole is not None:
                in_method.append(
                    (method.name, node, hole, PENDING if ast.unparse(hole) == REPLACED else DONE)
                )
            elif holes and width_source.judge(holes[0], cls, method, width_source.TOKENS) == HOLDS:
                in_method.append((method.name, node, holes[0], HELD))
        if in_method and kept_method(module, cls, method.name) is method:
            found += in_method
    return tuple(found)


def _unknown_site(layout, class_name: str, cls, common: dict, why: str = "") -> EditSite:
    unknown = why or (
        f"{class_name} is not in this file"
        if cls is None
        else f"{class_name} sizes its buffers in a form this tool does not know (none of: "
        f"{'; '.join(layout.width_exprs)})"
    )
    return EditSite(edits=(), patched_here=False, unknown=unknown, **common)


def locate(bug: Bug, data: bytes, path: Path) -> EditSite:
    """The bug's edits in these bytes of the backend's file (each ``Edit.kind`` is
    ``Class.method``). ToolError if it does not parse. A class missing, or one without any of
    the known width expressions, makes this bug ``unknown`` (cannot tell) and nothing else: the
    other bugs' verdicts and fixes do not depend on this file's layout. Every width held by a
    spelling of upstream's own (``HELD``) and none of sglang's left: ``fixed_upstream``. The
    change carries no comment of this tool's (``marked`` False): only a backup shows who wrote
    it (``classify``)."""
    return _locate(LAYOUTS[bug], bug, data, path)


@by_source
def _locate(layout, bug: Bug, data: bytes, path: Path) -> EditSite:
    module = parse(path, data)
    lines = data.splitlines(keepends=True)
    common = dict(bug=bug, path=path, data=data, affected_when=affected_when(layout), marked=False)
    edits, texts, held = [], [], []
    for class_name, row_width in layout.classes:
        try:
            cls = kept(module.body, class_name, ast.ClassDef)
            nodes = _width_nodes(module, cls, layout.width_exprs, row_width) if cls is not None else []
        except Unclear as exc:
            return _unknown_site(layout, class_name, None, common, f"{class_name}: {exc}")
        if not nodes:
            return _unknown_site(layout, class_name, cls, common)
        for method, node, inner, state in nodes:
            if state == HELD:
                held.append((node.lineno, ast.unparse(node)))
                continue
            start = byte_offset(lines, inner.lineno, inner.col_offset)
            end = byte_offset(lines, inner.end_lineno, inner.end_col_offset)
            found = data[start:end].decode()
            edits.append(Edit(f"{class_name}.{method}", start, end, inner.lineno, found, row_width))
            texts.append((start, ast.unparse(node)))
    # Some edits done and the rest all of expressions the tool added later (still sglang's):
    # what the earlier sglang-dsa-fix wrote, which revert undoes from its backup.
    pending = [text for edit, (_, text) in zip(edits, texts) if not edit.done]
    legacy = not held and 0 < len(pending) < len(edits) and set(pending) <= set(layout.later)
    edits.sort(key=lambda e: e.start)
    return EditSite(
        edits=tuple(edits),
        patched_here=not held and (legacy or all(e.done for e in edits)),
        fixed_upstream=bool(held) and not pending,
        lineno=min([e.lineno for e in edits[:1]] + [line for line, _ in held[:1]]),
        found="; ".join(dict.fromkeys([*(text for _, text in sorted(texts)), *(t for _, t in held)])),
        legacy=legacy,
        **common,
    )


def legacy_detail(bug: Bug) -> str:
    """What ``check`` says of a file holding an earlier form of this bug's change."""
    layout = LAYOUTS[bug]
    return (
        f"an earlier sglang-dsa-fix form of this change (`{'`, `'.join(layout.later)}` left as "
        "sglang wrote it): run `sglang-dsa-fix revert` then `apply` to widen that too"
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
    """(class, method) of each method the change edits, in file order (the plugin recompiles
    these)."""
    return [tuple(kind.split(".")) for kind in dict.fromkeys(e.kind for e in site.edits)]
