"""A launch line as operators paste it, down to the arguments sglang's ``prepare_server_args`` takes.

``status -- <launch line>`` accepts what a shell history or a manifest holds:
``python -m sglang.launch_server ARGS``, ``python3.12 -u -m sglang.launch_server ARGS``,
``sglang serve ARGS`` (0.5.14 cli/main.py:31-42: ``serve`` hands the rest to
cli/serve.py:49-126, which takes ``--model-type`` out before ``prepare_server_args``), a path to
either executable, or the arguments alone. Pure: no sglang, no files.
"""

from __future__ import annotations

import os
import re

from sglang_dsa_fix.errors import ToolError

LAUNCH_MODULES = ("sglang.launch_server",)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# What `sglang serve` itself reads before sglang's parser (cli/serve.py:16-46).
SERVE_ONLY = "--model-type"


def server_arguments(line: list) -> list:
    """The server arguments of a pasted launch line (ToolError: a line that launches something
    else, or sets environment variables this tool would not apply)."""
    if not line or line[0].startswith("-"):
        return list(line)  # the arguments alone
    if _ENV_ASSIGNMENT.match(line[0]):
        name = line[0].split("=", 1)[0]
        raise ToolError(
            f"the launch line starts with an environment assignment ({name}=...): `status` does not apply "
            "it; export it in this shell first if sglang's resolution should see it, then paste the rest"
        )
    program = os.path.basename(line[0])
    if _PYTHON.fullmatch(program):
        return _after_python(line)
    if program == "sglang" and line[1:2] == ["serve"]:
        return _without_model_type(line[2:])
    raise ToolError(
        f"`{line[0]}`: not a launch line this tool reads; paste `python -m sglang.launch_server ...`, "
        "`sglang serve ...`, or the arguments alone"
    )


def _after_python(line: list) -> list:
    rest = line[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":  # the interpreter's own flags
        rest = rest[1:]
    if rest[:1] != ["-m"] or rest[1:2] == [] or rest[1] not in LAUNCH_MODULES:
        module = rest[1] if rest[:1] == ["-m"] and len(rest) > 1 else " ".join(rest[:1]) or "nothing"
        raise ToolError(
            f"`{' '.join(line[:1])} ... {module}`: not sglang's server launcher; paste "
            f"`python -m {LAUNCH_MODULES[0]} ...` or the arguments alone"
        )
    return rest[2:]


def _without_model_type(args: list) -> list:
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == SERVE_ONLY:
            if args[i + 1 : i + 2] in ([], ["diffusion"]):
                raise ToolError("`sglang serve --model-type`: a diffusion server has no speculative decoding")
            skip = True
            continue
        if arg.startswith(SERVE_ONLY + "="):
            if arg.split("=", 1)[1] == "diffusion":
                raise ToolError("`sglang serve --model-type`: a diffusion server has no speculative decoding")
            continue
        out.append(arg)
    return out
