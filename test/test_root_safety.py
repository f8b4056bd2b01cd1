"""apply / revert run as root on a tree another user can write to.

The attack: ``dsa_backend.py`` is a symlink in a directory an unprivileged user owns; that user
flips it between a good copy in the tree and a root-only file elsewhere (root 0600 in a root 0700
directory, here a valid copy of the backend, so that only the tool's own checks protect it). The
tool must never change that file, with or without ``--allow-unsafe-dirs``.
"""

import contextlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

from helpers import INSTALLED, PatchToolTestCase, run_cli, tree_state

from sglang_dsa_fix import release, safe_files

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmark"

NOBODY = 65534
ROUNDS = 50
ATTACKER = """
import os, sys, time
link, targets = sys.argv[1], sys.argv[2:]
flip = link + ".flip"
i = 0
while True:
    try:
        os.unlink(flip)
    except FileNotFoundError:
        pass
    os.symlink(targets[i % 2], flip)
    os.rename(flip, link)  # atomic: the link always exists, pointing at one or the other
    i += 1
    time.sleep(0.0005)
"""


def _as_nobody():
    """argv prefix that runs a command as uid/gid 65534 without groups, or None."""
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    return None


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root (the attack is on a run as root)"
    prefix = _as_nobody()
    if prefix is None:
        return "needs setpriv or runuser to run the attacker as nobody"
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if python is None or subprocess.run([*prefix, python, "-c", "pass"], capture_output=True).returncode:
        return "no Python interpreter that nobody may run"
    return None


SKIP = _skip_reason()


@unittest.skipIf(SKIP, SKIP)
class RootTestCase(PatchToolTestCase):
    def setUp(self):
        super().setUp()
        self.tmp.chmod(0o755)  # mkdtemp's 0700: let nobody reach the tree
        self.attention = self.backend.parent
        # A file outside the tree that only root may touch, holding a valid backend.
        self.victim_dir = Path(tempfile.mkdtemp(prefix="dsa-fix-victim-"))
        self.addCleanup(shutil.rmtree, self.victim_dir)
        self.victim = self.victim_dir / "dsa_backend.py"
        self.victim.write_bytes(self.original)
        self.victim.chmod(0o600)
        self.victim_before = tree_state(self.victim_dir)

    def assertVictimUntouched(self):
        st = self.victim.stat()
        self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o7777), (0, 0, 0o600))
        self.assertEqual(self.victim.read_bytes(), self.original)
        self.assertEqual(tree_state(self.victim_dir), self.victim_before)  # no backup, no temp there


