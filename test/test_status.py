"""``sglang-dsa-fix status`` on the real backend file: pristine, applied, plugin on/off."""

import json
import os
import sys
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from test_patch_tool import PatchToolTestCase, run_cli  # noqa: E402

from sglang_dsa_fix import plugin, status  # noqa: E402

SHAPE = ["--context-length", "512", "--speculative-num-draft-tokens", "5", "--page-size", "64"]


class TestStatus(PatchToolTestCase):
    def report(self, **env):
        with mock.patch.dict(os.environ, env):
            rc, out, err = self.cli("status", "--json", *SHAPE)
        self.assertEqual(rc, 0, err)
        return json.loads(out)


    def test_pristine_affected_then_fixed_in_tree(self):
        with mock.patch.dict(os.environ, {plugin.KILL_SWITCH: "0"}):
            report = self.report()
        self.assertEqual(report["verdict"], "affected")
        self.assertIsNone(report["fix_live"])
        self.assertEqual(report["width_expression"],
                         "self.max_context_len + (self.speculative_num_draft_tokens or 0)")
        shape = report["shape"]
        self.assertEqual(shape["req_to_token_width"], 521)
        self.assertEqual(shape["graph_page_table_width_effective"], 517)
        self.assertTrue(shape["target_verify_can_overflow"])
        self.assertEqual(shape["overflowing_seq_lens"], [513, 516])
        self.assertIn("advice", report)

        self.cli("apply")
        report = self.report(**{plugin.KILL_SWITCH: "0"})
        self.assertEqual(report["verdict"], "fixed in-tree by sglang-dsa-fix")
        self.assertEqual(report["fix_live"], "in-tree")
        self.assertFalse(report["shape"]["target_verify_can_overflow"])

    def test_plugin_enabled_and_disabled(self):
        installed = mock.patch.object(status, "_entry_point_installed", return_value=True)
        with installed:
            on = self.report(**{plugin.KILL_SWITCH: "1", "SGLANG_PLUGINS": ""})
            off = self.report(**{plugin.KILL_SWITCH: "0"})
            other = self.report(**{plugin.KILL_SWITCH: "1", "SGLANG_PLUGINS": "other"})
        self.assertTrue(on["plugin"]["enabled"])
        self.assertEqual(on["fix_live"], "plugin")
        self.assertFalse(on["shape"]["target_verify_can_overflow"])
        for report in (off, other):
            self.assertFalse(report["plugin"]["enabled"])
            self.assertIsNone(report["fix_live"])
            self.assertTrue(report["shape"]["target_verify_can_overflow"])

    def test_release_without_plugin_api_is_told_to_apply(self):
        (self.backend.parents[2] / "plugins" / "hook_registry.py").unlink()
        report = self.report(**{plugin.KILL_SWITCH: "1"})
        self.assertFalse(report["plugin"]["sglang_has_plugin_api"])
        self.assertFalse(report["plugin"]["enabled"])
        self.assertIn("run `sglang-dsa-fix apply`", report["advice"])

    @unittest.skipUnless(status._entry_point_installed(), "sglang-dsa-fix is not installed")
    def test_installed_plugin_is_reported_enabled(self):
        # The real entry-point metadata of this environment, against the installed sglang.
        with mock.patch.dict(os.environ, {plugin.KILL_SWITCH: "1", "SGLANG_PLUGINS": ""}):
            rc, out, _ = run_cli("status", "--json")
        report = json.loads(out)
        self.assertEqual(rc, 0)
        self.assertTrue(report["plugin"]["installed"])
        self.assertTrue(report["plugin"]["enabled"])

    def test_topk_above_one_with_pages_is_refused(self):
        rc, out, err = self.cli("status", "--context-length", "512", "--speculative-num-draft-tokens",
                                "5", "--page-size", "64", "--speculative-eagle-topk", "2")
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("not supported by the DSA backend", err)

    def test_text_output(self):
        rc, out, _ = self.cli("status", *SHAPE)
        self.assertEqual(rc, 0)
        self.assertIn("verdict: affected", out)
        self.assertIn("req_to_token width 521", out)

    def test_not_an_sglang_tree(self):
        rc, out, err = run_cli("status", "--sglang-root", str(self.backend.parent))
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("not an sglang tree", err)


if __name__ == "__main__":
    unittest.main()
