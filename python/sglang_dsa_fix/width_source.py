"""Does a width in sglang's source hold ``req_to_token``'s row? Judged by what it evaluates to.

Upstream fixes a width in its own spelling: ``self.req_to_token.shape[1]`` (#29379, DSA's
``max_ctx_len = self.req_to_token.shape[1]``), an attribute set from it in ``__init__`` (PR
#29665's ``req_to_token_capacity_len``), a helper method returning it; or widens it by less
than the row (PR #35985's ``+ D``). Rather than a list of spellings, ``judge`` evaluates the
expression over made-up sizes (``SAMPLES``: a row wider than context_len by more than D, page
sizes 1 and larger) with the class's own code resolving its names: a local from its one
assignment above, ``self.<attr>`` from its one assignment in ``__init__``, ``self.<method>()``
or a property from the method's ``return``. sglang's inputs are the only givens
(``self.max_context_len``, ``self.page_size``, ``self.req_to_token``, the draft token count,
``__init__``'s ``model_runner``). What does not evaluate this way is ``UNKNOWN``: the caller
says it cannot tell. Nothing is imported or run; no torch, no sglang.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

HOLDS = "holds"  # at least the row at every sample
NARROW = "narrow"  # evaluates, and is narrower than the row at some sample
UNKNOWN = "unknown"  # does not evaluate from the class's own code

TOKENS, PAGES = "tokens", "pages"  # the unit of the width judged


@dataclass(frozen=True)
class Sample:
    context_len: int
    row: int  # req_to_token.shape[1]: context_len + the row headroom, which exceeds D (+ 4 at least)
    page: int
    draft: int


# context_len a multiple of the page, so a page rounding of context_len never reaches the row.
SAMPLES = (Sample(4096, 4120, 1, 8), Sample(4096, 4120, 64, 8), Sample(1024, 1038, 16, 3))

_CEIL_DIV = ("cdiv", "ceil_div", "div_up")  # triton.cdiv, sglang's utils.ceil_div
_BUILTINS = {"max": max, "min": min, "int": int, "abs": abs}
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: a / b,
}
_DEPTH = 24


class _Unknown(Exception):
    pass


class _Tensor:
    def __init__(self, row: int):
        self.shape = (7, row)

    def size(self, dim: int) -> int:
        return self.shape[dim]


class _Self:
    """``self`` of the class judged (its attributes: ``_Evaluator.attribute``)."""


def judge(expr: ast.expr, cls: ast.ClassDef, method: Optional[ast.FunctionDef], unit: str) -> str:
    """HOLDS, NARROW or UNKNOWN for ``expr``, written in ``method`` of ``cls``; ``unit``:
    TOKENS (at least the row) or PAGES (at least the row's pages at the sample's page size)."""
    for sample in SAMPLES:
        try:
            value = _Evaluator(cls, sample).value(expr, method, 0)
        except (_Unknown, ArithmeticError, AttributeError, TypeError, IndexError, ValueError):
            return UNKNOWN
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return UNKNOWN
        need = sample.row if unit == TOKENS else -(-sample.row // sample.page)
        if value < need:
            return NARROW
    return HOLDS


class _Evaluator:
    def __init__(self, cls: ast.ClassDef, sample: Sample):
        # Each name's last definition (the class was located by ``pysource.kept``: Python's).
        self.methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        s = sample
        self.given = {
            "max_context_len": s.context_len,
            "page_size": s.page,
            "req_to_token": _Tensor(s.row),
            "num_draft_tokens": s.draft,
            "speculative_num_draft_tokens": s.draft,
        }
        self.model_runner = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=_Tensor(s.row)),
            model_config=SimpleNamespace(context_len=s.context_len),
            page_size=s.page,
            server_args=SimpleNamespace(speculative_num_draft_tokens=s.draft, page_size=s.page),
        )

    def value(self, node, method, depth: int):
        if depth > _DEPTH:
            raise _Unknown()
        depth += 1
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            return self.name(node, method, depth)
        if isinstance(node, ast.Attribute):
            owner = self.value(node.value, method, depth)
            if isinstance(owner, _Self):
                return self.attribute(node.attr, depth)
            if node.attr.startswith("_") or not hasattr(owner, node.attr):
                raise _Unknown()
            return getattr(owner, node.attr)
        if isinstance(node, ast.Subscript):
            return self.value(node.value, method, depth)[self.value(node.slice, method, depth)]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = self.value(node.left, method, depth), self.value(node.right, method, depth)
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self.value(node.operand, method, depth)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            values = [self.value(v, method, depth) for v in node.values]
            return next((v for v in values if v), values[-1])
        if isinstance(node, ast.IfExp):  # either branch may run: the narrower decides
            return min(self.value(node.body, method, depth), self.value(node.orelse, method, depth))
        if isinstance(node, ast.Call) and not node.keywords:
            return self.call(node, method, depth)
        raise _Unknown()

    def call(self, node: ast.Call, method, depth: int):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            return self.returned(self.method(name), node.args, depth)
        args = [self.value(arg, method, depth) for arg in node.args]
        if isinstance(func, ast.Name) and name in _BUILTINS:
            return _BUILTINS[name](*args)
        if name in _CEIL_DIV and len(args) == 2:
            return -(-args[0] // args[1])
        if name == "ceil" and len(args) == 1:  # math.ceil
            return math.ceil(args[0])
        if name == "size" and isinstance(func, ast.Attribute):
            return self.value(func.value, method, depth).size(*args)
        raise _Unknown()

    def name(self, node: ast.Name, method, depth: int):
        if node.id == "self":
            return _Self()
        if method is not None:
            if method.name == "__init__" and node.id == "model_runner":
                return self.model_runner
            assigned = _one_assignment(method, lambda t: isinstance(t, ast.Name) and t.id == node.id)
            if assigned is not None and assigned.lineno < node.lineno:
                return self.value(assigned.value, method, depth)
        if node.id == "math":
            return math
        raise _Unknown()

    def attribute(self, attr: str, depth: int):
        """``self.<attr>``: sglang's given, a property, or its one assignment in ``__init__``."""
        if attr in self.given:
            return self.given[attr]
        prop = self.methods.get(attr)
        if prop is not None and any(ast.unparse(d) == "property" for d in prop.decorator_list):
            return self.returned(prop, [], depth)
        storing = [m for m in self.methods.values() if _stores(m, attr)]
        init = self.methods.get("__init__")
        assigned = init and _one_assignment(init, lambda t: _is_self_attr(t, attr))
        if storing != [init] or assigned is None:
            raise _Unknown()  # not set, set elsewhere too, more than once, or not plainly
        return self.value(assigned.value, init, depth)

    def method(self, name: str):
        if name not in self.methods:
            raise _Unknown()
        return self.methods[name]

    def returned(self, method: ast.FunctionDef, args: list, depth: int):
        """What a helper method without arguments returns: its body is assignments to names and
        one final ``return``."""
        body = [n for n in method.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        simple = all(isinstance(n, ast.Assign) and len(n.targets) == 1 for n in body[:-1])
        if args or len(method.args.args) != 1 or not body or not simple:
            raise _Unknown()
        last = body[-1]
        if not isinstance(last, ast.Return) or last.value is None:
            raise _Unknown()
        return self.value(last.value, method, depth)


def _is_self_attr(target, attr: str) -> bool:
    return (
        isinstance(target, ast.Attribute)
        and target.attr == attr
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


def _stores(method: ast.FunctionDef, attr: str) -> bool:
    """Does ``method`` store ``self.<attr>`` at all (any statement)?"""
    return any(
        _is_self_attr(node, attr) and isinstance(node.ctx, (ast.Store, ast.Del)) for node in ast.walk(method)
    )


def _one_assignment(method: ast.FunctionDef, is_target) -> Optional[ast.Assign]:
    """The one plain ``target = value`` in ``method`` whose target ``is_target``; None where the
    name is stored another way too (augmented, unpacked, in a loop) or more than once."""
    stores = [
        node
        for node in ast.walk(method)
        if is_target(node) and isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
    ]
    plain = [
        node
        for node in ast.walk(method)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and is_target(node.targets[0])
    ]
    return plain[0] if len(plain) == 1 and len(stores) == 1 else None
