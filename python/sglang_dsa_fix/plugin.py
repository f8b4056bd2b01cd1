"""SGLang general plugin (entry point group ``sglang.srt.plugins``, sglang 0.5.11+).

``load_plugins()`` calls ``register()`` in the launch process and first thing in every
scheduler process (0.5.14 managers/scheduler.py:4181, entrypoints/engine.py:204), where the
model runner sizes its pools and builds its attention backends. ``register`` adds, through
sglang's own HookRegistry, AFTER hooks for each bug that is affected in this tree:

- bug #1: ``<Backend>.init_cuda_graph_state`` → widen the graph page_table;
- bug #2: ``get_req_to_token_extra_context_len`` → widen the req_to_token row;
- bug #3: ``FlashAttentionBackend.init_cuda_graph_state`` → widen FA3's graph page tables and
  the replay's bounds to req_to_token's row (``fa3_width.enforce``, before any capture);
- bug #3's relatives (TRT-LLM MHA / MLA, FlashMLA, MiniMax NVFP4, Triton): REPLACE hooks, each method
  the in-tree change edits replaced by that method compiled with the change (``live_edit``: the
  code sglang loaded with ``apply``'s one substitution, refused where the file is not what was
  loaded; other plugins' hooks still wrap it);
- a hook in an attention backend's module (bugs #1, #3 and its relatives) is registered when
  sglang itself imports that module (``_when_imported``) and applied through HookRegistry then:
  ``register`` imports no backend a deployment does not use;
- always: ``Scheduler.get_internal_state`` → this plugin's state under ``sglang_dsa_fix`` in
  ``/server_info`` (``internal_states``), so a live server shows what is running;
- opt-in (``SGLANG_DSA_FIX_WATCH=1``, kill switch or not): the family watch's AROUND hooks
  (``watch.py``), its counters under ``watch`` in that state and in ``report()``;
- where sglang's metrics are on (``--enable-metrics``): each member's state and the watch's
  counters on sglang's ``/metrics`` too (``metrics.py``), set after sglang's own scheduler stats.

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
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from sglang_dsa_fix import __version__, graph_tables, members, metrics, watch
from sglang_dsa_fix.switch import (  # noqa: F401 (the plugin's names, as sglang and tests know them)
    ENABLE_VALUES,
    ENTRY_POINT_NAMES,
    KILL_SWITCH,
    KILL_VALUES,
    enabled,
    kill_switch_text,
    kill_switch_value,
    known_switch_value,
)
from sglang_dsa_fix.verdicts import Bug, Hook, State, Verdict

logger = logging.getLogger("sglang_dsa_fix")

INTERNAL_STATE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
STATE_KEY = "sglang_dsa_fix"

# This process's state: what /server_info and the log lines report.
STATE = {"version": __version__, "pid": None, "kill_switch": None, "bugs": {}}
# The watch's hook targets, once registered; the start-up log line then says the watch is on
# (benchmarks look for WATCH_ON_LINE to know a variant really ran with it).
WATCH_HOOKS = []
WATCH_ON_LINE = "family watch on"
_said = set()  # one-time log lines already emitted in this process


def _once(key: str, level: int, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.log(level, message, *args)


def _summary() -> str:
    bugs = "; ".join(
        f"{bug}: {info['state']} (hook {info['hook']}{': ' + info['detail'] if info['detail'] else ''})"
        for bug, info in STATE["bugs"].items()
    )
    hooks = len(WATCH_HOOKS)
    watching = f"; {WATCH_ON_LINE} ({hooks} hooks)" if hooks else ""
    return f"sglang-dsa-fix {__version__} (pid {os.getpid()}, {STATE['kill_switch']}): {bugs}{watching}"


def _set(bug: Bug, state: State, hook: Hook, detail: str = "", **extra) -> None:
    """One bug's entry: its ``State`` token (the vocabulary of check / status), what the hook
    did, and why in words."""
    STATE["bugs"][bug.value] = {"state": state.token, "hook": hook.value, "detail": detail, **extra}


def _ran(bug: Bug) -> dict:
    """A hook body ran: the width holds in this process. Returns the bug's entry."""
    info = STATE["bugs"][bug.value]
    info.update(state=State.PROTECTED_BY_PLUGIN.token, hook=Hook.APPLIED.value)
    info["calls"] = info.get("calls", 0) + 1
    return info


