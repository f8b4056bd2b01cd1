"""SGLang general plugin (entry point group ``sglang.srt.plugins``, sglang 0.5.11+).

``load_plugins()`` calls ``register()`` in the launch process and first thing in every
scheduler process (0.5.14 managers/scheduler.py:4181, entrypoints/engine.py:204), where the
model runner sizes its pools and builds its attention backends. ``register`` adds, through
sglang's own HookRegistry, AFTER hooks for each bug that is affected in this tree:

- bug #1: ``<Backend>.init_cuda_graph_state`` → widen the graph page_table;
- bug #2: ``get_req_to_token_extra_context_len`` → widen the req_to_token row;
- always: ``Scheduler.get_internal_state`` → this plugin's state under ``sglang_dsa_fix`` in
  ``/server_info`` (``internal_states``), so a live server shows what is running;
- opt-in (``SGLANG_DSA_FIX_WATCH=1``, kill switch or not): the family watch's AROUND hooks
  (``watch.py``), its counters under ``watch`` in that state and in ``report()``.

It never raises into sglang: a failing hook logs one warning and leaves sglang's own value.
``load_plugins()`` runs before sglang configures logging, so the state is logged again from
the first hook call in each scheduler process, where logging is set up.

Kill switch: ``SGLANG_DSA_FIX`` = 0 / false / no / off (any case) disables both fixes; 1 / true /
yes / on or unset enables them; any other value enables them too, with a warning in the log, and
the state (``kill_switch``) says which value was taken how.
``SGLANG_PLUGINS`` (sglang's own allow-list) applies as for any plugin; this one is named
``sglang_dsa_fix`` (and, for older allow-lists, ``dsa_page_table_width``).
"""

from __future__ import annotations

import copy
import logging
import os
import pkgutil

from sglang_dsa_fix import __version__, watch, width
from sglang_dsa_fix.verdicts import Bug, Verdict

logger = logging.getLogger("sglang_dsa_fix")

# The package's own name first; the old name stays for existing SGLANG_PLUGINS allow-lists.
# sglang calls register() once per entry point name: it is idempotent.
ENTRY_POINT_NAMES = ("sglang_dsa_fix", "dsa_page_table_width")
KILL_SWITCH = "SGLANG_DSA_FIX"
KILL_VALUES = ("0", "false", "no", "off")
ENABLE_VALUES = ("1", "true", "yes", "on", "")
INTERNAL_STATE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
STATE_KEY = "sglang_dsa_fix"

# What the plugin says for a bug it does not hook, by check verdict.
PLAN_STATE = {
    Verdict.FIXED_UPSTREAM.value: f"not needed ({Verdict.FIXED_UPSTREAM.value})",
    Verdict.FIXED_IN_TREE.value: f"not needed ({Verdict.FIXED_IN_TREE.value})",
    Verdict.NOT_APPLICABLE.value: Verdict.NOT_APPLICABLE.value,
    Verdict.NOT_COVERED.value: Verdict.NOT_COVERED.value,
}

# This process's state: what /server_info and the log lines report.
STATE = {"version": __version__, "pid": None, "kill_switch": None, "bugs": {}}
# The watch's hook targets, once registered; the start-up log line then says the watch is on
# (benchmarks look for WATCH_ON_LINE to know a variant really ran with it).
WATCH_HOOKS = []
WATCH_ON_LINE = "family watch on"
_said = set()  # one-time log lines already emitted in this process


def kill_switch_value() -> str:
    return os.environ.get(KILL_SWITCH, "")


def enabled(value: str | None = None) -> bool:
    value = kill_switch_value() if value is None else value
    return value.strip().lower() not in KILL_VALUES


def known_switch_value(value: str) -> bool:
    return value.strip().lower() in KILL_VALUES + ENABLE_VALUES


def kill_switch_text(value: str) -> str:
    """How a kill-switch value is taken, as the state and ``status`` say it."""
    if known_switch_value(value):
        return f"{KILL_SWITCH}={value!r}: {'enabled' if enabled(value) else 'disabled'}"
    return (
        f"{KILL_SWITCH}={value!r}: enabled (not a known value: 0 / false / no / off disable, "
        "1 / true / yes / on or unset enable)"
    )


