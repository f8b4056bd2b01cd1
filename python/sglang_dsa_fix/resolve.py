"""A deployment's configuration and widths, from sglang's OWN code, run in a child process.

Its launch_server arguments go through sglang's own argument processing, its ``req_to_token``
row through sglang's own sizing functions.

``status -- <launch_server args>`` calls ``resolve``: it starts the target environment's Python
(``--python``; default the venv holding the tree, else this one) isolated (``python -I``: no
working directory, PYTHONPATH's absolute entries handed on by hand) with the tree first on
``sys.path`` (as root every directory on it checked first: ``resolve_import_path``), and ``resolve_child.child_main`` there runs ``sglang.srt.server_args.prepare_server_args`` (0.5.23:
then ``resolve_once``) under a GPU profile, reads the resolved fields and calls
``get_req_to_token_extra_context_len`` / ``get_alloc_reserve_per_decode`` of that tree. The parent
imports neither torch nor sglang. Where the child cannot import sglang, no configuration is
resolved (``"basis": "unresolved"``, the reason and the fix): no rule stands in for sglang's, as
one that reads a few flags misses what sglang forces (``--dcp-size``, the backend, the page
size), and every bug the configuration decides is ``cannot_tell``. Either way the child reports
its own ``sys.path`` (before the tree and this package were put first): where the server's
interpreter would find the plugin (``tree.plugin_report``), under
``PLUGIN_SEARCH`` in what ``resolve`` returns.

sglang's argument processing asks the device (0.5.14 server_args.py:2521
``get_device_memory_capacity``, :4893 ``is_sm100_supported``, :5927 ``get_device_sm``; 0.5.23
arg_groups/model_hook.py:341 and overrides.py:512/631 ``torch.cuda.get_device_capability``,
memory_hook.py:78, and the platform probes through runtime_context.py:1874): the child answers
those from a ``GPU_PROFILES`` entry, so a CPU machine resolves what the server's GPU would.

This module is the flow's configuration step (``status.collect``): ``configuration(tree,
form, request)`` turns a ``Request`` into ``{"basis", "configuration", "widths", ...}``,
resolved by sglang (``basis: sglang``), for the old shape flags by the static rule at the release
the tree's files say (``basis: static``), or not at all where sglang cannot be imported
(``basis: unresolved``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import width
from sglang_dsa_fix.child_process import MAX_CHILD_OUTPUT, OutputCapExceeded, run_child
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.release import Form
from sglang_dsa_fix.resolve_import_path import import_path, refuse_foreign_code
from sglang_dsa_fix.resolve_result import RESULT_MARK, read_result
from sglang_dsa_fix.tree import SglangTree

# name -> what sglang's probes see. mem_mib as the driver reports it.
GPU_PROFILES = {
    "h100": {"vendor": "cuda", "capability": [9, 0], "mem_mib": 81559, "name": "NVIDIA H100 80GB HBM3"},
    "h200": {"vendor": "cuda", "capability": [9, 0], "mem_mib": 143771, "name": "NVIDIA H200"},
    "b200": {"vendor": "cuda", "capability": [10, 0], "mem_mib": 183359, "name": "NVIDIA B200"},
    "mi300": {
        "vendor": "hip",
        "capability": [9, 4],
        "mem_mib": 196592,
        "name": "AMD Instinct MI300X",
        "arch": "gfx942",
    },
}
GPU_PROFILE_NAMES = tuple(GPU_PROFILES)
DEFAULT_GPU = "h200"
CHILD_TIMEOUT_S = 180.0
# ``resolve`` hands the child's own sys.path on under PLUGIN_SEARCH, with the interpreter that
# reported it: where the server's interpreter would find the plugin (``status``).
PLUGIN_SEARCH = "plugin_search"
# How the child leaves once its result line is out: ``os._exit``, without the interpreter's
# teardown (freeing some 5000 modules of torch and sglang, their atexit hooks, GC): that took
# 4 - 4.5 s of a 19 - 24 s `status --` on the loaded 2-core CPU machine (benchmark/status_cost.py). The
# child writes nothing but its output; the parent kills its process group afterwards anyway.
CHILD_EXIT = "sys.stdout.flush(); sys.stderr.flush(); import os; os._exit(0)"
# The child starts isolated (``-I``): neither the working directory nor a script's directory on
# sys.path, no PYTHON* variable (PYTHONPATH, PYTHONSTARTUP, PYTHONHOME ...), no user site. What
# this environment's PYTHONPATH names is handed on by hand, its absolute entries only (a relative
# one means the caller's working directory); ``-W ignore`` stands in for PYTHONWARNINGS.
ISOLATED = ("-I", "-W", "ignore")
# argv[1]: {"parent", "ours", "pythonpath", "checked"}; argv[2]: the options; then the launch
# arguments. The target's own sys.path (its site dirs, the PYTHONPATH entries) is taken before the
# tree is put first: where the server would find the plugin. This package is imported from its
# own directory (``ours``), which then leaves sys.path again: its other entries shadow nothing.
BOOT = f"""\
import json, os, sys
boot = json.loads(sys.argv[1])
checked = boot["checked"]
unchecked = [p for p in sys.path if checked is not None and os.path.abspath(p) not in checked]
if unchecked:
    error = (unchecked[0] + ": on the import path of " + sys.executable + " but not among the "
             "directories checked before it started; as root sglang-dsa-fix does not import code "
             "from it (pass --allow-unsafe-dirs to override)")
    print({RESULT_MARK!r} + json.dumps({{"error_kind": "refused", "error": error}}), flush=True)
    os._exit(0)