def _guarded(bug: Bug, body):
    """Run a hook body; on any failure: one warning, sglang's own result kept."""

    def hook(result, *args, **kwargs):
        try:
            value = body(result, *args, **kwargs)
        except Exception as exc:  # never break sglang
            _set(bug, State.AFFECTED, Hook.FAILED, f"{type(exc).__name__}: {exc}; sglang's own value kept")
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


def _running(bug: Bug, body):
    """A member's hook body (``members.HookPlan.body``) as the AFTER hook's: the member's entry
    marked as ran (the width holds in this process), the body's log line said once."""

    def run(result, *args, **kwargs):
        value, line = body(_ran(bug), result, *args, **kwargs)
        if line:
            _once(f"ran-{bug.value}", logging.INFO, "sglang-dsa-fix: %s", line)
        return value

    return run


def _resolve(target: str):
    """``pkgutil.resolve_name`` (what sglang's HookRegistry uses), except that a module which
    fails to import raises its ImportError (resolve_name reports it as a missing attribute)."""
    try:
        return pkgutil.resolve_name(target)
    except AttributeError:
        parts = target.split(".")
        for end in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:end])
            try:
                importlib.import_module(name)
                break
            except ModuleNotFoundError as exc:
                if exc.name != name:
                    raise
        raise


# Modules sglang imports only for their own ``--attention-backend``: a hook there is registered
# when sglang imports the module (``_when_imported``), never by importing it here (sglang's
# HookRegistry imports every registered target's module in ``apply_hooks``).
BACKEND_PREFIX = "sglang.srt.layers.attention."
_ON_IMPORT = {}  # module name -> [action(module)], run once sglang imported the module


class _AfterExec:
    """The loader sglang's import found, running the waiting actions once the module executed;
    the module keeps the original loader."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        for action in _ON_IMPORT.pop(module.__name__, []):
            action(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _OnImport:
    """A meta path finder that finds nothing itself: for a module with actions waiting, the spec
    the other finders give, its loader wrapped (``_AfterExec``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _ON_IMPORT:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader)
                return spec
        return None


