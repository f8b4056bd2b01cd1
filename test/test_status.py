"""``check`` and ``status`` on the real sglang files: one flow (tree -> plugin -> configuration ->
state -> exit code), the static rule per shape, where the plugin is looked for (the target
environment, not the caller's), forms judged by behaviour, and the version read as pip reads it."""

import json
import os
import unittest
from unittest import mock

from helpers import INSTALLED, PatchToolTestCase, run_cli

from sglang_dsa_fix import bugs, classify, plugin, release, tree

SHAPE = ["--context-length", "512", "--speculative-num-draft-tokens", "5", "--page-size", "64"]
ENTRY_POINTS = "[sglang.srt.plugins]\nsglang_dsa_fix = sglang_dsa_fix.plugin:register\n"

# A row sizing of the form sglang's own repository moves to: the decode reservation held at every
# page size (written here from that behaviour, not copied).
FIXED_FORM = b"""
def get_req_to_token_extra_context_len(server_args: ServerArgs) -> int:
    extra = 4 + (server_args.max_speculative_num_draft_tokens or 0)
    if server_args.speculative_algorithm is not None:
        for page in {1, server_args.page_size}:
            extra = max(extra, get_alloc_reserve_per_decode(server_args) + page - 1)
    return extra
"""
# A form this tool does not know: the reservation is not what raises the headroom.
UNKNOWN_FORM = b"""
def get_req_to_token_extra_context_len(server_args: ServerArgs) -> int:
    extra = 4 + 2 * (server_args.max_speculative_num_draft_tokens or 0)
    return extra
"""


class StatusTestCase(PatchToolTestCase):
    layout = "site-packages"  # so the tree's own site dir can hold (or not) the plugin

    def report(self, command, *extra, expect_rc=None):
        rc, out, err = self.cli(command, "--json", *extra)
        data = json.loads(out)
        self.assertEqual(rc, data["exit_code"], err)
        if expect_rc is not None:
            self.assertEqual(rc, expect_rc, out)
        return data

    def install_plugin(self, with_package=True):
        dist = self.tmp / "sglang_dsa_fix-0.3.0.dist-info"
        dist.mkdir()
        (dist / "entry_points.txt").write_text(ENTRY_POINTS)
        if with_package:
            (self.tmp / "sglang_dsa_fix").mkdir()
            (self.tmp / "sglang_dsa_fix" / "plugin.py").write_text("")

    def bug(self, report, name):
        return next(b for b in report["bugs"] if b["bug"] == name)

    def replace_sizing_function(self, source: bytes):
        data = self.sizing.read_bytes()
        start = data.index(b"\ndef get_req_to_token_extra_context_len(")
        end = data.index(b"\n    return extra\n", start) + len(b"\n    return extra\n")
        self.sizing.write_bytes(data[:start] + source + data[end:])