sys.path[:0] = boot["pythonpath"]
path = list(sys.path)
sys.path.insert(0, boot["ours"])
import sglang_dsa_fix
sys.path.remove(boot["ours"])
sys.path.insert(0, boot["parent"])
from sglang_dsa_fix import resolve_child
resolve_child.child_main(sys.argv[2:], path)
{CHILD_EXIT}
"""
# ------------------------------------------------------------------------------ parent side


@dataclass(frozen=True)
class Request:
    """Which configuration to judge: the deployment's launch_server arguments (resolved by
    sglang), or the old shape flags (the static rule)."""

    launch_args: Optional[list] = None
    shape: Optional[width.SpecShape] = None
    python: Optional[str] = None  # the interpreter that imports the target sglang
    gpu: Optional[str] = None  # a GPU_PROFILES name
    prove: bool = False  # also drive sglang's decode path on CPU (``resolve_prove.prove``)
    allow_unsafe_dirs: bool = False  # as root: run and import what another user could change


def configuration(tree: SglangTree, form: Form, request: Request) -> dict:
    """The configuration step of the verdict flow. ``form``: the release's form, whose pristine
    arithmetic the static rule uses (the tree's files decide it, ``classify.read_tree``)."""
    if request.launch_args is not None:
        return resolve(
            tree,
            request.launch_args,
            request.python,
            request.gpu,
            request.prove,
            request.allow_unsafe_dirs,
        )
    return static(request.shape, form)


def static(shape: width.SpecShape, form: Form) -> dict:
    """The static rule's configuration and widths for a shape (``"basis": "static"``)."""
    config = {
        "speculative_algorithm": "EAGLE" if shape.has_draft_kv else "NGRAM",
        "speculative_num_draft_tokens": shape.speculative_num_draft_tokens,
        "speculative_eagle_topk": shape.speculative_eagle_topk,
        "speculative_num_steps": shape.speculative_num_steps,
        "page_size": shape.page_size,
        "context_length": shape.context_length,
        "disable_overlap_schedule": not shape.overlap,
    }
    widths = {
        "row_extra": width.pristine_row_extra(form, shape),
        "decode_reserve": width.reserve_per_decode(shape, form),
        "alloc_page_size": shape.page_size,  # the shape flags have no decode context parallel
    }
    return {"basis": "static", "configuration": config, "widths": widths}


def _venv_python(tree: SglangTree) -> Optional[Path]:
    """The interpreter of the venv that holds the tree (``<venv>/lib/pythonX.Y/site-packages``)."""
    for parent in tree.package_parent.parents:
        if (parent / "pyvenv.cfg").is_file() and (parent / "bin" / "python").is_file():
            return parent / "bin" / "python"
    return None


def pythonpath() -> list:
    """This environment's PYTHONPATH as handed on to the child: its absolute entries, each once."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return list(dict.fromkeys(os.path.normpath(e) for e in entries if os.path.isabs(e)))


def local_gpu() -> Optional[dict]:
    """The first local NVIDIA GPU as a profile (nvidia-smi), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
        name, capability, memory = (part.strip() for part in out[0].split(","))
        major, minor = (int(x) for x in capability.split("."))
        return {"vendor": "cuda", "capability": [major, minor], "mem_mib": int(float(memory)), "name": name}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def gpu_profile(name: Optional[str]) -> tuple:
    """(profile, how it was chosen)."""
    if name is not None:
        key = name.strip().lower()
        if key not in GPU_PROFILES:
            raise ToolError(f"--gpu {name}: unknown profile (choose from {', '.join(GPU_PROFILE_NAMES)})")
        return GPU_PROFILES[key], f"--gpu {key}"
    local = local_gpu()
    if local is not None:
        return local, f"the local GPU ({local['name']})"
    return GPU_PROFILES[DEFAULT_GPU], f"{DEFAULT_GPU} (no local GPU; pass --gpu)"


def resolve(
    tree: SglangTree,
    launch_args: list,
    python: Optional[str] = None,
    gpu: Optional[str] = None,
    prove: bool = False,
    allow_unsafe_dirs: bool = False,
) -> dict:
    """What sglang resolves for these launch arguments, and its own widths. ToolError when sglang
    rejects the arguments; ``unresolved`` (the reason) when sglang cannot be imported.
    ``prove``: also drive sglang's real decode path for that configuration (``proof.row_overflow``
    at context ``resolve_prove.PROVE_CONTEXT``) and report the columns it really writes past the
    row end. As root, refuses (``refuse_foreign_code``) unless ``allow_unsafe_dirs``."""
    profile, profile_note = gpu_profile(gpu)
    if python is not None:
        interpreter = Path(python)
        if not os.access(interpreter, os.X_OK) or interpreter.is_dir():
            raise ToolError(f"--python {python}: not an executable interpreter")
    else:
        interpreter = _venv_python(tree) or Path(sys.executable)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    handed_on = pythonpath()
    checked = None  # an unprivileged run imports nothing its user could not import anyway
    if not allow_unsafe_dirs and os.geteuid() == 0:
        refuse_foreign_code(interpreter, tree)
        checked = import_path(interpreter, tree, handed_on, env)
    boot = {
        "parent": str(tree.package_parent),
        "ours": str(Path(__file__).resolve().parents[1]),
        "pythonpath": handed_on,
        "checked": checked,
    }
    # "guard": the child refuses a model's remote code another user can change (as root).
    options = {"profile": profile, "prove": prove, "guard": checked is not None}
    command = [str(interpreter), *ISOLATED, "-c", BOOT, json.dumps(boot), json.dumps(options), *launch_args]
    if prove and local_gpu() is None:
        # Without a GPU the drive's tensors are CPU tensors and sglang's Triton kernels run in
        # Triton's interpreter (set before triton loads). On a GPU host the drive runs on the GPU,
        # compiled (``resolve_prove.prove``): compiled Triton refuses CPU tensors ("Pointer
        # argument cannot be accessed from Triton (cpu tensor?)") and an older Triton's interpreter
        # may not run sglang's kernels (triton 3.6.0 on the H200: "only 0-dimensional arrays ...").
        env["TRITON_INTERPRET"] = "1"
    started = time.monotonic()
    try:
        returncode, stdout, stderr = run_child(command, env, CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolError(f"sglang did not resolve the arguments within {CHILD_TIMEOUT_S:g} s") from None
    except OutputCapExceeded as exc:
        raise ToolError(
            f"{interpreter}: resolving the arguments printed more than {MAX_CHILD_OUTPUT >> 20} MiB of "
            f"output on {exc}; stopped"
        ) from None
    except OSError as exc:
        raise ToolError(f"{interpreter}: cannot run ({exc.strerror})") from None
    result = read_result(interpreter, returncode, stdout, stderr)
    sys_path = result.pop("sys_path", None)
    search = None if sys_path is None else {"interpreter": str(interpreter), "sys_path": sys_path}
    if result.get("error_kind") in ("refused", "model_config"):
        raise ToolError(result["error"])
    if result.get("error_kind") == "import":
        out = unresolved(f"{interpreter} cannot import sglang ({result['error']})")
        return out if search is None else {**out, PLUGIN_SEARCH: search}
    if "error" in result:
        raise ToolError(f"sglang rejected the launch arguments: {result['error']}")
    result["resolved_with"] = (
        f"{result.pop('sglang_version')} ({interpreter}, GPU profile {profile_note}, "
        f"{time.monotonic() - started:.1f} s)"
    )
    result["basis"] = "sglang"
    if search is not None:
        result[PLUGIN_SEARCH] = search
    return result


def unresolved(why: str) -> dict:
    """No configuration, and why (``width.at_configuration``: ``cannot_tell`` for every bug the
    configuration decides), with what makes sglang resolve it."""
    return {
        "basis": width.UNRESOLVED,
        "basis_note": f"{why}; pass --python the interpreter of the server's environment (the one that "
        "runs sglang.launch_server), or install what it lacks",
    }
