"""Load the fixed code from a temporary copy of the installed sglang with the in-tree patch.

Lets the tests and the demo run pristine, runtime-fixed and in-tree-patched code side by side
in one process while the installed sglang stays untouched: each patched file is loaded as a
module of its own; its absolute ``sglang.*`` imports resolve to the installed release. The copy
holds the files the tool reads (``release.FILES_READ``), not the whole package: nothing else of
it is imported, and copying sglang's 3000 files took ~2 s a copy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from sglang_dsa_fix import release, sites, snapshot, source_patch
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.verdicts import Bug

# The bugs whose patched module is loaded here. Bug #3's flashattention_backend imports
# sgl_kernel at module import: loaded over the stand-in where it is absent
# (``fa3_backend.import_fa3_file``), and only when asked (``patched_copy(fa3=True)``).
LOADED = (Bug.PAGE_TABLE, Bug.ROW_OVERFLOW)


@dataclass
class PatchedCopy:
    outcome: source_patch.Outcome  # what apply did to the copy
    modules: dict  # Bug -> the patched module (only the bugs apply changed)
    backend_class: object = None  # bug #1: the patched backend class
    sizing_function: object = None  # bug #2: the patched get_req_to_token_extra_context_len
    fa3_module: object = None  # bug #3: the patched flashattention_backend (patched_copy(fa3=True))


def _load(path: Path, installed_name: str, bug: Bug):
    name = f"{installed_name}__sglang_dsa_fix_patched"
    if bug is Bug.FA3_PAGE_TABLE:
        from sglang_dsa_fix.proof.fa3_backend import import_fa3_file

        return import_fa3_file(path, name)[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _inline_sizing(site: sites.Site):
    """0.5.9 - 0.5.12: the row extra of the patched ``ModelRunner`` block as a function of the
    server args: sglang's own start (``4 + speculative_num_draft_tokens``, which the CPU tier
    finds in the installed source), then the lines ``apply`` wrote into the copy, executed."""
    line = site.path.read_text().splitlines()[site.lineno - 2]  # the statement apply put there
    code = compile(line.strip(), str(site.path), "exec")

    def sizing(server_args):
        variable = sites.release.INLINE_ROW_VARIABLE
        namespace = {"self": SimpleNamespace(server_args=server_args)}
        namespace[variable] = 4 + (server_args.speculative_num_draft_tokens or 0)
        exec(code, namespace)
        return namespace[variable]

    return sizing


@contextlib.contextmanager
def patched_copy(fa3: bool = False):
    """Yield a PatchedCopy of the installed sglang; the copy is deleted after. ``fa3``: load bug
    #3's patched module too (``PatchedCopy.fa3_module``)."""
    installed = trees.find_tree(None)
    with tempfile.TemporaryDirectory(prefix="sglang-dsa-fix-") as tmp:
        for relative in release.FILES_READ:
            source = installed.package / relative
            if source.is_file():
                target = Path(tmp) / "sglang" / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
        copy = trees.find_tree(tmp)
        outcome = source_patch.apply(copy)
        names = []
        try:
            modules = {}
            loaded = (*LOADED, Bug.FA3_PAGE_TABLE) if fa3 else LOADED
            for state in outcome.states:
                if state.bug not in loaded or (state.site is not None and not state.site.hookable):
                    continue  # (the row sized inline: below)
                if state.site is not None and state.site.path in outcome.changed:
                    relative = state.site.path.relative_to(copy.package_parent).with_suffix("")
                    installed_name = ".".join(relative.parts)
                    modules[state.bug] = _load(state.site.path, installed_name, state.bug)
                    names.append(modules[state.bug].__name__)
            patched = PatchedCopy(outcome, modules)
            files = snapshot.read(copy)  # as patched
            if Bug.PAGE_TABLE in modules:
                layout, _ = sites.backend_file(files)
                patched.backend_class = getattr(modules[Bug.PAGE_TABLE], layout.class_name)
            patched.fa3_module = modules.get(Bug.FA3_PAGE_TABLE)
            if Bug.ROW_OVERFLOW in modules:
                patched.sizing_function = modules[Bug.ROW_OVERFLOW].get_req_to_token_extra_context_len
            row = sites.row_site(files)
            if row is not None and not row.hookable and row.patched_here:
                patched.sizing_function = _inline_sizing(row)
            yield patched
        finally:
            for name in names:
                sys.modules.pop(name, None)
