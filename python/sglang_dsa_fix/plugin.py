"""SGLang general plugin (entry point group ``sglang.srt.plugins``, sglang 0.5.11+).

``load_plugins()`` calls ``register()`` in the launch process and first thing in every
scheduler process (0.5.14 managers/scheduler.py:4181, entrypoints/engine.py:204), where the
model runner builds its attention backends. ``register`` hooks the backend class's
``init_cuda_graph_state`` through sglang's own HookRegistry (AFTER hook; the registry applies
it when the plugins have run). It never raises into sglang.

Kill switch: ``SGLANG_DSA_FIX=0``. ``SGLANG_PLUGINS`` (sglang's own allow-list) applies as for
any plugin; this one is named ``dsa_page_table_width``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sglang_dsa_fix")

ENTRY_POINT_NAME = "dsa_page_table_width"
KILL_SWITCH = "SGLANG_DSA_FIX"

_widen_logged = False


def enabled() -> bool:
    return os.environ.get(KILL_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _after_init_cuda_graph_state(result, backend, *args, **kwargs):
    """AFTER hook: ``hook(result, self, max_bs, max_num_tokens)``; returns None (keep result)."""
    global _widen_logged
    from sglang_dsa_fix import width

    table = width.graph_page_table(backend)
    old = None if table is None else table.shape[1]
    if width.enforce(backend) and not _widen_logged:
        _widen_logged = True
        # Logged here rather than in register(): scheduler logging is configured by now.
        logger.info(
            "sglang-dsa-fix: CUDA-graph page_table widened from %d to %d columns (req_to_token)",
            old,
            width.required_width(backend),
        )


def decide() -> tuple[str, str | None]:
    """(state, hook target). state is the text of the INFO line; target None = do not hook."""
    if not enabled():
        return f"disabled ({KILL_SWITCH}=0)", None
    from sglang_dsa_fix import source_patch

    tree = source_patch.find_tree(None)
    found = source_patch.find_backend_file(tree)
    if found is None:
        return f"unsupported (sglang {tree.version} has no DSA/NSA backend)", None
    layout = found[0]
    target = f"{layout.module}.{layout.class_name}.init_cuda_graph_state"
    try:
        verdict = source_patch.inspect(tree).verdict
    except source_patch.PatchError:
        verdict = None  # unrecognised source: the hook is a no-op where the width is right
    if verdict is source_patch.Verdict.FIXED_UPSTREAM:
        return "not needed (fixed upstream)", None
    if verdict is source_patch.Verdict.FIXED_IN_TREE:
        return "not needed (fixed in-tree by `sglang-dsa-fix apply`)", None
    return "applied", target


def register() -> None:
    """Entry point. Any failure: one warning line, sglang untouched."""
    try:
        state, target = decide()
        if target is not None:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register(target, _after_init_cuda_graph_state, HookType.AFTER)
            state = f"{state} (AFTER hook on {target})"
    except Exception as exc:  # never break sglang's start-up
        logger.warning("sglang-dsa-fix: unsupported (%s: %s); sglang untouched", type(exc).__name__, exc)
        return
    logger.info("sglang-dsa-fix: %s", state)