def _when_imported(module_name: str, action) -> None:
    """``action(module)`` once sglang imported ``module_name`` (at once where it already did)."""
    module = sys.modules.get(module_name)
    if module is not None:
        action(module)
        return
    _ON_IMPORT.setdefault(module_name, []).append(action)
    if not any(isinstance(finder, _OnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())


def _apply(registry, targets: list) -> None:
    """What ``HookRegistry.apply_hooks`` does, for these targets only (it has run already, or runs
    later and then skips what is in ``_patched``); a failure is logged as it logs one, and
    ``refresh_hook_states`` reports it."""
    for target in targets:
        if target in registry._patched:
            continue
        try:
            registry._apply_target(target, registry._hooks[target])
            registry._patched.add(target)
        except Exception:
            logger.exception("Failed to apply hooks to %s", target)


def _replacement_targets(plan: Plan) -> list:
    layout = graph_tables.LAYOUTS[plan.bug]
    return [f"{layout.module}.{c}.{m}" for c, m in graph_tables.methods(plan.replace)]


def _hook_on_import(registry, hook_type, plan: Plan):
    """The action registering ``plan``'s hooks on the module sglang imported. Bug #3's relatives:
    each method the in-tree change edits, built from the code sglang loaded with the change
    (``live_edit``), a REPLACE hook (REPLACE is applied first, so AROUND / AFTER hooks, the
    watch's too, wrap it); everything is built before anything is registered: a refusal leaves
    sglang untouched, and the state says why."""

    def action(module):
        try:
            if plan.replace is not None:
                from sglang_dsa_fix import live_edit

                functions = live_edit.patched_methods(plan.replace, module)
                targets = _replacement_targets(plan)
                for target, function in zip(targets, functions.values()):
                    registry.register(target, _replacing(plan.bug, function), hook_type.REPLACE)
            else:
                targets = [plan.target]
                registry.register(plan.target, _guarded(plan.bug, plan.body), hook_type.AFTER)
            _apply(registry, targets)
        except Exception as exc:  # never break sglang's import
            STATE["bugs"][plan.bug.value].update(  # keeps its target(s): what was not hooked
                state=State.AFFECTED.token,
                hook=Hook.UNSUPPORTED.value,
                detail=f"{type(exc).__name__}: {exc}; sglang untouched",
            )
            logger.warning("sglang-dsa-fix: cannot hook %s (%s: %s)", plan.target, type(exc).__name__, exc)

    return action


def _replacing(bug: Bug, function):
    """REPLACE hook: the patched method (its errors are sglang's own code's). The state is set
    on the first call only: some of these methods run every decode step."""
    first = [True]

    def replacement(*args, **kwargs):
        if first[0]:
            first[0] = False
            _ran(bug)["detail"] = REPLACED
            _once(bug.value, logging.INFO, "sglang-dsa-fix: %s: %s", bug.value, REPLACED)
        return function(*args, **kwargs)

    return replacement


REPLACED = "graph table sized from req_to_token's row (the in-tree change, compiled in memory)"


def refresh_hook_states() -> None:
    """Turn registered-but-never-called hooks into what they are, once the scheduler serves
    (``get_internal_state`` runs after sglang applied the hooks and built the model runner):
    ``failed`` where sglang's HookRegistry did not apply the hook (it logs and goes on,
    0.5.14 plugins/hook_registry.py:158-165; what it applied is in ``HookRegistry._patched``), else
    ``not_reached``: this process never ran the target (another attention backend, CUDA graphs
    disabled), so the bug's code never ran either (state ``not_reachable``)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError:
        return
    patched = getattr(HookRegistry, "_patched", None)
    for info in STATE["bugs"].values():
        target = info.get("target")
        if target is None or info["hook"] not in (Hook.INSTALLED.value, Hook.APPLIED.value):
            continue
        if info.get("module") in _ON_IMPORT:  # still waiting: sglang never imported the backend
            info.update(
                state=State.NOT_REACHABLE.token,
                hook=Hook.NOT_REACHED.value,
                detail=f"sglang never imported {info['module']} in this scheduler process (another "
                "attention backend)",
            )
            continue
        # Every method a relative's fix replaces must be in place, whether one of them ran or not:
        # one left out runs sglang's own width. A single hook that ran was applied.
        missing = [t for t in info.get("targets", []) if patched is not None and t not in patched]
        if not missing and not info.get("calls") and patched is not None and target not in patched:
            missing = [target]
        if missing:
            info.update(
                state=State.AFFECTED.token,
                hook=Hook.FAILED.value,
                detail=f"sglang's HookRegistry did not apply the hook on {', '.join(missing)}; see its log",
            )
        elif info.get("calls") or info["hook"] != Hook.INSTALLED.value:
            continue
        else:
            info.update(
                state=State.NOT_REACHABLE.token,
                hook=Hook.NOT_REACHED.value,
                detail=f"{target} never ran in this scheduler process",
            )


def _internal_state_body(result, *args, **kwargs):
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        refresh_hook_states()
        STATE["watch"] = watch.report()
        state[STATE_KEY] = {**copy.deepcopy(STATE), "summary": _summary()}
    return None


def member_states() -> dict:
    """{member: state token} as /server_info would report them now (for /metrics)."""
    refresh_hook_states()
    return {bug: info["state"] for bug, info in STATE["bugs"].items()}


def report() -> dict:
    """What /server_info reports for this process; the family watch's counters under ``watch``."""
    return {**STATE, "watch": watch.report()}


# 0.5.9 - 0.5.12 size the row inline in ModelRunner: no function for a hook to widen.
ROW_INLINE = "not fixed by the plugin (this release sizes the row inline): run `sglang-dsa-fix apply`"


@dataclass(frozen=True)
class Plan:
    """What ``register`` does for one bug: the state and hook it starts from, and the hook."""

    bug: Bug
    state: State
    hook: Hook
    detail: str = ""
    target: Optional[str] = None  # None: nothing to hook
    body: Optional[Callable] = None
    replace: Optional[object] = None  # an EditSite whose edited methods replace sglang's (REPLACE)


def decide(sglang=None) -> list:
    """One ``Plan`` per bug for this tree (None: the importable sglang's)."""
    from sglang_dsa_fix import classify, snapshot, tree

    sglang = tree.find_tree(None) if sglang is None else sglang
    # lock=False: sglang's start-up never waits on a running apply/revert's lock.
    files = snapshot.read(sglang, use_backups=False, lock=False)
    plans = []
    switch = kill_switch_value()
    for state in classify.states(files):
        state = classify.judged_with_its_backup(files, state)  # (read without backups)
        bug, verdict, site = state.bug, state.verdict, state.site
        # Stale bytecode means the pristine code is what runs: hook it (the hooks are no-ops
        # where the width is already right).
        hooked = State.PROTECTED_BY_PLUGIN, Hook.INSTALLED
        if verdict not in (Verdict.AFFECTED, Verdict.STALE_BYTECODE):
            plans.append(Plan(bug, verdict.state, Hook.NONE))
        elif not enabled(switch):
            plans.append(Plan(bug, State.AFFECTED, Hook.DISABLED, f"{KILL_SWITCH}={switch.strip()}"))
        elif not site.hookable:
            plans.append(Plan(bug, State.AFFECTED, Hook.NONE, ROW_INLINE))
        else:
            planned = members.of(bug).hook(files, site, sglang)
            body = planned.body and _running(bug, planned.body)
            plans.append(Plan(bug, *hooked, target=planned.target, body=body, replace=planned.replace))
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
            _set(bug, State.AFFECTED, Hook.UNSUPPORTED, f"{type(exc).__name__}: {exc}; sglang untouched")
        logger.warning("sglang-dsa-fix: unsupported (%s: %s); sglang untouched", type(exc).__name__, exc)
        return
    try:  # /server_info's report first: the bugs' hooks below say their own state there
        pkgutil.resolve_name(INTERNAL_STATE_TARGET)
        HookRegistry.register(INTERNAL_STATE_TARGET, _internal_state_body, HookType.AFTER)
    except Exception as exc:
        logger.warning(
            "sglang-dsa-fix: cannot hook %s (%s: %s)", INTERNAL_STATE_TARGET, type(exc).__name__, exc
        )
    metrics.install(HookRegistry, HookType, member_states)  # only where sglang's metrics are on
    for plan in plans:
        if plan.target is None:
            _set(plan.bug, plan.state, plan.hook, plan.detail)
            continue
        module = plan.target.rsplit(".", 2 if plan.target.startswith(BACKEND_PREFIX) else 1)[0]
        try:
            if module.startswith(BACKEND_PREFIX):
                targets = {"module": module}
                if plan.replace is not None:
                    targets["targets"] = _replacement_targets(plan)
                # The state first: the action, where sglang imported the module already, may say
                # that it refused.
                _set(plan.bug, plan.state, plan.hook, plan.detail, target=plan.target, **targets)
                _when_imported(module, _hook_on_import(HookRegistry, HookType, plan))
                continue
            _resolve(plan.target)  # sglang resolves it the same way when applying
            targets = {}
            HookRegistry.register(plan.target, _guarded(plan.bug, plan.body), HookType.AFTER)
        except ImportError as exc:
            # The module does not import in this process (e.g. FA3's without its kernels): sglang
            # imports the same module to run that code, so it never runs here.
            detail = f"{type(exc).__name__}: {exc}; sglang cannot import it here either"
            _set(plan.bug, State.NOT_REACHABLE, Hook.UNSUPPORTED, detail)
            continue
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}; sglang untouched"
            _set(plan.bug, State.AFFECTED, Hook.UNSUPPORTED, detail)
            logger.warning("sglang-dsa-fix: cannot hook %s (%s: %s)", plan.target, type(exc).__name__, exc)
            continue
        _set(plan.bug, plan.state, plan.hook, plan.detail, target=plan.target, **targets)
    if watch.enabled():  # opt-in (SGLANG_DSA_FIX_WATCH), independent of the fixes and the kill switch
        try:
            for target, hook_type, hook in watch.hooks(sglang):
                HookRegistry.register(target, hook, HookType[hook_type])
                WATCH_HOOKS.append(target)
        except Exception as exc:
            logger.warning("sglang-dsa-fix: watch not installed (%s: %s)", type(exc).__name__, exc)
    from sglang_dsa_fix.pysource import forget_parsed

    forget_parsed()  # the decisions are made: keep no parsed sglang file in the scheduler
    logger.info("%s", _summary())