def _once(key: str, level: int, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.log(level, message, *args)


def _summary() -> str:
    bugs = "; ".join(f"{bug}: {info['state']}" for bug, info in STATE["bugs"].items())
    hooks = len(WATCH_HOOKS)
    watching = f"; {WATCH_ON_LINE} ({hooks} hooks)" if hooks else ""
    return f"sglang-dsa-fix {__version__} (pid {os.getpid()}, {STATE['kill_switch']}): {bugs}{watching}"


def _set(bug: Bug, state: str, **extra) -> None:
    STATE["bugs"][bug.value] = {"state": state, **extra}


def _guarded(bug: Bug, body):
    """Run a hook body; on any failure: one warning, sglang's own result kept."""

    def hook(result, *args, **kwargs):
        try:
            value = body(result, *args, **kwargs)
        except Exception as exc:  # never break sglang
            _set(bug, f"failed ({type(exc).__name__}: {exc}); sglang's own value kept")
            _once(
                f"fail-{bug.value}",
                logging.WARNING,
                "sglang-dsa-fix: %s hook failed (%s: %s); sglang's own value kept",
                bug.value,
                type(exc).__name__,
                exc,
            )
            return None
        _once("summary", logging.INFO, "%s", _summary())
        return value

    return hook


def _page_table_body(result, backend, *args, **kwargs):
    changed = width.enforce(backend)
    info = STATE["bugs"][Bug.PAGE_TABLE.value]
    info["calls"] = info.get("calls", 0) + 1
    if changed:
        info.update(state="applied", widened=list(changed))
        _once(
            "widened",
            logging.INFO,
            "sglang-dsa-fix: CUDA-graph page_table widened from %d to %d columns (req_to_token)",
            *changed,
        )
    elif not info["state"].startswith("applied"):
        info["state"] = "applied (already as wide as req_to_token)"
    return None  # keep sglang's result


def _row_body_for(module_name: str):
    from sglang_dsa_fix.runtime_fix import row_extra_fix

    fix = row_extra_fix(module_name)

    def body(result, *args, **kwargs):
        extra = fix(result, *args, **kwargs)
        info = STATE["bugs"][Bug.ROW_OVERFLOW.value]
        info["calls"] = info.get("calls", 0) + 1
        info.update(state="applied", extra=[result, extra])
        if extra != result:
            _once(
                "row",
                logging.INFO,
                "sglang-dsa-fix: req_to_token row headroom raised from "
                "%d to %d columns past context_len (spec-v2 decode reservation)",
                result,
                extra,
            )
        return extra

    return body


INSTALLED_STATE = "installed, not yet called"


def refresh_hook_states() -> None:
    """Turn registered-but-never-called hooks into what they are, once the scheduler serves
    (``get_internal_state`` runs after sglang applied the hooks and built the model runner):
    ``failed`` where sglang's HookRegistry did not apply the hook (it logs and goes on,
    0.5.14 plugins/hook_registry.py:158-165; what it applied is in ``HookRegistry._patched``), else
    ``not reached``: this process never ran the target (another attention backend, CUDA graphs
    disabled), so the bug's code never ran either."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError:
        return
    patched = getattr(HookRegistry, "_patched", None)
    for info in STATE["bugs"].values():
        target = info.get("target")
        if target is None or info.get("calls") or not info["state"].startswith(INSTALLED_STATE):
            continue
        if patched is not None and target not in patched:
            info["state"] = f"failed (sglang's HookRegistry did not apply the hook on {target}; see its log)"
        else:
            info["state"] = f"not reached ({target} never ran in this scheduler process)"


def _internal_state_body(result, *args, **kwargs):
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        refresh_hook_states()
        STATE["watch"] = watch.report()
        state[STATE_KEY] = {**copy.deepcopy(STATE), "summary": _summary()}
    return None


def report() -> dict:
    """What /server_info reports for this process; the family watch's counters under ``watch``."""
    return {**STATE, "watch": watch.report()}


# 0.5.9 - 0.5.12 size the row inline in ModelRunner: no function for a hook to widen.
ROW_INLINE_STATE = "not fixed by the plugin (this release sizes the row inline): run `sglang-dsa-fix apply`"


def decide(sglang=None):
    """[(bug, state, hook target, hook)] for this tree (None: the importable sglang's). Target
    None: nothing to hook."""
    from sglang_dsa_fix import classify, sites, snapshot, tree

    sglang = tree.find_tree(None) if sglang is None else sglang
    # lock=False: sglang's start-up never waits on a running apply/revert's lock.
    files = snapshot.read(sglang, use_backups=False, lock=False)
    plans = []
    switch = kill_switch_value()
    for state in classify.states(files):
        bug, verdict, site = state.bug, state.verdict, state.site
        # Stale bytecode means the pristine code is what runs: hook it (the hooks are no-ops
        # where the width is already right).
        if verdict not in (Verdict.AFFECTED, Verdict.STALE_BYTECODE):
            plans.append((bug, PLAN_STATE[verdict.value], None, None))
        elif not enabled(switch):
            plans.append((bug, f"disabled ({KILL_SWITCH}={switch.strip()})", None, None))
        elif not site.hookable:
            plans.append((bug, ROW_INLINE_STATE, None, None))
        elif bug is Bug.PAGE_TABLE:
            layout, _ = sites.backend_file(files)
            plans.append((bug, "hooked", layout.hook_target, _page_table_body))
        else:
            module = ".".join(site.path.relative_to(sglang.package_parent).with_suffix("").parts)
            target = f"{module}.get_req_to_token_extra_context_len"
            plans.append((bug, "hooked", target, _row_body_for(module)))
    return plans


def register() -> None:
    """Entry point. Any failure: one warning line, sglang untouched. Idempotent: sglang calls
    it once per entry point name, and this package has two."""
    if STATE["pid"] == os.getpid():
        return
    STATE["pid"] = os.getpid()
    switch = kill_switch_value()
    STATE["kill_switch"] = kill_switch_text(switch)
    if not known_switch_value(switch):
        logger.warning(
            "sglang-dsa-fix: %s=%r is not a known value (0 / false / no / off disable, 1 / true / yes / "
            "on enable): taken as enabled",
            KILL_SWITCH,
            switch,
        )
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from sglang_dsa_fix import tree

        sglang = tree.find_tree(None)  # the tree, found once for the fixes and the watch
        plans = decide(sglang)
    except Exception as exc:  # never break sglang's start-up
        for bug in Bug:
            _set(bug, f"unsupported ({type(exc).__name__}: {exc}); sglang untouched")
        logger.warning("sglang-dsa-fix: unsupported (%s: %s); sglang untouched", type(exc).__name__, exc)
        return
    for bug, state, target, body in plans + [(None, None, INTERNAL_STATE_TARGET, None)]:
        try:
            if target is not None:
                pkgutil.resolve_name(target)  # sglang resolves it the same way when applying
                hook = _internal_state_body if bug is None else _guarded(bug, body)
                HookRegistry.register(target, hook, HookType.AFTER)
                state = f"{INSTALLED_STATE} ({target})"
        except Exception as exc:
            state = f"unsupported ({type(exc).__name__}: {exc}); sglang untouched"
            logger.warning("sglang-dsa-fix: cannot hook %s (%s: %s)", target, type(exc).__name__, exc)
        if bug is not None:
            _set(bug, state, **({"target": target} if state.startswith(INSTALLED_STATE) else {}))
    if watch.enabled():  # opt-in (SGLANG_DSA_FIX_WATCH), independent of the fixes and the kill switch
        try:
            for target, hook_type, hook in watch.hooks(sglang):
                HookRegistry.register(target, hook, HookType[hook_type])
                WATCH_HOOKS.append(target)
        except Exception as exc:
            logger.warning("sglang-dsa-fix: watch not installed (%s: %s)", type(exc).__name__, exc)
    logger.info("%s", _summary())
