"""The in-tree patch tool and its CLI on the real sglang files of the installed release.

Both bugs: the backend file (bug #1) and the row sizing file (bug #2). Every bad input must give
one line on stderr, exit 2 and leave every file byte-identical (owner and mode too).
"""

import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
import unittest
from pathlib import Path

from helpers import INSTALLED, PAGE_TABLE_SITE, PatchToolTestCase, run_cli, tree_state

from sglang_dsa_fix import backend_layouts, classify, cli, graph_tables, snapshot, source_patch, tree
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.verdicts import Bug


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TestLifecycle(PatchToolTestCase):
    def test_check_apply_check_apply_revert(self):
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 1, out)
        lines = out.splitlines()
        self.assertTrue(
            lines[0].startswith("sglang 0.5.14: 7 of 8 affected — run `sglang-dsa-fix apply`"), out
        )
        self.assertTrue(lines[1].startswith("bug #1 CUDA-graph page_table width (crash): affected"), out)
        self.assertIn(f"{self.backend}:{PAGE_TABLE_SITE.lineno}", lines[1])
        self.assertTrue(lines[2].startswith("bug #2 req_to_token row overflow (silent corruption): affected"))
        self.assertTrue(lines[3].startswith("bug #3 FA3 CUDA-graph page tables (crash): affected"), out)

        rc, out, _ = self.cli("apply")
        self.assertEqual(rc, 0, out)
        self.assertIn(f"applied: {self.backend}", out)
        self.assertIn(f"applied: {self.sizing}", out)
        self.assertIn(f"applied: {self.fa3}", out)
        self.assertEqual(out.splitlines()[-1], "restart the server: sglang reads its files when it starts")
        for path in (self.backend, self.sizing, self.fa3):
            compile(path.read_bytes(), str(path), "exec")
        self.assertIn(b"self.req_to_token.shape[1],", self.backend.read_bytes())
        self.assertIn(b"-(-self.req_to_token.shape[1] // self.page_size)", self.fa3.read_bytes())

        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count(": fixed in-tree by sglang-dsa-fix"), 3 + len(self.relatives), out)

        before = tree_state(self.tmp)
        rc, out, _ = self.cli("apply")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("nothing to apply"), out)
        self.assertEqual(tree_state(self.tmp), before)

        rc, out, _ = self.cli("revert")
        self.assertEqual(rc, 0, out)
        self.assertEqual(sha(self.backend.read_bytes()), sha(self.original))
        self.assertEqual(sha(self.sizing.read_bytes()), sha(self.original_sizing))
        self.assertEqual(sha(self.fa3.read_bytes()), sha(self.original_fa3))
        self.assertFalse(snapshot.backup_path(self.fa3).exists())
        self.assertFalse(snapshot.backup_path(self.backend).exists())
        self.assertFalse(snapshot.backup_path(self.sizing).exists())
        self.assertEqual(self.cli("check")[0], 1)

        rc, out, _ = self.cli("revert")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("nothing to revert"), out)

    def test_only_the_sites_change(self):
        self.cli("apply")
        removed = set(self.original.splitlines()) - set(self.backend.read_bytes().splitlines())
        self.assertEqual(len(removed), 1)
        self.assertIn(PAGE_TABLE_SITE.found.encode(), removed.pop())
        # bug #2: lines are only added, right before the function's final return.
        before, after = self.original_sizing.splitlines(), self.sizing.read_bytes().splitlines()
        self.assertEqual(len(after) - len(before), 3)
        self.assertTrue(set(before) <= set(after))
        added = [line for line in after if line not in before]
        self.assertIn(b"extra = max(extra, get_alloc_reserve_per_decode(", added[-1])

    def test_json_on_success(self):
        rc, out, _ = self.cli("apply", "--json")
        data = json.loads(out)
        self.assertEqual((rc, data["action"]), (0, "apply"))
        changed = [self.backend, self.sizing, self.fa3, *self.relatives]
        self.assertEqual(sorted(data["changed"]), sorted(map(str, changed)))
        self.assertEqual(
            {b["tree_state"] for b in data["bugs"] if b["tree_state"] != "not_applicable"}, {"fixed_in_tree"}
        )
        rc, out, _ = self.cli("check", "--json")
        self.assertEqual((rc, json.loads(out)["exit_code"]), (0, 0))


