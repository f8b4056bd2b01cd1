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
from importlib import metadata

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from sglang_dsa_fix import plugin  # noqa: E402


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


def _entry_point_installed():
    return any(ep.name == plugin.ENTRY_POINT_NAME
               for ep in metadata.entry_points(group="sglang.srt.plugins"))


@unittest.skipUnless(_entry_point_installed(), "sglang-dsa-fix is not installed (pip install -e .)")
class TestPluginInSpawnedProcess(unittest.TestCase):
    def test_plugin_widens_the_buffer(self):
        buffer, pool, error, mismatched, records = run_in_spawned_process()
        self.assertEqual(buffer, pool, records)
        self.assertEqual((error, mismatched), (None, 0))
        infos = [m for level, m in records if level == "INFO"]
        self.assertIn("sglang-dsa-fix: applied (AFTER hook on sglang.srt.layers.attention."
                      "dsa_backend.DeepseekSparseAttnBackend.init_cuda_graph_state)", infos)
        self.assertIn("sglang-dsa-fix: CUDA-graph page_table widened from 517 to 521 columns "
                      "(req_to_token)", infos)

    def test_kill_switch_keeps_the_pristine_width(self):
        buffer, pool, error, _, records = run_in_spawned_process(SGLANG_DSA_FIX="0")
        self.assertEqual((buffer, pool), (517, 521), records)
        self.assertIn("must match the size of tensor b", error)
        self.assertIn(("INFO", "sglang-dsa-fix: disabled (SGLANG_DSA_FIX=0)"), records)

    def test_sglang_plugins_allow_list_naming_another_plugin(self):
        buffer, pool, error, _, records = run_in_spawned_process(SGLANG_PLUGINS="someone_else")
        self.assertEqual((buffer, pool), (517, 521), records)
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
