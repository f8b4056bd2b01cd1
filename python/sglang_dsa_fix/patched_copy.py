"""Load the backend class from a temporary copy of the installed sglang with the in-tree patch.

Lets the tests and the demo run pristine, runtime-fixed and in-tree-patched backends side by
side in one process while the installed sglang stays untouched: the patched file is loaded as
a module of its own; its absolute ``sglang.*`` imports resolve to the installed release.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from sglang_dsa_fix import source_patch


@contextlib.contextmanager
def patched_backend_class():
    """Yield (backend class, apply message) from a patched copy; the copy is deleted after."""
    installed = source_patch.find_tree(None)
    with tempfile.TemporaryDirectory(prefix="sglang-dsa-fix-") as tmp:
        shutil.copytree(
            installed.package_parent / "sglang",
            Path(tmp) / "sglang",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        tree = source_patch.find_tree(tmp)
        message = source_patch.apply(tree)
        site = source_patch.locate(tree)
        name = f"{site.layout.module}__sglang_dsa_fix_patched"
        spec = importlib.util.spec_from_file_location(name, site.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
            yield getattr(module, site.layout.class_name), message
        finally:
            sys.modules.pop(name, None)
