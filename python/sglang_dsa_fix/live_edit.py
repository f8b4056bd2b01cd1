"""The in-tree change of bug #3's relatives, compiled into the live class (the plugin's form).

``graph_tables.locate`` finds the edits in the backend's file; ``patched_methods`` compiles that
file twice, as it is and with the edits applied, the way the import system compiles a module
(``compile(source, path, "exec", dont_inherit=True)``: the class bodies too, so private names are
mangled and ``super()`` has its ``__class__`` cell as in the class). Each edited method's code of
the file as it is must equal the code sglang loaded (``cls.__dict__[name].__code__``): otherwise
what runs is not that file (unchecked-hash bytecode of another source, an edit since the import,
a decorator) and nothing is replaced. The patched method is then a new function of the patched
code object with the loaded function's globals, closure, defaults and annotations: nothing of the
file is evaluated, and the code that runs is the code sglang loaded with the one substitution
``apply`` would write.

Refused (``LiveEditError``, the plugin then leaves sglang untouched and says why in its state).
"""

from __future__ import annotations

import ast
import linecache
import types

from sglang_dsa_fix import graph_tables
from sglang_dsa_fix.pysource import EditSite, Unclear, first_line, kept, kept_method, parse


class LiveEditError(RuntimeError):
    pass


def _named(code: types.CodeType, node, where: str) -> types.CodeType:
    """The code object of the definition ``node`` (an ``ast`` class or function) directly in
    ``code`` (a module's or class body's): its name, at its first line."""
    first = first_line(node)
    found = [
        c
        for c in code.co_consts
        if isinstance(c, types.CodeType) and c.co_name == node.name and c.co_firstlineno == first
    ]
    if len(found) != 1:
        raise LiveEditError(f"{where}: {len(found)} definitions of {node.name} at line {first}, not one")
    return found[0]


def _method_code(module_code: types.CodeType, kept_nodes: tuple, where: str):
    cls, method = kept_nodes
    return _named(_named(module_code, cls, where), method, f"{where}: {cls.name}")


def _kept(site: EditSite, class_name: str, method_name: str) -> tuple:
    """(class, method) nodes Python keeps in the site's file (``pysource.kept``): the code
    compiled is the definition the import binds, not an earlier one of the same name."""
    module = parse(site.path, site.data)
    try:
        cls = kept(module.body, class_name, ast.ClassDef)
        method = cls and kept_method(module, cls, method_name)
    except Unclear as exc:
        raise LiveEditError(f"{class_name}.{method_name}: {exc}") from None
    if method is None:
        raise LiveEditError(f"{site.path}: no {class_name}.{method_name}")
    return cls, method


def patched_methods(site: EditSite, module: types.ModuleType) -> dict:
    """{(class name, method name): function} for each method the site's edits touch; ``module``
    is the live module sglang imported from that file. LiveEditError where a method's loaded
    code is not the file's."""
    where = str(site.path)
    try:
        pristine = compile(site.data, where, "exec", dont_inherit=True)
        # Compiled under a name of its own whose lines (linecache) are the patched file's:
        # tracebacks and ``inspect.getsource`` show the code that runs, at the file's own lines.
        source = site.patched_bytes()
        filename = f"{site.path} (patched in memory by sglang-dsa-fix)"
        patched = compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        raise LiveEditError(f"{where} does not compile ({exc})") from None
    text = source.decode("utf-8", "replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    out = {}
    for class_name, method_name in graph_tables.methods(site):
        cls = getattr(module, class_name, None)
        live = vars(cls).get(method_name) if isinstance(cls, type) else None
        if not isinstance(live, types.FunctionType):
            raise LiveEditError(f"{module.__name__}: no plain function {class_name}.{method_name}")
        nodes = _kept(site, class_name, method_name)
        if live.__code__ != _method_code(pristine, nodes, where):
            raise LiveEditError(
                f"{class_name}.{method_name}: the code sglang loaded is not {where}'s (bytecode of "
                "another source, or the file changed since); not replaced"
            )
        code = _method_code(patched, nodes, where)  # (the edits change no line count)
        if code.co_freevars != live.__code__.co_freevars:
            raise LiveEditError(f"{class_name}.{method_name}: the change alters its closure")
        function = types.FunctionType(
            code, live.__globals__, method_name, live.__defaults__, live.__closure__
        )
        function.__kwdefaults__ = None if live.__kwdefaults__ is None else dict(live.__kwdefaults__)
        function.__annotations__ = live.__annotations__
        function.__dict__.update(live.__dict__)
        function.__doc__ = live.__doc__
        function.__qualname__ = live.__qualname__
        function.__module__ = live.__module__
        out[(class_name, method_name)] = function
    return out