class TestMetadataKept(PatchToolTestCase):
    def test_mode_kept(self):
        self.backend.chmod(0o640)
        self.cli("apply")
        self.assertEqual(self.backend.stat().st_mode & 0o777, 0o640)
        self.cli("revert")
        self.assertEqual(self.backend.stat().st_mode & 0o777, 0o640)

    @unittest.skipUnless(os.geteuid() == 0, "needs root to give the file to another user")
    def test_owner_and_group_kept(self):
        os.chown(self.backend, 4242, 4343)
        self.backend.chmod(0o600)
        self.cli("apply")
        st = self.backend.stat()
        self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o777), (4242, 4343, 0o600))
        self.assertEqual(snapshot.backup_path(self.backend).stat().st_uid, 4242)
        self.cli("revert")
        self.assertEqual(self.backend.stat().st_uid, 4242)

    def test_user_xattrs_kept(self):
        try:
            os.setxattr(self.backend, "user.origin", b"image-layer-3")
        except OSError:
            self.skipTest("this filesystem has no user xattrs")
        self.cli("apply")
        self.assertEqual(os.getxattr(self.backend, "user.origin"), b"image-layer-3")
        self.cli("revert")
        self.assertEqual(os.getxattr(self.backend, "user.origin"), b"image-layer-3")

    def test_symlinked_file_is_written_through(self):
        target = self.tmp / "elsewhere" / "dsa_backend.py"
        target.parent.mkdir()
        shutil.move(self.backend, target)
        self.backend.symlink_to(target)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertTrue(self.backend.is_symlink())
        self.assertIn(b"self.req_to_token.shape[1],", target.read_bytes())
        self.assertEqual(self.cli("check")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        self.assertTrue(self.backend.is_symlink())
        self.assertEqual(target.read_bytes(), self.original)


class TestBytecode(PatchToolTestCase):
    def compile_unchecked(self, path: Path):
        pyc = path.parent / "__pycache__" / f"{path.stem}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(
            str(path), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
        )
        return pyc

    def test_apply_removes_bytecode_and_check_notices_stale_bytecode(self):
        pyc = self.compile_unchecked(self.backend)
        self.cli("apply")
        self.assertFalse(pyc.exists(), "apply left bytecode Python would load instead of the fix")
        # Bytecode compiled from the pristine file and left beside the patched one:
        backup = snapshot.backup_path(self.backend)
        patched = self.backend.read_bytes()
        self.backend.write_bytes(backup.read_bytes())
        self.compile_unchecked(self.backend)
        self.backend.write_bytes(patched)
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 1, out)
        self.assertIn("fixed in source, but Python loads stale bytecode", out)
        self.assertEqual(self.cli("apply")[0], 0)  # apply cleans it up
        self.assertEqual(self.cli("check")[0], 0)

    def test_the_plugin_says_what_check_says_of_a_relative_apply_changed(self):
        # The plugin judges files without their backups; a relative's change carries no comment
        # of this tool's, so only the backup tells it from upstream's: fixed_in_tree, and with
        # the pristine file's bytecode left beside it, stale_bytecode (hooked), as check says.
        from sglang_dsa_fix import plugin
        from sglang_dsa_fix.verdicts import Hook, State

        triton = self.package / graph_tables.LAYOUTS[Bug.TRITON_KV_INDICES].relative_path
        self.assertEqual(self.cli("apply")[0], 0)

        def planned():
            return next(
                p for p in plugin.decide(tree.find_tree(str(self.tmp))) if p.bug is Bug.TRITON_KV_INDICES
            )

        self.assertEqual((planned().state, planned().hook), (State.FIXED_IN_TREE, Hook.NONE))
        patched = triton.read_bytes()
        triton.write_bytes(self.relatives[triton])
        self.compile_unchecked(triton)
        triton.write_bytes(patched)
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 1, out)
        self.assertEqual((planned().state, planned().hook), (State.PROTECTED_BY_PLUGIN, Hook.INSTALLED))
        self.assertTrue(planned().replace is not None)

    def test_revert_says_the_bytecode_apply_removed_is_not_restored(self):
        # Issue 34 item 8: pip installs timestamp .pycs beside sglang's files; apply removes
        # them, and revert used to leave them removed without a word.
        pyc = self.backend.parent / "__pycache__" / f"{self.backend.stem}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(self.backend), cfile=str(pyc))
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertFalse(pyc.exists())
        rc, out, err = self.cli("revert", "--json")
        self.assertEqual(rc, 0, err)
        (note,) = json.loads(out)["notes"]
        self.assertIn(f"no bytecode in __pycache__ for {self.backend.name}, ", note)
        self.assertIn("revert does not restore it", note)
        self.cli("apply")
        rc, out, err = self.cli("revert")
        self.assertIn(f"note: {note}\n", out)

    def test_revert_removes_bytecode(self):
        self.cli("apply")
        pyc = self.compile_unchecked(self.sizing)
        self.cli("revert")
        self.assertFalse(pyc.exists())


