"""``--prove`` in the resolution child: sglang's real decode path driven for the resolved configuration."""

from __future__ import annotations

import os

from sglang_dsa_fix import release

PROVE_CONTEXT, PROVE_PROMPT = 256, 100
# The decode prepares the CPU driver runs (``proof.row_overflow``): the spec-v2 EAGLE prepare,
# and DFLASH's own (DFLASH, DSPARK).
PROVE_PREPARES = (release.EAGLE_PREPARE, release.DFLASH_PREPARE, release.UNO_PREPARE)


def prove(config: dict, widths: dict) -> dict:
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
