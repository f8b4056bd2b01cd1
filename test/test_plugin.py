"""The SGLang plugin in real ``spawn`` processes, as sglang starts its schedulers.

Each child calls sglang's own ``load_plugins()`` (which finds this package through its installed
entry-point metadata and applies the hooks through sglang's HookRegistry), then:
- bug #1: builds the real backend and runs ``init_cuda_graph_state`` + a TARGET_VERIFY replay;
- bug #2: calls the real ``get_req_to_token_extra_context_len`` through the name the model
  runner imported (model_runner_kv_cache_mixin), as ``_init_pools`` does;
- bug #3: builds the real ``FlashAttentionBackend`` (over the sgl_kernel stand-in of
  graph_backends.import_fa3 where sgl_kernel is absent) and runs its ``init_cuda_graph_state``;
- bug #3's relatives: drives the real ``TRTLLMMLABackend`` at a verify past its 4096-token
  padded table (test/srt/test_graph_tables_other_backends.run_trtllm_mla, the pristine driver):
  with the plugin's REPLACE hooks every read stays in the request's own row;
- /server_info: calls the hooked ``Scheduler.get_internal_state``.
"""

import functools
import importlib.util
import logging
import multiprocessing
import os
import sys
import unittest
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from helpers import INSTALLED_FILES, PAGE_TABLE_SITE, ROW_SITE

from sglang_dsa_fix import plugin, width
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.members.fa3 import tables as fa3_width

POOL_WIDTH = 512 + 4 + 5  # Case(512, D=5): the pristine pool
FULL = os.environ.get("SGLANG_DSA_FIX_FULL") == "1"
PRISTINE_WIDTH = width.evaluate_page_table_expression(PAGE_TABLE_SITE.found, 512, 5, POOL_WIDTH)
ROW_ARGS = dict(
    speculative_algorithm="EAGLE",
    speculative_num_steps=11,
    speculative_eagle_topk=1,
    max_speculative_num_draft_tokens=12,
    page_size=1,
)
# 0.5.13+: a sizing function the plugin hooks (0.5.9 - 0.5.12 size the row inline: apply only).
ROW_HOOKED = ROW_SITE is not None and ROW_SITE.hookable
ROW_PRISTINE = 4 + 12 if ROW_HOOKED else None
ROW_FIXED = width.row_extra_floor(2 * 12) if ROW_HOOKED else None  # the whole reservation: 24
# With the plugin the pool's row holds the whole reservation at D 5 too (2·5 > 4 + 5) where the
# plugin hooks the sizing; the graph buffer follows the pool either way.
FIXED_POOL_WIDTH = 512 + max(4 + 5, width.row_extra_floor(2 * 5)) if ROW_HOOKED else POOL_WIDTH


def _child(env, queue):
    os.environ.update(env)
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("sglang_dsa_fix")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    try:
        import graph_backends as g
        from sglang.srt.plugins import load_plugins

        from sglang_dsa_fix.proof import replay

        g.import_fa3()  # before the plugin resolves its hook target, as a GPU server has it
        load_plugins()
        from sglang.srt.model_executor import model_runner_kv_cache_mixin as runner

        _, cls = replay.import_backend_class()
        session = replay.GraphSession(cls, replay.Case(512, 5, 64, 2))
        result = session.replay("TARGET_VERIFY", 2, 514)
        fa3 = g.fa3_release_backend(g.req_to_token_pool(512, 8, 1, 4), 512, 4, 1)
        fa3.init_cuda_graph_state(4, 16)  # bug #3: its graph tables, as the graph runner sizes them
        sys.path.insert(0, str(Path(__file__).parent / "srt"))
        import test_graph_tables_other_backends as other

        mla = None
        # (the driver runs the graph runners' API of 0.5.14+: out_graph / in_graph metadata and
        # model_executor.runner's replay view; the release matrix runs this on 0.5.11 - 0.5.13 too)
        mla_cls = getattr(other.TRTLLM_MLA, "TRTLLMMLABackend", None)
        driven = importlib.util.find_spec("sglang.srt.model_executor.runner") is not None
        if (
            driven
            and other.FLASHINFER_MLA is not None
            and hasattr(mla_cls, "init_forward_metadata_out_graph")
        ):
            measured = other.run_trtllm_mla("TARGET_VERIFY", 4096, 8, 64)
            mla = [(row.right, row.neighbour, row.past, row.pages) for row in measured.rows]
        sizing = getattr(runner, "get_req_to_token_extra_context_len", None)  # 0.5.13+
        row_extra = sizing and sizing(SimpleNamespace(**ROW_ARGS))
        try:
            internal = _internal_state()
        except ImportError as exc:  # releases whose scheduler needs sgl_kernel (< 0.5.13 on CPU)
            internal = f"scheduler not importable on CPU: {exc}"
        # A backend sglang can initialise but without req_to_token: our hook must not raise.
        broken = replay.make_backend(cls, replay.Case(512, 5, 64, 2), session.pool)
        del broken.req_to_token
        broken_error = None
        try:
            broken.init_cuda_graph_state(1, 1)
        except Exception as exc:
            broken_error = type(exc).__name__
        queue.put(
            dict(
                buffer=session.buffer_width,
                pool=session.pool.req_to_token.shape[1],
                error=result.error,
                mismatched=result.mismatched_rows,
                fa3_short=fa3_width.short_tables(fa3),
                mla=mla,
                row_extra=row_extra,
                internal=internal,
                broken_error=broken_error,
                records=records,
                state=plugin.STATE,
            )
        )
    except BaseException as exc:  # report, do not hang the parent
        queue.put(dict(crash=repr(exc), records=records))


