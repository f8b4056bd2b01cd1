"""A deployment's configuration and widths, from sglang's OWN code, run in a child process.

Its launch_server arguments go through sglang's own argument processing, its ``req_to_token``
row through sglang's own sizing functions.

``status -- <launch_server args>`` calls ``resolve``: it starts the target environment's Python
(``--python``; default the venv holding the tree, else this one) isolated (``python -I``: no
working directory, PYTHONPATH's absolute entries handed on by hand) with the tree first on
``sys.path`` (as root every directory on it checked first: ``import_path``), and ``child_main`` there runs ``sglang.srt.server_args.prepare_server_args`` (0.5.23:
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

import argparse
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import release, runtime_fix, safe_files, width
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.release import Form
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
RESULT_MARK = "@@sglang-dsa-fix-resolve@@ "
# Resolved ServerArgs fields reported under "configuration" (sglang's own names).
FIELDS = (
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_eagle_topk",
    "speculative_num_steps",
    "page_size",
    "context_length",
    "attention_backend",
    "decode_attention_backend",
    "prefill_attention_backend",
    "speculative_attention_mode",
    "speculative_draft_attention_backend",
    "disable_cuda_graph",
    "disable_overlap_schedule",
    "attn_dcp_size",
    "dcp_size",
    "device",
    # Not ServerArgs fields: the backend sglang picks by the model (``_model_attention_backend``),
    # and whether the scheduler runs the spec-v2 decode path (``_runs_spec_v2``).
    "model_attention_backend",
    "speculative_runs_spec_v2",
)
# What is read of the child's stdout and stderr, each (``run_child``): sglang's warnings and one
# result line are a few KiB. Read in CHUNKs, polled every POLL_S; once the child exited, what
# it left running is killed and the pipes drained for at most DRAIN_S.
MAX_CHILD_OUTPUT = 8 << 20
CHUNK = 64 << 10
POLL_S = 0.2
DRAIN_S = 2.0
# What the parent reads of the child's result line (``read_result``): the line's size, the
# integers' range, its error kinds and fields, the configuration fields that are integers, and
# each width's types.
MAX_RESULT_LINE = 1 << 20  # characters; a result is a few KiB
MAX_INT = 1 << 62
ERROR_KINDS = ("import", "arguments", "refused")
RESULT_FIELDS = ("sglang_version", "configuration", "sources", "widths", "prove", "sys_path")
# The child's own sys.path (``child_main``), where the plugin is looked for (``status``): at most
# MAX_SYS_PATH entries of at most MAX_PATH_ENTRY characters each. ``resolve`` hands it on under
# PLUGIN_SEARCH, with the interpreter that reported it.
MAX_SYS_PATH = 1024
MAX_PATH_ENTRY = 4096
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
# As root (``import_path``), the target's sys.path is asked first, without the site module
# (``-S``: no .pth file runs): its standard library entries and its site directories; each of
# those, every directory a .pth line there adds, the PYTHONPATH entries and the tree's parent are
# checked (``safe_files.import_dir_foreign``) before the child starts, and the child refuses to
# go on (``BOOT``) when its sys.path holds an entry that was not checked.
PATH_MARK = "@@sglang-dsa-fix-path@@ "
PROBE = (
    "import json, site, sys; venv, system = sys.argv[1], sys.argv[2] == '1'; "
    "dirs = site.getsitepackages([venv]) if venv else []; "
    "dirs += site.getsitepackages() if system or not venv else []; "
    f"print({PATH_MARK!r} + json.dumps({{'path': sys.path, 'site': dirs}}))"
)
PROBE_TIMEOUT_S = 30.0
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
from sglang_dsa_fix import resolve
resolve.child_main(sys.argv[2:], path)
{CHILD_EXIT}
"""
INT_FIELDS = (
    "speculative_num_draft_tokens",
    "speculative_eagle_topk",
    "speculative_num_steps",
    "page_size",
    "context_length",
    "attn_dcp_size",
    "dcp_size",
)
WIDTH_FIELDS = {
    "row_extra": (int,),
    "decode_reserve": (int,),
    "row_extra_with_plugin": (int, type(None)),
    "alloc_page_size": (int,),
    "sizing_function": (str,),
    "graph_page_table_width": (int,),
    "graph_page_table_from": (str,),
    "graph_page_table_error": (str,),
}
PROVE_FIELDS = (
    "context_length",
    "prompt_len",
    "row_extra",
    "columns_past_row_end",
    "neighbour_cells_changed",
    "leaked_slots",
)
PROVE_DEVICES = ("cpu", "cuda")  # where the drive ran (``_prove``)
# ------------------------------------------------------------------------------ parent side


