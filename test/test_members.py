"""The family as a registry: every member keeps the contract (``proof.contract``) on the
installed release (the release matrix holds it to every other release it reads), and a member
missing any one obligation fails it."""

import ast
import dataclasses
import re
import unittest
from pathlib import Path
from unittest import mock

from helpers import INSTALLED

from sglang_dsa_fix import classify, members, sites
from sglang_dsa_fix.members import HookPlan
from sglang_dsa_fix.proof import contract
from sglang_dsa_fix.verdicts import Bug

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sglang_dsa_fix"
# The shared machinery of the flow: it asks the registry and names no member.
SHARED = (
    "classify.py",
    "bugs.py",
    "plugin.py",
    "source_patch.py",
    "members/__init__.py",
    "proof/contract.py",
    "watch.py",
    "replay_checks.py",
)


class TestRegistry(unittest.TestCase):
    def test_one_member_per_bug_and_every_watch_kind_owned(self):
        self.assertEqual(contract.registry_violations(), [])
        self.assertEqual([m.bug for m in members.registry()], list(Bug))

    def test_a_registry_missing_a_member_fails(self):
        with mock.patch.object(members, "_REGISTRY", list(members.registry()[:-1])):
            self.assertTrue(contract.registry_violations())

    def test_a_watch_kind_without_a_check_fails(self):
        kinds = list(members.watch_kinds())
        broken = dataclasses.replace(kinds[0], replay_check=None, batch_size_at=None)
        with mock.patch.object(members, "_WATCHES", [broken, *kinds[1:]]):
            self.assertIn(
                "not one of a replay check or a row check", " ".join(contract.registry_violations())
            )

    def test_a_row_check_without_its_argument_names_fails(self):
        kinds = list(members.watch_kinds())
        row = next(kind for kind in kinds if kind.span_at)
        broken = dataclasses.replace(row, parameters=row.parameters[:-1])
        with mock.patch.object(members, "_WATCHES", [broken if k is row else k for k in kinds]):
            self.assertIn("without the names of the arguments", " ".join(contract.registry_violations()))

    def test_a_watch_kind_no_unit_owns_fails(self):
        kinds = list(members.watch_kinds())
        targets = tuple(dataclasses.replace(t, kind="orphan_replay") for t in kinds[-1].targets)
        orphan = dataclasses.replace(
            kinds[-1], kind="orphan_replay", counters=("orphan_short", None), targets=targets
        )
        with mock.patch.object(members, "_WATCHES", [*kinds, orphan]):
            self.assertIn("['orphan_replay'] belong to no member", " ".join(contract.registry_violations()))

    def test_the_watch_machinery_names_no_kind(self):
        # Each kind, its counters and targets live in its member's unit (``WATCHES``).
        kinds = members.watch_kinds()
        names = [k.kind for k in kinds] + [n for k in kinds for n in k.counters if n]
        for name in ("watch.py", "replay_checks.py", "release.py", "metrics.py"):
            with self.subTest(name):
                text = (PACKAGE / name).read_text()
                self.assertEqual(sorted({n for n in names if re.search(rf"\b{n}\b", text)}), [], name)

    def test_the_shared_machinery_names_no_member(self):
        for name in SHARED:
            with self.subTest(name):
                text = (PACKAGE / name).read_text()
                self.assertEqual(re.findall(r"Bug\.[A-Z_]+", text), [], name)


class TestEveryMemberKeepsTheContract(unittest.TestCase):
    def test_on_the_installed_release(self):
        for member in members.registry():
            with self.subTest(member.bug.value):
                self.assertEqual(contract.violations(member, INSTALLED.package), [])


def _without(bug: Bug, **change):
    return dataclasses.replace(members.of(bug), **change)


class TestAMemberMissingAnObligationFails(unittest.TestCase):
    """Each obligation, removed from a member that keeps it, is reported."""

    def assertFails(self, member, words: str):
        found = contract.violations(member, INSTALLED.package)
        self.assertTrue(any(words in line for line in found), found)

    def test_no_watch_and_no_reason(self):
        self.assertFails(_without(Bug.FA3_PAGE_TABLE, watch=()), "no watch counter sees it")

    def test_a_watch_kind_the_watch_does_not_count(self):
        self.assertFails(
            _without(Bug.FA3_PAGE_TABLE, watch=("fa3_replay_typo",)), "no counters of the family watch"
        )

    def test_a_rule_without_an_answer(self):
        self.assertFails(
            _without(Bug.TRITON_KV_INDICES, rule=lambda *a: {"reachable": None}), "neither reached"
        )

    def test_a_hook_on_no_sglang_target(self):
        self.assertFails(_without(Bug.PAGE_TABLE, hook=lambda *a: HookPlan("elsewhere.f")), "plugin hook")

    def test_a_locator_that_does_not_know_its_own_change(self):
        locate = members.of(Bug.ROW_OVERFLOW).locate
        member = _without(Bug.ROW_OVERFLOW, locate=lambda files, data=None: locate(files))
        self.assertFails(member, "not recognised as applied")

    def test_a_locator_blind_to_upstream_s_own_spelling(self):
        locate = members.of(Bug.PAGE_TABLE).locate

        def blind(files, data=None):
            site = locate(files, data)
            return site and dataclasses.replace(site, fixed_upstream=False)

        member = _without(Bug.PAGE_TABLE, locate=blind)
        registry = [member if m.bug is member.bug else m for m in members.registry()]
        with mock.patch.object(members, "_REGISTRY", registry):  # (check asks the registry)
            self.assertFails(member, "not fixed_upstream")

    def test_a_plugin_that_labels_this_tools_change_upstreams(self):
        # What the plugin said of the relatives before it asked the backup (it judges each file
        # without one): a change apply wrote, in upstream's spelling, reported fixed_upstream.
        with mock.patch.object(classify, "judged_with_its_backup", side_effect=lambda files, state: state):
            self.assertFails(members.of(Bug.TRITON_KV_INDICES), "the plugin reports fixed_upstream")

    def test_a_locator_that_judges_the_first_definition(self):
        # What every locator did before ``pysource.kept``: the first class / method of the name.
        def first(body, name, kind):
            return next((n for n in body if isinstance(n, kind) and n.name == name), None)

        def first_method(module, cls, name):
            return first(cls.body, name, ast.FunctionDef)

        with mock.patch.object(sites, "kept", first), mock.patch.object(sites, "kept_method", first_method):
            self.assertFails(members.of(Bug.PAGE_TABLE), "not affected")

    def test_a_title_that_is_not_the_family_s(self):
        self.assertFails(_without(Bug.FLASHMLA_KV_INDICES, title="FlashMLA"), "title")

    def test_an_absent_text_that_is_not_what_check_says(self):
        self.assertFails(_without(Bug.MINIMAX_NVFP4_PAGE_TABLE, absent="no such thing"), "no site")


if __name__ == "__main__":
    unittest.main()
