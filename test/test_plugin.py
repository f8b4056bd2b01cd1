"""The SGLang plugin in real ``spawn`` processes, as sglang starts its schedulers.

Each child calls sglang's own ``load_plugins()`` (which finds this package through its
installed entry-point metadata), then builds the real backend and runs
``init_cuda_graph_state``; the parent checks the graph page_table width it reports.
"""

import logging
import multiprocessing
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from sglang_dsa_fix import plugin, source_patch, status  # noqa: E402

# What the installed release should show for Case(512, D=5, page 64): the hook target, and the
# pristine width evaluated from the release's own width expression (517 on 0.5.10 - 0.5.14).
TREE = source_patch.find_tree(None)
SITE = source_patch.locate(TREE)
TARGET = f"{SITE.layout.module}.{SITE.layout.class_name}.init_cuda_graph_state"
POOL_WIDTH = 512 + 4 + 5
PRISTINE_WIDTH = status._evaluate_width(SITE.expression, 512, 5, POOL_WIDTH)


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
        from sglang.srt.plugins import load_plugins

        from sglang_dsa_fix import replay
        from sglang_dsa_fix.backends import import_backend_class

        load_plugins()
        _, cls = import_backend_class()
        session = replay.GraphSession(cls, replay.Case(512, 5, 64, 2))
        result = session.replay("TARGET_VERIFY", 2, 514)
        queue.put((session.buffer_width, session.pool.req_to_token.shape[1],
                   result.error, result.mismatched_rows, records))
    except BaseException as exc:  # report, do not hang the parent
        queue.put(("error", repr(exc), None, None, records))


def run_in_spawned_process(**env):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(env, queue))
    proc.start()
    try:
        return queue.get(timeout=300)
    finally:
        proc.join(timeout=60)


@unittest.skipUnless(status._entry_point_installed(), "sglang-dsa-fix is not installed (pip install -e .)")
@unittest.skipUnless(status._plugin_state(TREE)["sglang_has_plugin_api"], "sglang < 0.5.11: no plugin API")
class TestPluginInSpawnedProcess(unittest.TestCase):
    def test_plugin_widens_the_buffer(self):
        buffer, pool, error, mismatched, records = run_in_spawned_process()
        self.assertEqual(buffer, pool, records)
        self.assertEqual((error, mismatched), (None, 0))
        infos = [m for level, m in records if level == "INFO"]
        self.assertIn(f"sglang-dsa-fix: applied (AFTER hook on {TARGET})", infos)
        self.assertIn(f"sglang-dsa-fix: CUDA-graph page_table widened from {PRISTINE_WIDTH} to "
                      f"{POOL_WIDTH} columns (req_to_token)", infos)

    def test_kill_switch_keeps_the_pristine_width(self):
        buffer, pool, error, _, records = run_in_spawned_process(SGLANG_DSA_FIX="0")
        self.assertEqual((buffer, pool), (PRISTINE_WIDTH, POOL_WIDTH), records)
        self.assertIn("must match the size of tensor b", error)
        self.assertIn(("INFO", "sglang-dsa-fix: disabled (SGLANG_DSA_FIX=0)"), records)

    def test_sglang_plugins_allow_list_naming_another_plugin(self):
        buffer, pool, error, _, records = run_in_spawned_process(SGLANG_PLUGINS="someone_else")
        self.assertEqual((buffer, pool), (PRISTINE_WIDTH, POOL_WIDTH), records)
        self.assertIn("must match the size of tensor b", error)
        self.assertEqual(records, [])  # never loaded

    def test_sglang_plugins_allow_list_naming_this_plugin(self):
        buffer, pool, _, _, _ = run_in_spawned_process(SGLANG_PLUGINS=plugin.ENTRY_POINT_NAME)
        self.assertEqual(buffer, pool)


class TestPluginNeverRaises(unittest.TestCase):
    def test_failure_is_one_warning(self):
        original = plugin.decide
        plugin.decide = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        try:
            with self.assertLogs("sglang_dsa_fix", level="WARNING") as logs:
                plugin.register()
        finally:
            plugin.decide = original
        self.assertEqual(logs.output, [
            "WARNING:sglang_dsa_fix:sglang-dsa-fix: unsupported (RuntimeError: boom); sglang untouched"])


if __name__ == "__main__":
    unittest.main()
