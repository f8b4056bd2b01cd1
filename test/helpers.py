"""Helpers shared by the patch-tool, status and CLI tests: a disposable copy of the real sglang
files the tool reads, the CLI run in-process, and tree snapshots (bytes, owner, mode)."""

import contextlib
import copy
import hashlib
import io
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from sglang_dsa_fix import backend_layouts, cli, plugin, release, sites, tree
from sglang_dsa_fix.snapshot import read as read_files

INSTALLED = tree.find_tree(None)
INSTALLED_FILES = read_files(INSTALLED)
PAGE_TABLE_SITE = sites.page_table_site(INSTALLED_FILES)
ROW_SITE = sites.row_site(INSTALLED_FILES)


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as exc:  # argparse
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def tree_state(root: Path) -> dict:
    """Every file and directory under root: sha256 (files), owner, group and mode."""
    state = {}
    for p in sorted([root, *root.rglob("*")]):
        st = p.lstat()
        digest = None
        if p.is_file() and os.access(p, os.R_OK):
            # open(), not safe_files: tests inject read errors into the tool through the latter.
            with open(p, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
        state[p.relative_to(root).as_posix()] = (digest, st.st_uid, st.st_gid, st.st_mode)
    return state


class PatchToolTestCase(unittest.TestCase):
    layout = "checkout"  # or "site-packages"

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-test-"))
        self.addCleanup(self._cleanup)
        parent = self.tmp / "python" if self.layout == "checkout" else self.tmp
        for rel in release.FILES_READ:
            src = INSTALLED.package / rel
            if src.exists():
                dst = parent / "sglang" / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        self.package = parent / "sglang"
        self.backend = self.package / PAGE_TABLE_SITE.path.relative_to(INSTALLED.package)
        self.sizing = self.package / ROW_SITE.path.relative_to(INSTALLED.package)
        self.fa3 = self.package / backend_layouts.FA3_LAYOUT.relative_path  # bug #3's file
        self.original = self.backend.read_bytes()
        self.original_sizing = self.sizing.read_bytes()
        self.original_fa3 = self.fa3.read_bytes()
        # Bug #3's relatives present in this release: path -> original bytes.
        self.relatives = {
            path: path.read_bytes()
            for path in (
                self.package / layout.relative_path for layout in backend_layouts.GRAPH_TABLE_LAYOUTS
            )
            if path.exists()
        }

    @property
    def changed_files(self) -> dict:
        """Every file apply changes in this release: path -> its original bytes."""
        files = {self.backend: self.original, self.sizing: self.original_sizing, self.fa3: self.original_fa3}
        return {**files, **self.relatives}

    def assertRevertedAllBut(self, blocked, message_part):
        """``revert`` after ``apply``, where the files ``blocked`` cannot be reverted: every other
        file is (its backup gone), the blocked ones keep what they had, and the one line names
        each of them (issue 34 item 5: one file used to keep every file from being reverted)."""
        kept = {path: path.read_bytes() for path in blocked}
        rc, out, err = self.cli("revert")
        self.assertEqual((rc, out), (2, ""), err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("Traceback", err)
        self.assertIn(message_part, err)
        for path, original in self.changed_files.items():
            if path in kept:
                self.assertEqual(path.read_bytes(), kept[path])
                self.assertIn(path.name, err)
            else:
                self.assertEqual(path.read_bytes(), original, f"{path} not reverted: {err}")
                self.assertFalse(path.with_name(path.name + tree.BACKUP_SUFFIX).exists(), path)
        reverted = len(self.changed_files) - len(kept)
        self.assertIn(f"reverted {reverted} of {len(self.changed_files)} file(s)", err)

    def _cleanup(self):
        for path in [self.tmp, *self.tmp.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(self.tmp)

    def cli(self, command, *extra):
        return run_cli(command, "--sglang-root", str(self.tmp), *extra)

    def assertRefused(self, command, message_part, root=None, *extra):
        before = tree_state(self.tmp)
        rc, out, err = run_cli(command, "--sglang-root", str(root or self.tmp), *extra)
        self.assertEqual(rc, 2, (out, err))
        self.assertIn(message_part, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(out, "")
        self.assertEqual(tree_state(self.tmp), before, f"{command} changed files")

    def edit(self, path: Path, old: bytes, new: bytes, count=1):
        data = path.read_bytes()
        self.assertIn(old, data)
        path.write_bytes(data.replace(old, new, count))


class PluginRegistration(unittest.TestCase):
    """``register()`` in this process against sglang's real HookRegistry; its hooks and the
    plugin's state are put back after each test."""

    def setUp(self):
        from sglang.srt.plugins.hook_registry import HookRegistry

        hooks = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
        state = copy.deepcopy(plugin.STATE)

        def restore():
            HookRegistry._hooks.clear()
            HookRegistry._hooks.update(hooks)
            plugin.STATE.clear()
            plugin.STATE.update(state)

        self.addCleanup(restore)
        self.registry = HookRegistry

    def register(self, **env) -> dict:
        """{target: [HookType names]} registered once ``register()`` ran with ``env``."""
        # The fixes' hooks are registered but not applied to sglang's classes here (this
        # process's later tests drive the pristine backends; test_plugin_imports applies them in
        # a process of its own).
        with mock.patch.dict(os.environ, env), mock.patch.object(plugin, "_apply"):
            plugin.STATE["pid"] = None
            plugin.register()
        return {
            target: [entry[0].name for entry in entries] for target, entries in self.registry._hooks.items()
        }