@unittest.skipUnless(shutil.which("git"), "needs git")
class TestUpstreamDiff(PatchToolTestCase):
    def git(self, *args):
        return subprocess.run(["git", *args], cwd=self.tmp, capture_output=True, text=True)

    def test_diff_applies_with_git_and_equals_apply(self):
        rc, diff, _ = self.cli("diff")
        self.assertEqual(rc, 0)
        for path in (self.backend, self.sizing):
            rel = path.relative_to(self.tmp).as_posix()
            self.assertIn(f"--- a/{rel}\n+++ b/{rel}\n", diff)
        (self.tmp / "fix.patch").write_text(diff)
        self.assertEqual(self.git("apply", "--check", "fix.patch").returncode, 0)
        self.assertEqual(self.git("apply", "fix.patch").returncode, 0)
        via_git = (self.backend.read_bytes(), self.sizing.read_bytes())
        # The README's checkout path: the tree git apply leaves is "fixed in-tree" (no backup).
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 0, out)
        self.assertIn("no backup", out)
        rc, out, err = self.cli("status")
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.cli("diff")[1], "")
        self.assertRefused("revert", "restore it with `git checkout`")
        self.backend.write_bytes(self.original)
        self.sizing.write_bytes(self.original_sizing)
        self.cli("apply")
        self.assertEqual((self.backend.read_bytes(), self.sizing.read_bytes()), via_git)

    def test_diff_is_the_same_after_apply(self):
        before = self.cli("diff")[1]
        self.cli("apply")
        self.assertEqual(self.cli("diff")[1], before)


class TestSitePackagesLayout(PatchToolTestCase):
    layout = "site-packages"

    def test_apply_revert_and_checkout_paths_in_diff(self):
        self.assertEqual(self.cli("check")[0], 1)
        diff = self.cli("diff")[1]
        self.assertIn("--- a/python/sglang/srt/layers/attention/", diff)
        self.assertIn("--- a/python/sglang/srt/mem_cache/", diff)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("check")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        self.assertEqual(self.backend.read_bytes(), self.original)


