"""The resolution child's one result line: its mark and fields, read and checked by the parent."""

from __future__ import annotations

import json
from typing import Optional

from sglang_dsa_fix.errors import ToolError

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
# What the parent reads of the child's result line (``read_result``): the line's size, the
# integers' range, its error kinds and fields, the configuration fields that are integers, and
# each width's types.
MAX_RESULT_LINE = 1 << 20  # characters; a result is a few KiB
MAX_INT = 1 << 62
ERROR_KINDS = ("import", "arguments", "refused", "model_config")
RESULT_FIELDS = ("sglang_version", "configuration", "sources", "widths", "prove", "sys_path")
# The child's own sys.path (``child_main``), where the plugin is looked for (``status``): at most
# MAX_SYS_PATH entries of at most MAX_PATH_ENTRY characters each.
MAX_SYS_PATH = 1024
MAX_PATH_ENTRY = 4096
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
PROVE_DEVICES = ("cpu", "cuda")  # where the drive ran (``resolve_prove.prove``)


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
