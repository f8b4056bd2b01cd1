"""Bug #1: the DSA / NSA backend's CUDA-graph ``page_table``, narrower than ``req_to_token``
(0.5.4 - 0.5.14; upstream #30570, fixed by #29379 in 0.5.15). Its rule is ``width``'s (the
runtime fix, ``width.enforce``), its in-tree change ``sites.page_table_site``."""

from __future__ import annotations

from sglang_dsa_fix import backend_layouts, replay_checks, sites, width
from sglang_dsa_fix.members import ALREADY_WIDE, HookPlan, Member, WatchKind
from sglang_dsa_fix.release import WatchTarget
from sglang_dsa_fix.verdicts import Bug, Verdict


def why_not(inputs: dict) -> str:
    """Why the graph page_table is not reached at this configuration; "" where it may be."""
    if inputs["no_speculative_decoding"]:
        return "no speculative decoding"
    if inputs["cuda_graphs_disabled"]:
        return "CUDA graphs disabled"
    if inputs["resolved"] and inputs["decode_backend"] not in backend_layouts.DSA_BACKENDS:
        return f"decode attention backend {inputs['decode_backend']}: no DSA/NSA graph page_table"
    return ""


def rule(verdict, found: str, form, inputs: dict, resolved: dict) -> dict:
    """The pool and graph buffer widths, and whether the longest target_verify the scheduler can
    run reads past the buffer (``width.verify_seq_len_bound``, observed on the H200 at D 5,
    checked by the CPU driver on 0.5.14: test/srt/test_verify_reach.py)."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    pool = C + inputs["row_extra"]
    buffer, source = inputs.get("graph_page_table_width"), inputs.get("graph_page_table_from")
    if buffer is None:  # the static rule: the file's own expression at this shape
        source = "static rule: the file's width expression"
        if inputs.get("graph_page_table_error"):
            source += f" (init_cuda_graph_state could not run here: {inputs['graph_page_table_error']})"
        if verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE):
            buffer = pool
        else:
            buffer = width.evaluate_page_table_expression(found, C, D, pool)
    longest = width.verify_seq_len_bound(C, D, inputs["overlap"])
    out = {
        "req_to_token_width": pool,
        "graph_page_table_width": buffer,
        "graph_page_table_from": source,
        "longest_verify_seq_len": longest,
    }
    if why_not(inputs):
        out.update(reachable=False, why_not=why_not(inputs))
    elif buffer is None:
        out["reachable"] = None
    else:
        # The replay copies min(seq_len + D, pool) columns of req_to_token into the buffer
        # (slices clamp): only a pool wider than the buffer can overflow it.
        out["reachable"] = longest + D > buffer and pool > buffer
        out["overflowing_seq_lens"] = [buffer - D + 1, longest] if out["reachable"] else None
    return out


def run_enforce(info: dict, result, backend, *args, **kwargs):
    """After ``init_cuda_graph_state``: the graph page_table as wide as req_to_token."""
    changed = width.enforce(backend)
    if changed:
        info.update(widened=list(changed), detail="")
        old, new = changed
        return None, f"CUDA-graph page_table widened from {old} to {new} columns (req_to_token)"
    if "widened" not in info:
        info["detail"] = ALREADY_WIDE
    return None, None  # keep sglang's result


def hook(files, site, sglang) -> HookPlan:
    layout, _ = sites.backend_file(files)
    return HookPlan(layout.hook_target, body=run_enforce)


def check_replay(site, arguments) -> None:
    """Columns the DSA replay copies into the graph page_table (0.5.14 dsa_backend.py:1201-1266):
    decode and draft_extend_v2 max(seq_lens), target_verify max(seq_lens) + D."""
    backend, bs, mode = next(iter(arguments.values())), arguments["bs"], arguments.get("forward_mode")
    graph = getattr(backend, "decode_cuda_graph_metadata", None)
    if mode is None or not isinstance(graph, dict) or bs not in graph:
        return  # capture: the per-bs metadata is being built, nothing replayed yet
    longest = replay_checks.longest(arguments)
    if longest is None:
        return
    if mode.is_target_verify():
        needed = longest + (backend.speculative_num_draft_tokens or 0)
    elif mode.is_decode_or_idle() or mode.is_draft_extend_v2():
        needed = longest
    else:
        return
    table = getattr(graph[bs], "page_table_1", None)
    if table is None:  # 0.5.17+ may drop the wide table; then it reads req_to_token's width
        table = width.graph_page_table(backend)
    table_width = int(table.shape[1]) if table is not None else width.required_width(backend)
    replay_checks.count_short(site, table_width, needed)


DSA_REPLAY = "dsa_replay"
# The family watch: every DSA / NSA graph replay, against the page_table captured for it.
WATCHES = (
    WatchKind(
        DSA_REPLAY,
        ("dsa_page_table_short", None),
        targets=(
            # DSA: the shared capture + replay body behind init_forward_metadata_out_graph, which the
            # cuda-graph runners call (0.5.14 dsa_backend.py:601-618 -> :1160; 0.5.17 :1403; 0.5.23
            # :1797); the spec runners also call it directly. The class has no
            # init_forward_metadata_replay_cuda_graph of its own in 0.5.14. 0.5.14 target_verify copies
            # req_to_token[idx, :max(seq_lens) + D] into page_table_1 (:1217-1233), a view of
            # decode_cuda_graph_metadata["page_table"], max_context_len + D wide (:995-1000).
            WatchTarget(
                DSA_REPLAY,
                "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._apply_cuda_graph_metadata",
                'decode_cuda_graph_metadata["page_table"]',
                (0, 5, 13),
            ),
            # NSA, 0.5.11 - 0.5.12 (the same backend before its rename): the replay entry itself
            # (0.5.11 nsa_backend.py:961, 0.5.12 :976; the multi-step draft backend calls it per step
            # through the class, 0.5.12 :2348), arguments bs / forward_mode / seq_lens_cpu as in the DSA
            # body; target_verify copies max(seq_lens) + D columns into page_table_1, a view of
            # decode_cuda_graph_metadata["page_table"], max_context_len + D wide.
            WatchTarget(
                DSA_REPLAY,
                "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend.init_forward_metadata_replay_cuda_graph",
                'decode_cuda_graph_metadata["page_table"]',
                (0, 5, 11),
                (0, 5, 12),
            ),
        ),
        replay_check=check_replay,
    ),
)


MEMBERS = (
    Member(
        bug=Bug.PAGE_TABLE,
        title="bug #1 CUDA-graph page_table width (crash)",
        column="bug #1 CUDA-graph page_table width",
        absent="no DSA/NSA backend",
        holds="sizes the graph page_table as wide as req_to_token",
        affected_what="this graph page_table is",
        legacy="",
        locate=sites.page_table_site,
        rule=rule,
        hook=hook,
        watch=(DSA_REPLAY,),
        releases="sglang 0.5.4 – 0.5.14 with the DSA / NSA backend (DeepSeek-V3.2, GLM-5); fixed upstream "
        "in 0.5.15 (sgl-project/sglang#29379)",
        symptoms=(
            (
                r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)",
                "the DSA target_verify CUDA-graph replay copied a request's req_to_token row into a "
                "narrower graph page_table past context_len; the scheduler dies and clients hang",
            ),
        ),
    ),
)