class TestBadInput(PatchToolTestCase):
    commands = ("check", "apply", "revert", "diff", "status")

    def test_wrong_paths(self):
        for command in self.commands:
            with self.subTest(command=command):
                self.assertRefused(command, "no such directory", self.tmp / "missing")
                self.assertRefused(command, "not an sglang tree", self.backend.parent)

    def test_json_error_on_every_command(self):
        for command in self.commands:
            with self.subTest(command=command):
                rc, out, err = run_cli(command, "--sglang-root", str(self.tmp / "missing"), "--json")
                self.assertEqual(rc, 2)
                self.assertIn("no such directory", json.loads(out)["error"])
                self.assertEqual(len(err.strip().splitlines()), 1)

    def test_allocation_not_found(self):
        self.edit(self.backend, b'"page_table": torch.zeros(', b'"page_table": torch.empty(')
        for command in self.commands:
            with self.subTest(command=command):
                self.assertRefused(command, "not recognised")

    def test_allocation_found_twice(self):
        self.edit(
            self.backend,
            b'"cu_seqlens_k": torch.zeros(\n                max_bs + 1,',
            b'"page_table": torch.zeros(\n                max_bs + 1, 7,',
        )
        for command in ("check", "apply"):
            with self.subTest(command=command):
                self.assertRefused(command, "found 2")

    def test_row_sizing_not_recognised(self):
        self.edit(
            self.sizing,
            b"    return extra\n\n\ndef alloc_token_slots",
            b"    return extra + 0\n\n\ndef alloc_token_slots",
        )
        for command in ("check", "apply", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "not recognised: expected get_req_to_token_extra_context_len")

    def test_file_that_does_not_parse(self):
        self.edit(self.backend, b"def init_cuda_graph_state(self", b"def init_cuda_graph_state(self,,")
        for command in ("check", "apply", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "does not parse")

    def test_empty_or_truncated_backend_file(self):
        for content in (b"", self.original[: len(self.original) // 3]):
            self.backend.write_bytes(content)
            for command in ("check", "apply", "status"):
                with self.subTest(command=command, size=len(content)):
                    self.assertRefused(command, "not recognised")

    def test_latin1_file(self):
        self.backend.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + self.original)
        rc, out, err = self.cli("diff")
        self.assertEqual(rc, 0, err)
        self.assertIn("+++ b/python/sglang/srt/layers/attention/", out)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        self.assertTrue(self.backend.read_bytes().startswith(b"# -*- coding: latin-1 -*-\n# caf\xe9\n"))

    def test_hand_edited_after_apply(self):
        self.cli("apply")
        self.edit(self.backend, b"\n", b"\n# local tweak\n")
        for command in ("check", "apply", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "changed since sglang-dsa-fix applied it")
        self.assertRevertedAllBut({self.backend}, "changed since sglang-dsa-fix applied it")

    def test_stale_backup_after_an_upgrade_says_how_to_recover(self):
        # An upgrade replaced the patched files; the backups of the old release stayed.
        self.cli("apply")
        backup = self.sizing.with_name(self.sizing.name + ".sglang-dsa-fix.orig")
        self.sizing.write_bytes(self.original_sizing + b"\n# the next release\n")
        self.assertRefused("check", f"`rm {backup}`")
        backup.unlink()
        self.assertEqual(self.cli("check")[0], 1)  # the new file, judged by itself

    def test_the_plugin_does_not_depend_on_backups(self):

        foreign = self.sizing.with_name(self.sizing.name + ".sglang-dsa-fix.orig")
        foreign.write_bytes(b"# not what this tool wrote\n")
        copy = tree.find_tree(str(self.tmp))
        with self.assertRaises(ToolError):
            classify.check(copy)
        states = classify.check(copy, wait=False, use_backups=False)  # what plugin.decide reads
        self.assertEqual(
            {s.verdict.value for s in states if s.verdict.value != "not_applicable"}, {"affected"}
        )

    def test_revert_killed_before_removing_its_backups(self):
        self.cli("apply")
        # The revert wrote the originals back, then died before removing the backups.
        self.backend.write_bytes(self.original)
        self.sizing.write_bytes(self.original_sizing)
        self.fa3.write_bytes(self.original_fa3)
        for path, original in self.relatives.items():
            path.write_bytes(original)
        rc, out, err = self.cli("revert")
        self.assertEqual(rc, 0, err)
        self.assertIn("nothing to revert", out)
        self.assertEqual(out.count(".sglang-dsa-fix.orig"), 3 + len(self.relatives), out)  # every backup
        self.assertEqual(list(self.package.rglob("*.sglang-dsa-fix.orig")), [])
        self.assertEqual(
            (self.backend.read_bytes(), self.sizing.read_bytes()), (self.original, self.original_sizing)
        )

    def test_fix_undone_by_hand_after_apply(self):
        self.cli("apply")
        self.edit(self.backend, b"self.req_to_token.shape[1],", PAGE_TABLE_SITE.found.encode() + b",")
        self.assertRefused("apply", "changed since sglang-dsa-fix applied it")
        self.assertRevertedAllBut({self.backend}, "changed since sglang-dsa-fix applied it")
        self.assertTrue(snapshot.backup_path(self.backend).exists())  # what the advice says to remove

    def test_backup_missing(self):
        self.cli("apply")
        snapshot.backup_path(self.backend).unlink()
        self.assertRevertedAllBut({self.backend}, "has no .sglang-dsa-fix.orig backup")

    def test_read_only_file(self):
        self.backend.chmod(0o444)
        self.assertRefused("apply", "read-only")

    def test_read_only_directory(self):
        self.sizing.parent.chmod(0o555)
        self.assertRefused("apply", "read-only")  # neither file changes: all or nothing

    def test_read_only_after_apply(self):
        self.cli("apply")
        self.backend.parent.chmod(0o555)
        attention = {path for path in self.changed_files if path.parent == self.backend.parent}
        self.assertRevertedAllBut(attention, f"{self.backend.parent}: read-only")

    @unittest.skipIf(os.geteuid() == 0, "root reads any file")
    def test_unreadable_file(self):
        self.backend.chmod(0o000)
        for command in ("check", "apply", "diff", "status"):
            with self.subTest(command=command):
                self.assertRefused(command, "cannot read")

    def test_return_sharing_its_line_is_refused(self):
        # A hand edit that puts another statement before `return extra` on its line: apply used to
        # patch mid-line, check then read the change as sglang's own form ("fixed upstream") and
        # revert left it patched beside an orphaned backup (issue 25 J).
        data = self.sizing.read_bytes()
        self.sizing.write_bytes(data.replace(b"\n    return extra\n", b"\n    pass; return extra\n", 1))
        for command in ("check", "apply", "diff", "status"):
            with self.subTest(command=command):
                self.assertRefused(command, "shares its line with other code")

    def test_permission_denied_reading_is_one_line(self):
        # As root nothing is unreadable, so the OS error is injected where the tool reads.
        from unittest import mock

        real_read = snapshot.read_at

        def read_at(loc):
            if loc.name == self.backend.name:
                raise PermissionError(13, "Permission denied", str(loc))
            return real_read(loc)

        with mock.patch.object(snapshot, "read_at", read_at):
            for command in ("check", "apply", "diff", "status"):
                with self.subTest(command=command):
                    self.assertRefused(command, "cannot read (Permission denied)")

    def test_disk_full_on_the_second_file_changes_nothing(self):
        real_write = source_patch._write
        calls = []

        def failing_write(path, data, metadata):
            calls.append(path)
            if len(calls) == 3:  # backup 1, file 1, then the second backup fails
                raise OSError(28, "No space left on device", str(path))
            return real_write(path, data, metadata)

        from unittest import mock

        with mock.patch.object(source_patch, "_write", failing_write):
            self.assertRefused("apply", "No space left on device")
        self.assertEqual(self.backend.read_bytes(), self.original)
        self.assertEqual(list(self.tmp.rglob("*.tmp")), [])

    def test_stale_temp_file_from_a_killed_run_is_removed(self):
        stale = self.backend.parent / f".{self.backend.name}.abc123.tmp"
        stale.write_bytes(b"half a file")
        rc, out, _ = self.cli("apply")
        self.assertEqual(rc, 0)
        self.assertFalse(stale.exists())
        self.assertIn(f"removed: {stale}", out)

    def test_stale_temp_files_go_with_the_next_check_apply_or_revert(self):
        # Issue 34 item 7: a killed run's temp file stayed until that same file was written
        # again: beside a backup, or beside a file the next run did not write, for ever.
        def plant() -> list:
            temps = [
                self.sizing.parent / f".{self.sizing.name}.0badc0de.tmp",
                self.backend.parent / f".{self.backend.name}.sglang-dsa-fix.orig.0badc0de.tmp",
            ]
            for temp in temps:
                temp.write_bytes(b"half a file")
            return temps

        for command, rc_expected in (("check", 1), ("revert", 0), ("apply", 0), ("check", 0)):
            with self.subTest(command=command):
                temps = plant()
                rc, out, err = self.cli(command, "--json")
                self.assertEqual(rc, rc_expected, err)
                self.assertEqual(sorted(json.loads(out)["removed"]), sorted(map(str, temps)))
                self.assertEqual(list(self.tmp.rglob("*.tmp")), [])

    def test_argument_errors(self):
        for argv in (
            ["check", "--sglang-root", ""],
            ["status", "--context-length", "-5", "--speculative-num-draft-tokens", "4"],
            ["status", "--context-length", "512"],
        ):
            with self.subTest(argv=argv):
                rc, out, err = run_cli(*argv)
                self.assertEqual((rc, out), (2, ""))
                self.assertIn("error:", err)
                self.assertNotIn("Traceback", err)
        rc, out, _ = run_cli("status", "--context-length", "512", "--json")
        self.assertEqual(rc, 2)
        self.assertIn("go together", json.loads(out)["error"])


class TestConcurrentRuns(PatchToolTestCase):
    def test_mixed_apply_revert_runs_serialise(self):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for _ in range(3):
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "sglang_dsa_fix", cmd, "--sglang-root", str(self.tmp)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    env=env,
                )
                for cmd in ["apply", "revert"] * 5
            ]
            for proc in procs:
                proc.wait(timeout=120)
                self.assertEqual(proc.returncode, 0, proc.stderr.read())
            rc, out, err = self.cli("check")
            self.assertIn(rc, (0, 1), (out, err))  # a consistent tree, whichever came last
            self.assertEqual(self.cli("revert")[0], 0)
            self.assertEqual(self.backend.read_bytes(), self.original)


