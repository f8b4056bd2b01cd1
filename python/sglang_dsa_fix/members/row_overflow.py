"""Bug #2: the spec-v2 decode reservation writes past a request's ``req_to_token`` row into the
next request's (0.5.9 - newest; DFLASH / DSPARK reserve 2 x block the same way). Its rule is
``width``'s row arithmetic, its runtime fix ``runtime_fix.row_extra_fix``, its in-tree change
``sites.row_site`` (the sizing function) or ``sites.inline_row_site`` (0.5.9 - 0.5.12)."""

from __future__ import annotations

from sglang_dsa_fix import release, sites, width
from sglang_dsa_fix.members import HookPlan, Member, WatchKind
from sglang_dsa_fix.release import WatchTarget
from sglang_dsa_fix.verdicts import Bug, Verdict

# What the row arithmetic says beside the numbers, per decode prepare (``release.DECODE_PREPARE``).
PREPARE_NOTES = {
    release.DFLASH_PREPARE: (
        "DFLASH (and DSPARK, its family) reserves 2 x block in its own decode path "
        "(DFlashDraftInputV2.prepare_for_decode, speculative/dflash_info_v2.py 0.5.17:113, "
        "0.5.23:114) with no row check; judged from get_alloc_reserve_per_decode(), which equals "
        "that at steps = topk = 1; `--prove` drives that prepare itself on CPU; both fixes raise "
        "the row to it"
    ),
    release.UNO_PREPARE: (
        "UNO reserves 2 x (D + 1) in its own decode path and raises where it would pass the row "
        "(speculative/uno_info.py 0.5.20:141-146): a refused request, not a silent overflow; "
        "judged from sglang's own sizing, which holds that reservation from 0.5.20"
    ),
}


def _prepare(inputs: dict) -> str:
    algorithm = inputs["algorithm"]
    return release.DECODE_PREPARE.get("NONE" if not algorithm else str(algorithm).upper(), "unknown")


def why_not(inputs: dict) -> str:
    algorithm = inputs["algorithm"]
    if algorithm and inputs["config"].get("speculative_runs_spec_v2") is False:
        return (
            f"{algorithm} runs sglang's spec-v1 decode path here (ScheduleBatch.is_spec_v2 is False): "
            "no spec-v2 decode reservation"
        )
    if inputs["no_speculative_decoding"]:
        return "no speculative decoding"
    return ""


def rule(verdict, found: str, form, inputs: dict, resolved: dict) -> dict:
    """From the row headroom and the decode reservation (sglang's own numbers where resolved):
    how far the last reservation writes past the row end, now and with either fix
    (``width.row_extra_floor``: the reservation plus the allocator page's rounding)."""
    prepare = _prepare(inputs)
    if prepare == "unknown":
        return {
            "reachable": None,
            "cannot_tell": f"speculative algorithm {inputs['algorithm']}: this tool has no rule for its "
            "decode path (release.DECODE_PREPARE)",
        }
    if why_not(inputs):
        return {"reachable": False, "why_not": why_not(inputs)}
    extra, reserve, page = inputs["row_extra"], inputs["decode_reserve"], inputs["alloc_page_size"]
    need = width.required_row_extra(
        reserve, page, form, inputs["overlap"], prepare != release.DFLASH_PREPARE, inputs["context_len"]
    )
    align = page if form.page_aligns_reservation else 1
    # Resolved by sglang: the plugin's own hook ran on sglang's numbers (runtime_fix); the
    # in-tree form computes the same. Else the rule: the reservation and the page's rounding.
    with_fix = inputs["row_extra_with_plugin"] or max(extra, width.row_extra_floor(reserve, align))
    # Resolved by sglang, the headroom is the tree's own function, an in-tree change included;
    # the static rule mirrors the pristine function, so a tree whose files hold the reservation
    # (patched, or fixed upstream) gets the fix's number.
    fixed = verdict in (Verdict.FIXED_IN_TREE, Verdict.FIXED_UPSTREAM)
    now = with_fix if fixed and not inputs["resolved"] else extra
    columns = max(0, need - now)
    at = {
        **({"note": PREPARE_NOTES[prepare]} if prepare in PREPARE_NOTES else {}),
        "row_extra": now,
        "decode_reserve": reserve,
        "alloc_page_size": page,
        "row_extra_needed": need,
        "row_extra_with_fix": with_fix,
        "columns_past_row_end": columns,
        "columns_past_row_end_with_fix": max(0, need - with_fix),
        "reachable": columns > 0,
    }
    if "prove" in resolved:
        at["measured"] = measured(at, resolved["prove"])
    return at


