"""Runtime form of bugs #1 and #2's fixes (bug #3's: ``fa3_width.enforce``), for files that cannot be edited.

- bug #1: right after ``init_cuda_graph_state``, widen the graph page_table (``width.enforce``);
- bug #2: right after ``get_req_to_token_extra_context_len``, raise the row headroom to
  ``width.row_extra_floor`` of sglang's own ``get_alloc_reserve_per_decode``, the whole
  reservation and the allocator page's rounding (the place
  upstream widened it in 0.5.16, so the pool, the bug #1 buffer and every graph buffer sized
  from ``req_to_token`` stay consistent).

``plugin.py`` registers these through sglang's HookRegistry; ``install_page_table_fix`` is a
plain class patch for the tests, the demo and releases without the plugin API.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

from sglang_dsa_fix import release, width

_WRAPPED_MARK = "__sglang_dsa_fix_original__"


def row_extra_fix(module_name: str):
    """AFTER-hook body for ``<module_name>.get_req_to_token_extra_context_len``.

    Called as ``hook(result, *args, **kwargs)`` with the function's own arguments (0.5.13 -
    0.5.16 pass ``server_args``, 0.5.23 none), which ``get_alloc_reserve_per_decode`` of the
    same module takes too. Returns the widened headroom.
    """

    def after(result, *args, **kwargs):
        module = importlib.import_module(module_name)
        reserve = getattr(module, release.RESERVE_FUNCTION)(*args, **kwargs)
        return max(result, width.row_extra_floor(reserve, _alloc_page(module, args, kwargs)))

    return after


def _alloc_page(module, args, kwargs) -> int:
    """The allocator page the release's prepare rounds ``nxt`` up to: sglang's own
    ``get_alloc_page_size()`` where it has one (0.5.19+, page x attn_dcp_size); from the server
    args where the sizing module is allocation_sizing (0.5.16 - 0.5.17 round by the allocator's
    page, page x dcp_size under DCP); 1 before (0.5.13 - 0.5.15, mem_cache/common.py: no rounding).
    0.5.18's sizing takes no argument and has no ``get_alloc_page_size``: 1 there, so under decode
    context parallel this fix holds the reservation without the page's rounding (not yet covered)."""
    own = getattr(module, "get_alloc_page_size", None)
    if own is not None:
        return int(own(*args, **kwargs))
    if not module.__name__.endswith("allocation_sizing"):
        return 1
    return width.alloc_page_size(args[0] if args else kwargs.get("server_args"))


def sizing_module():
    """The imported sglang module holding the row sizing function
    (``release.ROW_SIZING_FILES``); None where the release sizes the row inline (0.5.9 - 0.5.12)."""
    for relative in release.ROW_SIZING_FILES:
        name = "sglang." + relative.removesuffix(".py").replace("/", ".")
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, release.ROW_SIZING_FUNCTION):
            return module
    return None


@contextlib.contextmanager
def dcp_group_widths(dcp_size: int):
    """The decode-context-parallel widths a server's process groups give, where no group is built
    (the resolution child, the CPU driver). 0.5.19 reads ``attn_dcp_size`` from a stamp that
    ``initialize_model_parallel`` takes when it builds the groups (0.5.19
    distributed/parallel_state.py:2517-2525, :2737; runtime_context.py:181 ``dcp_size if
    dcp_enabled else 1``, the DCP group existing iff dcp_size > 1), else from the live group;
    without either, the server's allocator page (``get_alloc_page_size``) is not what a CPU
    process computes. Stamped here the same way and cleared after; a no-op on releases that
    derive the width from the configuration (0.5.20+) or have no stamp (before 0.5.19)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        stamp, clear = parallel.stamp_derived_widths, parallel.clear_derived_widths
    except (ImportError, AttributeError, RuntimeError, ValueError):
        yield
        return
    enabled = dcp_size > 1
    stamp(dcp_enabled=enabled, attn_dcp_size=dcp_size if enabled else 1)
    try:
        yield
    finally:
        clear()


def install_page_table_fix(cls):
    """Wrap ``cls.init_cuda_graph_state`` so the graph page_table is as wide as req_to_token.

    Idempotent. The multi-step draft backend calls each sub-backend's method through the
    class (dsa_backend.py:2568-2570 in 0.5.14), so one class patch covers target,
    draft-extend and draft-decode backends.
    """
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


def uninstall_page_table_fix(cls) -> None:
    """Undo ``install_page_table_fix`` (tests and the demo run pristine and fixed in one process)."""
    original = getattr(cls.__dict__["init_cuda_graph_state"], _WRAPPED_MARK, None)
    if original is not None:
        cls.init_cuda_graph_state = original


def page_table_fix_installed(cls) -> bool:
    return hasattr(cls.__dict__["init_cuda_graph_state"], _WRAPPED_MARK)