class TestOtherReleases(PatchToolTestCase):
    def test_a_relatives_file_of_another_layout_is_that_bug_only(self):
        # A release that moved a class bug #3's relative edits: that bug cannot be told, the
        # others are judged and fixed as before.
        triton = self.package / backend_layouts.ATTENTION_DIR / "triton_backend.py"
        self.edit(triton, b"class TritonMultiStepDraftBackend", b"class TritonDraftBackendMoved")
        self.assertEqual(self.cli("check")[0], 1)
        states = self.report_states()
        self.assertEqual(states.pop("triton_kv_indices"), "cannot_tell")
        self.assertEqual(set(states.values()) - {"not_applicable"}, {"affected"})
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(
            set(self.report_states().values()) - {"not_applicable"}, {"fixed_in_tree", "cannot_tell"}
        )

    def report_states(self) -> dict:
        return {b["bug"]: b["tree_state"] for b in json.loads(self.cli("check", "--json")[1])["bugs"]}

    def test_no_backend_no_sizing_is_not_applicable(self):
        for path in [
            self.backend.parent / "dsa_backend.py",
            self.backend.parent / "nsa_backend.py",
            self.sizing,
            self.package / "srt/speculative/eagle_info_v2.py",
            self.fa3,
            *self.relatives,
        ]:
            path.unlink(missing_ok=True)
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count(": not applicable"), len(backend_layouts.GRAPH_TABLE_LAYOUTS) + 3, out)
        before = tree_state(self.tmp)
        self.assertEqual(self.cli("apply")[0], 0)
        rc, out, err = self.cli("diff")
        self.assertEqual((rc, out), (0, ""))
        self.assertEqual(tree_state(self.tmp), before)

    def test_non_utf8_path_with_a_strict_stdout(self):
        odd = Path(os.fsdecode(bytes(self.tmp) + b"-\xff"))
        self.tmp.rename(odd)
        self.addCleanup(lambda: odd.rename(self.tmp))
        env = {**os.environ, "PYTHONIOENCODING": "ascii:strict"}
        for command in ("apply", "check", "revert"):
            with self.subTest(command=command):
                proc = subprocess.run(
                    [sys.executable, "-m", "sglang_dsa_fix", command, "-v", "--sglang-root", str(odd)],
                    env=env,
                    capture_output=True,
                )
                self.assertIn(proc.returncode, (0, 1), proc.stderr)
                self.assertNotIn(b"Traceback", proc.stderr)
                self.assertIn(b"\\udcff", proc.stdout)

    def test_only_backups_left_after_pip_uninstall(self):
        self.cli("apply")
        for path in self.package.rglob("*"):
            if path.is_file() and not path.name.endswith(".sglang-dsa-fix.orig"):
                path.unlink()
        for command in ("check", "revert", "apply"):
            with self.subTest(command=command):
                self.assertRefused(
                    command,
                    f"sglang is not installed here any more; only {3 + len(self.relatives)} sglang-dsa-fix backup(s)",
                )

    def test_inline_row_sizing_is_not_covered(self):
        # 0.5.11 / 0.5.12: the spec-v2 reservation exists, the sizing function does not.
        self.sizing.unlink()
        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 1, out)  # bug #1 still affected
        self.cli("apply")
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 2, out)
        self.assertIn("bug #2 req_to_token row overflow (silent corruption): cannot tell", out)

    def test_fixed_upstream_through_a_local_name(self):
        # The 0.5.15+ shape: ``max_ctx_len = self.req_to_token.shape[1]`` then ``max_ctx_len``.
        self.edit(
            self.backend,
            b"        self.decode_cuda_graph_metadata: Dict = {",
            b"        max_ctx_len = self.req_to_token.shape[1]\n"
            b"        self.decode_cuda_graph_metadata: Dict = {",
        )
        self.edit(self.backend, PAGE_TABLE_SITE.found.encode() + b",", b"max_ctx_len,")
        rc, out, _ = self.cli("check", "-v")
        self.assertIn("bug #1 CUDA-graph page_table width (crash): fixed upstream", out)
        self.cli("apply")
        self.assertEqual(self.cli("check")[0], 0)
        self.assertIn(b"max_ctx_len,", self.backend.read_bytes())

    def test_narrower_old_expression_is_affected(self):
        # 0.5.4 - 0.5.9 size it ``self.max_context_len``.
        self.edit(self.backend, PAGE_TABLE_SITE.found.encode() + b",", b"self.max_context_len,")
        self.assertEqual(self.cli("check")[0], 1)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)