def measured(at: dict, prove: dict) -> dict:
    """``status --prove``: what sglang's real decode path wrote, beside the arithmetic."""
    if "columns_past_row_end" not in prove or "columns_past_row_end" not in at:
        return prove
    agrees = prove["columns_past_row_end"] == at["columns_past_row_end"]
    out = {**prove, "agrees_with_arithmetic": agrees}
    if not agrees:  # the drive ran sglang's own decode path; the arithmetic is this tool's model
        out["sglang_behaviour"] = "measured"
    return out


def hook(files, site, sglang) -> HookPlan:
    from sglang_dsa_fix.runtime_fix import row_extra_fix

    module = ".".join(site.path.relative_to(sglang.package_parent).with_suffix("").parts)
    fix = row_extra_fix(module)

    def body(info: dict, result, *args, **kwargs):
        extra = fix(result, *args, **kwargs)
        info["extra"] = [result, extra]
        if extra == result:
            return extra, None
        return extra, (
            f"req_to_token row headroom raised from {result} to {extra} columns past context_len "
            "(spec-v2 decode reservation)"
        )

    return HookPlan(f"{module}.{release.ROW_SIZING_FUNCTION}", body=body)


def unjudged(found) -> str:
    """No sizing function to judge, but a spec-v2 reservation (0.5.4 - 0.5.8). Its form differs
    between these releases (0.5.4 - 0.5.5 seq_lens + A, 0.5.6 - 0.5.8 kv_committed_len + 2A:
    speculative/eagle_info_v2.py 0.5.4 :92, 0.5.6 :96, 0.5.8 :97) and this tool reads none of it."""
    if not found.spec_v2:
        return ""
    return (
        "this release sizes the req_to_token row inline in model_runner.py beside an opt-in spec-v2 "
        "decode reservation (speculative/eagle_info_v2.py) that this tool does not read; it neither "
        "judges nor fixes it"
    )