@dataclass(frozen=True)
class Request:
    """Which configuration to judge: the deployment's launch_server arguments (resolved by
    sglang), or the old shape flags (the static rule)."""

    launch_args: Optional[list] = None
    shape: Optional[width.SpecShape] = None
    python: Optional[str] = None  # the interpreter that imports the target sglang
    gpu: Optional[str] = None  # a GPU_PROFILES name
    prove: bool = False  # also drive sglang's decode path on CPU (``_prove``)
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


def refuse_foreign_code(interpreter: Path, tree: SglangTree) -> None:
    """As root, ToolError when the child would run an interpreter, or import a tree, that a user
    other than root could change (``safe_files.foreign_code``: the file, its directories up to
    ``/``, the links on the way; the package parent and everything under ``sglang/``)."""
    if os.geteuid() != 0:
        return  # an unprivileged run executes nothing its user could not run anyway
    try:
        found = safe_files.foreign_code(interpreter, tree.package_parent)
    except OSError as exc:
        raise ToolError(f"{exc.filename or interpreter}: cannot check ({exc.strerror or exc})") from None
    if found is None:
        return
    what, where = found
    doing = "run an interpreter" if what == "interpreter" else "import code"
    named = interpreter if what == "interpreter" else tree.package
    said = f"{named}: " + ("" if where.path == str(named) else f"{where.path} is ") + where.reason
    raise ToolError(
        f"{said}; as root sglang-dsa-fix does not {doing} another user can change (pass "
        "--allow-unsafe-dirs to override)"
    )


def pythonpath() -> list:
    """This environment's PYTHONPATH as handed on to the child: its absolute entries, each once."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return list(dict.fromkeys(os.path.normpath(e) for e in entries if os.path.isabs(e)))


def _pth_dirs(site_dir: str) -> list:
    """The directories the .pth files of ``site_dir`` add to sys.path, as ``site.addpackage``
    reads them (``import`` lines run code from what is already on the path: checked there)."""
    from sglang_dsa_fix.tree import MAX_METADATA_FILE, read_text

    dirs = []
    for pth in sorted(Path(site_dir).glob("*.pth")):
        try:
            lines = read_text(pth, MAX_METADATA_FILE).splitlines()
        except OSError:  # what site cannot read adds nothing
            continue
        for line in lines:
            if line.startswith("#") or not line.strip() or line.startswith(("import ", "import\t")):
                continue
            target = os.path.abspath(os.path.join(site_dir, line.rstrip()))
            if os.path.exists(target):
                dirs.append((target, f"a line of {pth}"))
    return dirs


def _venv_system_site(venv: Path) -> bool:
    """Does the venv's pyvenv.cfg include the base interpreter's site-packages?"""
    from sglang_dsa_fix.tree import MAX_METADATA_FILE, read_text

    try:
        text = read_text(venv / "pyvenv.cfg", MAX_METADATA_FILE)
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip().lower() == "include-system-site-packages":
            return value.strip().lower() == "true"
    return False


def import_path(interpreter: Path, tree: SglangTree, handed_on: list, env: dict) -> list:
    """As root, the directories the child imports from, each checked (``import_dir_foreign``):
    ToolError naming the first one another user could change. ``handed_on``: the PYTHONPATH
    entries the child gets."""
    venv = safe_files.venv_of(interpreter)
    system = "1" if venv is None or _venv_system_site(venv) else "0"
    command = [str(interpreter), "-I", "-S", "-c", PROBE, str(venv or ""), system]
    try:
        returncode, stdout, stderr = run_child(command, env, PROBE_TIMEOUT_S)
        line = next(line for line in reversed(stdout.splitlines()) if line.startswith(PATH_MARK))
        probed = json.loads(line[len(PATH_MARK) :])
        stdlib, sites = probed["path"], probed["site"]
        if not all(isinstance(e, str) for e in [*stdlib, *sites]):
            raise ValueError("not a list of paths")
    except (StopIteration, ValueError, KeyError, TypeError, OutputCapExceeded, subprocess.TimeoutExpired):
        raise ToolError(
            f"{interpreter}: did not report its sys.path, so as root sglang-dsa-fix cannot check "
            "what it would import (pass --allow-unsafe-dirs to override)"
        ) from None
    except OSError as exc:
        raise ToolError(f"{interpreter}: cannot run ({exc.strerror})") from None
    entries = [(str(tree.package_parent), "the tree's parent")]
    entries += [(e, "PYTHONPATH") for e in handed_on]
    entries += [(os.path.abspath(e), "its standard library") for e in stdlib]
    for site_dir in sites:
        entries.append((os.path.abspath(site_dir), "a site directory"))
        if os.path.isdir(site_dir):
            entries += _pth_dirs(site_dir)
    checked = []
    for entry, why in entries:
        if entry in checked:
            continue
        try:
            found = safe_files.import_dir_foreign(entry)
        except OSError as exc:
            raise ToolError(f"{exc.filename or entry}: cannot check ({exc.strerror or exc})") from None
        if found is not None:
            said = f"{entry}: " + ("" if found.path == entry else f"{found.path} is ") + found.reason
            raise ToolError(
                f"{said} ({why}, on the import path of {interpreter}); as root sglang-dsa-fix does not "
                "import code another user can change (pass --allow-unsafe-dirs to override)"
            )
        checked.append(entry)
    return checked


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
    at context ``PROVE_CONTEXT``) and report the columns it really writes past the row end.
    As root, refuses (``refuse_foreign_code``) unless ``allow_unsafe_dirs``."""
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
        # compiled (``_prove``): compiled Triton refuses CPU tensors ("Pointer argument cannot be
        # accessed from Triton (cpu tensor?)") and an older Triton's interpreter may not run
        # sglang's kernels (triton 3.6.0 on the H200: "only 0-dimensional arrays ...").
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
    if result.get("error_kind") == "refused":
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


