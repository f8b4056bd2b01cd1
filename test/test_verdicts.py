"""One verdict model: every state has one exit code, and the README's table says exactly that."""

import itertools
import re
import unittest
from pathlib import Path

from sglang_dsa_fix import backend_layouts, plugin, server_status
from sglang_dsa_fix.verdicts import Bug, Hook, State, Verdict, combined_exit, judge

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_table(marker: str) -> dict:
    """Rows ``| `token` | meaning | exit |`` of the table after ``<!-- marker -->``."""
    text = README.read_text()
    block = text[text.index(f"<!-- {marker} -->") :].split("\n\n", 1)[0]
    return {m[0]: int(m[1]) for m in re.findall(r"^\| `([^`]+)` \|.*\| (\d) \|$", block, re.M)}


class TestReadmeAgrees(unittest.TestCase):
    def test_state_exit_codes(self):
        self.assertEqual(readme_table("states"), {s.token: s.exit_code for s in State})

    def test_live_server_states(self):
        # Per hook, the state the plugin reports on /server_info and `status --url`'s exit.
        text = README.read_text()
        block = text[text.index("<!-- server-states -->") :].split("\n\n", 1)[0]
        rows = re.findall(r"^\| `([^`]+)` \| (.*) \| .* \| (\d|that state's) \|$", block, re.M)
        self.assertEqual({hook for hook, _, _ in rows}, {hook.value for hook in Hook})
        for hook, states, code in rows:
            with self.subTest(hook=hook):
                said = [token for token in re.findall(r"`([a-z_]+)`", states) if State.of_token(token)]
                self.assertTrue(said, states)
                for token in said:
                    expected = State.of_token(token).exit_code if code == "that state's" else int(code)
                    self.assertEqual(server_status.state_exit(token), expected)


class TestJudge(unittest.TestCase):
    def test_every_verdict(self):
        for verdict, plugin_fixes, reachable, fix_holds in itertools.product(
            Verdict, (False, True), (None, True, False), (True, False)
        ):
            with self.subTest(verdict=verdict, plugin=plugin_fixes, reachable=reachable, holds=fix_holds):
                state = judge(verdict, plugin_fixes, reachable, fix_holds)
                fixable = verdict in (Verdict.AFFECTED, Verdict.STALE_BYTECODE)
                if fixable and reachable is False:
                    self.assertIs(state, State.NOT_REACHABLE)
                elif fixable and plugin_fixes and fix_holds:
                    self.assertIs(state, State.PROTECTED_BY_PLUGIN)
                elif verdict in (Verdict.FIXED_IN_TREE, Verdict.FIXED_UPSTREAM) and (
                    reachable or (reachable is None and not fix_holds)
                ):
                    # The files carry the change, but at this configuration it does not hold.
                    self.assertIs(state, State.AFFECTED)
                else:
                    # A verdict never turns into a fix that is not running (nor one that does
                    # not hold), nor a fixed tree into "affected".
                    self.assertEqual(state.exit_code == 1, fixable)

    def test_combined_exit(self):
        self.assertEqual(combined_exit([0, 2, 1]), 1)
        self.assertEqual(combined_exit([0, 2]), 2)
        self.assertEqual(combined_exit([0, 0]), 0)

    def test_plugin_states_are_judged_by_status_url(self):
        # Every state the plugin itself can set maps to the exit code its meaning has.
        # The plugin reports State tokens: status --url reads each one's own exit code.
        for state in State:
            self.assertEqual(server_status.state_exit(state.token), state.exit_code)
        for verdict in Verdict:  # what the plugin says for a bug it does not hook
            with self.subTest(verdict=verdict):
                self.assertEqual(verdict.value, verdict.state.token)
        # Free text of plugins before 0.4 (older images): still judged by its prefix.
        self.assertEqual(server_status.state_exit("installed, not yet called (x)"), 0)
        self.assertEqual(server_status.state_exit("not reached (x never ran)"), 0)
        self.assertEqual(server_status.state_exit("failed (sglang's HookRegistry did not apply)"), 1)
        self.assertEqual(server_status.state_exit("cannot tell"), 2)
        self.assertEqual(
            {b.value for b in Bug},
            {"page_table", "req_to_token_row", "fa3_page_table"}
            | {layout.key for layout in backend_layouts.GRAPH_TABLE_LAYOUTS},
        )


class TestPackageMetadata(unittest.TestCase):
    def test_entry_points_classifiers_and_summary(self):
        import tomllib

        project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
        plugins = project["entry-points"]["sglang.srt.plugins"]
        # Both names load the one idempotent register(); status knows both.
        self.assertEqual(set(plugins), set(plugin.ENTRY_POINT_NAMES))
        self.assertEqual(set(plugins.values()), {"sglang_dsa_fix.plugin:register"})
        self.assertIn("Development Status :: 4 - Beta", project["classifiers"])
        self.assertIn("Programming Language :: Python :: 3.11", project["classifiers"])
        self.assertTrue(project["urls"])
        # The summary says what the README's first lines say: bug #2 from 0.5.9 to the newest.
        self.assertIn("0.5.9 - newest", project["description"])
        self.assertIn("0.5.9 – newest", README.read_text().split("\n## ", 1)[0])
        # ... and bug #3's releases, where the matrix says FA3's tables are affected.
        self.assertIn("FA3", project["description"])
        self.assertIn("0.5.4 – 0.5.23, FA3", README.read_text().split("\n## ", 1)[0])


if __name__ == "__main__":
    unittest.main()
