"""The in-tree patch tool and its CLI on the real sglang backend file of the installed release.

Every bad input must give a clear message, exit 2 and leave every file byte-identical.
"""

import contextlib
import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from sglang_dsa_fix import cli, source_patch  # noqa: E402

INSTALLED = source_patch.find_tree(None)
SITE = source_patch.locate(INSTALLED)
# Files a backend-file check needs: the version files and the attention backends.
COPIED = ["_version.py", "version.py", "srt/layers/attention/dsa_backend.py",
          "srt/layers/attention/nsa_backend.py", "srt/plugins/hook_registry.py"]


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class PatchToolTestCase(unittest.TestCase):
    layout = "checkout"  # or "site-packages"

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-test-"))
        self.addCleanup(self._cleanup)
        parent = self.tmp / "python" if self.layout == "checkout" else self.tmp
        for rel in COPIED:
            src = INSTALLED.package_parent / "sglang" / rel
            if src.exists():
                dst = parent / "sglang" / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        self.backend = parent / "sglang" / SITE.path.relative_to(INSTALLED.package_parent / "sglang")
        self.original = self.backend.read_bytes()

    def _cleanup(self):
        for path in [self.tmp, *self.tmp.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(self.tmp)

    def cli(self, command, *extra):
        return run_cli(command, "--sglang-root", str(self.tmp), *extra)

    def assertRefused(self, command, message_part, root=None):
        before = snapshot(self.tmp)
        argv = [command, "--sglang-root", str(root or self.tmp)]
        rc, out, err = run_cli(*argv)
        self.assertEqual(rc, 2, (out, err))
        self.assertIn(message_part, err)
        self.assertEqual(out, "")
        self.assertEqual(snapshot(self.tmp), before, f"{command} changed files")

    def edit(self, old: bytes, new: bytes, count=1):
        data = self.backend.read_bytes()
        self.assertIn(old, data)
        self.backend.write_bytes(data.replace(old, new, count))


class TestLifecycle(PatchToolTestCase):
    def test_check_apply_check_apply_revert(self):
        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 1, out)
        self.assertTrue(out.startswith("affected: "), out)
        self.assertIn(f"{self.backend}:{SITE.lineno}", out)

        rc, out, _ = self.cli("apply")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("applied: "), out)
        patched = self.backend.read_bytes()
        self.assertNotEqual(patched, self.original)
        self.assertIn(b"self.req_to_token.shape[1],", patched)
        compile(patched, str(self.backend), "exec")

        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("fixed in-tree by sglang-dsa-fix: "), out)

        before = snapshot(self.tmp)
        rc, out, _ = self.cli("apply")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("nothing to do: "), out)
        self.assertEqual(snapshot(self.tmp), before)

        rc, out, _ = self.cli("revert")
        self.assertEqual(rc, 0, out)
        self.assertEqual(hashlib.sha256(self.backend.read_bytes()).digest(),
                         hashlib.sha256(self.original).digest())
        self.assertFalse(source_patch.backup_path(self.backend).exists())
        self.assertEqual(self.cli("check")[0], 1)

        rc, out, _ = self.cli("revert")
        self.assertEqual(rc, 0, out)
        self.assertTrue(out.startswith("nothing to revert: "), out)

    def test_only_the_width_argument_changes(self):
        self.cli("apply")
        removed = set(self.original.splitlines()) - set(self.backend.read_bytes().splitlines())
        self.assertEqual(len(removed), 1)
        self.assertIn(SITE.expression.encode(), removed.pop())

    def test_file_mode_is_kept(self):
        self.backend.chmod(0o640)
        self.cli("apply")
        self.assertEqual(stat.S_IMODE(self.backend.stat().st_mode), 0o640)


@unittest.skipUnless(shutil.which("git"), "needs git")
class TestUpstreamDiff(PatchToolTestCase):
    def git(self, *args):
        return subprocess.run(["git", *args], cwd=self.tmp, capture_output=True, text=True)

    def test_diff_applies_with_git_and_equals_apply(self):
        rc, diff, _ = self.cli("diff")
        self.assertEqual(rc, 0)
        rel = self.backend.relative_to(self.tmp).as_posix()
        self.assertTrue(rel.startswith("python/sglang/srt/layers/attention/"), rel)
        self.assertIn(f"--- a/{rel}\n+++ b/{rel}\n", diff)
        (self.tmp / "fix.patch").write_text(diff)
        check = self.git("apply", "--check", "fix.patch")
        self.assertEqual(check.returncode, 0, check.stderr)
        self.assertEqual(self.git("apply", "fix.patch").returncode, 0)
        via_git = self.backend.read_bytes()
        self.backend.write_bytes(self.original)
        self.cli("apply")
        self.assertEqual(self.backend.read_bytes(), via_git)

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
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("check")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)
        self.assertEqual(self.backend.read_bytes(), self.original)