class OutputCapExceeded(Exception):
    """The child printed more than MAX_CHILD_OUTPUT on one stream (the stream's name)."""


def _exited(pid: int) -> bool:
    """Has the child exited? It is not reaped: its process group stays ours to kill."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_child(command: list, env: dict, timeout: float) -> tuple:
    """(exit code, stdout, stderr) of ``command``, run in a session (process group) of its own.
    At most MAX_CHILD_OUTPUT bytes are read from each stream (OutputCapExceeded beyond), and
    at most ``timeout`` seconds waited (subprocess.TimeoutExpired); either way, and whatever the
    child leaves running when it exits, the whole group is killed (a grandchild included)."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    read = {fd: bytearray() for fd in names}
    deadline = time.monotonic() + timeout
    exited_at = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in names:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if exited_at is None and _exited(proc.pid):
                    exited_at = now
                    _kill_group(proc.pid)  # what it left behind; its pipes then close
                if exited_at is not None and now - exited_at > DRAIN_S:
                    break  # a process that left the group still holds a pipe
                if now >= deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                for key, _ in selector.select(min(deadline - now, POLL_S)):
                    chunk = os.read(key.fd, CHUNK)
                    if not chunk:
                        selector.unregister(key.fd)
                    elif len(read[key.fd]) + len(chunk) > MAX_CHILD_OUTPUT:
                        raise OutputCapExceeded(names[key.fd])
                    else:
                        read[key.fd] += chunk
        if exited_at is None:  # both pipes closed, the child runs on
            proc.wait(max(0.0, deadline - time.monotonic()))
    finally:
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out, err = (bytes(read[fd]).decode("utf-8", "replace") for fd in names)
    return proc.returncode, out, err


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_result(interpreter, returncode: int, stdout: str, stderr: str) -> dict:
    """The child's last RESULT_MARK line, parsed under MAX_RESULT_LINE and checked against what
    ``child_main`` prints (``schema_error``); ToolError of one line otherwise."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolError(f"{interpreter}: resolving the arguments failed (exit {returncode}: {tail})")
    line = lines[-1][len(RESULT_MARK) :]
    if len(line) > MAX_RESULT_LINE:
        why = f"a result line of {len(line)} characters, over the {MAX_RESULT_LINE} cap"
    else:
        try:
            result, why = json.loads(line), None
        except (ValueError, RecursionError):
            why = "the result line is not JSON"
        else:
            why = schema_error(result)
    if why is not None:
        raise ToolError(f"{interpreter}: resolving the arguments gave no result this tool reads ({why})")
    return result


def _is_int(value) -> bool:
    return type(value) is int and abs(value) <= MAX_INT


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, bool, float)) or _is_int(value)


def _typed(value, kinds: tuple) -> bool:
    return (
        (value is None and type(None) in kinds)
        or (isinstance(value, str) and str in kinds)
        or (int in kinds and _is_int(value))
    )


def schema_error(result) -> Optional[str]:
    """What in a parsed result line is not what ``child_main`` prints, or None."""
    if not isinstance(result, dict):
        return f"a JSON {type(result).__name__}, not an object"
    path = result.get("sys_path", [])
    if not (
        isinstance(path, list)
        and len(path) <= MAX_SYS_PATH
        and all(isinstance(entry, str) and len(entry) <= MAX_PATH_ENTRY for entry in path)
    ):
        return f"sys_path is not a list of at most {MAX_SYS_PATH} paths"
    if "error_kind" in result or "error" in result:
        if result.get("error_kind") not in ERROR_KINDS or not isinstance(result.get("error"), str):
            return "an error without a known kind and its text"
        return None
    unknown = sorted(set(result) - set(RESULT_FIELDS))
    if unknown:
        return f"unknown fields {', '.join(name[:80] for name in unknown[:5])}"
    config, sources, widths = result.get("configuration"), result.get("sources"), result.get("widths")
    if not isinstance(result.get("sglang_version"), (str, type(None))):
        return "sglang_version is not a string"
    if not isinstance(config, dict) or not isinstance(sources, dict) or not isinstance(widths, dict):
        return "configuration, sources and widths are not all objects"
    for name, value in config.items():
        if name not in FIELDS or not _scalar(value):
            return f"configuration field {name[:80]!r} is not one of sglang's fields with a plain value"
        if name in INT_FIELDS and not (value is None or _is_int(value)):
            return f"configuration field {name} is not an integer"
    if not _is_int(config.get("context_length")) or config["context_length"] <= 0:
        return "no positive integer context_length"
    if not all(name in FIELDS and isinstance(value, str) for name, value in sources.items()):
        return "sources is not a field -> string object"
    for name, value in widths.items():
        if not _typed(value, WIDTH_FIELDS.get(name, ())):
            return f"width {name[:80]!r} is not what the sizing functions give"
    if not all(_is_int(widths.get(name)) for name in ("row_extra", "decode_reserve", "alloc_page_size")):
        return "no row_extra, decode_reserve and alloc_page_size integers (sglang's sizing functions did not run)"
    if widths["alloc_page_size"] <= 0:
        return "alloc_page_size is not positive"
    prove = result.get("prove")
    if prove is not None:
        if not isinstance(prove, dict):
            return "prove is not an object"
        if "columns_past_row_end" in prove:
            if set(prove) != {*PROVE_FIELDS, "device"} or not all(
                _is_int(prove[name]) for name in PROVE_FIELDS
            ):
                return "prove's counts are not integers"
            if prove["device"] not in PROVE_DEVICES:
                return "prove's device is neither cpu nor cuda"
        elif len(prove) != 1 or not isinstance(prove.get("error", prove.get("skipped")), str):
            return "prove has neither counts nor a reason"
    return None


def unresolved(why: str) -> dict:
    """No configuration, and why (``width.at_configuration``: ``cannot_tell`` for every bug the
    configuration decides), with what makes sglang resolve it."""
    return {
        "basis": width.UNRESOLVED,
        "basis_note": f"{why}; pass --python the interpreter of the server's environment (the one that "
        "runs sglang.launch_server), or install what it lacks",
    }


# ------------------------------------------------------------------------------ child side


def _profile_patches(profile: dict) -> list:
    """mock patches answering sglang's and torch's device queries from ``profile``."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from sglang.srt.utils import common

    cuda, hip = profile["vendor"] == "cuda", profile["vendor"] == "hip"
    major, minor = profile["capability"]
    capability = (major, minor)
    answers = {
        "is_cuda": cuda,
        "is_hip": hip,
        "is_cuda_alike": True,
        "is_npu": False,
        "is_xpu": False,
        "is_musa": False,
        "is_mps": False,
        "is_hpu": False,
        "is_cpu": False,
        "is_sm80_supported": cuda and major == 8,
        "is_sm90_supported": cuda and major == 9,
        "is_sm100_supported": cuda and major == 10,
        "is_sm110_supported": cuda and major == 11,
        "is_sm100_or_sm110_supported": cuda and major in (10, 11),
        "is_sm120_supported": cuda and major == 12,
        "is_blackwell_supported": cuda and major in (10, 11, 12),
        "is_blackwell": cuda and major in (10, 11, 12),
        "is_hopper_with_cuda_12_3": cuda and major == 9,
        "is_ampere_with_cuda_12_3": cuda and major == 8,
        "is_gfx942_supported": hip and profile.get("arch") == "gfx942",
        "is_gfx95_supported": hip and profile.get("arch") == "gfx950",
        "is_flashinfer_available": cuda,
        "get_device_sm": major * 10 + minor,
        "get_device_capability": capability,
        "get_device_memory_capacity": profile["mem_mib"],
        "get_nvgpu_memory_capacity": profile["mem_mib"],
        "get_amdgpu_memory_capacity": profile["mem_mib"],
    }

    def answer(value):
        fake = lambda *args, **kwargs: value  # noqa: E731
        fake.cache_clear = lambda: None  # callers clear lru caches
        return fake

    fakes = {name: answer(value) for name, value in answers.items() if hasattr(common, name)}
    # Answers cached on the CPU at import time (0.5.23 dsa/utils.py's
    # aiter_can_use_preshuffle_paged_mqa, first called at dsa_indexer.py:134) are forgotten.
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("sglang") and m]:
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):  # no getattr: lazy proxies import
                value.cache_clear()
    # Modules imported `from ...common import is_cuda`: rebind every reference to the originals.
    originals = {id(getattr(common, name)): name for name in fakes}
    patches = []
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("sglang") and m]:
        for attr, value in list(vars(module).items()):
            if id(value) in originals:
                patches.append(mock.patch.object(module, attr, fakes[originals[id(value)]]))
    properties = SimpleNamespace(
        name=profile["name"],
        total_memory=profile["mem_mib"] << 20,
        major=major,
        minor=minor,
        multi_processor_count=132,
        gcnArchName=profile.get("arch", ""),
    )
    for name, value in {
        "is_available": True,
        "device_count": 8,
        "get_device_capability": capability,
        "get_device_properties": properties,
        "get_device_name": profile["name"],
        "mem_get_info": (properties.total_memory, properties.total_memory),
        "current_device": 0,
    }.items():
        patches.append(mock.patch.object(torch.cuda, name, answer(value)))
    patches.append(mock.patch.object(torch.version, "cuda", "12.9" if cuda else None))
    patches.append(mock.patch.object(torch.version, "hip", "6.4.0" if hip else None))
    return patches


