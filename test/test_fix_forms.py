"""Each member judged by what the code Python runs computes (issue 34, items 5, 6 and 8).

- upstream's own fix, however spelt (the rule's ``self.req_to_token.shape[1]``, an attribute set
  from the row in ``__init__``, a helper method, a property), is ``fixed_upstream`` and left
  untouched; a width that is wider but still narrower than the row (``+ D``) stays affected; one
  this tool cannot evaluate is ``cannot_tell``, never patched;
- a class or method defined twice is judged, patched and hooked in the definition Python keeps
  (the last); where other code binds the name last, ``cannot_tell``;
- the older TRT-LLM MLA form of this tool's change (block tables only) is no protection where
  the verify mask it left is reached.

The fixed forms are made here by editing a copy of the installed release's own files.
"""

import ast
import sys
import types
import unittest

from helpers import PatchToolTestCase

from sglang_dsa_fix import backend_layouts, bugs, classify, graph_tables, live_edit, plugin, tree
from sglang_dsa_fix.verdicts import Bug, Verdict

ROW = b"self.req_to_token.shape[1]"
POOL = b"self.req_to_token = model_runner.req_to_token_pool.req_to_token\n"
FA3_CLASS = backend_layouts.FA3_LAYOUT.class_name


def _definition(data: bytes, *names: str) -> ast.AST:
    """The first top-level class ``names[0]`` (or its method ``names[1]``) in these bytes."""
    node = ast.parse(data)
    for name in names:
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return node


def _span(data: bytes, node) -> tuple:
    """Byte range of a top-level-or-method definition's whole lines, decorators included."""
    lines = data.splitlines(keepends=True)
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return sum(map(len, lines[: first - 1])), sum(map(len, lines[: node.end_lineno]))


def within(data: bytes, names: tuple, old: bytes, new: bytes) -> bytes:
    """``old`` -> ``new`` inside one class or method only."""
    start, end = _span(data, _definition(data, *names))
    assert old in data[start:end], (names, old)
    return data[:start] + data[start:end].replace(old, new) + data[end:]


def with_alias(data: bytes, alias: bytes = b"req_to_token_capacity_len") -> bytes:
    """``self.<alias>`` set from the pool's row in ``__init__`` (PR #29665's attribute)."""
    indent = data[: data.index(POOL)].rsplit(b"\n", 1)[1]
    line = indent + b"self." + alias + b" = model_runner.req_to_token_pool.req_to_token.shape[1]\n"
    return data.replace(POOL, POOL + line, 1)


def with_method(data: bytes, class_name: str, source: bytes) -> bytes:
    """``source`` (a method at class-body indent) added as the class's last method."""
    start, end = _span(data, _definition(data, class_name))
    return data[:end] + b"\n" + source + data[end:]


def dsa_layout(package):
    """Bug #1's layout in this release (``sites.backend_file``: the newest whose file exists)."""
    return next(layout for layout in backend_layouts.LAYOUTS if (package / layout.relative_path).exists())


class FormsTestCase(PatchToolTestCase):
    def states(self) -> dict:
        return {s.bug: s for s in classify.check(tree.find_tree(str(self.tmp)))}

    def file_of(self, bug: Bug):
        site = self.states()[bug].site
        return None if site is None else site.path

    def assertUntouchedByApply(self, *paths):
        before = {path: path.read_bytes() for path in paths}
        self.assertIn(self.cli("apply")[0], (0, 1))
        for path in paths:
            self.assertEqual(path.read_bytes(), before[path], path)
            self.assertFalse(path.with_name(path.name + ".sglang-dsa-fix.orig").exists(), path)