def _internal_state():
    """The real hooked Scheduler.get_internal_state on an object carrying what it reads."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(SimpleNamespace(model_config=None))
    runner = SimpleNamespace(weight_load_mem_usage=1.0, graph_mem_usage=0.5)
    scheduler = SimpleNamespace(
        metrics_reporter=SimpleNamespace(last_gen_throughput=0.0),
        tp_worker=SimpleNamespace(model_runner=runner),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace(mem_usage=2.0)),
        max_total_num_tokens=16384,
        max_running_requests=8,
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
    )
    return Scheduler.get_internal_state(scheduler, None).internal_state.get(plugin.STATE_KEY)


def run_in_spawned_process(**env):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(env, queue))
    proc.start()
    try:
        out = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
    assert "crash" not in out, out
    return out


# The children TestPluginInSpawnedProcess reads, by name: each is one spawned process (~10 s of
# CPU, most of it importing torch and sglang), started two at a time when the first test asks for
# one (the test process itself only waits on them). "enabled_by_one_name": sglang loads the plugin
# under one of its entry-point names only (SGLANG_PLUGINS) and the kill switch holds a value it
# does not know, which is taken as enabled (either failing leaves bug #1's buffer pristine); two
# tests read it.
KILL_SWITCH_VALUES = ("0", "false", " OFF ", "No") if FULL else (" OFF ",)
CHILDREN = {
    "default": {},
    **{f"off {value!r}": {"SGLANG_DSA_FIX": value} for value in KILL_SWITCH_VALUES},
    "enabled_by_one_name": {"SGLANG_PLUGINS": plugin.ENTRY_POINT_NAMES[1], "SGLANG_DSA_FIX": "yes-please"},
    "someone_else": {"SGLANG_PLUGINS": "someone_else"},
}


@functools.cache
def _children() -> dict:
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run_in_spawned_process, **env) for name, env in CHILDREN.items()}
    pool.shutdown(wait=False)  # the threads end once the children have reported
    return futures


def child(name: str) -> dict:
    return _children()[name].result()


@unittest.skipUnless(trees.plugin_installed_here(), "sglang-dsa-fix is not installed (pip install -e .)")
@unittest.skipUnless(trees.plugin_report(INSTALLED_FILES, True)["sglang_has_plugin_api"], "no plugin API")
class TestPluginInSpawnedProcess(unittest.TestCase):
    def test_plugin_fixes_both_bugs_and_reports_it(self):
        out = child("default")
        self.assertEqual((out["buffer"], out["pool"]), (FIXED_POOL_WIDTH, FIXED_POOL_WIDTH), out["records"])
        self.assertEqual((out["error"], out["mismatched"]), (None, 0))
        self.assertEqual(out["row_extra"], ROW_FIXED)
        self.assertEqual(out["fa3_short"], [])
        fa3 = out["state"]["bugs"]["fa3_page_table"]
        self.assertEqual((fa3["state"], fa3["hook"]), ("protected_by_plugin", "applied"), fa3)
        if out["mla"] is not None:  # bug #3's relative: every read in the request's own row
            self.assertEqual([r[:3] for r in out["mla"]], [(r[3], 0, 0) for r in out["mla"]])
            mla = out["state"]["bugs"]["trtllm_mla_kv_indices"]
            self.assertEqual((mla["state"], mla["hook"]), ("protected_by_plugin", "applied"), mla)
        infos = [m for level, m in out["records"] if level == "INFO"]
        self.assertIn(
            f"sglang-dsa-fix: CUDA-graph page_table widened from {PRISTINE_WIDTH} to "
            f"{FIXED_POOL_WIDTH} columns (req_to_token)",
            infos,
        )
        if ROW_HOOKED:
            self.assertIn(
                # (logged once per process: the first raise, the D 5 pool's)
                f"sglang-dsa-fix: req_to_token row headroom raised from {4 + 5} to "
                f"{FIXED_POOL_WIDTH - 512} columns past context_len (spec-v2 decode reservation)",
                infos,
            )
        summary = [m for m in infos if m.startswith(f"sglang-dsa-fix {plugin.__version__} (pid")]
        self.assertTrue(summary, infos)
        if ROW_HOOKED:  # 0.5.13+: the scheduler imports on CPU, so /server_info is checked
            bugs = out["internal"]["bugs"]
            for name in ("page_table", "fa3_page_table"):
                self.assertEqual(
                    (bugs[name]["state"], bugs[name]["hook"]), ("protected_by_plugin", "applied")
                )
            self.assertEqual(bugs["req_to_token_row"]["extra"], [ROW_PRISTINE, ROW_FIXED])
        # The broken backend: one warning, no exception into sglang.
        self.assertIsNone(out["broken_error"])
        warnings = [m for level, m in out["records"] if level == "WARNING" and "hook failed" in m]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("page_table hook failed (AttributeError", warnings[0])
        failed = out["state"]["bugs"]["page_table"]
        self.assertEqual((failed["state"], failed["hook"]), ("affected", "failed"))
        self.assertTrue(failed["detail"].startswith("AttributeError"), failed)

    def test_kill_switch_values(self):
        # Each value is one spawned process (~10 s): the fast tier takes one spelling (padded,
        # upper case), the full sweep all (plugin.enabled's parsing of every spelling is tested
        # in-process, TestKillSwitchSpellings).
        for value in KILL_SWITCH_VALUES:
            with self.subTest(value=value):
                out = child(f"off {value!r}")
                self.assertEqual((out["buffer"], out["pool"]), (PRISTINE_WIDTH, POOL_WIDTH))
                self.assertIn("must match the size of tensor b", out["error"])
                self.assertEqual(out["row_extra"], ROW_PRISTINE)
                self.assertTrue(out["fa3_short"])  # sglang's own ceil(512 / 1) = 512 < 520
                if out["mla"] is not None:  # the last row reads one page past its table
                    self.assertEqual(out["mla"][-1][2], 1, out["mla"])
                off = out["state"]["bugs"]["page_table"]
                self.assertEqual((off["state"], off["hook"]), ("affected", "disabled"))
                self.assertIn(repr(value), out["state"]["kill_switch"])
        out = child("enabled_by_one_name")
        self.assertEqual(out["buffer"], out["pool"])
        self.assertTrue(
            out["state"]["kill_switch"].startswith("SGLANG_DSA_FIX='yes-please': enabled"), out["state"]
        )

    def test_sglang_plugins_allow_list(self):
        out = child("someone_else")
        self.assertEqual((out["buffer"], out["row_extra"]), (PRISTINE_WIDTH, ROW_PRISTINE))
        self.assertEqual(out["records"], [])  # never loaded
        if ROW_HOOKED:  # (the scheduler imports on CPU): the plugin never loaded, no state
            self.assertIsNone(out["internal"])
        out = child("enabled_by_one_name")
        self.assertEqual(out["buffer"], out["pool"])
        fa3 = out["state"]["bugs"]["fa3_page_table"]  # (page_table's: the broken backend's failure)
        self.assertEqual((fa3["state"], fa3["hook"]), ("protected_by_plugin", "applied"))


class TestKillSwitchSpellings(unittest.TestCase):
    def test_every_off_spelling_and_only_those(self):
        for value in ("0", "false", " OFF ", "No", "FALSE", "off"):
            self.assertFalse(plugin.enabled(value), repr(value))
        for value in ("", "1", "yes-please", "on", "true"):
            self.assertTrue(plugin.enabled(value), repr(value))


class TestPluginNeverRaises(unittest.TestCase):
    def test_failure_is_one_warning(self):
        from unittest import mock

        with (
            mock.patch.dict(plugin.STATE, {"pid": None}),
            mock.patch.object(plugin, "decide", side_effect=RuntimeError("boom")),
        ):
            with self.assertLogs("sglang_dsa_fix", level="WARNING") as logs:
                plugin.register()
        self.assertEqual(
            logs.output,
            ["WARNING:sglang_dsa_fix:sglang-dsa-fix: unsupported (RuntimeError: boom); sglang untouched"],
        )
        self.assertEqual(plugin.STATE["bugs"]["page_table"]["hook"], "unsupported")
        self.assertEqual(plugin.STATE["bugs"]["page_table"]["state"], "affected")


@unittest.skipUnless(trees.plugin_report(INSTALLED_FILES, True)["sglang_has_plugin_api"], "no plugin API")
class TestHookStates(unittest.TestCase):
    """A hook sglang failed to apply reads "failed"; one applied but never run "not reached";
    register() is idempotent (sglang calls it once per entry point name, and there are two)."""

    def test_registered_hooks_become_failed_or_not_reached(self):
        import copy
        from unittest import mock

        from sglang.srt.plugins.hook_registry import HookRegistry

        installed = {"state": "protected_by_plugin", "hook": "installed", "detail": ""}
        bugs = {
            "page_table": {**installed, "target": "a.b"},
            "req_to_token_row": {**installed, "target": "c.d"},
        }
        with (
            mock.patch.dict(plugin.STATE, {"bugs": copy.deepcopy(bugs)}),
            mock.patch.object(HookRegistry, "_patched", {"c.d"}),
        ):
            plugin.refresh_hook_states()
            said = {name: (b["state"], b["hook"]) for name, b in plugin.STATE["bugs"].items()}
            self.assertEqual(
                said,
                {"page_table": ("affected", "failed"), "req_to_token_row": ("not_reachable", "not_reached")},
            )
        called = {
            "page_table": {"state": "protected_by_plugin", "hook": "applied", "target": "a.b", "calls": 1}
        }
        with (
            mock.patch.dict(plugin.STATE, {"bugs": called}),
            mock.patch.object(HookRegistry, "_patched", set()),
        ):
            plugin.refresh_hook_states()
            self.assertEqual(plugin.STATE["bugs"]["page_table"]["hook"], "applied")
        # A relative's fix replaces several methods: one that sglang did not apply makes it
        # failed even after another ran (that one runs sglang's own width).
        replaced = {
            "triton_kv_indices": {
                "state": "protected_by_plugin",
                "hook": "applied",
                "target": "m.A.f",
                "targets": ["m.A.f", "m.B.g"],
                "calls": 3,
            }
        }
        for applied, expected in (({"m.A.f"}, ("affected", "failed")), ({"m.A.f", "m.B.g"}, None)):
            with (
                self.subTest(applied=sorted(applied)),
                mock.patch.dict(plugin.STATE, {"bugs": copy.deepcopy(replaced)}),
                mock.patch.object(HookRegistry, "_patched", applied),
            ):
                plugin.refresh_hook_states()
                info = plugin.STATE["bugs"]["triton_kv_indices"]
                self.assertEqual(
                    (info["state"], info["hook"]), expected or ("protected_by_plugin", "applied")
                )
                if expected:
                    self.assertIn("m.B.g", info["detail"])

    def test_a_module_that_does_not_import_here_is_not_reached(self):
        # sglang imports the same module to run that code: where it cannot, the bug is not
        # reachable in that process; a module that imports but lacks the target is a failure.
        from unittest import mock

        from sglang_dsa_fix.verdicts import Bug, Hook, State

        plans = [
            plugin.Plan(
                Bug.FA3_PAGE_TABLE, State.PROTECTED_BY_PLUGIN, Hook.INSTALLED, target="no_such_mod.C.f"
            ),
            plugin.Plan(Bug.PAGE_TABLE, State.PROTECTED_BY_PLUGIN, Hook.INSTALLED, target="os.no_such_name"),
        ]
        with (
            mock.patch.dict(plugin.STATE, {"pid": None, "bugs": {}}),
            mock.patch.object(plugin, "decide", return_value=plans),
            self.assertLogs("sglang_dsa_fix", level="WARNING"),
        ):
            plugin.register()
            said = {name: (b["state"], b["hook"]) for name, b in plugin.STATE["bugs"].items()}
        self.assertEqual(
            said,
            {"fa3_page_table": ("not_reachable", "unsupported"), "page_table": ("affected", "unsupported")},
        )

    def test_register_is_idempotent(self):
        from unittest import mock

        with (
            mock.patch.dict(plugin.STATE, {"pid": None, "bugs": {}}),
            mock.patch.object(plugin, "decide", return_value=[]) as decide,
        ):
            plugin.register()
            plugin.register()
        decide.assert_called_once()


if __name__ == "__main__":
    unittest.main()