class TestStatusStatic(StatusTestCase):
    def test_pristine_affected_then_fixed_in_tree(self):
        report = self.report("status", *SHAPE, expect_rc=1)
        self.assertEqual(report["basis"], "static")
        self.assertFalse(report["plugin"]["installed"])
        page_table = self.bug(report, "page_table")
        self.assertEqual((page_table["state"], page_table["exit_code"]), ("affected", 1))
        self.assertEqual(
            page_table["found"], "self.max_context_len + (self.speculative_num_draft_tokens or 0)"
        )
        at = page_table["at_configuration"]
        self.assertEqual((at["req_to_token_width"], at["graph_page_table_width"]), (521, 517))
        # The longest target_verify: context_len + D - 4 with the overlap scheduler.
        self.assertEqual(at["longest_verify_seq_len"], 513)
        self.assertEqual(at["overflowing_seq_lens"], [513, 513])
        self.assertIn("advice", page_table)
        # D 5: the row is wide enough (2·5 - 3 = 7 <= 4 + 5): bug #2 not reachable here.
        row = self.bug(report, "req_to_token_row")
        self.assertEqual((row["state"], row["exit_code"]), ("not_reachable", 0))
        self.assertEqual(row["at_configuration"]["columns_past_row_end"], 0)

        self.cli("apply")
        report = self.report("status", *SHAPE, expect_rc=0)
        self.assertEqual(self.bug(report, "page_table")["state"], "fixed_in_tree")
        self.assertFalse(self.bug(report, "page_table")["at_configuration"]["reachable"])

    def test_row_overflow_per_shape(self):
        # 0.5.14 with overlap on: D - 7 columns past the row end from D 8 (shared ROW_OVERFLOW.md).
        for D, page, columns in ((7, 1, 0), (8, 1, 1), (9, 64, 2), (12, 1, 5), (16, 64, 9)):
            with self.subTest(D=D, page=page):
                report = self.report(
                    "status",
                    "--context-length",
                    "256",
                    "--speculative-num-draft-tokens",
                    str(D),
                    "--page-size",
                    str(page),
                )
                row = self.bug(report, "req_to_token_row")
                self.assertEqual(row["at_configuration"]["columns_past_row_end"], columns)
                self.assertEqual(row["exit_code"], 1 if columns else 0)
                self.assertEqual(row["at_configuration"]["row_extra_with_fix"], max(4 + D, 2 * D))
        report = self.report(
            "status",
            "--context-length",
            "256",
            "--speculative-num-draft-tokens",
            "9",
            "--disable-overlap-schedule",
        )
        self.assertEqual(self.bug(report, "req_to_token_row")["at_configuration"]["columns_past_row_end"], 1)

    def test_draft_tokens_4_keeps_bug_1_away(self):
        # README FAQ: D 4 (steps 3) is a workaround for bug #1 on 0.5.14; D 5 is not.
        for D, code in ((4, 0), (5, 1)):
            with self.subTest(D=D):
                report = self.report(
                    "status", "--context-length", "163840", "--speculative-num-draft-tokens", str(D)
                )
                page_table = self.bug(report, "page_table")
                self.assertEqual(page_table["exit_code"], code)
                self.assertEqual(page_table["at_configuration"]["longest_verify_seq_len"], 163840 + D - 4)

    def test_plugin_read_from_the_target_environment(self):
        # The caller's Python has the plugin (editable install); the target's site dir does not.
        with mock.patch.object(tree, "plugin_installed_here", return_value=True):
            report = self.report("status", *SHAPE, expect_rc=1)
        self.assertFalse(report["plugin"]["installed"])
        self.install_plugin()
        report = self.report("status", *SHAPE, expect_rc=0)
        self.assertTrue(report["plugin"]["installed"])
        self.assertEqual(self.bug(report, "page_table")["state"], "protected_by_plugin")
        self.assertIn("unless SGLANG_DSA_FIX=0", report["plugin"]["kill_switch"])

    def test_plugin_metadata_without_its_package_is_not_a_fix(self):
        self.install_plugin(with_package=False)
        report = self.report("check", expect_rc=1)
        self.assertFalse(report["plugin"]["installed"])

    def test_check_counts_the_plugin(self):
        # check, status and the README agree: an installed, enabled plugin protects (exit 0).
        self.assertEqual(self.report("check", expect_rc=1)["bugs"][0]["state"], "affected")
        self.install_plugin()
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 0)
        self.assertIn("protected by the plugin once sglang loads it", out)
        self.assertEqual(self.report("status", expect_rc=0)["exit_code"], 0)

    def test_kill_switch_in_this_shell_does_not_decide(self):
        # Only the server's environment decides; status says so instead of reading ours.
        self.install_plugin()
        with mock.patch.dict(os.environ, {plugin.KILL_SWITCH: "0"}):
            report = self.report("status", *SHAPE, expect_rc=0)
        self.assertEqual(self.bug(report, "page_table")["state"], "protected_by_plugin")

    def test_ray_launch_path_is_named(self):
        self.install_plugin()
        report = self.report("status")
        self.assertTrue(
            any("RayEngine" in note for note in report["plugin"]["not_loaded_by"]), report["plugin"]
        )
        actor = self.package / "srt/ray/scheduler_actor.py"
        actor.write_bytes(actor.read_bytes() + b"\n# load_plugins() called here in a fixed release\n")
        self.assertEqual(self.report("status")["plugin"]["not_loaded_by"], [])

    def test_release_without_plugin_api_is_told_to_apply(self):
        self.install_plugin()
        (self.package / "srt" / "plugins" / "hook_registry.py").unlink()
        report = self.report("status", expect_rc=1)
        self.assertFalse(report["plugin"]["live"])
        self.assertIn("run `sglang-dsa-fix apply`", self.bug(report, "page_table")["advice"])

    def test_text_output(self):
        rc, out, _ = self.cli("status", "-v", *SHAPE)
        self.assertEqual(rc, 1)
        self.assertIn("bug #1 CUDA-graph page_table width (crash): affected", out)
        self.assertIn("req_to_token width 521", out)
        self.assertIn("configuration (static rule from the shape flags", out)

    def test_not_an_sglang_tree(self):
        rc, out, err = run_cli("status", "--sglang-root", str(self.backend.parent))
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("not an sglang tree", err)

    def test_shape_flags_as_sglang_takes_them(self):
        report = self.report(
            "status", *SHAPE[:4], "--speculative-algorithm", "ngram", "--speculative-eagle-topk", "10"
        )
        self.assertEqual(report["configuration"]["speculative_algorithm"], "NGRAM")
        # sglang's human-readable ints: 160Ki = 163840, 1.6k = 1600.
        for text, value in (("160Ki", 163840), ("1.6k", 1600), ("4096", 4096)):
            with self.subTest(context_length=text):
                report = self.report(
                    "status", "--context-length", text, "--speculative-num-draft-tokens", "4"
                )
                self.assertEqual(report["configuration"]["context_length"], value)
        for argv, message in (
            (["--page-size", "1"], "needs --context-length"),
            (["--context-length", "1.5Ki", "--speculative-num-draft-tokens", "4"], "invalid integer"),
            (["--context-length", "256"], "go together"),
            (["--url", "http://x", *SHAPE], "--url judges the live server alone"),
            (["--gpu", "h200"], "go with `-- <launch_server args>`"),
            (["--allow-unsafe-dirs"], "go with `-- <launch_server args>`"),
            ([*SHAPE, "--", "--model-path", "x"], "shape flags are the static rule"),
        ):
            with self.subTest(argv=argv):
                rc, out, err = self.cli("status", *argv)
                self.assertEqual(rc, 2)
                self.assertIn(message, err)

    @unittest.skipUnless(tree.plugin_installed_here(), "sglang-dsa-fix is not installed (pip install -e .)")
    def test_own_environment_uses_its_metadata(self):
        rc, out, _ = run_cli("status", "--json")
        report = json.loads(out)
        self.assertTrue(report["plugin"]["installed"])
        self.assertEqual(report["sglang_path"], str(INSTALLED.package))


