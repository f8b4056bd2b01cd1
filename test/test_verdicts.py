"""One verdict model: every state has one exit code, and the README's table says exactly that."""

import itertools
import re
import unittest
from pathlib import Path

from sglang_dsa_fix import plugin, server_status
from sglang_dsa_fix.verdicts import Bug, State, Verdict, combined_exit, judge

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
        # What a plugin reports per bug on /server_info, and what `status --url` exits with.
        table = readme_table("server-states")
        self.assertTrue(table)
        for state, code in table.items():
            with self.subTest(state=state):
                self.assertEqual(server_status.state_exit(state), code)


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
                elif verdict is Verdict.FIXED_IN_TREE and reachable:
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
        self.assertEqual(server_status.state_exit(f"{plugin.INSTALLED_STATE} (x)"), 0)
        self.assertEqual(server_status.state_exit("not reached (x never ran)"), 0)
        self.assertEqual(server_status.state_exit("failed (sglang's HookRegistry did not apply)"), 1)
        self.assertEqual(server_status.state_exit(plugin.ROW_INLINE_STATE), 1)
        for verdict, text in plugin.PLAN_STATE.items():
            with self.subTest(verdict=verdict):
                code = server_status.state_exit(text)
                self.assertEqual(code, 2 if verdict == Verdict.NOT_COVERED.value else 0)
        self.assertEqual({b.value for b in Bug}, {"page_table", "req_to_token_row"})


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


if __name__ == "__main__":
    unittest.main()