class TestConsoleScript(unittest.TestCase):
    def test_installed_sglang_is_checked_by_default(self):
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_dsa_fix", "check", "-v"], capture_output=True, text=True
        )
        from sglang_dsa_fix.tree import plugin_installed_here

        states = classify.check(INSTALLED)
        affected = any(s.verdict.name == "AFFECTED" for s in states)
        # An installed plugin (this venv's editable install) protects the affected bugs: exit 0.
        expected = 1 if affected and not plugin_installed_here() else 0
        self.assertEqual(proc.returncode, expected, proc.stderr)
        self.assertIn(str(PAGE_TABLE_SITE.path), proc.stdout)

    def test_version(self):
        from sglang_dsa_fix import __version__

        rc, out, _ = run_cli("--version")
        self.assertEqual((rc, out.strip()), (0, f"sglang-dsa-fix {__version__}"))

    def test_machine_contract(self):
        from sglang_dsa_fix import __version__

        rc, out, _ = run_cli("-V")
        self.assertEqual((rc, out.strip()), (0, f"sglang-dsa-fix {__version__}"))
        rc, out, _ = run_cli("--version", "--json")
        self.assertEqual(
            json.loads(out),
            {"schema_version": cli.SCHEMA_VERSION, "tool_version": __version__, "command": "version"},
        )
        for argv in (["check", "--json=1"], ["check", "--json"], ["diff", "--json"]):
            with self.subTest(argv=argv):
                rc, out, _ = run_cli(*argv)
                data = json.loads(out)
                self.assertEqual(
                    (data["schema_version"], data["tool_version"]), (cli.SCHEMA_VERSION, __version__)
                )
                self.assertEqual(data["sglang_version"], INSTALLED.version)
        rc, out, _ = run_cli("check", "--json=0")
        self.assertRaises(ValueError, json.loads, out)
        rc, out, _ = run_cli("frobnicate", "--json")
        self.assertEqual((rc, json.loads(out)["schema_version"]), (2, cli.SCHEMA_VERSION))

    def test_demo_without_torch_is_one_line(self):
        repo_python = str(Path(__file__).resolve().parents[1] / "python")
        for extra in ([], ["--json"]):
            with self.subTest(extra=extra):
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-S",
                        "-s",
                        "-c",
                        "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from sglang_dsa_fix import cli; sys.exit(cli.main(sys.argv[2:]))",
                        repo_python,
                        "demo",
                        *extra,
                    ],
                    capture_output=True,
                    text=True,
                )
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
                self.assertIn("needs torch and sglang", proc.stderr)
                if extra:
                    self.assertEqual(json.loads(proc.stdout)["exit_code"], 2)

    def test_usage_error(self):
        rc, out, err = run_cli("frobnicate")
        self.assertEqual(rc, 2)
        self.assertIn("invalid choice", err)
        # --json: the usage error as JSON too, from the top parser and from a subcommand's.
        for argv, said in ((("frobnicate", "--json"), "invalid choice"), (("check", "--json", "-x"), "-x")):
            with self.subTest(argv=argv):
                rc, out, err = run_cli(*argv)
                self.assertEqual((rc, json.loads(out)["exit_code"]), (2, 2))
                self.assertIn(said, json.loads(out)["error"])
        # Without --json nothing on stdout, in the same process after a --json run.
        self.assertEqual(run_cli("check", "-x")[:2], (2, ""))


if __name__ == "__main__":
    unittest.main()
