"""The plugin's state and the family watch's counters on sglang's /metrics (``metrics.py``).

A spawned process started as sglang starts a scheduler with ``--enable-metrics``: the
multiprocess directory set (a temporary one, as entrypoints/engine.py:1270 sets it), the watch on,
sglang's own ``load_plugins()`` (``register()`` and ``HookRegistry.apply_hooks()``), then sglang's
real ``SchedulerMetricsCollector`` with the labels ``init_new`` gives it
(observability/metrics_collector.py:1051-1067):

1. ``log_stats``, as the scheduler's first stats: the test process scrapes;
2. the row sizing the plugin fixes (bug #2: its member's state changes to protected_by_plugin),
   one real row write 2 columns past its row end through the hooked writer (the name sglang's
   spec-v2 code calls; the Triton kernel writes them into the next row), one row read the watch
   cannot check (its check switches off), ``log_stats``: the test process scrapes again.

Each scrape goes through sglang's own /metrics app (``add_prometheus_middleware``:
prometheus_client's MultiProcessCollector and make_asgi_app over that directory), in this process
as in sglang's HTTP server process.
"""

import importlib.util
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

from helpers import INSTALLED_FILES, PluginRegistration
from test_plugin import ROW_ARGS, ROW_HOOKED

from sglang_dsa_fix import metrics, plugin
from sglang_dsa_fix import tree as trees

LABELS = {
    "model_name": "tiny",
    "engine_type": "unified",
    "tp_rank": 0,
    "pp_rank": 0,
    "moe_ep_rank": 0,
    "dp_rank": 1,
}
HAS_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None


def states() -> dict:
    """{member: state token} as /server_info reports them (its hook refreshes the hooks' states)."""
    plugin.refresh_hook_states()
    return {member: info["state"] for member, info in plugin.STATE["bugs"].items()}


def _child(directory, queue, go_on):
    os.environ.update(PROMETHEUS_MULTIPROC_DIR=directory, SGLANG_DSA_FIX_WATCH="1")
    try:
        import dataclasses
        import pkgutil

        import torch
        from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector, SchedulerStats
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs

        from sglang_dsa_fix import watch

        load_plugins()
        # server_args: sglang's defaults (a ServerArgs needs a model to be built), which the
        # collector reads for its prefill-delayer buckets.
        defaults = {
            f.name: f.default for f in dataclasses.fields(ServerArgs) if f.default is not dataclasses.MISSING
        }
        collector = SchedulerMetricsCollector(labels=dict(LABELS), server_args=SimpleNamespace(**defaults))
        collector.log_stats(SchedulerStats())  # as the scheduler's first stats (its first batch, or idle)
        queue.put(dict(started=states()))
        go_on.wait(timeout=300)
        from sglang.srt.model_executor import model_runner_kv_cache_mixin as runner

        sizing = getattr(runner, "get_req_to_token_extra_context_len", None)  # 0.5.13+
        if sizing is not None:
            sizing(SimpleNamespace(**ROW_ARGS))
        writer = next(s.target for s in watch._SITES.values() if s.kind == "row_write")
        req_to_token = torch.zeros((2, 10), dtype=torch.int32)
        out_cache_loc = torch.arange(101, 105, dtype=torch.int64)
        start, end = torch.tensor([8], dtype=torch.int64), torch.tensor([12], dtype=torch.int64)
        pkgutil.resolve_name(writer)(torch.tensor([0]), req_to_token, start, end, out_cache_loc, 1)
        # A row read the watch cannot check (no req_to_token): its check switches off.
        reader = next(s.target for s in watch._SITES.values() if s.kind == "row_read")
        try:
            pkgutil.resolve_name(reader)(torch.tensor([0]), None, start, end, 1)
        except Exception:
            pass  # sglang's own kernel fails on it too
        collector.log_stats(SchedulerStats())
        queue.put(dict(done=states(), next_row=req_to_token[1, :2].tolist()))
    except BaseException as exc:  # report, do not hang the parent
        queue.put(dict(crash=repr(exc)))


def scrape(directory: str) -> list:
    """[(name, labels, value)] of the plugin's samples, as sglang's /metrics serves them."""
    from fastapi import FastAPI
    from prometheus_client.parser import text_string_to_metric_families
    from sglang.srt.utils import add_prometheus_middleware
    from starlette.testclient import TestClient

    app = FastAPI()
    with mock.patch.dict(os.environ, {"PROMETHEUS_MULTIPROC_DIR": directory}):
        add_prometheus_middleware(app)  # (its collector reads the directory set at this moment)
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200, response.text
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name.startswith(("sglang:dsa_fix_", "sglang:num_running_reqs"))
    ]


