"""Every bug's text and JSON derive from its state (issue 27 e): over every tree state, plugin or
none, and no / a reached / an unreached configuration, through ``bugs.judge`` and both renderings
(``check``'s line, ``status``'s lines), nothing a bug says contradicts the state it is in.
"""

import itertools
import re
import unittest
from pathlib import Path
from types import SimpleNamespace

from sglang_dsa_fix import bugs, members, release, render, resolve
from sglang_dsa_fix.classify import BugState
from sglang_dsa_fix.verdicts import Bug, State, Verdict

FORM = release.form_for("0.5.17")
PLUGIN = {
    "installed": True,
    "live": True,
    "sglang_has_plugin_api": True,
    "not_loaded_by": [],
    "where": "x",
    "kill_switch": "k",
}
NO_PLUGIN = {**PLUGIN, "installed": False, "live": False}


def configuration(reached: bool) -> dict:
    """A resolved FA3 / DSA-free EAGLE deployment; ``reached``: D 9 at page 1 (bug #2 writes
    past the row, bug #3 reads past its table) or speculative decoding off (nothing reached)."""
    config = {
        "speculative_algorithm": "EAGLE" if reached else None,
        "speculative_num_draft_tokens": 9,
        "speculative_eagle_topk": 1,
        "page_size": 1,
        "context_length": 4096,
        "attention_backend": "fa3",
    }
    widths = {"row_extra": 13, "decode_reserve": 18, "alloc_page_size": 1, "row_extra_with_plugin": 18}
    return {"basis": "sglang", "configuration": config, "widths": widths}


def bug_state(bug: Bug, verdict: Verdict) -> BugState:
    site = SimpleNamespace(
        path=Path(f"/x/{bug.value}.py"),
        lineno=1,
        found="max_num_pages" if bug is Bug.FA3_PAGE_TABLE else "return extra",
        hookable=True,
        legacy=False,
        affected_when="at page 1 only: topk 1 from D 9",
    )
    site = None if verdict is Verdict.NOT_APPLICABLE else site
    detail = (
        "this row sizing is affected at page 1 only: topk 1 from D 9" if verdict is Verdict.AFFECTED else ""
    )
    return BugState(bug, verdict, site, detail=detail)


# `status --` where sglang could not be imported: no configuration.
UNRESOLVED = resolve.unresolved("python cannot import sglang (ModuleNotFoundError: numpy)")

# What only an unprotected, reached bug may say (numbers past a row / buffer as today's fact).
REACHED_WORDS = re.compile(
    r"(writes \d+ column|up to \d+ column|overflows for seq_len|crashes for seq_len|reads \d+ page\(s\) past)"
)
# The verdict line's words per exit code (``render.headline``).
HEADLINE = {1: "1 of 1 affected", 2: "cannot tell for 1 of 1", 0: "nothing to do"}


class TestTextFollowsState(unittest.TestCase):
    def test_every_state_every_output(self):
        seen = set()
        for bug, verdict, plugin_info, resolved in itertools.product(
            (Bug.ROW_OVERFLOW, Bug.FA3_PAGE_TABLE),
            Verdict,
            (PLUGIN, NO_PLUGIN),
            (None, configuration(True), configuration(False), UNRESOLVED),
        ):
            files = SimpleNamespace(states=[bug_state(bug, verdict)], form=FORM)
            entries, code = bugs.judge(files, plugin_info, resolved)
            entry = entries[0]
            state = State.of_token(entry["state"])
            seen.add(state)
            with self.subTest(bug=bug, verdict=verdict, plugin=plugin_info["live"], config=bool(resolved)):
                # JSON: one vocabulary; the files' state and the deployment's agree in kind.
                self.assertEqual(entry["tree_state"], verdict.state.token)
                self.assertEqual((entry["state_text"], entry["exit_code"]), (state.text, state.exit_code))
                self.assertEqual(code, state.exit_code)
                if state is State.PROTECTED_BY_PLUGIN:
                    self.assertIn(verdict, (Verdict.AFFECTED, Verdict.STALE_BYTECODE))
                if resolved is UNRESOLVED and verdict is not Verdict.NOT_APPLICABLE:
                    # No configuration: only what the files alone decide may be green.
                    self.assertIs(state, State.CANNOT_TELL)
                self.assertEqual("advice" in entry, state.exit_code == 1)
                at = entry.get("at_configuration", {})
                if at.get("overflowing_seq_lens"):
                    low, high = at["overflowing_seq_lens"]
                    self.assertLessEqual(low, high)  # never an empty range
                if resolved is not None and at:
                    # The form's general page rule is not printed beside a configuration's numbers.
                    self.assertNotIn("at page 1 only", entry["detail"])
                # Text: the state's own words; "reached" facts only as "without the plugin".
                report = {
                    "sglang_version": "x",
                    "sglang_path": "/x",
                    "plugin": plugin_info,
                    "bugs": entries,
                    "summary": bugs.summary(entries),
                    **(resolved or {}),
                }
                text = render.render_status(report)
                self.assertIn(f"{members.of(bug).title}: {state.text}", text)
                for line in text.splitlines():
                    if REACHED_WORDS.search(line) and state.exit_code != 1:
                        self.assertIn("without the plugin", line, (state, line))
                check_line = render._state_line(entry)
                self.assertTrue(check_line.startswith(f"{members.of(bug).title}: {state.text}"), check_line)
                # The first screen: the verdict line, and the member's line with its state token.
                short = render.render_status_short(report).splitlines()
                self.assertIn(HEADLINE[state.exit_code], short[0])
                line = next(line for line in short if members.of(bug).title in line)
                self.assertEqual(line.split()[0], state.token)
                if REACHED_WORDS.search(line):
                    self.assertEqual(state.exit_code, 1, line)
        # The sweep reaches every state but stale bytecode's own (it is one of the tree's).
        self.assertLessEqual(set(State) - seen, set())


if __name__ == "__main__":
    unittest.main()