class TestFormsByBehaviour(StatusTestCase):
    """Bug #2 judged by the form of the row sizing, not by the version string."""

    def test_reservation_held_at_every_page_size_is_fixed_upstream(self):
        self.replace_sizing_function(FIXED_FORM)
        row = self.bug(self.report("check", expect_rc=1), "req_to_token_row")  # (bug #1: 1)
        self.assertEqual((row["state"], row["exit_code"]), ("fixed_upstream", 0))
        before = self.sizing.read_bytes()
        self.cli("apply")
        self.assertEqual(self.sizing.read_bytes(), before)  # apply leaves it alone
        self.assertEqual(self.report("check", expect_rc=0)["exit_code"], 0)

    def test_unknown_form_cannot_be_told(self):
        self.replace_sizing_function(UNKNOWN_FORM)
        self.cli("apply")  # fixes bug #1, leaves bug #2's file alone
        report = self.report("check", expect_rc=2)
        row = self.bug(report, "req_to_token_row")
        self.assertEqual((row["state"], row["exit_code"]), ("cannot_tell", 2))
        self.assertIn("in a form this tool knows", row["detail"])

    def test_page_gated_form_is_affected_at_page_1_only(self):
        # The 0.5.16+ form: widened only for page > 1.
        self.edit(
            self.sizing,
            b"        and server_args.page_size > 1\n        and (server_args.speculative_eagle_topk or 1) > 1\n",
            b"        and server_args.page_size > 1\n",
        )
        row = self.bug(self.report("check", expect_rc=1), "req_to_token_row")
        self.assertIn("at page 1 only", row["detail"])

    def test_margin_form_of_an_older_tool_is_recognised_and_reverted(self):
        data = self.sizing.read_bytes()
        old = (
            b"    # Hold the spec-v2 decode reservation: it writes this row up to kv_committed_len +\n"
            b"    # get_alloc_reserve_per_decode(), and kv_committed_len reaches context_len - 3.\n"
            b"    extra = max(extra, get_alloc_reserve_per_decode(server_args) - 3)\n"
        )
        self.sizing.with_name(self.sizing.name + ".sglang-dsa-fix.orig").write_bytes(data)
        self.edit(
            self.sizing,
            b"    return extra\n\n\ndef alloc_token_slots",
            old + b"    return extra\n\n\ndef alloc_token_slots",
        )
        row = self.bug(self.report("check"), "req_to_token_row")
        # The files carry the change (tree_state), but an older, partial form of it: no fix.
        self.assertEqual((row["tree_state"], row["state"]), ("fixed_in_tree", "affected"))
        self.assertEqual(row["action"], "revert_then_apply")
        self.assertIn("older sglang-dsa-fix", row["detail"])
        self.cli("revert")
        self.assertEqual(self.sizing.read_bytes(), data)


