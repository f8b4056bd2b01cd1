"""Issue "as root, nothing foreign runs (round 3)": the plugin's start-up in a scheduler process.

- ``register()`` imports no attention backend module: a backend's hooks are registered when
  sglang itself imports that module, and applied by sglang's HookRegistry then;
- the REPLACE hooks of bug #3's relatives are built from the code sglang loaded: where the
  ``.py`` is not what was loaded (unchecked-hash bytecode, a user who may edit only the ``.py``),
  nothing of the ``.py`` is evaluated (its default arguments included) and an edited method is
  not replaced (the state says so).

Each case is a fresh ``python`` (it imports sglang: ~10 s) on the installed sglang, or on a tree
linked to it with ``trtllm_mha_backend.py`` a real copy.
"""

import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from helpers import INSTALLED
from test_resolve import link_tree

from sglang_dsa_fix import graph_tables
from sglang_dsa_fix.verdicts import Bug

NOBODY = 65534
MHA = graph_tables.LAYOUTS[Bug.TRTLLM_MHA_PAGE_TABLE]
MHA_FILE = INSTALLED.package / MHA.relative_path
# In a scheduler: sglang's own imports first (the scheduler module, which the plugin's state hook
# targets), then load_plugins' register() and apply_hooks(), then the backend sglang builds.
CHILD = """
import json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import sglang.srt.managers.scheduler
from sglang.srt.plugins.hook_registry import HookRegistry
attention = lambda: sorted(m for m in sys.modules if m.startswith("sglang.srt.layers.attention."))
before = attention()
from sglang_dsa_fix import plugin
plugin.register()
HookRegistry.apply_hooks()
after = attention()
import sglang.srt.layers.attention.trtllm_mha_backend
plugin.refresh_hook_states()
print("@@" + json.dumps({"before": before, "after": after, "bugs": plugin.STATE["bugs"],
                         "patched": sorted(HookRegistry._patched)}))
"""


def run_scheduler_start(site: str = "") -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "SGLANG_DSA_FIX": "1"}
    env.pop("SGLANG_DSA_FIX_WATCH", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, site], capture_output=True, text=True, env=env, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][2:])


@unittest.skipUnless(MHA_FILE.exists(), "this release has no TRT-LLM MHA backend")
class TestStartUpImports(unittest.TestCase):
    def test_register_imports_no_backend_module_and_hooks_on_sglangs_import(self):
        report = run_scheduler_start()
        self.assertEqual(report["after"], report["before"], "register() imported backend modules")
        # Applied by sglang's HookRegistry once sglang imported the module; never called here.
        mha = report["bugs"][Bug.TRTLLM_MHA_PAGE_TABLE.value]
        self.assertEqual((mha["state"], mha["hook"]), ("not_reachable", "not_reached"), mha)
        self.assertIn("never ran in this scheduler process", mha["detail"])
        self.assertTrue(mha["targets"])
        for target in mha["targets"]:
            self.assertIn(target, report["patched"])
        mla = report["bugs"][Bug.TRTLLM_MLA_KV_INDICES.value]  # a backend sglang never imported
        self.assertEqual((mla["state"], mla["hook"]), ("not_reachable", "not_reached"), mla)
        self.assertIn("never imported sglang.srt.layers.attention.trtllm_mla_backend", mla["detail"])


@unittest.skipUnless(MHA_FILE.exists(), "this release has no TRT-LLM MHA backend")
@unittest.skipUnless(os.geteuid() == 0, "needs root (a .py another user owns)")
class TestReplacementsFromTheLoadedCode(unittest.TestCase):
    """sglang loads an unchecked-hash .pyc of the pristine file; nobody may edit only the .py."""

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-loaded-"))
        self.addCleanup(shutil.rmtree, self.tmp)
        self.tmp.chmod(0o755)
        self.marker = self.tmp / "ran-as-root"
        self.site = self.tmp / "site"
        link_tree(INSTALLED.package, self.site / "sglang", {Path(MHA.relative_path).parent})
        self.py = self.site / "sglang" / MHA.relative_path
        self.py.unlink()
        shutil.copyfile(MHA_FILE, self.py)
        cached = Path(importlib.util.cache_from_source(str(self.py)))
        if cached.is_symlink() or cached.exists():
            cached.unlink()
        py_compile.compile(
            str(self.py),
            str(cached),
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        os.chown(self.py, NOBODY, NOBODY)
        self.pristine = self.py.read_bytes()

    def edit_as_nobody(self, old: bytes, new: bytes) -> None:
        self.assertIn(old, self.pristine)
        data = self.pristine.replace(old, new, 1)
        plant = "import sys; open(sys.argv[1], 'wb').write(sys.argv[2].encode())"
        done = subprocess.run(
            [
                "runuser",
                "-u",
                "nobody",
                "--",
                "/usr/bin/python3",
                "-I",
                "-c",
                plant,
                str(self.py),
                data.decode(),
            ],
            capture_output=True,
        )
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_a_default_argument_of_the_py_is_not_evaluated(self):
        payload = f"open({str(self.marker)!r}, 'w').write('0') and 0".encode()
        self.edit_as_nobody(b"speculative_step_id: int = 0,", b"speculative_step_id: int = " + payload + b",")
        report = run_scheduler_start(str(self.site))
        self.assertFalse(self.marker.exists(), "the .py's default argument ran as root")
        mha = report["bugs"][Bug.TRTLLM_MHA_PAGE_TABLE.value]
        # The method's own code is what sglang loaded: replaced, with the loaded defaults.
        self.assertIn("never ran in this scheduler process", mha["detail"])
        self.assertTrue(mha["targets"])
        for target in mha["targets"]:
            self.assertIn(target, report["patched"])

    def test_an_edited_method_is_not_replaced(self):
        payload = f"open({str(self.marker)!r}, 'w').write('0') and ".encode()
        old = b"env_var = envs.SGLANG_FLASHINFER_WORKSPACE_SIZE"
        self.edit_as_nobody(old, b"env_var = " + payload + old.split(b"= ")[1])
        report = run_scheduler_start(str(self.site))
        mha = report["bugs"][Bug.TRTLLM_MHA_PAGE_TABLE.value]
        self.assertEqual((mha["state"], mha["hook"]), ("affected", "unsupported"), mha)
        self.assertIn("the code sglang loaded is not", mha["detail"])
        self.assertTrue(mha["targets"])
        for target in mha["targets"]:
            self.assertNotIn(target, report["patched"])
