"""Where each sglang release keeps its DSA/NSA attention backend.

Found by layout, not by version string, so patched forks and release candidates work too:
- 0.5.13+: layers/attention/dsa_backend.py, class DeepseekSparseAttnBackend
  (0.5.13 - 0.5.20 also ship nsa_backend.py as a re-export shim: skipped, it has no class body);
- 0.5.3 - 0.5.12: layers/attention/nsa_backend.py, class NativeSparseAttnBackend.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

ATTENTION_DIR = ("sglang", "srt", "layers", "attention")


@dataclass(frozen=True)
class BackendLayout:
    module: str  # dotted module name
    class_name: str
    multi_step_class_name: str

    @property
    def filename(self) -> str:
        return self.module.rsplit(".", 1)[1] + ".py"


# Newest first: the first layout whose file defines the class wins.
LAYOUTS = (
    BackendLayout(
        "sglang.srt.layers.attention.dsa_backend",
        "DeepseekSparseAttnBackend",
        "DeepseekSparseAttnMultiStepBackend",
    ),
    BackendLayout(
        "sglang.srt.layers.attention.nsa_backend",
        "NativeSparseAttnBackend",
        "NativeSparseAttnMultiStepBackend",
    ),
)


def import_backend_class(layout: BackendLayout | None = None):
    """Import the installed backend class (importing sglang). Returns (layout, class) or (None, None)."""
    for candidate in (layout,) if layout else LAYOUTS:
        try:
            module = importlib.import_module(candidate.module)
        except ImportError:
            continue
        cls = module.__dict__.get(candidate.class_name)
        # The 0.5.13+ nsa shim re-exports dsa classes under old names: only a class
        # defined in that very module counts, so the shim never shadows the real one.
        if isinstance(cls, type) and cls.__module__ == candidate.module:
            return candidate, cls
    return None, None
