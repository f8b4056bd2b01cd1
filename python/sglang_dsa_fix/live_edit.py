"""The in-tree change of bug #3's relatives, compiled into the live class (the plugin's form).

``graph_tables.locate`` finds the edits in the backend's file; ``patched_methods`` applies them to
the file's bytes, parses the result and compiles each edited method on its own, with the
module's globals and the class as ``__class__`` (so ``super()`` works as in the class body). The
plugin then runs these functions in place of sglang's (REPLACE hooks through sglang's
HookRegistry): the code that runs is sglang's own, with the one substitution ``apply`` would write.

Refused (``LiveEditError``, the plugin then leaves sglang untouched): a decorated method, or one
that uses a private ``__name`` (compiled outside the class body, it would not be mangled).
"""

from __future__ import annotations
import __future__

import ast
import linecache
import types

from sglang_dsa_fix import graph_tables
from sglang_dsa_fix.pysource import EditSite


class LiveEditError(RuntimeError):
    pass


_FACTORY = "def _sglang_dsa_fix_method(__class__):\n    pass\n"


def _private_names(node: ast.AST) -> list:
    names = {getattr(n, "attr", None) or getattr(n, "id", None) for n in ast.walk(node)}
    return sorted(n for n in names if n and n.startswith("__") and not n.endswith("__"))


def patched_methods(site: EditSite, module: types.ModuleType) -> dict:
    """{(class name, method name): function} for each method the site's edits touch, compiled
    from the site's file with the edits applied; ``module`` is the live module of that file."""
    source = site.patched_bytes()
    tree = ast.parse(source, filename=str(site.path))
    # The file's own future imports (``annotations``: its annotations stay unevaluated).
    flags = 0
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            for alias in statement.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    # Compiled under a name of its own whose lines (linecache) are the patched file's: tracebacks
    # and ``inspect.getsource`` show the code that runs, at the file's own line numbers.
    filename = f"{site.path} (patched in memory by sglang-dsa-fix)"
    text = source.decode("utf-8", "replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out = {}
    for class_name, method_name in graph_tables.methods(site):
        cls = getattr(module, class_name, None)
        node = classes.get(class_name)
        method = node and next(
            (m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == method_name), None
        )
        if cls is None or method is None:
            raise LiveEditError(f"{site.path}: no {class_name}.{method_name}")
        if method.decorator_list:
            raise LiveEditError(f"{class_name}.{method_name} is decorated")
        private = _private_names(method)
        if private:
            raise LiveEditError(f"{class_name}.{method_name} uses private names {private}")
        factory = ast.parse(_FACTORY).body[0]
        factory.body = [method, ast.Return(ast.Name(method.name, ast.Load()))]
        wrapper = ast.Module([factory], type_ignores=[])
        ast.fix_missing_locations(wrapper)
        code = compile(wrapper, filename, "exec", flags=flags, dont_inherit=True)
        factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
        function = types.FunctionType(factory_code, vars(module))(cls)
        function.__qualname__ = f"{cls.__qualname__}.{method_name}"
        function.__module__ = module.__name__
        out[(class_name, method_name)] = function
    return out
