"""The operator's first screen (issue 37): the verdict line first, a short line per member, the
advice once, -q / -v, colour only on a terminal; the launch line as pasted; `explain`.

The status cases resolve through sglang's own argument processing in a child (~8 s each).
"""

import json
import os
import re
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from helpers import PatchToolTestCase, run_cli
from test_resolve import LLAMA

from sglang_dsa_fix import explain, launch_line, members, render, resolve
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.verdicts import State

TOKENS = {state.token for state in State}


class TestCheckScreen(PatchToolTestCase):
    def test_verdict_first_member_lines_advice_once(self):
        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 1, out)
        lines = out.splitlines()
        affected = len([line for line in lines[1:] if line.split()[:1] == ["affected"]])
        self.assertEqual(
            lines[0],
            f"sglang 0.5.14: {affected} of {len(members.registry())} affected — run `sglang-dsa-fix apply` "
            "(or install the plugin in the server's environment), then restart the server",
        )
        member_lines = [line for line in lines if line.startswith("  ")]
        self.assertEqual(len(member_lines), len(members.registry()))
        self.assertTrue(all(line.split()[0] in TOKENS for line in member_lines), out)
        self.assertTrue(all(len(line) <= render.MAX_LINE for line in lines[1:]), out)
        # Affected members first: the line that needs the operator leads.
        self.assertEqual([line.split()[0] for line in member_lines][:affected], ["affected"] * affected)
        self.assertEqual(len([line for line in lines if line.startswith("advice:")]), 1, out)
        self.assertNotIn("\x1b", out)  # not a terminal: no colour
        rc_q, quiet, _ = self.cli("check", "-q")
        self.assertEqual((rc_q, quiet.splitlines()), (rc, lines[:1]))

    def test_apply_and_revert_say_restart(self):
        for command in ("apply", "revert"):
            with self.subTest(command=command):
                rc, out, _ = self.cli(command)
                self.assertEqual(rc, 0, out)
                self.assertEqual(out.splitlines()[-1], render.RESTART)
        rc, out, _ = self.cli("revert")  # nothing changed: nothing to restart
        self.assertNotIn(render.RESTART, out)


class TestColour(unittest.TestCase):
    def test_only_on_a_terminal_and_never_with_no_color(self):
        tty = mock.Mock(isatty=lambda: True)
        with mock.patch.dict(os.environ, {"TERM": "xterm"}, clear=True):
            self.assertTrue(render.colour_wanted(tty))
            self.assertFalse(render.colour_wanted(mock.Mock(isatty=lambda: False)))
        with mock.patch.dict(os.environ, {"TERM": "xterm", "NO_COLOR": "1"}, clear=True):
            self.assertFalse(render.colour_wanted(tty))
        painted = render.screen(["head", "  affected            bug #1 x", "  note \x1b[2J"], colour=True)
        self.assertEqual(painted.splitlines()[1], "  \x1b[31maffected\x1b[0m            bug #1 x")
        self.assertEqual(painted.splitlines()[2], "  note \\x1b[2J")  # the input's own escapes stay escaped


class TestLaunchLine(unittest.TestCase):
    ARGS = ["--model-path", "m", "--speculative-algorithm", "EAGLE"]

    def test_as_pasted(self):
        for line in (
            ["python", "-m", "sglang.launch_server", *self.ARGS],
            ["python3.12", "-u", "-m", "sglang.launch_server", *self.ARGS],
            ["/opt/venv/bin/python3", "-m", "sglang.launch_server", *self.ARGS],
            ["sglang", "serve", *self.ARGS],
            ["/usr/local/bin/sglang", "serve", "--model-type", "llm", *self.ARGS],
            ["sglang", "serve", "--model-type=auto", *self.ARGS],
            self.ARGS,
        ):
            with self.subTest(line=line):
                self.assertEqual(launch_line.server_arguments(line), self.ARGS)

    def test_what_is_not_a_launch_line(self):
        for line, words in (
            (["python", "-m", "sglang.bench_serving", *self.ARGS], "not sglang's server launcher"),
            (["CUDA_VISIBLE_DEVICES=0", "python", "-m", "sglang.launch_server"], "environment assignment"),
            (["sglang", "serve", "--model-type", "diffusion", *self.ARGS], "diffusion"),
            (["vllm", "serve", *self.ARGS], "not a launch line this tool reads"),
        ):
            with self.subTest(line=line):
                with self.assertRaises(ToolError) as raised:
                    launch_line.server_arguments(line)
                self.assertIn(words, str(raised.exception))

    def test_missing_double_dash_is_hinted(self):
        rc, out, err = run_cli("status", "--model-path", "x", "--speculative-algorithm", "EAGLE")
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("the launch line goes after `--`", err)


class Stop(Exception):
    """Ends a status run once its request is made."""