def _preimport() -> None:
    """Import the resolution modules first, so the profile patches reach their references."""
    import importlib
    import pkgutil

    import sglang.srt.server_args  # noqa: F401

    for package in ("sglang.srt.arg_groups",):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except Exception:  # optional backends' modules
                continue
    for name in (
        "sglang.srt.configs.model_config",
        "sglang.srt.speculative.spec_info",
        "sglang.srt.speculative.dflash_utils",
        "sglang.srt.layers.attention.dsa.utils",
        "sglang.srt.mem_cache.common",
        "sglang.srt.mem_cache.allocation_sizing",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def _resolve(launch_args: list):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(launch_args)
    if hasattr(server_args, "resolve_once"):  # 0.5.23: resolution is explicit (server_args.py:247)
        server_args.resolve_once()
    return server_args


def _warm_up(launch_args: list) -> None:
    """One throw-away resolution on this machine's own answers, so that modules sglang's handlers
    import lazily are imported without the profile (under it, ``is_cuda()`` makes 0.5.23's
    dflash_utils import sgl_kernel, a CUDA-only package). Environment writes are undone."""
    from unittest import mock

    with mock.patch.dict(os.environ):
        try:
            _resolve(launch_args)
        except BaseException:
            pass


# A --config file is read by sglang's ConfigArgumentMerger (yaml.safe_load, then every value
# str()-ed into arguments): a few hundred bytes of nested aliases expand to gigabytes there.
# Checked first (``_config_refusal``): a regular file, at most MAX_CONFIG_BYTES, at most
# MAX_YAML_ALIASES aliases (a merge key ``<<: *defaults`` is one; 8 of them expand a file at most
# some 20 times).
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 8


def _config_refusal(argv: list) -> Optional[str]:
    """Why a ``--config FILE`` among the launch arguments is not handed to sglang, or None.
    A file that cannot be opened or parsed is sglang's to report."""
    import stat

    for path in [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]:
        try:  # O_NONBLOCK: a FIFO answers at once, and is refused below
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"--config {path}: not a regular file"
            if st.st_size > MAX_CONFIG_BYTES:
                return f"--config {path}: {st.st_size} bytes, over the {MAX_CONFIG_BYTES} byte cap"
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            import yaml

            aliases = sum(
                isinstance(token, yaml.AliasToken)
                for token in yaml.scan(data.decode("utf-8", "replace"), Loader=yaml.SafeLoader)
            )
        except Exception:  # no yaml here, or not YAML: sglang says so
            continue
        if aliases > MAX_YAML_ALIASES:
            return (
                f"--config {path}: {aliases} YAML aliases, more than {MAX_YAML_ALIASES}: not handed "
                "to sglang (nested aliases expand without bound); write the values out"
            )
    return None


# The directories ``--trust-remote-code`` makes transformers import code from (auto_map's
# ``configuration_*.py``, the tokenizer's and the draft model's), where they are local.
REMOTE_CODE_PATHS = ("model_path", "tokenizer_path", "speculative_draft_model_path")


def _remote_code_refusal(argv: list) -> Optional[str]:
    """As root: why the model's own code is not run (``--trust-remote-code``, on the command line
    or in ``--config``, with a local model directory another user could change), or None."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parsed = _given_and_defaults(argv)[0]
    except (Exception, SystemExit):  # sglang's parser rejects them: its resolution says so
        return None
    if not parsed.get("trust_remote_code"):
        return None
    for name in REMOTE_CODE_PATHS:
        where = parsed.get(name)
        if not isinstance(where, str) or not os.path.isdir(where):
            continue  # a hub id: fetched into root's own cache
        flag = "--" + name.replace("_", "-")
        try:
            found = safe_files.code_tree_foreign(os.path.abspath(where))
        except OSError as exc:
            return f"{flag} {where}: cannot check ({exc.strerror or exc}); --trust-remote-code runs its code"
        if found is not None:
            said = ("" if found.path == os.path.abspath(where) else f"{found.path} is ") + found.reason
            return (
                f"{flag} {where}: {said}; with --trust-remote-code its code runs, and as root "
                "sglang-dsa-fix does not run code another user can change (pass --allow-unsafe-dirs "
                "to override)"
            )
    return None


def _given_and_defaults(argv: list) -> tuple:
    """(the parser's values, the dests the arguments set, the dests only ``--config`` sets):
    sglang's own parser, with ``--config FILE`` merged as ``prepare_server_args`` merges it
    (0.5.14 server_args.py:7213-7219, ConfigArgumentMerger: the file's values first, the
    command line after them, so the command line wins)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    merged = argv
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        merged = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    parsed = vars(parser.parse_args(merged))
    for action in parser._actions:  # what an argument list sets itself, as argparse reads it
        action.default, action.required = argparse.SUPPRESS, False
    given = set(vars(parser.parse_args(merged)))
    if merged is argv:
        return parsed, given, set()
    at = argv.index("--config")
    on_command_line = set(vars(parser.parse_args(argv[:at] + argv[at + 2 :])))
    return parsed, given, given - on_command_line


def _read_fields(server_args, parsed: dict, given: set, from_config: set) -> tuple:
    """(configuration, sources): each field's resolved value and where it came from. 0.5.17+
    record which handler declared a field (``_resolved_overrides``); 0.5.17 writes the result
    onto the fields, 0.5.23 keeps the record raw (``_raw_input``) and resolves on read."""
    declarations = getattr(server_args, "_resolved_overrides", None) or ()
    read = lambda name: getattr(server_args, name)  # noqa: E731
    if getattr(server_args, "_raw_input", None) is not None:
        from sglang.srt.arg_groups.overrides import resolution_result, resolving_view

        view = resolving_view(server_args)
        read = lambda name: resolution_result(server_args, name) if name in parsed else getattr(view, name)  # noqa: E731
    config, sources = {}, {}
    for name in FIELDS:
        try:
            value = read(name)
        except Exception:  # not a field of this release
            continue
        if callable(value):
            continue
        config[name] = value
        by = sorted({source for source, fields in declarations if name in fields})
        if name in parsed and value != parsed[name]:
            sources[name] = "resolved by sglang" + (f" ({', '.join(by)})" if by else "")
        elif name in from_config:
            sources[name] = "config file"
        elif name in given:
            sources[name] = "argument"
        elif name in parsed:
            sources[name] = "sglang default"
    return config, sources


def _context_len(server_args) -> int:
    """The context length sglang serves: the model config's, capped or raised by the flag."""
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of  # 0.5.23

        return int(model_config_of(server_args).context_len)
    except ImportError:
        return int(server_args.get_model_config().context_len)


def _model_attention_backend(server_args):
    """The backend sglang's ``attn_backend_wrapper`` puts in place of the flag's for this model,
    where it does so for a backend this tool judges (0.5.23 layers/attention/attention_registry.py:
    375-380: a MiniMax sparse model on the NVFP4 stack), by sglang's own predicates; else None."""
    try:
        from sglang.srt.configs.model_config import is_minimax_sparse, uses_minimax_m3_nvfp4_native_stack
    except ImportError:  # a release without that backend
        return None
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of  # 0.5.23

        model_config = model_config_of(server_args)
    except ImportError:
        model_config = server_args.get_model_config()
    if is_minimax_sparse(model_config.hf_config) and uses_minimax_m3_nvfp4_native_stack(
        model_config.quantization
    ):
        return "MiniMaxSparseNvfp4AttnBackend"  # (the class it builds)
    return None


def _runs_spec_v2(server_args):
    """Whether the scheduler runs this algorithm's spec-v2 decode path (bug #2's reservation):
    sglang's own ``ScheduleBatch.is_spec_v2`` on a batch with the scheduler's two fields
    (0.5.9 - 0.5.12: overlap on, managers/schedule_batch.py 0.5.12:2280-2284; 0.5.13: the
    algorithm's ``supports_spec_v2``, :2460-2463, EAGLE and STANDALONE only, whatever the
    overlap); None where the release has no such predicate (0.5.14+ run every algorithm on spec
    v2) or no algorithm. The predicate is found in the file first: 0.5.14+ skip the import."""
    import importlib.util
    import inspect
    from pathlib import Path
    from types import SimpleNamespace

    algorithm = getattr(server_args, "speculative_algorithm", None)
    spec = importlib.util.find_spec("sglang.srt.managers.schedule_batch")
    if not algorithm or spec is None or b"def is_spec_v2(" not in Path(spec.origin).read_bytes():
        return None
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    predicate = inspect.getattr_static(ScheduleBatch, "is_spec_v2")
    predicate = predicate.fget if isinstance(predicate, property) else predicate
    batch = SimpleNamespace(
        enable_overlap=not server_args.disable_overlap_schedule,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
    )
    try:
        return bool(predicate(batch))
    except AssertionError:  # 0.5.9 - 0.5.12: overlap on for an algorithm without spec v2
        return False


def _widths(server_args) -> dict:
    """sglang's own row headroom and decode reservation for these server args."""
    import inspect

    module = runtime_fix.sizing_module()
    if module is None:
        return {}
    extra, reserve = module.get_req_to_token_extra_context_len, module.get_alloc_reserve_per_decode
    call = (server_args,) if inspect.signature(extra).parameters else ()  # 0.5.13 - 0.5.17 take it
    if not call:  # 0.5.18+ read the published runtime context
        from sglang.srt.runtime_context import publish

        publish(server_args, role="test")
    page = getattr(module, "get_alloc_page_size", None)
    with runtime_fix.dcp_group_widths(getattr(server_args, "dcp_size", 1) or 1):  # as the server's groups
        out = {"row_extra": extra(*call), "decode_reserve": reserve(*call)}
        # What the plugin's own hook makes of it, called as sglang calls the function.
        out["row_extra_with_plugin"] = runtime_fix.row_extra_fix(module.__name__)(out["row_extra"], *call)
        # The allocator's page: sglang's own get_alloc_page_size() (0.5.19+), else the one rule
        # (page_size x dcp_size, what 0.5.15 - 0.5.18 page the allocator by).
        own = page is not None and not inspect.signature(page).parameters
        out["alloc_page_size"] = int(page()) if own else width.alloc_page_size(server_args)
    out["sizing_function"] = f"{module.__name__}.get_req_to_token_extra_context_len"
    return {
        k: int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out.items()
    }


def _graph_page_table_width(config: dict, widths: dict) -> dict:
    """Bug #1's buffer as the tree's own DSA/NSA backend allocates it: its
    ``init_cuda_graph_state`` run on CPU (bs 1) over a ``req_to_token`` of the width sglang
    sizes for this configuration; the width of the graph ``page_table`` it allocated. Empty
    where the configuration has no DSA graph (the verdict then says why) or the backend cannot
    be built here (the parent then evaluates the file's expression, and says so)."""
    algorithm, D = config.get("speculative_algorithm"), config.get("speculative_num_draft_tokens") or 0
    if (
        not algorithm
        or config.get("disable_cuda_graph")
        or width.decode_backend(config) not in release.DSA_BACKENDS
    ):
        return {}
    if "row_extra" not in widths:
        return {}
    try:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_dsa_fix.proof import replay

        _, backend_cls = replay.import_backend_class()
        if backend_cls is None:
            return {}
        C = int(config["context_length"])
        pool = ReqToTokenPool(
            size=1, max_context_len=C + widths["row_extra"], device="cpu", enable_memory_saver=False
        )
        case = replay.Case(C, D, config.get("page_size") or 1, 1)
        backend = replay.make_backend(backend_cls, case, pool)
        backend.init_cuda_graph_state(1, D)
        table = width.graph_page_table(backend)
    except Exception as exc:  # attributes a release reads that make_backend does not set
        return {"graph_page_table_error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    if table is None:
        return {}
    return {
        "graph_page_table_width": int(table.shape[1]),
        "graph_page_table_from": f"{backend_cls.__module__}.{backend_cls.__name__}.init_cuda_graph_state",
    }


def child_main(argv: list, sys_path: Optional[list] = None) -> None:
    """In the target environment: print one RESULT_MARK line of JSON, whatever happens.
    ``sys_path``: this interpreter's own path before the boot line put the tree and this package
    first; reported (``""``, the working directory, as its absolute path) for the plugin lookup."""
    result = _child_result(argv)
    if sys_path is not None:
        # Started isolated (``ISOLATED``): no entry is the working directory ("").
        entries = [entry for entry in sys_path if isinstance(entry, str) and os.path.isabs(entry)]
        result["sys_path"] = [e for e in entries if len(e) <= MAX_PATH_ENTRY][:MAX_SYS_PATH]
    _emit(result)


def _child_result(argv: list) -> dict:
    import contextlib
    import io
    import logging

    options, launch_args = json.loads(argv[0]), argv[1:]
    profile = options["profile"]
    refused = _config_refusal(launch_args)
    if refused is not None:
        return {"error_kind": "refused", "error": refused}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _preimport()
            import sglang
    except Exception as exc:  # ImportError, or a broken environment: the static rule takes over
        return {"error_kind": "import", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    refused = _remote_code_refusal(launch_args) if options.get("guard") else None
    if refused is not None:
        return {"error_kind": "refused", "error": refused}
    logging.disable(logging.CRITICAL)
    errors = io.StringIO()
    try:
        with contextlib.ExitStack() as stack, contextlib.redirect_stdout(io.StringIO()):
            stack.enter_context(contextlib.redirect_stderr(errors))
            _warm_up(launch_args)
            for patch in _profile_patches(profile):
                stack.enter_context(patch)
            parsed, given, from_config = _given_and_defaults(launch_args)
            server_args = _resolve(launch_args)
            config, sources = _read_fields(server_args, parsed, given, from_config)
            config["context_length"] = _context_len(server_args)
            config["model_attention_backend"] = _model_attention_backend(server_args)
            config["speculative_runs_spec_v2"] = _runs_spec_v2(server_args)
            widths = _widths(server_args)
    except SystemExit as exc:  # argparse: its message went to stderr
        said = (errors.getvalue().strip().splitlines() or [f"sglang's parser exited ({exc.code})"])[-1]
        return {"error_kind": "arguments", "error": said}
    except BaseException as exc:
        return {"error_kind": "arguments", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    widths.update(_graph_page_table_width(config, widths))
    result = {
        "sglang_version": getattr(sglang, "__version__", None),
        "configuration": config,
        "sources": sources,
        "widths": widths,
    }
    if options.get("prove"):
        result["prove"] = _prove(config, widths)
    return result


PROVE_CONTEXT, PROVE_PROMPT = 256, 100
# The decode prepares the CPU driver runs (``proof.row_overflow``): the spec-v2 EAGLE prepare,
# and DFLASH's own (DFLASH, DSPARK).
PROVE_PREPARES = (release.EAGLE_PREPARE, release.DFLASH_PREPARE, release.UNO_PREPARE)


def _prove(config: dict, widths: dict) -> dict:
    """Drive the real spec-v2 decode path (sizing, pool, allocator, prepare, Triton kernel) for
    one request of this configuration to its last reservation, a canary in the next row. The
    columns past the row end depend on the context length only through its residue modulo the
    allocator's page (``width.required_row_extra``), so a short context with the same residue
    stands in; decode context parallel is driven as configured (the allocator pages page x dcp)."""
    algorithm = str(config.get("speculative_algorithm") or "").upper()
    if not algorithm:
        return {"skipped": "no speculative decoding"}
    if config.get("speculative_runs_spec_v2") is False:
        return {
            "skipped": f"{algorithm} runs sglang's spec-v1 decode path here: no spec-v2 reservation to drive"
        }
    prepare = release.DECODE_PREPARE.get(algorithm, "unknown")
    if prepare not in PROVE_PREPARES:
        return {"skipped": f"{algorithm} reserves in its own decode path, which the CPU driver does not run"}
    try:
        import torch

        from sglang_dsa_fix.proof import row_overflow

        # The parent set TRITON_INTERPRET=1 where it found no GPU; else the GPU drives it.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
        D = config["speculative_num_draft_tokens"]
        context = PROVE_CONTEXT + (int(config["context_length"]) - PROVE_CONTEXT) % (
            widths.get("alloc_page_size") or 1
        )
        case = row_overflow.RowCase(
            context,
            D,
            config.get("page_size") or 1,
            not config.get("disable_overlap_schedule"),
            PROVE_PROMPT,
            topk=config.get("speculative_eagle_topk") or 1,
            num_steps=config.get("speculative_num_steps") or max(1, D - 1),
            algorithm=config["speculative_algorithm"],
            dcp_size=config.get("attn_dcp_size") or config.get("dcp_size") or 1,
            device="cpu" if interpreted else "cuda",
        )
        result = row_overflow.run(case)
    except Exception as exc:  # a release or algorithm the driver does not run
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return {
        "device": case.device,
        "context_length": context,
        "prompt_len": PROVE_PROMPT,
        "row_extra": result.row_extra,
        "columns_past_row_end": result.columns_past_row_end,
        "neighbour_cells_changed": result.canary_clobbered,
        "leaked_slots": result.leaked_slots,
    }


MAX_CHILD_ERROR = 2000  # characters of an error the child reports (argparse can quote megabytes)


def _emit(result: dict) -> None:
    if isinstance(result.get("error"), str) and len(result["error"]) > MAX_CHILD_ERROR:
        result["error"] = result["error"][:MAX_CHILD_ERROR] + f"... ({len(result['error'])} characters, cut)"
    print(RESULT_MARK + json.dumps(result, default=str), flush=True)
