"""Bug #3: FlashAttention (FA3 / FA4)'s CUDA-graph page tables, ``ceil(context_len / page)``
wide, which a verify or draft decode near the context limit outgrows (upstream #34239; every
release 0.5.4 - 0.5.23). Its rule and runtime fix are ``fa3_width``'s, its in-tree change
``fa3_sites``'."""

from __future__ import annotations

from sglang_dsa_fix import fa3_sites, fa3_width, release, width
from sglang_dsa_fix.members import ALREADY_WIDE, HookPlan, Member
from sglang_dsa_fix.verdicts import Bug, Verdict

TOPK_CANNOT_TELL = (
    "topk > 1: FA3 verifies through its token-wide topk > 1 tables, which this tool's rule (topk 1) "
    "does not judge"
)


def why_not(inputs: dict) -> str:
    if not inputs["resolved"]:
        return (
            "static rule: the shape flags describe bug #1's DSA deployment, which runs no FA3 "
            "(give the launch arguments after `--` to judge an FA3 deployment)"
        )
    if inputs["no_speculative_decoding"]:
        return "no speculative decoding"
    if inputs["cuda_graphs_disabled"]:
        return "CUDA graphs disabled"
    verify, backend = inputs["verify_backend"], inputs["decode_backend"]
    if verify not in release.FA3_BACKENDS and backend not in release.FA3_BACKENDS:
        return f"verify / decode attention backend {verify} / {backend}: not FlashAttention (FA3)"
    return ""


def rule(verdict, found: str, form, inputs: dict, resolved: dict) -> dict:
    """The pages of the longest verify's read (topk 1) against the FA3 graph tables' pages,
    sglang's (ceil(context_len / page), every release 0.5.4 - 0.5.23) or the rule's
    (req_to_token's row, ``fa3_width``), now and with the fix."""
    if why_not(inputs):
        return {"reachable": False, "why_not": why_not(inputs)}
    if inputs["topk"] > 1:
        return {"reachable": None, "cannot_tell": TOPK_CANNOT_TELL}
    C, D, page = inputs["context_len"], inputs["num_draft_tokens"], inputs["page_size"]
    pool = C + inputs["row_extra"]
    pool_with_fix = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    table = width.graph_table_pages(pool if fixed else C, page)
    read = width.longest_verify_pages(C, D, page, inputs["overlap"])
    with_fix = width.graph_table_pages(pool_with_fix, page)
    return {
        "graph_page_table_pages": table,
        "graph_page_table_from": (
            "static rule: "
            + ("req_to_token's width in pages" if fixed else "ceil(context_len / page_size)")
            + " (FlashAttentionBackend.init_cuda_graph_state)"
        ),
        "longest_verify_pages_read": read,
        "pages_past_table": max(0, read - table),
        "graph_page_table_pages_with_fix": with_fix,
        "pages_past_table_with_fix": max(0, read - with_fix),
        "reachable": read > table,
    }


def run_enforce(info: dict, result, backend, *args, **kwargs):
    """After ``init_cuda_graph_state``, before any capture: every FA3 graph table and the
    replay's bounds at req_to_token's row (``fa3_width.enforce``)."""
    changed = fa3_width.enforce(backend)
    if changed:
        # (step, attribute, key, old, new) -> "attribute[key] old->new"
        widened = sorted({f"{a or 'self'}[{k}] {old}->{new}" for _, a, k, old, new in changed})
        info.update(widened=widened, detail="")
        return None, f"FA3 CUDA-graph page tables widened to req_to_token's row ({'; '.join(widened)})"
    if "widened" not in info:
        info["detail"] = ALREADY_WIDE
    return None, None  # keep sglang's result


def hook(files, site, sglang) -> HookPlan:
    return HookPlan(release.FA3_LAYOUT.hook_target, body=run_enforce)


MEMBERS = (
    Member(
        bug=Bug.FA3_PAGE_TABLE,
        title="bug #3 FA3 CUDA-graph page tables (crash)",
        absent="no FlashAttention (FA3) backend",
        holds="sizes the FA3 graph page tables from req_to_token",
        affected_what="these graph page tables are",
        legacy=fa3_sites.LEGACY_DETAIL,
        locate=fa3_sites.fa3_page_table_site,
        rule=rule,
        hook=hook,
        watch=(release.FA3_REPLAY,),
        releases="sglang 0.5.4 – 0.5.23 where FA3 (or FA4) runs the verify or the draft decode in CUDA "
        "graphs (sgl-project/sglang#34239)",
        symptoms=(
            (
                r"illegal memory access",
                "near the context limit: a verify or draft decode read past FA3's CUDA-graph page "
                "tables (a garbage page index; one instance of upstream #34239 took a TP8 server down)",
            ),
            (
                r"used (\d+) > capacity (\d+)",
                "FA3's draft decode asserted its graph page_table is too narrow for the request "
                "(0.5.14: a request near the context limit with D >= 6)",
            ),
        ),
    ),
)