class TestSymlinkFlipRace(RootTestCase):
    def test_flipping_symlink_never_redirects_a_write(self):
        good = self.attention / "dsa_backend_good.py"
        self.backend.rename(good)
        self.backend.symlink_to(good)
        os.chown(self.attention, NOBODY, NOBODY)  # the attacker's directory, inside the tree
        outside = {p: sorted(os.listdir(p)) for p in (self.tmp, self.tmp / "python")}
        python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
        attacker = subprocess.Popen(
            [*_as_nobody(), python, "-I", "-c", ATTACKER, str(self.backend), str(good), str(self.victim)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.addCleanup(attacker.wait)
        self.addCleanup(attacker.kill)
        deadline = time.monotonic() + 10
        while os.readlink(self.backend) != str(self.victim):  # the attacker is flipping
            if attacker.poll() is not None:
                self.fail(f"the attacker failed: {attacker.stderr.read()}")
            self.assertLess(time.monotonic(), deadline, "the attacker never flipped the link")
            time.sleep(0.01)

        results = {}
        for flag in ((), ("--allow-unsafe-dirs",)):
            results[flag] = []
            for _ in range(ROUNDS):
                for command in ("apply", "revert"):
                    rc, out, err = self.cli(command, *flag)
                    self.assertIn(rc, (0, 2), err)
                    if rc == 2:
                        self.assertEqual(len(err.strip().splitlines()), 1, err)
                        self.assertNotIn("Traceback", err)
                    results[flag].append((command, rc, err))
        self.assertIsNone(attacker.poll(), "the attacker stopped early")
        attacker.kill()

        self.assertVictimUntouched()
        self.assertEqual({p: sorted(os.listdir(p)) for p in outside}, outside)
        # Without the flag every apply is refused (the link's directory belongs to nobody) ...
        plain = results[()]
        self.assertTrue(all(rc == 2 for command, rc, _ in plain if command == "apply"), plain[:4])
        self.assertTrue(any("--allow-unsafe-dirs" in err for _, _, err in plain), plain[:4])
        # ... with it, the good copy inside the tree is patched whenever the link pointed there.
        flagged = results[("--allow-unsafe-dirs",)]
        self.assertTrue(any(rc == 0 and c == "apply" for c, rc, _ in flagged))
        self.assertTrue(any("outside the sglang tree" in err for _, _, err in flagged))


class TestUnsafeDirectories(RootTestCase):
    def test_symlink_to_a_root_file_outside_the_tree_is_refused_even_with_the_flag(self):
        self.backend.unlink()
        self.backend.symlink_to(self.victim)
        os.chown(self.attention, NOBODY, NOBODY)
        self.assertRefused("apply", "--allow-unsafe-dirs")
        self.assertRefused("apply", "outside the sglang tree", None, "--allow-unsafe-dirs")
        self.assertVictimUntouched()

    def test_group_writable_directory_needs_the_flag(self):
        self.sizing.parent.chmod(0o775)
        self.assertRefused("apply", f"{self.sizing.parent} is writable by group")
        self.assertEqual(self.cli("apply", "--allow-unsafe-dirs")[0], 0)
        # Revert is per file: every file but the one in that directory is reverted.
        self.assertRevertedAllBut({self.sizing}, "pass --allow-unsafe-dirs")
        self.assertEqual(self.cli("revert", "--allow-unsafe-dirs")[0], 0)
        self.assertEqual(self.sizing.read_bytes(), self.original_sizing)

    def test_check_removes_no_temp_file_where_root_may_not_write(self):
        # check removes a killed run's temp files (issue 34 item 7), never where apply would
        # be refused without --allow-unsafe-dirs (check has no such flag).
        self.sizing.parent.chmod(0o775)
        temp = self.sizing.parent / f".{self.sizing.name}.0badc0de.tmp"
        temp.write_bytes(b"half a file")
        rc, out, err = self.cli("check", "--json")
        self.assertEqual(rc, 1, err)
        self.assertNotIn("removed", json.loads(out))
        self.assertTrue(temp.exists())

    def test_directory_of_another_user_needs_the_flag(self):
        os.chown(self.attention, NOBODY, NOBODY)
        self.assertRefused("apply", f"{self.attention} is owned by uid {NOBODY}")
        self.assertEqual(self.cli("apply", "--allow-unsafe-dirs")[0], 0)
        self.assertEqual(self.cli("revert", "--allow-unsafe-dirs")[0], 0)
        self.assertEqual(self.backend.read_bytes(), self.original)

    def test_sticky_root_directory_is_safe(self):
        self.tmp.chmod(0o1777)  # as /tmp
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertEqual(self.cli("revert")[0], 0)

    def test_file_swapped_between_lookup_and_read_is_refused(self):
        real_check = safe_files.check_place

        def swap_then_check(shown, loc, *args):
            if loc.name == self.backend.name:  # the attacker wins the race here
                self.backend.rename(self.attention / "moved.py")
                self.backend.write_bytes(self.original)
            return real_check(shown, loc, *args)

        with mock.patch.object(safe_files, "check_place", swap_then_check):
            rc, out, err = self.cli("apply")
        self.assertEqual(rc, 2, out)
        self.assertIn("replaced by another file", err)
        self.assertEqual(self.sizing.read_bytes(), self.original_sizing)  # all or nothing
        self.assertEqual(self.backend.read_bytes(), self.original)


class TestLinksAnotherUserChose(RootTestCase):
    """Issue 25 C and N1b: where a link in the tree leads is the choice of whoever owns it (or
    owns the tree); root does not write there."""

    def test_another_users_link_in_a_sticky_directory_is_not_followed(self):
        # C: a root-owned 1777 directory inside the tree; nobody's link there to a root-only,
        # sglang-shaped file elsewhere in the tree.
        private = self.package / "srt" / "private"
        private.mkdir(mode=0o700)
        target = private / "dsa_backend.py"
        target.write_bytes(self.original)
        target.chmod(0o600)
        self.attention.chmod(0o1777)
        self.backend.unlink()
        self.backend.symlink_to(target)
        os.lchown(self.backend, NOBODY, NOBODY)
        self.assertRefused("apply", f"the link {self.backend} is owned by uid {NOBODY}")
        self.assertEqual(target.read_bytes(), self.original)
        # The same link root made is root's choice.
        os.lchown(self.backend, 0, 0)
        self.assertEqual(self.cli("apply")[0], 0)
        self.assertNotEqual(target.read_bytes(), self.original)

    def test_a_tree_of_another_user_linking_outside_it(self):
        # N1b: the whole tree is nobody's, its dsa_backend.py a link to a root-only file elsewhere.
        self.backend.unlink()
        self.backend.symlink_to(self.victim)
        for path in [self.tmp, *self.tmp.rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)
        for flag in ((), ("--allow-unsafe-dirs",)):
            with self.subTest(flag=flag):
                self.assertRefused("apply", "outside the sglang tree", None, *flag)
        self.assertVictimUntouched()


if __name__ == "__main__":
    unittest.main()


@unittest.skipIf(SKIP, SKIP)
class TestUnreadableAsAnotherUser(PatchToolTestCase):
    """As a non-root user, a directory of the tree it may not search is "cannot read" (exit 2),
    never "not applicable" or "not covered"."""

    def setUp(self):
        super().setUp()
        for path in [self.tmp, *self.tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        repo_python = Path(__file__).resolve().parents[1] / "python"
        probe = [*_as_nobody(), "/usr/bin/python3", "-c", f"import os; os.listdir({str(repo_python)!r})"]
        if subprocess.run(probe, capture_output=True).returncode:
            self.skipTest("this checkout is not readable by nobody")
        self.cli_as_nobody = [
            *_as_nobody(),
            "/usr/bin/python3",
            "-c",
            f"import sys; sys.path.insert(0, {str(repo_python)!r}); "
            "from sglang_dsa_fix import cli; sys.exit(cli.main(sys.argv[1:]))",
        ]

    def test_unreadable_directories(self):
        for relative in ("srt/layers/attention", "srt/layers", "srt/mem_cache"):
            directory = self.package / relative
            with self.subTest(directory=relative):
                directory.chmod(0o700)
                try:
                    proc = subprocess.run(
                        [*self.cli_as_nobody, "check", "--sglang-root", str(self.tmp)],
                        capture_output=True,
                        text=True,
                    )
                finally:
                    directory.chmod(0o755)
                self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
                self.assertIn("cannot read (Permission denied)", proc.stderr)
                self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)


# ------------------------------------------------------------------------------ code root runs
# What nobody writes into a place it owns: code that leaves a mark only root could leave.
PAYLOAD = "open({marker!r}, 'w').write(str(__import__('os').geteuid()))\nraise ImportError('planted')\n"
PLANT = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
BARE_PYTHON = "/usr/bin/python3"


def _plant_as_nobody(path: Path, text: str) -> None:
    done = subprocess.run(
        [*_as_nobody(), BARE_PYTHON, "-I", "-c", PLANT, str(path), text], capture_output=True
    )
    assert done.returncode == 0, done.stderr


class StatusTargetCase(unittest.TestCase):
    """A root-owned venv (this Python's base interpreter, no packages) holding a copy of the
    sglang files the tool reads: its child cannot import sglang and answers at once."""

    LAUNCH = ("--model-path", "x", "--context-length", "4096", "--speculative-num-draft-tokens", "4")

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-code-"))
        self.addCleanup(shutil.rmtree, self.tmp)
        self.tmp.chmod(0o755)  # root's: nobody cannot leave the marker here itself
        self.marker = self.tmp / "ran-as-root"
        base = os.path.realpath(sys.executable)
        self.venv = self.tmp / "venv"
        self.site = self.venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        for rel in release.FILES_READ:
            src = INSTALLED.package / rel
            if src.exists():
                (self.site / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, self.site / "sglang" / rel)
        (self.venv / "bin").mkdir()
        (self.venv / "bin" / "python").symlink_to(base)
        (self.venv / "pyvenv.cfg").write_text(
            f"home = {os.path.dirname(base)}\ninclude-system-site-packages = false\n"
        )

    def status(self, *flags, root=None):
        return run_cli("status", "--sglang-root", str(root or self.site), *flags, "--", *self.LAUNCH)

    def assertRefusedOnce(self, rc, out, err, *parts):
        self.assertFalse(self.marker.exists(), "code another user wrote ran as root")
        self.assertEqual(rc, 2, (out, err))
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("Traceback", err)
        for part in parts:
            self.assertIn(part, err)


@unittest.skipIf(SKIP, SKIP)
class TestStatusRunsNoCodeAnotherUserCanChange(StatusTargetCase):
    """Issue 25 A: ``status -- <launch args>`` as root runs the target's Python and imports the
    target's sglang in a child. Where nobody owns the venv (or a part of the tree, or the
    interpreter), nobody's code would run as root: refused, one line, exit 2."""

    def test_venv_of_another_user_is_not_run(self):
        for path in [self.venv, *self.venv.rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)  # nobody's venv ...
        init = self.site / "sglang" / "__init__.py"
        _plant_as_nobody(init, PAYLOAD.format(marker=str(self.marker)))  # ... and nobody's sglang
        rc, out, err = self.status()
        self.assertRefusedOnce(
            rc,
            out,
            err,
            f"{self.venv}/bin/python: {self.venv} is owned by uid {NOBODY} (nobody)",
            "does not run an interpreter another user can change",
            "--allow-unsafe-dirs",
        )
        rc, out, err = self.status("--json")
        self.assertRefusedOnce(rc, out, err)
        self.assertIn("does not run an interpreter", json.loads(out)["error"])
        # The root interpreter still imports nobody's tree: refused too.
        rc, out, err = self.status("--python", sys.executable)
        self.assertRefusedOnce(rc, out, err, f"{self.site / 'sglang'}: ", "does not import code")
        # The override runs it (and the planted code with it, as asked).
        rc, out, err = self.status("--allow-unsafe-dirs")
        self.assertNotIn("Traceback", err)
        self.assertTrue(self.marker.exists())

    def test_part_of_the_tree_another_user_can_change_is_not_imported(self):
        site = self.tmp / "site"  # root's, as is the interpreter (--python)
        shutil.copytree(self.site, site)
        (site / "sglang" / "__init__.py").write_text("")
        srt = site / "sglang" / "srt"
        os.chown(srt, NOBODY, NOBODY)
        _plant_as_nobody(srt / "__init__.py", PAYLOAD.format(marker=str(self.marker)))
        rc, out, err = self.status("--python", sys.executable, root=site)
        self.assertRefusedOnce(
            rc,
            out,
            err,
            f"{site / 'sglang'}: {srt} is owned by uid {NOBODY} (nobody)",
            "does not import code",
        )
        # Root's file, but writable by others: the same.
        for path in (srt, srt / "__init__.py"):
            os.chown(path, 0, 0)
        (srt / "__init__.py").chmod(0o666)
        rc, out, err = self.status("--python", sys.executable, root=site)
        self.assertRefusedOnce(
            rc, out, err, f"{srt / '__init__.py'} is writable by others (owner uid 0 (root))"
        )

    def test_python_of_another_user_is_not_run(self):
        bin_dir = self.tmp / "nobody-bin"
        bin_dir.mkdir()
        os.chown(bin_dir, NOBODY, NOBODY)
        python = bin_dir / "python"
        _plant_as_nobody(python, f"#!/bin/sh\necho -n 0 > {self.marker}\n")
        python.chmod(0o755)  # as root: nobody could chmod its own file as well
        rc, out, err = self.status("--python", str(python))
        self.assertRefusedOnce(rc, out, err, f"{python}: {bin_dir} is owned by uid {NOBODY} (nobody)")

    def test_link_in_a_sticky_directory_counts_its_owner(self):
        sticky = self.tmp / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)  # as /tmp: fine when what it holds is root's
        link = sticky / "python"
        link.symlink_to(os.path.realpath(sys.executable))
        self.assertIsNone(safe_files.foreign_code(link, self.site))
        os.lchown(link, NOBODY, NOBODY)  # nobody may replace its own link there at any time
        what, found = safe_files.foreign_code(link, self.site)
        self.assertEqual(
            (what, found.path, found.why), ("interpreter", str(link), f"owned by uid {NOBODY} (nobody)")
        )


@unittest.skipIf(SKIP, SKIP)
class TestStatusChildImportsOnlyCheckedCode(StatusTargetCase):
    """Issue "as root, nothing foreign runs (round 3)": the resolution child starts isolated (no
    working directory, PYTHONPATH only as checked), and as root every directory on its sys.path
    (site dirs, .pth targets, PYTHONPATH, the tree's parent) and a ``--trust-remote-code`` model
    directory are root's and writable by no one else, or nothing starts."""

    def nobody_dir(self, name: str, module: str) -> Path:
        """A directory nobody owns, holding nobody's ``module``.py (the marker payload)."""
        directory = self.tmp / name
        directory.mkdir()
        os.chown(directory, NOBODY, NOBODY)
        _plant_as_nobody(directory / f"{module}.py", PAYLOAD.format(marker=str(self.marker)))
        return directory

    def test_the_working_directory_is_not_imported(self):
        # `cd <nobody's dir> && status ...`: the child imports `selectors` (run_child's stdlib).
        cwd = self.nobody_dir("cwd", "selectors")
        here = os.getcwd()
        os.chdir(cwd)
        self.addCleanup(os.chdir, here)
        rc, out, err = self.status("--json")
        self.assertFalse(self.marker.exists(), "nobody's selectors.py in the cwd ran as root")
        self.assertNotIn("Traceback", err)
        # this venv has no sglang.srt: the child ran and said so, nothing else
        self.assertEqual(json.loads(out)["basis"], "unresolved", (out, err))

    def test_a_pythonpath_entry_of_another_user_is_refused(self):
        shadow = self.nobody_dir("shadow", "selectors")
        with mock.patch.dict(os.environ, {"PYTHONPATH": str(shadow)}):
            rc, out, err = self.status()
            self.assertRefusedOnce(
                rc, out, err, f"{shadow}: owned by uid {NOBODY} (nobody) (PYTHONPATH", "--allow-unsafe-dirs"
            )
            rc, out, err = self.status("--allow-unsafe-dirs")  # the override: as asked
        self.assertTrue(self.marker.exists())

    def test_a_pth_line_naming_another_users_directory_is_refused(self):
        shadow = self.nobody_dir("shadow", "yaml")  # imported for --config
        pth = self.site / "shadow.pth"
        pth.write_text(f"{shadow}\n")  # root's .pth, nobody's directory
        config = self.tmp / "config.yaml"
        config.write_text("page-size: 1\n")
        rc, out, err = run_cli(
            "status", "--sglang-root", str(self.site), "--", *self.LAUNCH, "--config", str(config)
        )
        self.assertRefusedOnce(rc, out, err, f"{shadow}: owned by uid {NOBODY} (nobody) (a line of {pth}")

    def test_a_group_writable_site_dir_of_a_plain_interpreter_is_refused(self):
        # A non-venv interpreter (its own prefix: the binary, the standard library linked in) whose
        # site-packages is root:staff 2775, as Debian's /usr/local/lib/python3.X/dist-packages.
        base = Path(os.path.realpath(sys.executable))
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        stdlib = Path(os.__file__).parent
        prefix = self.tmp / "prefix"
        (prefix / "bin").mkdir(parents=True)
        python = prefix / "bin" / base.name
        shutil.copy2(base, python)
        lib = prefix / "lib" / version
        lib.mkdir(parents=True)
        for entry in stdlib.iterdir():
            if entry.name != "site-packages":
                (lib / entry.name).symlink_to(entry)
        site = lib / "site-packages"
        site.mkdir()
        os.chown(site, 0, 50)  # group staff
        site.chmod(0o2775)
        # What a member of that group could leave there: a .pth whose line runs at start-up.
        (site / "group.pth").write_text(
            f"import os; open({str(self.marker)!r}, 'w').write(str(os.geteuid()))\n"
        )
        probe = subprocess.run(
            [str(python), "-I", "-S", "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
        )
        self.assertEqual(probe.stdout.strip(), str(prefix), probe.stderr)  # its own prefix
        rc, out, err = self.status("--python", str(python))
        # (found as an entry of the standard library's directory, which holds it)
        self.assertRefusedOnce(rc, out, err, f"{site} is writable by group 50 (staff) (owner uid 0 (root))")

    def test_a_sticky_directory_on_the_import_path_is_refused(self):
        # The tree's parent root's and 1777, as /tmp: it passed the check, and another user then
        # added a module there (the child's sys.path[0], ahead of the standard library).
        site = self.tmp / "sticky-site"
        shutil.copytree(self.site, site)
        site.chmod(0o1777)
        real = safe_files.foreign_code

        def checked_then_planted(*args, **kwargs):
            found = real(*args, **kwargs)
            _plant_as_nobody(site / "selectors.py", PAYLOAD.format(marker=str(self.marker)))
            return found

        with mock.patch.object(safe_files, "foreign_code", checked_then_planted):
            rc, out, err = self.status("--python", sys.executable, root=site)
        self.assertRefusedOnce(rc, out, err, f"{site} is writable by others (owner uid 0 (root))")

    def test_remote_code_of_a_model_directory_another_user_owns_is_refused(self):
        # sglang's own resolution (the installed tree, this venv): --trust-remote-code imports the
        # model directory's auto_map configuration module.
        model = self.tmp / "model"
        model.mkdir()
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "evil",
            "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"},
            "max_position_embeddings": 8192,
        }
        (model / "config.json").write_text(json.dumps(config))
        for path in (model, model / "config.json"):
            os.chown(path, NOBODY, NOBODY)
        _plant_as_nobody(model / "configuration_evil.py", PAYLOAD.format(marker=str(self.marker)))
        launch = ["--model-path", str(model), "--trust-remote-code", "--context-length", "4096"]
        launch += ["--speculative-algorithm", "NGRAM", "--device", "cuda"]
        with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
            rc, out, err = run_cli("status", "--gpu", "h200", "--", *launch)
        self.assertRefusedOnce(
            rc, out, err, f"--model-path {model}: owned by uid {NOBODY} (nobody); with --trust-remote-code"
        )


