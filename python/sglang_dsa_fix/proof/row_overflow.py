"""Drive the real spec-v2 decode reservation to a request's last step and watch the next row.

Real sglang parts, per release: the row sizing (``get_req_to_token_extra_context_len``),
``ReqToTokenPool``, the token allocator (``TokenToKVPoolAllocator`` at page 1,
``PagedTokenToKVPoolAllocator`` otherwise, whose ``alloc_extend`` is a Triton kernel),
the disabled tree cache (``ChunkCache``; from 0.5.22 a disabled ``UnifiedRadixCache``), ``Req``
(its KV bookkeeping moving into ``Req.kv`` over 0.5.16 - 0.5.19), ``ScheduleBatch``, the
published server args (0.5.17+ through sglang's scoped test override), the spec-v2 prepare (0.5.13 / 0.5.14
``EagleDraftInputV2Mixin.prepare_for_decode``, 0.5.15+ ``eagle_utils.eagle_prepare_for_decode``)
(DFLASH / DSPARK: ``DFlashDraftInputV2.prepare_for_decode``; FROZEN_KV_MTP and UNO through
sglang's own ``ScheduleBatch.prepare_for_decode`` dispatch, with the prepare that ran recorded)
with its Triton kernel ``assign_req_to_token_pool`` (0.5.16+ called from
``mem_cache/allocation.py``; run on CPU by Triton's interpreter:
``TRITON_INTERPRET=1`` must be set before triton is imported), and ``release_kv_cache``.

What is modelled here is only the scheduler's bookkeeping between two prepares, as sglang
does it (0.5.14 managers/scheduler_components/batch_result_processor.py:560-582): the verify
accepts ``accept_len`` tokens; the result raises kv_committed_len by ``accept_len - 1`` where
prepare pre-claimed the bonus slot (0.5.13 / 0.5.14, detected by watching prepare) or by
``accept_len`` where it did not (0.5.15+); a request finishes when its output reaches
max_new_tokens, which sglang clamps to ``context_len - 2 - prompt`` when unset (0.5.14
managers/scheduler.py:1868); a finished request's pre-claim is given back. With overlap on,
the next batch is prepared before the previous result is processed
(event_loop_overlap), so a request gets one more prepare after its last useful verify.

Each prepare is followed by a target_verify run with the batch's ``seq_lens`` (0.5.14
speculative/eagle_utils.py:309-312 writes the D draft tokens' KV at [seq_lens, seq_lens + D);
the DSA replay copies ``max(seq_lens) + D`` columns, layers/attention/dsa_backend.py:1217-1219).
sglang's seq_lens bookkeeping, modelled here: prefill leaves the prompt length
(speculative/eagle_worker_v2.py:1081-1083), every verify gives ``seq_lens + accept_lens``
(eagle_worker_v2.py:1530), and the next batch runs with that whether or not its result has been
processed: with overlap it is published at verify end (eagle_worker_v2.py:1139-1142 ->
managers/overlap_utils.py:314-318) and read back before the next forward (scheduler.py:3172 ->
overlap_utils.py:284); without, scheduler.py:3250-3251. The result records each verify's
seq_len next to the row columns the real prepare had reserved by then.

The neighbour row (the next request's) is filled with a canary. Observers that do not depend
on any fix: the canary, the [start, end) of every row write (recorded around the real kernel
call), and the allocator's free size after the request is released.
"""

from __future__ import annotations

import torch

from sglang_dsa_fix import release
from sglang_dsa_fix.proof.row_case import RowCase, RowResult
from sglang_dsa_fix.proof.row_observers import PrepareSpy, WriteRecorder
from sglang_dsa_fix.proof.row_observers import writer_module as writer_module  # re-exported: see below
from sglang_dsa_fix.proof.row_setup import (
    CANARY,
    Prefilled,
    global_server_args,
    kv_state,
    prefill,
    release_request,
    require_interpreter,
    server_args_for,
    sizing_args,
)
from sglang_dsa_fix.runtime_fix import sizing_module

# ``X as X`` above: re-exported for now, the tests and benchmark/row_observer.py name the row
# writer's module as ``row_overflow.writer_module``; it lives in row_observers. RowCase,
# RowResult and the setup steps are still read as ``row_overflow.X`` too.