class TestVersion(StatusTestCase):
    def test_pep440_ordering(self):
        order = [
            "0.5.14",
            "0.5.15.dev3",
            "0.5.15.dev12+g0123abc",
            "0.5.15rc1",
            "0.5.15",
            "0.5.15.post1",
            "0.5.16",
        ]
        keys = [release.parse_version(v) for v in order]
        self.assertEqual(keys[1], keys[2])  # a local label does not order
        self.assertEqual(sorted(set(keys)), [k for i, k in enumerate(keys) if i != 2])
        self.assertFalse(release.at_least("0.5.15.dev3", (0, 5, 15)))
        self.assertTrue(release.at_least("0.5.15.post1", (0, 5, 15)))
        self.assertIsNone(release.parse_version("not a version"))

    def test_dist_info_wins_over_version_py(self):
        dist = self.tmp / "sglang-0.5.14.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.14.post2\n")
        self.assertEqual(self.report("check")["sglang_version"], "0.5.14.post2")

    def test_files_win_over_a_contradicting_version(self):
        # 0.5.14 files labelled 0.5.15 (or a 0.5.15 dev build): bug #2 keeps 0.5.14's margin.
        for label in ("0.5.15", "0.5.15.dev12+g0123abc"):
            with self.subTest(label=label):
                (self.package / "_version.py").write_text(f"__version__ = version = '{label}'\n")
                report = self.report(
                    "status", "--context-length", "256", "--speculative-num-draft-tokens", "8", expect_rc=1
                )
                if label == "0.5.15":  # (a dev build of 0.5.15 orders before 0.5.15: no contradiction)
                    self.assertIn("the files contradict the version", report["version_note"])
                row = self.bug(report, "req_to_token_row")
                self.assertEqual(row["at_configuration"]["columns_past_row_end"], 1)
                self.cli("apply")
                self.assertEqual(self.report("check")["exit_code"], 0)
                self.assertIn(b"get_alloc_reserve_per_decode(server_args))\n", self.sizing.read_bytes())
                self.cli("revert")


class TestAlgorithms(StatusTestCase):
    """Bug #2 per speculative algorithm, by the decode path it runs (``release.DECODE_PREPARE``)."""

    def judge(self, algorithm, **resolved_fields):
        files = classify.read_tree(tree.find_tree(str(self.tmp)))
        config = {
            "speculative_algorithm": algorithm,
            "speculative_num_draft_tokens": 16,
            "context_length": 256,
            "page_size": 1,
            "attention_backend": "flashinfer",  # (no bug #3 nor relative reached: bug #2 decides)
            **resolved_fields,
        }
        resolved = {
            "basis": "sglang",
            "configuration": config,
            "widths": {"row_extra": 20, "decode_reserve": 32, "alloc_page_size": 1},
        }
        entries, code = bugs.judge(files, tree.plugin_report(files.files, False), resolved)
        self.judge_entries = entries
        return self.bug({"bugs": entries}, "req_to_token_row"), code

    def test_dflash_family_is_judged_by_its_own_prepare(self):
        for algorithm in ("DFLASH", "DSPARK"):
            with self.subTest(algorithm=algorithm):
                row, code = self.judge(algorithm)
                self.assertIn("DFlashDraftInputV2.prepare_for_decode", row["at_configuration"]["note"])
                self.assertEqual((row["state"], code), ("affected", 1))

    def test_an_algorithm_sglang_runs_on_spec_v1_does_not_reach_bug_2(self):
        # sglang's own ScheduleBatch.is_spec_v2 (0.5.9 - 0.5.13) said False for it (the resolution
        # child's speculative_runs_spec_v2): no spec-v2 reservation; None (0.5.14+) judges as ever.
        for runs_v2, expected in ((False, ("not_reachable", 0)), (None, ("affected", 1))):
            with self.subTest(runs_v2=runs_v2):
                row, code = self.judge("NGRAM", speculative_runs_spec_v2=runs_v2)
                self.assertEqual((row["state"], code), expected)
                if runs_v2 is False:
                    self.assertIn("spec-v1", row["at_configuration"]["why_not"])

    def test_trtllm_mla_verify_mask_is_judged(self):
        # 0.5.14's TRT-LLM MLA sizes its verify tree mask D * (C + D) cells a request; with every
        # request of the largest batch at the longest verify (C + D - 4 = 260 at D 8, C 256) the
        # tree builder writes D * (s + D) = 2144 of 2112; the fixed row (C + 20) holds it.
        row, _ = self.judge("EAGLE", attention_backend="trtllm_mla", speculative_num_draft_tokens=8)
        entries = self.judge_entries
        mla = self.bug({"bugs": entries}, "trtllm_mla_kv_indices")
        at = mla["at_configuration"]
        self.assertEqual((at["verify_mask_cells_needed"], at["verify_mask_cells_per_request"]), (2144, 2112))
        self.assertEqual(at["verify_mask_cells_with_fix"], 8 * (256 + 20 + 8))
        self.assertEqual((at["reachable"], mla["state"]), (True, "affected"))

    def test_an_algorithm_without_a_rule_cannot_be_told(self):
        row, code = self.judge("WARP_DRIVE")
        self.assertEqual((row["state"], code), ("cannot_tell", 2))
        self.assertIn("no rule for its decode path", row["at_configuration"]["cannot_tell"])


if __name__ == "__main__":
    unittest.main()