class TestBadInput(PatchToolTestCase):
    def test_wrong_paths(self):
        for command in ("check", "apply", "revert", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "no such directory", root=self.tmp / "missing")
                self.assertRefused(command, "not an sglang tree", root=self.backend.parent)

    def test_allocation_not_found(self):
        self.edit(b'"page_table": torch.zeros(', b'"page_table": torch.empty(')
        for command in ("check", "apply", "revert", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "not recognised")

    def test_allocation_found_twice(self):
        self.edit(b'"cu_seqlens_k": torch.zeros(\n                max_bs + 1,',
                  b'"page_table": torch.zeros(\n                max_bs + 1, 7,')
        for command in ("check", "apply"):
            with self.subTest(command=command):
                self.assertRefused(command, "found 2")

    def test_file_that_does_not_parse(self):
        self.edit(b"def init_cuda_graph_state(self", b"def init_cuda_graph_state(self,,")
        for command in ("check", "apply", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "does not parse")

    def test_hand_edited_after_apply(self):
        self.cli("apply")
        self.edit(b"\n", b"\n# local tweak\n")
        for command in ("check", "apply", "revert", "diff"):
            with self.subTest(command=command):
                self.assertRefused(command, "changed since sglang-dsa-fix applied it")

    def test_fix_undone_by_hand_after_apply(self):
        self.cli("apply")
        self.edit(b"self.req_to_token.shape[1],", SITE.expression.encode() + b",")
        self.assertRefused("apply", "changed since sglang-dsa-fix applied it")
        self.assertRefused("revert", "changed since sglang-dsa-fix applied it")

    def test_backup_missing(self):
        self.cli("apply")
        source_patch.backup_path(self.backend).unlink()
        self.assertRefused("revert", "is missing")

    def test_read_only_file(self):
        self.backend.chmod(0o444)
        self.assertRefused("apply", "read-only")

    def test_read_only_directory(self):
        self.backend.parent.chmod(0o555)
        self.assertRefused("apply", "read-only")

    def test_read_only_after_apply(self):
        self.cli("apply")
        self.backend.parent.chmod(0o555)
        self.assertRefused("revert", "read-only")


class TestOtherReleases(PatchToolTestCase):
    def test_no_backend_is_not_applicable(self):
        for name in ("dsa_backend.py", "nsa_backend.py"):
            path = self.backend.parent / name
            if path.exists():
                path.unlink()
        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("no DSA/NSA backend: "), out)
        before = snapshot(self.tmp)
        self.assertEqual(self.cli("apply")[0], 0)
        rc, out, err = self.cli("diff")
        self.assertEqual((rc, out), (0, ""))
        self.assertEqual(snapshot(self.tmp), before)

    def test_fixed_upstream_through_a_local_name(self):
        # The 0.5.15+ shape: ``max_ctx_len = self.req_to_token.shape[1]`` then ``max_ctx_len``.
        self.edit(b"        self.decode_cuda_graph_metadata: Dict = {",
                  b"        max_ctx_len = self.req_to_token.shape[1]\n"
                  b"        self.decode_cuda_graph_metadata: Dict = {")
        self.edit(SITE.expression.encode() + b",", b"max_ctx_len,")
        rc, out, _ = self.cli("check")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("fixed upstream: "), out)
        before = snapshot(self.tmp)
        self.assertTrue(self.cli("apply")[1].startswith("nothing to do: fixed upstream"))
        self.assertEqual(snapshot(self.tmp), before)

    def test_narrower_old_expression_is_affected(self):
        # 0.5.4 - 0.5.9 size it ``self.max_context_len``.
        self.edit(SITE.expression.encode() + b",", b"self.max_context_len,")
        self.assertEqual(self.cli("check")[0], 1)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)


class TestConsoleScript(unittest.TestCase):
    def test_installed_sglang_is_checked_by_default(self):
        proc = subprocess.run([sys.executable, "-m", "sglang_dsa_fix.cli", "check"],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])})
        expected = 1 if source_patch.inspect(INSTALLED).verdict.name == "AFFECTED" else 0
        self.assertEqual(proc.returncode, expected, proc.stderr)
        self.assertIn(str(SITE.path), proc.stdout)

    def test_usage_error(self):
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit) as ctx:
                cli.main(["frobnicate"])
        self.assertEqual(ctx.exception.code, 2)


if __name__ == "__main__":
    unittest.main()
