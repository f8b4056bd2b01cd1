"""Issue 27 (f): with ``status -- <launch args>`` the plugin is looked for where the server would
import it: on the sys.path of the target interpreter (``--python``, else the venv holding the
tree, else this Python), as that interpreter reports it in the resolution child (its site dirs,
PYTHONPATH as this environment hands it on), the tree's parent first; ``check`` and the shape
flags look where they did.

The target here is this Python without its site dirs (``-S``: the editable install of the test
run is not on its path) and a copy of the sglang files the tool reads: the child cannot import
sglang there, so it answers at once and no configuration is resolved (exit 2, every bug the
configuration decides ``cannot_tell``); the sys.path it reports is the interpreter's own all the
same. A plugin install is a dist-info declaring the
entry point, beside the package (or a ``.pth`` line to its directory)."""

import json
import os
import shutil
import sys
from pathlib import Path
from unittest import mock

from helpers import PatchToolTestCase, run_cli

from sglang_dsa_fix import resolve, resolve_import_path, resolve_result

ENTRY_POINTS = "[sglang.srt.plugins]\nsglang_dsa_fix = sglang_dsa_fix.plugin:register\n"
# Never resolved here (the child cannot import sglang): what is judged is where the plugin is.
LAUNCH = ("--model-path", "x", "--context-length", "256", "--speculative-num-draft-tokens", "8")
OURS = str(Path(resolve.__file__).resolve().parents[1])


def install_plugin(site: Path, package: str = "dir") -> None:
    """The plugin's metadata in ``site``, its code there (``dir``), behind a ``.pth`` (``pth``) or
    nowhere (``none``)."""
    dist = site / "sglang_dsa_fix-0.3.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    if package == "dir":
        (site / "sglang_dsa_fix").mkdir()
        (site / "sglang_dsa_fix" / "plugin.py").write_text("")
    elif package == "pth":
        code = site.parent / "src"
        (code / "sglang_dsa_fix").mkdir(parents=True)
        (code / "sglang_dsa_fix" / "plugin.py").write_text("")
        (site / "__editable__.sglang_dsa_fix-0.3.0.pth").write_text(f"{code}\n")


class PluginLookupTestCase(PatchToolTestCase):
    layout = "site-packages"

    def setUp(self):
        super().setUp()
        self.python = self.tmp.parent / f"{self.tmp.name}-python"  # outside the tree
        self.python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
        self.python.chmod(0o755)
        self.addCleanup(self.python.unlink)
        self.elsewhere = self.tmp / "elsewhere"  # a dir on the server's PYTHONPATH
        self.elsewhere.mkdir()

    def status(self, *flags, pythonpath=None, root=None):
        env = {"PYTHONPATH": pythonpath} if pythonpath is not None else {}
        argv = ["status", "--json", "--sglang-root", str(root or self.tmp), *flags, "--", *LAUNCH]
        with mock.patch.dict(os.environ, env):
            if pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            rc, out, err = run_cli(*argv)
        report = json.loads(out)
        self.assertEqual(rc, report["exit_code"], err)
        # The -S child cannot import sglang: nothing resolved, so nothing is green.
        self.assertEqual((rc, report["basis"]), (2, "unresolved"), report)
        return report