# FROZEN_KV_MTP and UNO run through sglang's own decode entry (below): no draft input or call
# of their own is written here, so what runs is what the release dispatches to.
DISPATCHED = ("FROZEN_KV_MTP", "UNO")


def _draft_input(case: RowCase):
    """The draft input the algorithm's spec-v2 worker leaves on the batch between decode steps.

    FROZEN_KV_MTP: the worker's idle seed, a ``FrozenKVMTPDraftInput`` (an ``EagleDraftInput``,
    0.5.14 - 0.5.23 speculative/frozen_kv_mtp_info.py:44; built as 0.5.23
    frozen_kv_mtp_worker_v2.py:418-425 builds it, hidden size 1 here: the prepare reads no
    hidden state). UNO: a ``UnoDraftInput`` with one seed token and frontier per request, as
    its prefill leaves it (0.5.23 speculative/uno_worker_v2.py:429-433; linear UNO's forward
    width is speculative_num_draft_tokens, :86-91)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    if case.algorithm.upper() == "UNO":
        from sglang.srt.speculative.uno_info import UnoDraftInput

        return UnoDraftInput(
            bonus_tokens=torch.zeros(1, dtype=torch.int64, device=case.device),
            new_seq_lens=torch.tensor([case.prompt_len], dtype=torch.int64, device=case.device),
            forward_width=case.num_draft_tokens,
        )
    from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPDraftInput

    return FrozenKVMTPDraftInput.create_idle_input(
        device=case.device,
        hidden_size=1,
        dtype=torch.bfloat16,
        topk=case.topk,
        capture_hidden_mode=CaptureHiddenMode.LAST,
    )


def runs_spec_v2(algorithm: str) -> bool:
    """Whether this sglang registers ``algorithm`` and runs it on spec v2: up to 0.5.13
    ``SpeculativeAlgorithm.supports_spec_v2`` says (0.5.13 speculative/spec_info.py:148-149: not
    FROZEN_KV_MTP); 0.5.14+ drop it and run every algorithm on spec v2."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    member = getattr(SpeculativeAlgorithm, algorithm.upper(), None)
    if member is None:
        return False
    return member.supports_spec_v2() if hasattr(member, "supports_spec_v2") else True