def ones(samples: list, name: str) -> dict:
    """{member: state} of the series set to 1."""
    return {labels["member"]: labels["state"] for n, labels, value in samples if n == name and value == 1}


@unittest.skipUnless(HAS_PROMETHEUS, "prometheus_client is not installed (requirements/cpu.txt)")
@unittest.skipUnless(trees.plugin_installed_here(), "sglang-dsa-fix is not installed (pip install -e .)")
@unittest.skipUnless(trees.plugin_report(INSTALLED_FILES, True)["sglang_has_plugin_api"], "no plugin API")
class TestMetricsAsSglangServesThem(unittest.TestCase):
    def test_member_states_and_watch_counters_on_metrics(self):
        directory = tempfile.mkdtemp(prefix="dsa-fix-metrics-")
        self.addCleanup(shutil.rmtree, directory)
        ctx = multiprocessing.get_context("spawn")
        queue, go_on = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_child, args=(directory, queue, go_on))
        proc.start()
        try:
            started = queue.get(timeout=300)
            self.assertNotIn("crash", started)
            first = scrape(directory)
            go_on.set()
            done = queue.get(timeout=300)
            self.assertNotIn("crash", done)
        finally:
            go_on.set()
            proc.join(timeout=60)
        second = scrape(directory)
        labels = {name: str(value) for name, value in LABELS.items()}
        # sglang's own gauge carries the same labels as the plugin's series.
        self.assertIn(("sglang:num_running_reqs", labels, 0.0), first)
        for name, series_labels, _ in first + second:
            self.assertEqual({k: series_labels[k] for k in labels}, labels, name)
        # Every member once, at its state in the scheduler process.
        self.assertEqual(ones(first, metrics.MEMBER_STATE), started["started"])
        self.assertEqual(ones(second, metrics.MEMBER_STATE), done["done"])
        if ROW_HOOKED:  # the sizing ran between the scrapes: its earlier state reads 0
            row = plugin.Bug.ROW_OVERFLOW.value
            self.assertEqual(done["done"][row], "protected_by_plugin")
            earlier = started["started"][row]
            self.assertNotEqual(earlier, "protected_by_plugin")
            series = {
                lb["state"]: v for n, lb, v in second if n == metrics.MEMBER_STATE and lb["member"] == row
            }
            self.assertEqual(series, {earlier: 0.0, "protected_by_plugin": 1.0})

        def watch(samples, name):
            return {lb["kind"]: v for n, lb, v in samples if n == name}

        # The watch: every watched kind at 0 at start; then the one row write past the end.
        self.assertEqual(done["next_row"], [103, 104])  # the kernel wrote 2 columns into the next row
        violations = watch(second, metrics.WATCH_VIOLATIONS)
        self.assertEqual(watch(first, metrics.WATCH_VIOLATIONS), dict.fromkeys(violations, 0.0))
        self.assertEqual(violations, {**dict.fromkeys(violations, 0.0), "row_write": 1.0})
        self.assertEqual(watch(second, metrics.WATCH_COLUMNS), {"row_write": 2.0, "row_read": 0.0})
        self.assertEqual(watch(first, metrics.WATCH_CHECKING), dict.fromkeys(violations, 1.0))
        self.assertEqual(
            watch(second, metrics.WATCH_CHECKING), {**dict.fromkeys(violations, 1.0), "row_read": 0.0}
        )
        self.assertIn("dsa_replay", violations)


class TestMetricsOnlyWhereSglangsAreOn(PluginRegistration):
    def test_hooks_on_sglangs_collector_only_with_its_multiprocess_directory(self):
        def on_collector(**env):
            registered = self.register(SGLANG_DSA_FIX_WATCH="0", **env)
            return {target: registered.get(target, []) for target in metrics.TARGETS}

        self.assertEqual(on_collector(PROMETHEUS_MULTIPROC_DIR=""), dict.fromkeys(metrics.TARGETS, []))
        with tempfile.TemporaryDirectory() as directory:
            self.assertEqual(
                on_collector(PROMETHEUS_MULTIPROC_DIR=directory), dict.fromkeys(metrics.TARGETS, ["AFTER"])
            )

    def test_prometheus_client_missing_is_said_once(self):
        # sglang's collector cannot be built without prometheus_client (its __init__ imports it):
        # what the exporter reads of it, its labels.
        exporter = metrics.Exporter(lambda: {"page_table": "affected"})
        collector = SimpleNamespace(labels=dict(LABELS))
        with mock.patch.dict(sys.modules, {"prometheus_client": None}):
            with self.assertLogs("sglang_dsa_fix", level=logging.INFO) as logs:
                exporter.export(collector)
                exporter.export(collector)
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("nothing on /metrics: prometheus_client missing", logs.output[0])


if __name__ == "__main__":
    unittest.main()