class TestPluginOnTheTargetsSysPath(PluginLookupTestCase):
    def test_on_the_servers_pythonpath_with_the_tree_elsewhere(self):
        install_plugin(self.elsewhere)
        report = self.status("--python", str(self.python), pythonpath=str(self.elsewhere))
        plugin = report["plugin"]
        self.assertTrue(plugin["installed"], plugin)
        self.assertEqual(plugin["where"], f"{self.elsewhere} (on the sys.path of {self.python})")
        self.assertEqual(plugin["interpreter"], str(self.python))
        self.assertEqual(plugin["looked_in"][0], str(self.tmp))  # the tree's parent first
        self.assertIn(str(self.elsewhere), plugin["looked_in"])
        self.assertTrue(plugin["live"], plugin)  # what the verdict reads (bugs.judge)

    def test_behind_a_pth_line(self):
        install_plugin(self.elsewhere, package="pth")
        report = self.status("--python", str(self.python), pythonpath=str(self.elsewhere))
        self.assertTrue(report["plugin"]["installed"], report["plugin"])

    def test_absent_is_not_installed(self):
        # Nothing on the target's path has it; the caller's own (editable) install does not count,
        # nor does the directory the child puts this package in to run.
        report = self.status("--python", str(self.python))
        plugin = report["plugin"]
        self.assertFalse(plugin["installed"], plugin)
        self.assertEqual(plugin["where"], f"the sys.path of {self.python}")
        self.assertNotIn(OURS, plugin["looked_in"])
        self.assertIn(os.path.dirname(os.__file__), plugin["looked_in"])  # the target's stdlib
        self.assertFalse(plugin["live"], plugin)

    def test_the_callers_working_directory_does_not_count(self):
        # An empty plugin.py and a dist-info naming it where `status` is run from: the server
        # does not import from the caller's working directory (the child starts isolated).
        install_plugin(self.elsewhere)
        here = os.getcwd()
        os.chdir(self.elsewhere)
        self.addCleanup(os.chdir, here)
        report = self.status("--python", str(self.python))
        self.assertFalse(report["plugin"]["installed"], report["plugin"])
        self.assertFalse(report["plugin"]["live"], report["plugin"])  # what the verdict reads
        self.assertNotIn(str(self.elsewhere), report["plugin"]["looked_in"])

    def test_metadata_without_the_package_is_not_installed(self):
        install_plugin(self.elsewhere, package="none")
        report = self.status("--python", str(self.python), pythonpath=str(self.elsewhere))
        self.assertFalse(report["plugin"]["installed"], report["plugin"])

    def test_in_the_trees_own_site_dir(self):
        install_plugin(self.tmp)
        report = self.status("--python", str(self.python))
        self.assertEqual(report["plugin"]["where"], f"{self.tmp} (on the sys.path of {self.python})")

    def test_the_venv_holding_the_tree_is_the_target_without_python(self):
        # --sglang-root in a venv, no --python: that venv's interpreter is asked (here the -S
        # wrapper as its bin/python), PYTHONPATH included.
        venv = self.tmp / "venv"
        site = venv / "lib" / "python3" / "site-packages"
        shutil.copytree(self.package, site / "sglang")
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to(self.python)
        (venv / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
        install_plugin(self.elsewhere)
        report = self.status(pythonpath=str(self.elsewhere), root=site)
        self.assertEqual(report["plugin"]["interpreter"], str(venv / "bin" / "python"))
        self.assertTrue(report["plugin"]["installed"], report["plugin"])
        report = self.status(root=site)
        self.assertFalse(report["plugin"]["installed"], report["plugin"])

    def test_check_and_the_shape_flags_look_where_they_did(self):
        # No interpreter named: the tree's site dir only, whatever PYTHONPATH says.
        install_plugin(self.elsewhere)
        with mock.patch.dict(os.environ, {"PYTHONPATH": str(self.elsewhere)}):
            for argv in (
                ["check"],
                ["status", "--context-length", "256", "--speculative-num-draft-tokens", "8"],
            ):
                with self.subTest(argv=argv):
                    rc, out, _ = run_cli(*argv, "--json", "--sglang-root", str(self.tmp))
                    plugin = json.loads(out)["plugin"]
                    self.assertEqual((rc, plugin["installed"], plugin["where"]), (1, False, str(self.tmp)))
                    self.assertNotIn("looked_in", plugin)


class TestTheChildsReport(PluginLookupTestCase):
    def test_a_sys_path_that_is_not_a_list_of_paths_is_refused(self):
        for bad in (
            "x",
            [1],
            ["a" * (resolve_result.MAX_PATH_ENTRY + 1)],
            ["a"] * (resolve_result.MAX_SYS_PATH + 1),
        ):
            with self.subTest(bad=str(bad)[:40]):
                self.assertIn(
                    "sys_path",
                    resolve_result.schema_error({"error_kind": "import", "error": "x", "sys_path": bad}),
                )
        self.assertIsNone(
            resolve_result.schema_error({"error_kind": "import", "error": "x", "sys_path": ["/a"]})
        )

    def test_a_child_without_a_sys_path_leaves_the_lookup_as_before(self):
        # An interpreter that prints a result line without sys_path (an older tool's child).
        line = json.dumps(
            {
                "sglang_version": "0.5.14",
                "configuration": {"speculative_algorithm": None, "context_length": 4096, "page_size": 1},
                "sources": {},
                "widths": {"row_extra": 4, "decode_reserve": 1, "alloc_page_size": 1},
            }
        )
        fake = self.tmp.parent / f"{self.tmp.name}-fake"
        # As root the tool first asks the interpreter for its sys.path
        # (``resolve_import_path.PROBE``): the fake answers that it has none, then the result line.
        probed = resolve_import_path.PATH_MARK + json.dumps({"path": [], "site": []})
        fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{probed}' '{resolve_result.RESULT_MARK}{line}'\n")
        fake.chmod(0o755)
        self.addCleanup(fake.unlink)
        install_plugin(self.tmp)
        rc, out, err = run_cli(
            "status", "--json", "--sglang-root", str(self.tmp), "--python", str(fake), "--", "-x"
        )
        plugin = json.loads(out)["plugin"]
        self.assertEqual((rc, plugin["installed"], plugin["where"]), (0, True, str(self.tmp)), err)
