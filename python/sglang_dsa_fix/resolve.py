"""A deployment's configuration and widths, from sglang's OWN code, run in a child process.

Its launch_server arguments go through sglang's own argument processing, its ``req_to_token``
row through sglang's own sizing functions.

``status -- <launch_server args>`` calls ``resolve``: it starts the target environment's Python
(``--python``; default the venv holding the tree, else this one) isolated (``python -I``: no
working directory, PYTHONPATH's absolute entries handed on by hand) with the tree first on
``sys.path`` (as root every directory on it checked first: ``import_path``), and ``resolve_child.child_main`` there runs ``sglang.srt.server_args.prepare_server_args`` (0.5.23:
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
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import safe_files, width
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
ERROR_KINDS = ("import", "arguments", "refused", "model_config")
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
from sglang_dsa_fix import resolve_child
resolve_child.child_main(sys.argv[2:], path)
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
