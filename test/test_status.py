"""``sglang-dsa-fix status`` on the real sglang files: per bug, per shape, exit codes, and where the
plugin is looked for (the target environment, not the caller's)."""

import json
import os
import unittest
from unittest import mock

from helpers import INSTALLED, PatchToolTestCase, run_cli

from sglang_dsa_fix import plugin, status

SHAPE = ["--context-length", "512", "--speculative-num-draft-tokens", "5", "--page-size", "64"]
ENTRY_POINTS = "[sglang.srt.plugins]\ndsa_page_table_width = sglang_dsa_fix.plugin:register\n"


class TestStatus(PatchToolTestCase):
    layout = "site-packages"  # so the tree's own site dir can hold (or not) the plugin's metadata

    def report(self, *extra, expect_rc=None):
        rc, out, err = self.cli("status", "--json", *extra)
        data = json.loads(out)
        self.assertEqual(rc, data["exit_code"], err)
        if expect_rc is not None:
            self.assertEqual(rc, expect_rc, out)
        return data

    def install_plugin_metadata(self):
        dist = self.tmp / "sglang_dsa_fix-0.2.0.dist-info"
        dist.mkdir()
        (dist / "entry_points.txt").write_text(ENTRY_POINTS)

    def bug(self, report, name):
        return next(b for b in report["bugs"] if b["bug"] == name)

    def test_pristine_affected_then_fixed_in_tree(self):
        report = self.report(*SHAPE, expect_rc=1)
        self.assertFalse(report["plugin"]["installed"])
        page_table = self.bug(report, "page_table")
        self.assertEqual(page_table["verdict"], "affected")
        self.assertIsNone(page_table["fix_live"])
        self.assertEqual(
            page_table["found"], "self.max_context_len + (self.speculative_num_draft_tokens or 0)"
        )
        shape = page_table["shape"]
        self.assertEqual((shape["req_to_token_width"], shape["graph_page_table_width"]), (521, 517))
        self.assertEqual(shape["overflowing_seq_lens"], [513, 516])
        self.assertIn("advice", page_table)
        # D 5: the row is wide enough (2·5 - 3 = 7 <= 4 + 5): bug #2 protected at this shape.
        row = self.bug(report, "req_to_token_row")
        self.assertEqual((row["shape"]["columns_past_row_end"], row["exit_code"]), (0, 0))

        self.cli("apply")
        report = self.report(*SHAPE, expect_rc=0)
        self.assertEqual(self.bug(report, "page_table")["fix_live"], "in-tree")
        self.assertFalse(self.bug(report, "page_table")["shape"]["overflows"])

    def test_row_overflow_per_shape(self):
        # 0.5.14 with overlap on: D - 7 columns past the row end from D 8 (shared ROW_OVERFLOW.md).
        for D, page, columns in ((7, 1, 0), (8, 1, 1), (9, 64, 2), (12, 1, 5), (16, 64, 9)):
            with self.subTest(D=D, page=page):
                report = self.report(
                    "--context-length",
                    "256",
                    "--speculative-num-draft-tokens",
                    str(D),
                    "--page-size",
                    str(page),
                )
                row = self.bug(report, "req_to_token_row")["shape"]
                self.assertEqual(row["columns_past_row_end"], columns)
                self.assertEqual(self.bug(report, "req_to_token_row")["exit_code"], 1 if columns else 0)
        report = self.report(
            "--context-length", "256", "--speculative-num-draft-tokens", "9", "--disable-overlap-schedule"
        )
        self.assertEqual(self.bug(report, "req_to_token_row")["shape"]["columns_past_row_end"], 1)

    def test_plugin_read_from_the_target_environment(self):
        # The caller's Python has the plugin (editable install); the target's site dir does not.
        with mock.patch.object(status, "plugin_installed_here", return_value=True):
            report = self.report(*SHAPE, expect_rc=1)
        self.assertFalse(report["plugin"]["installed"])
        self.install_plugin_metadata()
        report = self.report(*SHAPE, expect_rc=0)
        self.assertTrue(report["plugin"]["installed"])
        self.assertEqual(self.bug(report, "page_table")["fix_live"], "plugin")
        self.assertIn("unless SGLANG_DSA_FIX=0", report["plugin"]["kill_switch"])
        self.assertFalse(self.bug(report, "page_table")["shape"]["overflows"])

    def test_kill_switch_in_this_shell_does_not_decide(self):
        # Only the server's environment decides; status says so instead of reading ours.
        self.install_plugin_metadata()
        with mock.patch.dict(os.environ, {plugin.KILL_SWITCH: "0"}):
            report = self.report(*SHAPE, expect_rc=0)
        self.assertEqual(self.bug(report, "page_table")["fix_live"], "plugin")

    def test_ray_launch_path_is_named(self):
        self.install_plugin_metadata()
        report = self.report()
        self.assertTrue(
            any("RayEngine" in note for note in report["plugin"]["not_loaded_by"]), report["plugin"]
        )
        actor = self.package / "srt/ray/scheduler_actor.py"
        actor.write_bytes(actor.read_bytes() + b"\n# load_plugins() called here in a fixed release\n")
        self.assertEqual(self.report()["plugin"]["not_loaded_by"], [])

    def test_release_without_plugin_api_is_told_to_apply(self):
        self.install_plugin_metadata()
        (self.package / "srt" / "plugins" / "hook_registry.py").unlink()
        report = self.report(expect_rc=1)
        self.assertFalse(report["plugin"]["live"])
        self.assertIn("run `sglang-dsa-fix apply`", self.bug(report, "page_table")["advice"])

    def test_text_output(self):
        rc, out, _ = self.cli("status", *SHAPE)
        self.assertEqual(rc, 1)
        self.assertIn("bug #1 CUDA-graph page_table width (crash): affected", out)
        self.assertIn("req_to_token width 521", out)

    def test_not_an_sglang_tree(self):
        rc, out, err = run_cli("status", "--sglang-root", str(self.backend.parent))
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("not an sglang tree", err)

    @unittest.skipUnless(status.plugin_installed_here(), "sglang-dsa-fix is not installed (pip install -e .)")
    def test_own_environment_uses_its_metadata(self):
        rc, out, _ = run_cli("status", "--json")
        report = json.loads(out)
        self.assertTrue(report["plugin"]["installed"])
        self.assertEqual(report["sglang_path"], str(INSTALLED.package))


class TestStatusURL(unittest.TestCase):
    def test_unreachable_server(self):
        rc, out, err = run_cli("status", "--url", "http://127.0.0.1:9", "--json")
        self.assertEqual(rc, 2)
        self.assertIn("cannot read server info", json.loads(out)["error"])

    def test_live_states(self):
        applied = {
            "summary": "s",
            "bugs": {"page_table": {"state": "applied"}, "req_to_token_row": {"state": "applied"}},
        }
        disabled = {"summary": "s", "bugs": {"page_table": {"state": "disabled (SGLANG_DSA_FIX=0)"}}}
        for ranks, code in (([applied, applied], 0), ([applied, disabled], 1), ([applied, None], 2), ([], 2)):
            info = {
                "version": "0.5.14",
                "internal_states": [{plugin.STATE_KEY: r} if r else {} for r in ranks],
            }
            with (
                self.subTest(ranks=len(ranks), code=code),
                mock.patch.object(status.urllib.request, "urlopen", return_value=_Response(info)),
            ):
                self.assertEqual(status.from_server("http://x")["exit_code"], code)


class _Response:
    def __init__(self, data):
        self.data = json.dumps(data).encode()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, *args):
        return self.data


if __name__ == "__main__":
    unittest.main()