class TestUpstreamSpellings(FormsTestCase):
    """Item 5: how upstream spells the row decides nothing; what the width evaluates to does."""

    def test_a_relative_in_the_rules_own_spelling_is_fixed_upstream(self):
        # The spelling #29379 fixed DSA with, in each relative, with no backup beside it: nothing
        # shows this tool wrote it, so it is sglang's own fix, not "fixed in-tree ... no backup".
        relatives = [
            layout for layout in backend_layouts.GRAPH_TABLE_LAYOUTS if Bug(layout.key) in self.states()
        ]
        changed = []
        for layout in relatives:
            state = self.states()[Bug(layout.key)]
            if state.verdict is Verdict.AFFECTED:
                state.site.path.write_bytes(state.site.patched_bytes())
                changed.append((Bug(layout.key), state.site.path))
        self.assertTrue(changed)
        states = self.states()
        for bug, _ in changed:
            self.assertIs(states[bug].verdict, Verdict.FIXED_UPSTREAM, bug)
        rc, out, _ = self.cli("check")
        self.assertNotIn("no backup", out)
        self.assertUntouchedByApply(*(path for _, path in changed))
        self.assertEqual(self.cli("revert")[0], 0)  # it was refused: "carries the fix but has no backup"
        self.assertEqual(self.backend.read_bytes(), self.original)

    def test_fa3_through_an_alias_attribute_is_fixed_upstream(self):
        alias = b"self.req_to_token_capacity_len"
        data = with_alias(self.original_fa3)
        names = (FA3_CLASS, "init_cuda_graph_state")
        data = within(data, names, b"self.max_context_len, self.page_size", b"max_num_pages * self.page_size")
        data = within(data, names, b"self.max_context_len", alias)
        self.fa3.write_bytes(data)
        self.assertIs(self.states()[Bug.FA3_PAGE_TABLE].verdict, Verdict.FIXED_UPSTREAM)
        self.assertUntouchedByApply(self.fa3)

    def test_fa3_through_helper_methods_is_fixed_upstream(self):
        data = with_method(
            self.original_fa3,
            FA3_CLASS,
            b"    def _graph_table_pages(self) -> int:\n"
            b'        """Pages of req_to_token\'s row."""\n'
            b"        row = self.req_to_token.shape[1]\n"
            b"        return -(-row // self.page_size)\n\n"
            b"    @property\n"
            b"    def row_width(self) -> int:\n"
            b"        return self.req_to_token.size(1)\n",
        )
        names = (FA3_CLASS, "init_cuda_graph_state")
        data = within(
            data,
            names,
            b"max_num_pages = (self.max_context_len + self.page_size - 1) // self.page_size",
            b"max_num_pages = self._graph_table_pages()",
        )
        data = within(data, names, b"self.max_context_len", b"self.row_width")
        self.fa3.write_bytes(data)
        self.assertIs(self.states()[Bug.FA3_PAGE_TABLE].verdict, Verdict.FIXED_UPSTREAM)
        self.assertUntouchedByApply(self.fa3)

    def test_fa3_wider_by_d_is_still_affected(self):
        # PR #35985's form: D more than context_len, still narrower than the row (C + D + 4 ...).
        wider = b"(self.max_context_len + self.speculative_num_draft_tokens)"
        data = within(self.original_fa3, (FA3_CLASS, "init_cuda_graph_state"), b"self.max_context_len", wider)
        self.fa3.write_bytes(data)
        self.assertIs(self.states()[Bug.FA3_PAGE_TABLE].verdict, Verdict.AFFECTED)

    def test_a_relative_through_an_alias_attribute_is_fixed_upstream(self):
        layout = graph_tables.LAYOUTS[Bug.TRTLLM_MHA_PAGE_TABLE]
        path = self.package / layout.relative_path
        if not path.exists():
            self.skipTest("no TRT-LLM MHA backend in this release")
        data = with_alias(path.read_bytes())
        data = within(
            data,
            (layout.classes[0][0],),
            b"self.max_context_len + self.page_size - 1",
            b"self.req_to_token_capacity_len + self.page_size - 1",
        )
        path.write_bytes(data)
        self.assertIs(self.states()[Bug.TRTLLM_MHA_PAGE_TABLE].verdict, Verdict.FIXED_UPSTREAM)
        self.assertUntouchedByApply(path)

    def test_dsa_through_a_helper_method_or_an_alias_is_fixed_upstream(self):
        layout = dsa_layout(self.package)
        found = self.states()[Bug.PAGE_TABLE].site.found.encode()
        method = b"    def _graph_width(self) -> int:\n        return max(self.max_context_len, self.req_to_token.shape[1])\n"
        for spelling, data in (
            (b"self._graph_width()", with_method(self.original, layout.class_name, method)),
            (b"self.req_to_token_capacity_len", with_alias(self.original)),
        ):
            with self.subTest(spelling=spelling):
                self.backend.write_bytes(
                    within(data, (layout.class_name, "init_cuda_graph_state"), found + b",", spelling + b",")
                )
                self.assertIs(self.states()[Bug.PAGE_TABLE].verdict, Verdict.FIXED_UPSTREAM)
        self.assertUntouchedByApply(self.backend)

    def test_a_width_that_does_not_evaluate_cannot_be_told_and_is_not_patched(self):
        layout = dsa_layout(self.package)
        found = self.states()[Bug.PAGE_TABLE].site.found.encode()
        self.edit(self.backend, found + b",", b"self.width_from_elsewhere,")
        state = self.states()[Bug.PAGE_TABLE]
        self.assertIs(state.verdict, Verdict.NOT_COVERED)
        self.assertIn("does not evaluate", state.detail)
        self.assertIn(layout.class_name, state.detail)
        self.assertUntouchedByApply(self.backend)

    def test_a_width_that_recurses_or_misuses_a_name_cannot_be_told(self):
        layout = dsa_layout(self.package)
        found = self.states()[Bug.PAGE_TABLE].site.found.encode()
        helpers = (
            b"    def _w(self) -> int:\n        return self._w()\n\n"
            b"    def _v(self) -> int:\n        return self.page_size.size(1)\n"
        )
        data = with_method(self.original, layout.class_name, helpers)
        for spelling in (b"self._w()", b"self._v()", b"self.req_to_token.shape[9]"):
            with self.subTest(spelling=spelling):
                names = (layout.class_name, "init_cuda_graph_state")
                self.backend.write_bytes(within(data, names, found + b",", spelling + b","))
                self.assertIs(self.states()[Bug.PAGE_TABLE].verdict, Verdict.NOT_COVERED)


