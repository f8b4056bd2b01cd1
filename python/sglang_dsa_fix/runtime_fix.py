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
    ``get_alloc_page_size()`` where it has one (0.5.19+, page x attn_dcp_size); where the sizing
    module is allocation_sizing without it, the allocator's page (page x dcp_size under DCP) from
    the server args the sizing function is called with (0.5.16 - 0.5.17) or, called with none,
    from sglang's runtime context (0.5.18); 1 before (0.5.13 - 0.5.15, mem_cache/common.py: no
    rounding)."""
    own = getattr(module, "get_alloc_page_size", None)
    if own is not None:
        return int(own(*args, **kwargs))
    if not module.__name__.endswith("allocation_sizing"):
        return 1
    if args or "server_args" in kwargs:
        return width.alloc_page_size(args[0] if args else kwargs["server_args"])
    from sglang.srt.runtime_context import get_parallel, get_schedule

    return width.alloc_page_in_context(get_schedule, get_parallel)


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
    (the resolution child, the CPU driver): without them a CPU process computes the allocator
    page as 1 x page_size where the server pages page_size x dcp_size. Held for the block and
    restored after, the way each release lets a test set them:
    - 0.5.19 reads ``attn_dcp_size`` from a stamp that ``initialize_model_parallel`` takes when
      it builds the groups (0.5.19 distributed/parallel_state.py:2517-2525, :2737;
      runtime_context.py:181 ``dcp_size if dcp_enabled else 1``), else from the live group:
      stamped here the same way, cleared after;
    - 0.5.20+ derive it from the published configuration (runtime_context ``attn_dcp_size_of``):
      nothing to do;
    - 0.5.16 - 0.5.18 read the live group (0.5.18 runtime_context.py:243-256): sglang's own
      scoped ``ParallelContext.override`` (:157-169) stands in for it.
    A no-op where the release has no runtime context or no such field (0.5.15 and older)."""
    try:
        from sglang.srt import runtime_context

        parallel = runtime_context.get_parallel()
    except (ImportError, AttributeError, RuntimeError, ValueError):
        yield
        return
    enabled = dcp_size > 1
    widths = {"dcp_enabled": enabled, "attn_dcp_size": dcp_size if enabled else 1}
    if hasattr(parallel, "stamp_derived_widths"):
        parallel.stamp_derived_widths(**widths)
        try:
            yield
        finally:
            parallel.clear_derived_widths()
        return
    with contextlib.ExitStack() as stack:
        if not hasattr(runtime_context, "attn_dcp_size_of"):
            with contextlib.suppress(AttributeError, ValueError):  # no such fields (0.5.15)
                stack.enter_context(parallel.override(**widths))
        yield


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