class TestStatusAsPasted(unittest.TestCase):
    """The same deployment pasted three ways is judged the same; sglang's rejection and a missing
    config.json read as what they are."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="sglang-dsa-fix-screen-")
        cls.model = Path(cls.tmp.name) / "llama"
        cls.model.mkdir()
        (cls.model / "config.json").write_text(json.dumps(LLAMA))
        cls.args = ["--model-path", str(cls.model), "--speculative-algorithm", "NGRAM", "--device", "cuda"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def status(self, *line, env=None):
        with mock.patch.dict(os.environ, env or {}):
            return run_cli("status", "--json", "--", *line)

    def test_three_forms_one_verdict(self):
        # The first form is judged through sglang (a child that imports it, ~5 s); the others
        # are read by the same CLI up to the request that goes to that child, which must be the
        # first form's: the child is handed nothing else of the line.
        forms = (
            ["python", "-m", "sglang.launch_server", *self.args],
            ["sglang", "serve", *self.args],
            self.args,
        )
        requests = []
        real_request = resolve.Request

        def recorded(*args, **kwargs):
            requests.append(real_request(*args, **kwargs))
            if len(requests) > 1:
                raise Stop
            return requests[-1]

        with mock.patch.object(resolve, "Request", recorded):
            rc, out, err = self.status(*forms[0])
            for line in forms[1:]:
                with self.assertRaises(Stop):
                    self.status(*line)
        report = json.loads(out)
        self.assertIn(rc, (0, 1, 2), err)
        self.assertEqual(report["basis"], "sglang", report)
        self.assertEqual(report["configuration"]["speculative_algorithm"], "NGRAM", report)
        self.assertEqual(len(requests), 3)
        self.assertEqual(requests[1], requests[0])
        self.assertEqual(requests[2], requests[0])

    def test_sglang_s_rejection_names_the_launcher(self):
        rc, out, err = run_cli(
            "status", "--", "python", "-m", "sglang.launch_server", *self.args, "--no-such-flag"
        )
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("sglang.launch_server: error: unrecognized arguments: --no-such-flag", err)
        self.assertNotIn("-c:", err)

    def test_a_hub_id_offline_names_config_json(self):
        env = {"HF_HUB_OFFLINE": "1", "HF_HOME": self.tmp.name}
        rc, out, err = self.status("--model-path", "no-such-org/no-such-model", *self.args[2:], env=env)
        self.assertEqual(rc, 2)
        self.assertIn("needs the model's config.json", json.loads(out)["error"])
        self.assertIn("no-such-org/no-such-model is not a local directory", err)


class TestExplain(unittest.TestCase):
    MESSAGES = {
        "RuntimeError: The size of tensor a (614406) must match the size of tensor b (614408) at "
        "non-singleton dimension 1": ["page_table"],
        "ValueError: token_to_kv_pool_allocator memory leak detected! available_size=1, protected=0": [
            "req_to_token_row"
        ],
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered": None,
        "AssertionError: FA3 draft-decode page_table: used 257 > capacity 256": ["fa3_page_table"],
    }

    def test_each_known_message(self):
        graph_members = [
            m.bug.value for m in members.registry() if "illegal memory access" in str(m.symptoms)
        ]
        for message, expected in self.MESSAGES.items():
            with self.subTest(message=message[:40]):
                found = explain.explain(message)
                self.assertEqual([m["member"] for m in found["matches"]], expected or graph_members)
                self.assertTrue(all(m["releases"] and m["means"] for m in found["matches"]))
                rc, out, _ = run_cli("explain", message)
                self.assertEqual(rc, 0)
                self.assertTrue(out.splitlines()[-1].startswith("next: `sglang-dsa-fix check`"))
        self.assertIn("fa3_page_table", graph_members)

    def test_an_unknown_message_is_cannot_tell(self):
        rc, out, _ = run_cli("explain", "KeyError: 'foo'")
        self.assertEqual(rc, 2)
        self.assertIn("not a message this tool knows", out)
        self.assertIn("`used N > capacity N`", out)
        rc, out, _ = run_cli("explain", "--json", "KeyError: 'foo'")
        self.assertEqual((rc, json.loads(out)["matches"]), (2, []))


class TestHelpMatchesWhatIsAccepted(unittest.TestCase):
    def test_every_command(self):
        for command in ("check", "apply", "revert", "diff", "status", "explain", "demo"):
            with self.subTest(command=command):
                rc, out, _ = run_cli(command, "--help")
                self.assertEqual(rc, 0)
                options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", out)) - {"--help"}
                for option in options:
                    if option in ("--no-json",):
                        continue
                    rc, _, err = run_cli(command, option, "--help")
                    self.assertNotIn("unrecognized arguments", err, (command, option))
        self.assertNotIn("--sglang-root", run_cli("demo", "--help")[1])
        self.assertNotIn("--sglang-root", run_cli("explain", "--help")[1])


if __name__ == "__main__":
    unittest.main()
