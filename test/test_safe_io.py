"""The patch tool's I/O: source encodings, the plugin and the tree lock, errors that name their
file, and files planted where the tool writes (any user)."""

import errno
import fcntl
import os
import shutil
import time
from unittest import mock

from helpers import PAGE_TABLE_SITE, PatchToolTestCase, tree_state

from sglang_dsa_fix import classify, plugin, safe_files, snapshot, source_patch, tree
from sglang_dsa_fix.tree import BACKUP_SUFFIX
from sglang_dsa_fix.verdicts import Bug, Verdict

FULL = os.environ.get("SGLANG_DSA_FIX_FULL") == "1"
COOKIE = b"# -*- coding: latin-1 -*-\n"


class TestSourceEncoding(PatchToolTestCase):
    def test_latin1_byte_before_the_width_on_its_line(self):
        # The non-ASCII byte sits on the width's own line, before it: ast's columns count it as
        # two bytes (UTF-8), the file as one (latin-1).
        found = PAGE_TABLE_SITE.found.encode()
        data = self.original
        at = data.index(found)
        line_start = data.rindex(b"\n", 0, at) + 1
        self.assertEqual(data[line_start:at].strip(), b"", "the width has a line of its own")
        joined = data[: line_start - 2] + b' if "caf\xe9" else 0, ' + data[at:]  # onto the line above
        self.assertEqual(data[line_start - 2 : line_start - 1], b",")
        self.backend.write_bytes(COOKIE + joined)
        compile(self.backend.read_bytes(), "x", "exec")

        rc, out, err = self.cli("check", "-v")
        self.assertEqual(rc, 1, err)
        self.assertIn(f"`{PAGE_TABLE_SITE.found}`", out)
        rc, diff, err = self.cli("diff")
        self.assertEqual(rc, 0, err)
        self.assertIn(f' if "caf\udce9" else 0, {PAGE_TABLE_SITE.found},\n+', diff)
        self.assertIn(' if "caf\udce9" else 0, self.req_to_token.shape[1],\n ', diff)
        rc, out, err = self.cli("apply")
        self.assertEqual(rc, 0, err)
        patched = self.backend.read_bytes()
        compile(patched, "x", "exec")
        self.assertIn(b' if "caf\xe9" else 0, self.req_to_token.shape[1],', patched)
        self.assertEqual(self.cli("check")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        self.assertEqual(self.backend.read_bytes(), COOKIE + joined)

    def test_unknown_coding_cookie_is_one_line(self):
        self.backend.write_bytes(b"# -*- coding: no-such-codec -*-\n" + self.original)
        for command in ("check", "apply", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "not recognised")


class TestPluginDoesNotWait(PatchToolTestCase):
    def test_decide_while_another_run_holds_the_lock(self):
        copy = tree.find_tree(str(self.tmp))
        with mock.patch.object(tree, "find_tree", return_value=copy):
            unlocked = [(p.bug, p.state, p.target) for p in plugin.decide()]
            fd = os.open(self.package, os.O_RDONLY | os.O_DIRECTORY)
            self.addCleanup(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)  # an apply in progress
            start = time.monotonic()
            plans = plugin.decide()
            self.assertLess(time.monotonic() - start, 1.0)
        self.assertEqual([(p.bug, p.state, p.target) for p in plans], unlocked)
        # Affected: hooked; 0.5.14 has no MiniMax sparse NVFP4 backend (not applicable: nothing).
        present = [bug for bug in Bug if bug is not Bug.MINIMAX_NVFP4_PAGE_TABLE]
        self.assertEqual([p.bug for p in plans if p.hook.value == "installed"], present)
        verdicts = {s.bug: s.verdict for s in classify.check(copy, wait=False)}
        self.assertEqual([bug for bug, v in verdicts.items() if v is Verdict.AFFECTED], present)
        # A run that must write still waits for the lock (here: briefly, then one line).
        with mock.patch.object(snapshot, "LOCK_TIMEOUT_S", 0.2):
            self.assertRefused("apply", "another sglang-dsa-fix run holds the lock")


class TestErrorsNameTheirFile(PatchToolTestCase):
    def fail_write(self, failing_call):
        real_write = source_patch._write
        calls = []

        def write(loc, data, metadata):
            calls.append(loc)
            if len(calls) == failing_call:
                raise OSError(errno.ENOSPC, "No space left on device")  # os.write: no filename
            return real_write(loc, data, metadata)

        return mock.patch.object(source_patch, "_write", write)

    def test_disk_full_names_the_file_being_written(self):
        # Writes: backup 1, file 1, backup 2, file 2 (bug #1's file first).
        for call, path in (
            (2, self.backend),
            (3, snapshot.backup_path(self.sizing)),
            (4, self.sizing),
        ):
            with self.subTest(call=call), self.fail_write(call):
                self.assertRefused("apply", f"error: {path}: cannot write (No space left on device)")
        self.assertEqual(self.backend.read_bytes(), self.original)
        self.assertEqual(list(self.tmp.rglob("*.tmp")), [])

    def test_backup_that_cannot_be_removed_after_revert(self):
        self.assertEqual(self.cli("apply")[0], 0)
        backup = snapshot.backup_path(self.backend)
        real_unlink = safe_files.unlink

        def unlink(loc):
            if loc.name == backup.name:
                raise PermissionError(errno.EACCES, "Permission denied")
            return real_unlink(loc)

        with mock.patch.object(safe_files, "unlink", unlink):
            rc, out, err = self.cli("revert")
        self.assertEqual(rc, 2, out)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn(f"{backup}: cannot remove (Permission denied); the revert itself succeeded", err)
        self.assertEqual(self.backend.read_bytes(), self.original)
        self.assertEqual(self.sizing.read_bytes(), self.original_sizing)
        # What is left is consistent: the leftover backup equals its file.
        self.assertEqual(self.cli("check")[0], 1)
        self.assertEqual(self.cli("apply")[0], 0)


class TestPlantedFiles(PatchToolTestCase):
    def test_symlink_planted_as_the_backup_is_not_followed(self):
        outside = self.tmp / "outside.py"
        outside.write_bytes(self.original)
        backup = snapshot.backup_path(self.backend)
        backup.symlink_to(outside)
        for command in ("check", "apply"):
            with self.subTest(command=command):
                self.assertRefused(command, "cannot read (Too many levels of symbolic links)")
        self.assertEqual(outside.read_bytes(), self.original)

    def test_symlink_planted_as_a_temp_file_is_replaced_not_followed(self):
        outside = self.tmp / "outside.py"
        outside.write_bytes(b"keep me")
        stale = self.backend.parent / f".{self.backend.name}.abc123.tmp"
        stale.symlink_to(outside)
        rc, out, err = self.cli("apply")
        self.assertEqual(rc, 0, err)
        self.assertIn(f"removed: {stale}", out)
        self.assertFalse(stale.is_symlink())
        self.assertEqual(outside.read_bytes(), b"keep me")

    def test_fifo_planted_as_the_backup_is_refused_at_once(self):
        os.mkfifo(snapshot.backup_path(self.backend))
        for command in ("check", "apply"):
            with self.subTest(command=command):
                self.assertRefused(command, "not a regular file")

    def test_bug_order(self):
        # what the tests above assume
        self.assertEqual(list(Bug)[:3], [Bug.PAGE_TABLE, Bug.ROW_OVERFLOW, Bug.FA3_PAGE_TABLE])


def _chattr(flag: str, path) -> bool:
    """chattr FLAG PATH; False where chattr or the filesystem's flags are not there (or not root)."""
    import shutil
    import subprocess

    chattr = shutil.which("chattr")
    return bool(chattr) and subprocess.run([chattr, flag, str(path)], capture_output=True).returncode == 0


class TestInodeFlags(PatchToolTestCase):
    """Issue 25 P: ``chattr +a`` on the file's directory left a temp file behind while saying
    nothing changed; an immutable or append-only file or directory is now refused first."""

    def flag(self, flag: str, path) -> None:
        if not _chattr(f"+{flag}", path):
            self.skipTest(f"chattr +{flag} not available here")
        self.addCleanup(_chattr, f"-{flag}", path)

    def test_append_only_or_immutable(self):
        cases = [("a", self.backend.parent, "append-only"), ("a", self.backend, "append-only")]
        cases += [("i", self.sizing, "")]  # os.access already says no: "read-only"
        for flag, path, said in cases:
            with self.subTest(flag=flag, path=path.name):
                self.flag(flag, path)
                self.assertRefused("apply", f"{path}: {said or 'read-only'}")
                _chattr(f"-{flag}", path)
        self.assertEqual(self.cli("apply")[0], 0)
        self.flag("a", self.backend.parent)
        # Every file but the sizing file is in that directory: revert reverts that one alone.
        attention = {path for path in self.changed_files if path.parent == self.backend.parent}
        self.assertEqual(set(self.changed_files) - attention, {self.sizing})
        self.assertRevertedAllBut(attention, f"{self.backend.parent}: append-only")


class FailingOs:
    """``os`` as ``safe_files`` sees it, with every write, rename and fsync failing with ENOSPC
    from the ``fail_from``-th such call on (a disk that fills up mid-run and stays full). An
    fsync before that returns at once: durability is not what the sweep checks, and the ~30
    fsyncs of each of its ~250 runs took most of its time."""

    FAILING = ("write", "replace", "rename", "fsync")

    def __init__(self, fail_from: float = float("inf"), failing=FAILING):
        self.fail_from, self.failing, self.calls = fail_from, failing, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.FAILING:
            return real

        def call(*args, **kwargs):
            self.calls += name in self.failing
            if name in self.failing and self.calls >= self.fail_from:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return None if name == "fsync" else real(*args, **kwargs)

        return call


class TestFullDisk(PatchToolTestCase):
    """Issue 34 item 7: with every write failing from the N-th on (N over every call of an apply
    and of a revert of the whole family), the tree is the state before, or the message names its
    exact state; no file is ever left patched without its backup; the next apply and the next
    revert each recover it."""

    def setUp(self):
        super().setUp()
        self.files = self.changed_files
        self.saved = self.tmp.parent / f"{self.tmp.name}-saved"
        self.addCleanup(shutil.rmtree, self.saved, True)

    def save(self, name: str) -> None:
        shutil.copytree(self.package, self.saved / name, symlinks=True)

    def restore(self, name: str) -> None:
        shutil.rmtree(self.package)
        shutil.copytree(self.saved / name, self.package, symlinks=True)

    def run_failing(self, command: str, fail_from: float = float("inf"), names=FailingOs.FAILING) -> tuple:
        failing = FailingOs(fail_from, names)
        with mock.patch.object(safe_files, "os", failing):
            rc, out, err = self.cli(command)
        return rc, out, err, failing.calls

    def assertNamesItsState(self, err: str, unchanged: dict) -> None:
        """Each file is pristine or carries the fix beside its backup (never without it); a
        run that says "nothing changed" left the tree as ``unchanged``; otherwise the message
        names every file that carries the fix and every backup left beside a pristine file."""
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(list(self.tmp.rglob("*.tmp")), [], err)
        for path, original in self.files.items():
            backup = snapshot.backup_path(path)
            has_backup = backup.exists()
            if has_backup:
                self.assertEqual(backup.read_bytes(), original, f"{backup}: not the original; {err}")
            patched = path.read_bytes() != original
            self.assertTrue(has_backup or not patched, f"{path}: patched without its backup; {err}")
            if "nothing changed" not in err and (patched or has_backup):
                self.assertIn(path.name, err)
        if "nothing changed" in err:
            self.assertEqual(tree_state(self.tmp), unchanged, err)

    def sweep(self, command: str, start: str, end: str) -> None:
        """Fail ``command`` from each of its calls on, starting from the saved tree ``start``;
        after each, recover with apply (-> "applied") and with revert (-> "pristine"): both
        under ``make test-full``, else one of them in turn. Only a failure that changes nothing
        may go unsaid (the directory's fsync after the last rename)."""
        self.restore(start)
        unchanged = tree_state(self.tmp)
        rc, _, err, total = self.run_failing(command)
        self.assertEqual(rc, 0, err)
        self.assertGreater(total, 4 * len(self.files) - 1)
        for fail_from in range(1, total + 1):
            with self.subTest(command=command, fail_from=fail_from):
                self.restore(start)
                rc, out, err, _ = self.run_failing(command, fail_from)
                if rc == 0:
                    self.assertEqual(tree_state(self.tmp), self.states[end], out)
                else:
                    self.assertEqual((rc, out), (2, ""), err)
                    self.assertNamesItsState(err, unchanged)
                self.save("failed")
                recoveries = (("apply", "applied"), ("revert", "pristine"))
                for recovery, expected in recoveries if FULL else recoveries[fail_from % 2 :][:1]:
                    self.restore("failed")
                    rc, out, err2, _ = self.run_failing(recovery)
                    self.assertEqual(rc, 0, (err, err2))
                    self.assertEqual(tree_state(self.tmp), self.states[expected], (recovery, err))
                shutil.rmtree(self.saved / "failed")

    def test_apply_and_revert_on_a_disk_that_fills_up(self):
        self.save("pristine")
        self.states = {"pristine": tree_state(self.tmp)}
        self.assertEqual(self.run_failing("apply")[0], 0)
        self.save("applied")
        self.states["applied"] = tree_state(self.tmp)
        self.sweep("apply", "pristine", "applied")
        self.sweep("revert", "applied", "pristine")

    def test_a_full_disk_fails_writes_but_not_renames(self):
        # What a real ENOSPC does: a new file's data cannot be written, a rename still works.
        # Every write of apply failing from the N-th on: the undo renames each backup back over
        # its file, so every run leaves the tree as it was and says so.
        self.save("pristine")
        before = tree_state(self.tmp)
        total = self.run_failing("apply", names=("write",))[3]
        self.assertEqual(total, 2 * len(self.files))  # a backup and a file each
        for fail_from in range(1, total + 1):
            with self.subTest(fail_from=fail_from):
                self.restore("pristine")
                rc, out, err, _ = self.run_failing("apply", fail_from, ("write",))
                self.assertEqual((rc, out), (2, ""), err)
                self.assertIn("cannot write (No space left on device); nothing changed", err)
                self.assertEqual(tree_state(self.tmp), before, err)

    def test_a_leftover_backup_the_undo_used_is_said(self):
        # A backup equal to its file (what a revert killed before removing it leaves) is
        # rewritten by apply and, when the apply is undone, renamed back over its file: gone.
        backup = snapshot.backup_path(self.backend)
        backup.write_bytes(self.original)
        rc, out, err, _ = self.run_failing("apply", 3, ("write",))  # backup 1, file 1, backup 2
        self.assertEqual((rc, out), (2, ""), err)
        self.assertIn(
            f"{self.sizing}{BACKUP_SUFFIX}: cannot write (No space left on device); no file changed", err
        )
        self.assertIn(f"beside {self.backend.name} was used to restore it", err)
        self.assertFalse(backup.exists())
        self.assertEqual([p.read_bytes() for p in self.files], list(self.files.values()))