@unittest.skipIf(SKIP, SKIP)
class TestModuleEntryPoint(unittest.TestCase):
    """``python -m sglang_dsa_fix`` from a directory nobody owns: its ``dataclasses.py`` (which
    the CLI imports) is not imported as root."""

    def test_the_working_directory_leaves_sys_path(self):
        tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-main-"))
        self.addCleanup(shutil.rmtree, tmp)
        tmp.chmod(0o755)
        marker, cwd = tmp / "ran-as-root", tmp / "cwd"
        cwd.mkdir()
        os.chown(cwd, NOBODY, NOBODY)
        _plant_as_nobody(cwd / "dataclasses.py", PAYLOAD.format(marker=str(marker)))
        done = subprocess.run(
            [sys.executable, "-m", "sglang_dsa_fix", "check", "--sglang-root", str(INSTALLED.package_parent)],
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        self.assertFalse(marker.exists(), "nobody's dataclasses.py ran as root")
        self.assertIn(done.returncode, (0, 1), done.stderr)


# ------------------------------------------------------------------------------ benchmarks as root
SWAP = "import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.moved'); os.symlink(sys.argv[2], sys.argv[1])"


@unittest.skipIf(SKIP, SKIP)
class TestBenchmarkWorkDir(unittest.TestCase):
    """Issue 25 B: root's long-gen benchmark under a --work-dir nobody can rename entries of.
    nobody swaps the run's private directory for a link to a root-only directory between its
    creation and the first log; root must never empty the root-only ``none.log``."""

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-bench-"))
        self.addCleanup(shutil.rmtree, self.tmp)
        self.tmp.chmod(0o755)
        self.victim_dir = self.tmp / "root-only"
        self.victim_dir.mkdir(mode=0o700)
        self.victim = self.victim_dir / "none.log"
        self.victim.write_text("root's data\n")
        self.victim.chmod(0o600)
        sys.path.insert(0, str(BENCHMARK))
        self.addCleanup(sys.path.remove, str(BENCHMARK))
        self.long_gen = importlib.import_module("dsa_eagle_long_gen")
        sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own
        self.addCleanup(signal.signal, signal.SIGTERM, sigterm)
        worker = self.tmp / "worker.py"
        worker.write_text("")  # the engine's worker: exits at once
        self.swaps = []

        def attacked_run_all(names, args, work):
            done = subprocess.run(
                [*_as_nobody(), BARE_PYTHON, "-I", "-c", SWAP, str(work), str(self.victim_dir)],
                capture_output=True,
                text=True,
            )
            self.swaps.append(done.returncode)
            return real_run_all(names, args, work)

        real_run_all = self.long_gen.run_all
        for name, value in (("run_all", attacked_run_all), ("WORKER", worker)):
            patcher = mock.patch.object(self.long_gen, name, value)
            patcher.start()
            self.addCleanup(patcher.stop)

    def run_benchmark(self, work_dir: Path):
        out, err = io.StringIO(), io.StringIO()
        argv = [
            "--variants",
            "none",
            "--work-dir",
            str(work_dir),
            "--start-timeout",
            "20",
            "--control-reps",
            "0",
        ]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = self.long_gen.main(argv)
        return rc, out.getvalue(), err.getvalue()

    def test_work_dir_another_user_can_rename_in_is_refused(self):
        for mode, owner, said in (
            (0o777, 0, "is writable by others (owner uid 0 (root))"),
            (0o755, NOBODY, f"is owned by uid {NOBODY} (nobody)"),
        ):
            with self.subTest(mode=oct(mode), owner=owner):
                shared = self.tmp / f"shared-{mode:o}-{owner}"
                shared.mkdir()
                shared.chmod(mode)
                os.chown(shared, owner, owner)
                rc, out, err = self.run_benchmark(shared)
                self.assertEqual(self.victim.read_text(), "root's data\n", "root wrote through nobody's link")
                self.assertEqual(rc, 2, (out, err))
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn(f"{shared}: {shared} {said}", err)
                self.assertEqual(os.listdir(shared), [])  # refused before making anything

    def test_sticky_root_work_dir_runs_and_the_swap_fails(self):
        shared = self.tmp / "sticky"
        shared.mkdir()
        shared.chmod(0o1777)  # as /tmp: nobody cannot rename root's entries there
        rc, out, err = self.run_benchmark(shared)
        self.assertEqual(self.swaps, [1])  # the attacker's rename was refused by the kernel
        self.assertEqual(self.victim.read_text(), "root's data\n")
        (run,) = [p for p in shared.iterdir()]
        self.assertTrue((run / "none.log").is_file() and not (run / "none.log").is_symlink())
        self.assertEqual(run.stat().st_mode & 0o777, 0o700)