ROW_WRITE, ROW_READ, UNIFORM_ROW_READ, DRAFT_SLOT_READ = (
    "row_write",
    "row_read",
    "uniform_row_read",
    "draft_slot_read",
)
# The family watch: every write of the decode reservation into req_to_token and every read of
# the verify slots back out of it, counted on the device (watch.py's row check). batch_size is
# the writer's 6th argument (req_pool_indices, req_to_token, start_offset, end_offset,
# out_cache_loc, batch_size) and the reader's 5th (no out_cache_loc).
WATCHES = (
    WatchKind(
        ROW_WRITE,
        ("row_writes_past_end", "row_columns_past_end"),
        targets=(
            # 0.5.16+: a module global of mem_cache/allocation.py (0.5.17 :631, 0.5.23 :737), called from
            # there by alloc_for_spec_decode (0.5.17 :710, 0.5.23 :837) as a global, so the module
            # attribute is what the spec-v2 prepare really calls.
            WatchTarget(
                ROW_WRITE,
                "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
                "req_to_token",
                (0, 5, 16),
            ),
            # 0.5.13 - 0.5.15: the spec-v2 prepare imports it from speculative/spec_utils.py at call time
            # (0.5.14 eagle_info_v2.py:33, :104; spec_utils.py:29 re-exports the definition of
            # speculative/triton_ops/cache_locs.py:50). HookRegistry sets the wrapper on spec_utils and
            # propagates it to every module holding the original (0.5.14 plugins/hook_registry.py:297-300, :322-349).
            # 0.5.11 - 0.5.12 (the plugin API's first releases): the same, imported at call time by
            # speculative/eagle_info_v2.py (0.5.11 :92 -> :157, 0.5.12 :92 -> :164; spec_utils.py
            # 0.5.11:125, 0.5.12:129 define it there).
            WatchTarget(
                ROW_WRITE,
                "sglang.srt.speculative.spec_utils.assign_req_to_token_pool_func",
                "req_to_token",
                (0, 5, 11),
                (0, 5, 15),
            ),
        ),
        batch_size_at=5,
        parameters=(
            "req_pool_indices",
            "req_to_token",
            "start_offset",
            "end_offset",
            "out_cache_loc",
            "batch_size",
        ),
    ),
    WatchKind(
        ROW_READ,
        ("row_reads_past_end", "row_read_columns_past_end"),
        targets=(
            # The verify-slot reader: sglang.kernels from 0.5.17 (0.5.17 kernels/ops/speculative/
            # cache_locs.py:432, 0.5.23 :679; called by ngram_worker.py 0.5.23:374, dflash_worker_v2.py),
            # speculative/triton_ops/cache_locs.py:337 in 0.5.14 (called by eagle_info_v2.py, ngram_worker.py:324,
            # eagle_utils.py:308). 0.5.15 / 0.5.16 not read: whichever resolves.
            WatchTarget(
                ROW_READ,
                "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func",
                "req_to_token",
                (0, 5, 15),
            ),
            WatchTarget(
                ROW_READ,
                "sglang.srt.speculative.triton_ops.cache_locs.assign_extend_cache_locs_func",
                "req_to_token",
                (0, 5, 13),
                (0, 5, 16),
            ),
            # 0.5.11 - 0.5.12: defined in speculative/eagle_info_v2.py itself (0.5.11 :534, 0.5.12 :561)
            # and called there as a module global (0.5.11 :253, 0.5.12 :270).
            WatchTarget(
                ROW_READ,
                "sglang.srt.speculative.eagle_info_v2.assign_extend_cache_locs_func",
                "req_to_token",
                (0, 5, 11),
                (0, 5, 12),
            ),
        ),
        batch_size_at=4,
        parameters=("req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size"),
    ),
    # From 0.5.17 EAGLE's verify reads its slots through the uniform reader, every row the same
    # draft_token_num columns from start_offset, its end computed in the kernel, which masks only
    # the column against draft_token_num (0.5.17 kernels/ops/speculative/cache_locs.py:365-418,
    # 0.5.23 :596; called by eagle_utils.py eagle_prepare_for_verify 0.5.17 :520, 0.5.23 :357, from
    # 0.5.20 by multi_layer_eagle_worker_v2.py (0.5.23 :789), in 0.5.23 by
    # mem_cache/kv_index_translator.py :336). Each imports it from that module inside the function;
    # from 0.5.20 eagle_prepare_for_verify keeps what its first call imported (0.5.23 :313-337,
    # _PREPARE_FOR_VERIFY_DEPS), which is the hook: the plugin registers before the first request.
    # Its arguments: (req_pool_indices, req_to_token, start_offset, batch_size, draft_token_num,
    # device, *, ...).
    WatchKind(
        UNIFORM_ROW_READ,
        ("uniform_row_reads_past_end", "uniform_row_read_columns_past_end"),
        targets=(
            WatchTarget(
                UNIFORM_ROW_READ,
                "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_uniform_func",
                "req_to_token",
                (0, 5, 17),
            ),
        ),
        batch_size_at=3,
        span_at=(4,),
        parameters=("req_pool_indices", "req_to_token", "start_offset", "batch_size", "draft_token_num"),
    ),
    # 0.5.23: EAGLE's draft reads its slots, topk x num_cols columns of every row from seq_lens
    # (cache_locs.py:43-82: copy_len = topk * speculative_num_steps from kv_start, masked only
    # against copy_len), through assign_draft_cache_locs_contiguous_func (:85-123; req_pool_indices,
    # req_to_token, seq_lens, out_cache_loc, topk, num_cols, positions=None, mrope=None; the batch is
    # seq_lens' length). Called positionally by eagle_worker_common.py:290 (imported at module level
    # there, :7-9: the plugin's HookRegistry propagates the wrapper to it); with topk 1 and more draft
    # tokens than steps it gathers the verify window too (num_cols = draft tokens, :265-282).
    # Before 0.5.23 the EAGLE workers launch the assign_draft_cache_locs kernels directly (no
    # function to hook): docs/plugin.md says so.
    WatchKind(
        DRAFT_SLOT_READ,
        ("draft_slot_reads_past_end", "draft_slot_read_columns_past_end"),
        targets=(
            WatchTarget(
                DRAFT_SLOT_READ,
                "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_func",
                "req_to_token",
                (0, 5, 23),
            ),
        ),
        batch_size_at=2,
        span_at=(4, 5),
        parameters=("req_pool_indices", "req_to_token", "seq_lens", "out_cache_loc", "topk", "num_cols"),
    ),
)


MEMBERS = (
    Member(
        bug=Bug.ROW_OVERFLOW,
        title="bug #2 req_to_token row overflow (silent corruption)",
        column="bug #2 req_to_token row overflow",
        absent="no spec-v2 decode reservation",
        holds="reserves the decode reservation at every page size",
        affected_what="this row sizing is",
        legacy=(
            "an older sglang-dsa-fix form of this change (0.2: headroom reserve - margin; 0.3 on 0.5.16 - "
            "0.5.17, 0.4 on 0.5.18: without the allocator page's rounding): run `sglang-dsa-fix revert` "
            "then `apply` to hold the whole reservation"
        ),
        locate=sites.row_site,
        rule=rule,
        hook=hook,
        watch=(ROW_WRITE, ROW_READ, UNIFORM_ROW_READ, DRAFT_SLOT_READ),
        unjudged=unjudged,
        releases="sglang 0.5.9 – newest with spec v2 (the default from 0.5.11); at page 1 from 0.5.16, and "
        "at page > 1 with decode context parallel on 0.5.16 – 0.5.18",
        symptoms=(
            (
                r"memory leak detected",
                "sglang's idle leak check found KV slots nobody frees: the slots a decode reservation "
                "wrote past a request's req_to_token row, into the next request's row (that request "
                "read another request's KV before this line)",
            ),
        ),
    ),
)