class TestTheDefinitionPythonKeeps(FormsTestCase):
    """Item 6: a name defined twice is its last definition, for check, apply and the plugin."""

    def backend_files(self) -> dict:
        """{path: class name} of each file with a member's class in it here."""
        out = {}
        for layout in (dsa_layout(self.package), backend_layouts.FA3_LAYOUT):
            path = self.package / layout.relative_path
            if path.exists():
                out[path] = layout.class_name
        for layout in backend_layouts.GRAPH_TABLE_LAYOUTS:
            path = self.package / layout.relative_path
            if path.exists():
                out[path] = layout.classes[0][0]  # (Triton's second class stays single)
        return {path: name for path, name in out.items() if b"class " + name.encode() in path.read_bytes()}

    def duplicate_classes(self) -> dict:
        """Each backend class defined a second time, unchanged, at the end of its file."""
        files = self.backend_files()
        for path, name in files.items():
            data = path.read_bytes()
            start, end = _span(data, _definition(data, name))
            path.write_bytes(data + b"\n\n" + data[start:end])
        return {path: path.read_bytes() for path in files}

    def test_apply_changes_the_last_definition_and_check_judges_it(self):
        files = self.duplicate_classes()
        self.assertGreaterEqual(len(files), 5)
        self.assertEqual(self.cli("apply")[0], 0)
        names = self.backend_files()
        for path, before in files.items():
            with self.subTest(path.name):
                first_end = _span(before, _definition(before, names[path]))[1]
                after = path.read_bytes()
                self.assertEqual(after[:first_end], before[:first_end], "the first definition was changed")
                self.assertNotEqual(after, before, "the definition Python keeps was not changed")
        self.assertEqual(self.cli("check")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        for path, before in files.items():
            self.assertEqual(path.read_bytes(), before)

    def test_a_change_in_the_first_definition_only_is_no_fix(self):
        files = self.backend_files()
        self.assertEqual(self.cli("apply")[0], 0)
        for path, name in files.items():  # the pristine class again, after the patched one
            pristine = path.with_name(path.name + ".sglang-dsa-fix.orig")
            data = pristine.read_bytes()
            start, end = _span(data, _definition(data, name))
            path.write_bytes(path.read_bytes() + b"\n\n" + data[start:end])
            pristine.unlink()
        states = self.states()
        for path in files:
            bugs_here = [s for s in states.values() if s.site is not None and s.site.path == path]
            for state in bugs_here:
                self.assertIs(state.verdict, Verdict.AFFECTED, (state.bug, state.detail))
        planned = {p.bug for p in plugin.decide(tree.find_tree(str(self.tmp))) if p.target}
        self.assertIn(Bug.PAGE_TABLE, planned)
        self.assertIn(Bug.FA3_PAGE_TABLE, planned)

    def test_a_method_defined_twice(self):
        layout = dsa_layout(self.package)
        method = _definition(self.original, layout.class_name, "init_cuda_graph_state")
        start, end = _span(self.original, method)
        data = self.original[:end] + b"\n" + self.original[start:end] + self.original[end:]
        self.backend.write_bytes(data)
        self.assertEqual(self.cli("apply")[0], 0)
        after = self.backend.read_bytes()
        self.assertEqual(after[:end], data[:end])  # the first one, which the second replaces
        self.assertNotEqual(after, data)

    def test_a_name_bound_again_by_other_code_cannot_be_told(self):
        files = self.backend_files()
        for path, name in files.items():
            path.write_bytes(path.read_bytes() + f"\n\nif _SOME_FLAG:\n    {name} = None\n".encode())
        states = self.states()
        for path in files:
            for state in (s for s in states.values() if s.site is not None and s.site.path == path):
                self.assertIs(state.verdict, Verdict.NOT_COVERED, state.bug)
                self.assertIn("which one Python keeps is not in the source", state.detail)
        self.assertUntouchedByApply(*files)

    def test_the_plugin_compiles_the_definition_python_keeps(self):
        layout = graph_tables.LAYOUTS[Bug.TRTLLM_MHA_PAGE_TABLE]
        path = self.package / layout.relative_path
        if not path.exists():
            self.skipTest("no TRT-LLM MHA backend in this release")
        ((class_name, _),) = layout.classes
        data = path.read_bytes()
        start, end = _span(data, _definition(data, class_name))
        data += b"\n\n" + data[start:end]
        path.write_bytes(data)
        site = self.states()[Bug.TRTLLM_MHA_PAGE_TABLE].site
        self.assertTrue(
            all(edit.start > len(data) - (end - start) for edit in site.edits), "judged the first"
        )
        module = types.ModuleType("sglang_dsa_fix_test_duplicated_backend")
        # Registered while it runs (its dataclasses look it up); the modules it imports stay,
        # as after any import (dropping them would leave triton half-imported for later tests).
        sys.modules[module.__name__] = module
        try:
            exec(compile(data, str(path), "exec", dont_inherit=True), module.__dict__)
        finally:
            del sys.modules[module.__name__]
        replaced = live_edit.patched_methods(site, module)
        self.assertTrue(replaced)
        kept_class = vars(module)[class_name]
        for (_, name), function in replaced.items():
            self.assertEqual(function.__code__.co_firstlineno, vars(kept_class)[name].__code__.co_firstlineno)
            self.assertNotEqual(function.__code__, vars(kept_class)[name].__code__)


class TestTheOlderMlaForm(FormsTestCase):
    """Item 8 (last clause): this tool's earlier TRT-LLM MLA change (block tables only, the
    verify mask as sglang wrote it) is no protection where that mask is reached."""

    MASK = backend_layouts.VERIFY_MASK_EXPR.encode()

    def test_it_is_affected_where_the_mask_is_reached(self):
        path = self.package / graph_tables.LAYOUTS[Bug.TRTLLM_MLA_KV_INDICES].relative_path
        if not path.exists() or self.MASK not in path.read_bytes():
            self.skipTest("no TRT-LLM MLA verify mask sized from context_len in this release")
        self.assertEqual(self.cli("apply")[0], 0)
        fixed_mask = self.MASK.replace(b"self.max_context_len", ROW)
        path.write_bytes(path.read_bytes().replace(fixed_mask, self.MASK))  # the earlier form
        files = classify.read_tree(tree.find_tree(str(self.tmp)))
        state = next(s for s in files.states if s.bug is Bug.TRTLLM_MLA_KV_INDICES)
        self.assertEqual((state.verdict, state.site.legacy), (Verdict.FIXED_IN_TREE, True))
        config = {
            "speculative_algorithm": "EAGLE",
            "speculative_num_draft_tokens": 8,
            "context_length": 256,
            "page_size": 1,
            "attention_backend": "trtllm_mla",
        }
        resolved = {
            "basis": "sglang",
            "configuration": config,
            "widths": {"row_extra": 20, "decode_reserve": 16, "alloc_page_size": 1},
        }
        entries, code = bugs.judge(files, tree.plugin_report(files.files, False), resolved)
        mla = next(e for e in entries if e["bug"] == Bug.TRTLLM_MLA_KV_INDICES.value)
        at = mla["at_configuration"]
        # D * (C + D) cells a request as sglang sized it; D * (s + D) written at s = C + D - 4.
        self.assertEqual((at["verify_mask_cells_per_request"], at["verify_mask_cells_needed"]), (2112, 2144))
        self.assertEqual((mla["state"], code), ("affected", 1))
        self.assertIn("older form", mla["advice"])


if __name__ == "__main__":
    unittest.main()


class TestRememberedAnswers(FormsTestCase):
    def test_a_locator_answers_by_the_bytes_and_the_plugin_forgets_them(self):
        # pysource.by_source: the same bytes, the same (remembered) answer; other bytes, their
        # own; forget_parsed (the plugin, once its decisions are made) keeps no file's bytes.
        from sglang_dsa_fix import pysource
        from sglang_dsa_fix.members.fa3 import sites as fa3_sites

        data = self.fa3.read_bytes()
        first = fa3_sites.locate(data, self.fa3)
        self.assertIs(fa3_sites.locate(data, self.fa3), first)
        patched = fa3_sites.locate(first.patched_bytes(), self.fa3)
        self.assertTrue(patched.patched_here and not first.patched_here)
        pysource.forget_parsed()
        self.assertEqual(fa3_sites.locate.cache_info().currsize, 0)
        self.assertEqual(graph_tables._locate.cache_info().currsize, 0)