def _dispatched_prepare(case: RowCase):
    """sglang's own ``ScheduleBatch.prepare_for_decode`` on a batch carrying the algorithm's
    ``SpeculativeAlgorithm`` member and draft input: the dispatch the scheduler runs. 0.5.14 calls
    the draft input's own ``prepare_for_decode`` (managers/schedule_batch.py:2617-2622; for
    FrozenKVMTPDraftInput that is EagleDraftInputV2Mixin's, speculative/eagle_info_v2.py:30);
    0.5.15+ call ``spec_utils.spec_prepare_for_decode``, which sends the DFLASH family and UNO
    (0.5.20+) to the draft input's method and every other algorithm to
    ``eagle_utils.eagle_prepare_for_decode`` (0.5.15 spec_utils.py:676-685, 0.5.20 :1081-1102,
    0.5.23 :1249-1270). 0.5.12 / 0.5.13 run FROZEN_KV_MTP on spec v1 only
    (speculative/spec_info.py 0.5.13:148-149, :178-184): no spec-v2 prepare to drive there."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if not runs_spec_v2(case.algorithm):
        raise RuntimeError(f"this sglang runs {case.algorithm} on spec v1 only")
    algorithm = SpeculativeAlgorithm.from_string(case.algorithm)
    spec_info = _draft_input(case)

    def prepare(batch):
        batch.spec_algorithm, batch.spec_info = algorithm, spec_info
        batch.prepare_for_decode()

    return prepare


def _prepare_for_decode(case: RowCase):
    """The release's spec-v2 prepare for this case's algorithm: a callable taking the batch.

    DFLASH (spec v2 from 0.5.14) reserves in its own ``DFlashDraftInputV2.prepare_for_decode``
    (speculative/dflash_info_v2.py 0.5.14:131, 0.5.17:113, 0.5.23:114: 2 x block, no row check),
    on the draft input the batch carries, which spec_prepare_for_decode dispatches to (0.5.23
    spec_utils.py:1259-1260); its overlap plan stream is off by default
    (SGLANG_ENABLE_OVERLAP_PLAN_STREAM). FROZEN_KV_MTP and UNO go through sglang's own dispatch
    (``_dispatched_prepare``). Every other algorithm goes through the EAGLE prepare."""
    if case.algorithm.upper() in DISPATCHED:
        return _dispatched_prepare(case)
    if release.DECODE_PREPARE.get(case.algorithm.upper()) == release.DFLASH_PREPARE:  # DFLASH, DSPARK
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

        spec_info = DFlashDraftInputV2.create_idle_input(case.device)

        def prepare(batch):
            batch.spec_info = spec_info
            spec_info.prepare_for_decode(batch)

        return prepare
    try:
        from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode

        return eagle_prepare_for_decode
    except ImportError:
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        spec_info = EagleDraftInput.__new__(EagleDraftInput)
        return lambda batch: EagleDraftInput.prepare_for_decode(spec_info, batch)


def run(case: RowCase, sizing_function=None) -> RowResult:
    """One request from its first decode prepare to its release. ``sizing_function`` replaces
    the release's ``get_req_to_token_extra_context_len`` (a fixed one); None = as installed."""
    require_interpreter(case.device)
    # Imported here first, as before the setup moved to row_setup: the order sglang's modules
    # are first imported in is the one every release of the matrix ran with.
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch  # noqa: F401
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: F401
    from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: F401

    server_args = server_args_for(case)
    if sizing_function is None and sizing_module() is None:
        raise RuntimeError("this sglang sizes the row inline: pass its width as sizing_function")
    sizing = sizing_function or sizing_module().get_req_to_token_extra_context_len
    with global_server_args(server_args) as server_args:
        extra = sizing(*sizing_args(server_args))
        row_width = case.context_len + extra
        request = prefill(case, row_width)
        spy = PrepareSpy()
        recorder = WriteRecorder()
        prepares, last_committed, verifies = _decode(case, request, recorder, spy)
        release_request(request.owner, request.tree_cache)
        canary_clobbered = int((request.pool.req_to_token[request.next_row] != CANARY).sum())
        leaked = request.free_before - request.allocator.available_size()
    return RowResult(
        case,
        row_width,
        extra,
        recorder.furthest,
        last_committed,
        canary_clobbered,
        leaked,
        prepares,
        recorder.writes,
        verifies,
        frozenset(spy.ran),
    )


def _decode(case: RowCase, request: Prefilled, recorder: WriteRecorder, spy: PrepareSpy) -> tuple:
    """The scheduler's decode steps for the prefilled owner, each prepare followed by its verify,
    until its last result is processed (see the module docstring): (the prepares run, the
    kv_committed_len the last prepare saw, each verify's (seq_len, kv_allocated_len))."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    owner, committed, batch, max_new = request.owner, request.committed, request.batch, request.max_new
    outputs = 1  # prefill samples the first output token
    pending, pre_claims, prepares, last_committed, verifies = None, None, 0, None, []

    def process(accepted: int) -> None:
        nonlocal outputs
        if owner.finished():
            committed.kv_committed_len -= 1 if pre_claims else 0
            return
        committed.kv_committed_len += accepted - 1 if pre_claims else accepted
        outputs += accepted
        if outputs >= max_new:
            owner.finished_reason = FINISH_LENGTH(max_new)

    if outputs >= max_new:  # finished by prefill: no decode step at all
        owner.finished_reason = FINISH_LENGTH(max_new)
    with recorder.installed(), spy.installed():
        prepare = _prepare_for_decode(case)
        while not owner.finished() or pending is not None:
            if not owner.finished():
                before = last_committed = committed.kv_committed_len
                prepare(batch)
                prepares += 1
                pre_claims = committed.kv_committed_len == before + 1
                step = case.accept_len
                # The verify this prepare feeds runs with batch.seq_lens, and leaves
                # seq_lens + accept_len for the next batch (see the module docstring).
                allocated = kv_state(owner, "kv_allocated_len").kv_allocated_len
                verifies.append((int(batch.seq_lens.max()), allocated))
                batch.seq_lens = batch.seq_lens + case.accept_len
            else:
                step = None
            if case.overlap:
                if pending is not None:
                    process(pending)
                pending = step
            elif step is not None:
                process(step)
    return prepares, last_committed, verifies
