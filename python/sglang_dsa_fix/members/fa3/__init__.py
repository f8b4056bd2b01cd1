"""Bug #3: FlashAttention (FA3 / FA4)'s CUDA-graph page tables, ``ceil(context_len / page)``
wide, which a verify or draft decode near the context limit outgrows (upstream #34239; every
release 0.5.4 - 0.5.23). One unit: the member (here), its tables' widths and runtime fix
(``tables``), where its in-tree change goes (``sites``)."""

from __future__ import annotations

import sglang_dsa_fix.members.fa3.sites as fa3_sites
import sglang_dsa_fix.members.fa3.tables as fa3_width
from sglang_dsa_fix import backend_layouts, width
from sglang_dsa_fix.members import ALREADY_WIDE, HookPlan, Member
from sglang_dsa_fix.members.fa3.watched import FA3_REPLAY, WATCHES  # noqa: F401 (the unit's watch)
from sglang_dsa_fix.verdicts import Bug, Verdict


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
    if verify not in backend_layouts.FA3_BACKENDS and backend not in backend_layouts.FA3_BACKENDS:
        return f"verify / decode attention backend {verify} / {backend}: not FlashAttention (FA3)"
    return ""


def rule(verdict, found: str, form, inputs: dict, resolved: dict) -> dict:
    """The pages of the longest verify's read (topk 1; topk > 1: ``topk_rule``) against the FA3 graph tables' pages,
    sglang's (ceil(context_len / page), every release 0.5.4 - 0.5.23) or the rule's
    (req_to_token's row, ``fa3_width``), now and with the fix."""
    if why_not(inputs):
        return {"reachable": False, "why_not": why_not(inputs)}
    if inputs["topk"] > 1:
        return topk_rule(verdict, inputs)
    read = width.longest_verify_pages(
        inputs["context_len"], inputs["num_draft_tokens"], inputs["page_size"], inputs["overlap"]
    )
    return pages_answer(
        verdict,
        inputs,
        read,
        lambda fixed: (
            "static rule: "
            + ("req_to_token's width in pages" if fixed else "ceil(context_len / page_size)")
            + " (FlashAttentionBackend.init_cuda_graph_state)"
        ),
    )


def pages_answer(verdict, inputs: dict, read: int, source) -> dict:
    """``read`` pages against the FA3 graph tables' pages, sglang's (ceil(context_len / page)) or
    the rule's (req_to_token's row, ``fa3_width``), now and with the fix; ``source(fixed)`` says
    where the tables' width comes from."""
    C, page = inputs["context_len"], inputs["page_size"]
    fixed = verdict in (Verdict.FIXED_UPSTREAM, Verdict.FIXED_IN_TREE)
    table = width.graph_table_pages(C + inputs["row_extra"] if fixed else C, page)
    with_fix = width.graph_table_pages(C + (inputs["row_extra_with_plugin"] or inputs["row_extra"]), page)
    return {
        "graph_page_table_pages": table,
        "graph_page_table_from": source(fixed),
        "longest_verify_pages_read": read,
        "pages_past_table": max(0, read - table),
        "graph_page_table_pages_with_fix": with_fix,
        "pages_past_table_with_fix": max(0, read - with_fix),
        "reachable": read > table,
    }


def topk_reads(inputs: dict) -> dict:
    """Pages each FA3 graph table is read for at topk > 1, at the longest seq_len s
    (``width.longest_seq_len``: a verify appends at most steps + 1 tokens, NGRAM's D): the prefix
    halves of the verify and of the draft decode read s keys through the topk > 1 tables (0.5.14
    flashattention_backend.py:2327-2345, :2187-2212); the draft extend after a verify reads s + D
    through its topk-1 table (base_spec_worker.py:149-151, flashattention_backend.py:2414-2467).
    NGRAM runs no draft model: its verify only."""
    s, D, page = width.longest_seq_len(inputs), inputs["num_draft_tokens"], inputs["page_size"]
    reads = {"verify prefix": width.pages_read(s, page)}
    if (inputs["algorithm"] or "").upper() not in width.DRAFTLESS:
        reads["draft decode prefix"] = width.pages_read(s, page)
        reads["draft extend"] = width.pages_read(s + D, page)
    return reads


def topk_rule(verdict, inputs: dict) -> dict:
    """topk > 1: the longest read of ``topk_reads`` against the pages the tables hold filled:
    ``ceil(context_len / page)`` as sglang ships them (the topk > 1 tables are context_len tokens
    wide, filled through the page-start gather of ceil(context_len / page) entries, or 0.5.16+'s
    device builder, which writes past them at page 1; the draft extend's table is that wide), the
    rule's req_to_token row with the fix (``fa3_width.TOPK_TABLES``). And the verify's expand half,
    which gathers req_to_token[row, s : s + D] (0.5.14 :2391-2395): past the row, torch's gather
    raises. Measured on the real backend (test/srt/test_topk_reach.py)."""
    C, D = inputs["context_len"], inputs["num_draft_tokens"]
    row = C + inputs["row_extra"]
    row_with_fix = C + (inputs["row_extra_with_plugin"] or inputs["row_extra"])
    reads = topk_reads(inputs)
    longest = max(reads, key=reads.get)
    out = pages_answer(
        verdict,
        inputs,
        reads[longest],
        lambda fixed: (
            "static rule, topk > 1: "
            + ("req_to_token's width in pages" if fixed else "ceil(context_len / page_size) pages filled")
            + f" (FlashAttentionBackend's topk > 1 and draft-extend tables); the longest read is the {longest}'s"
        ),
    )
    expand = width.longest_seq_len(inputs) + D
    out.update(
        pages_read=reads,
        verify_expand_columns_read=expand,
        req_to_token_width=row,
        req_to_token_width_with_fix=row_with_fix,
        reachable=out["reachable"] or expand > row,
        reachable_with_fix=out["pages_past_table_with_fix"] > 0 or expand > row_with_fix,
    )
    return out


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
    return HookPlan(backend_layouts.FA3_LAYOUT.hook_target, body=run_enforce)


MEMBERS = (
    Member(
        bug=Bug.FA3_PAGE_TABLE,
        title="bug #3 FA3 CUDA-graph page tables (crash)",
        column="bug #3 FA3 CUDA-graph page tables",
        absent="no FlashAttention (FA3) backend",
        holds="sizes the FA3 graph page tables from req_to_token",
        affected_what="these graph page tables are",
        legacy=fa3_sites.LEGACY_DETAIL,
        locate=fa3_sites.fa3_page_table_site,
        rule=rule,
        hook=hook,
        watch=(FA3_REPLAY,),
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
