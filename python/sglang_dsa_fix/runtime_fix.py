"""Runtime form of the fix: widen the graph page_table right after init_cuda_graph_state.

For images whose sglang files cannot be edited. ``install()`` is a plain class patch (tests,
the demo, releases without the plugin API); ``plugin.py`` hooks the same ``width.enforce``
through sglang's HookRegistry.
"""

from __future__ import annotations

import functools

from sglang_dsa_fix import width
from sglang_dsa_fix.backends import import_backend_class

_WRAPPED_MARK = "__sglang_dsa_fix_original__"


def install(cls=None):
    """Wrap ``cls.init_cuda_graph_state`` (default: the installed release's backend class).

    Idempotent. The multi-step draft backend calls each sub-backend's method through the
    class (dsa_backend.py:2568-2570 in 0.5.14), so one class patch covers target,
    draft-extend and draft-decode backends. Returns the patched class, or None when sglang
    has no DSA/NSA backend.
    """
    if cls is None:
        _, cls = import_backend_class()
        if cls is None:
            return None
    original = cls.__dict__["init_cuda_graph_state"]
    if hasattr(original, _WRAPPED_MARK):
        return cls

    @functools.wraps(original)
    def init_cuda_graph_state(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        width.enforce(self)
        return result

    setattr(init_cuda_graph_state, _WRAPPED_MARK, original)
    cls.init_cuda_graph_state = init_cuda_graph_state
    return cls


def uninstall(cls=None) -> None:
    """Undo ``install`` (tests and the demo run pristine and fixed in one process)."""
    if cls is None:
        _, cls = import_backend_class()
        if cls is None:
            return
    current = cls.__dict__["init_cuda_graph_state"]
    original = getattr(current, _WRAPPED_MARK, None)
    if original is not None:
        cls.init_cuda_graph_state = original


def is_installed(cls) -> bool:
    return hasattr(cls.__dict__["init_cuda_graph_state"], _WRAPPED_MARK)
