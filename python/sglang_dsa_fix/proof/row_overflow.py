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

import contextlib
import importlib
import inspect
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import torch

from sglang_dsa_fix import release
from sglang_dsa_fix.runtime_fix import dcp_group_widths, sizing_module

CANARY = 0x5A5A5A5  # a slot index no allocator of these sizes hands out


@dataclass(frozen=True)
class RowCase:
    context_len: int
    num_draft_tokens: int  # D
    page_size: int
    overlap: bool
    prompt_len: int
    accept_len: int = 1
    topk: int = 1
    num_steps: Optional[int] = None  # default D - 1 (topk 1)
    algorithm: str = "EAGLE"
    dcp_size: int = 1  # decode context parallel: the allocator pages page_size x dcp_size
    # Where the pool, allocator and batch live: "cpu" (the kernels in Triton's interpreter) or
    # "cuda" (compiled: a GPU host, whose Triton's interpreter may not run sglang's kernels).
    device: str = "cpu"

    @property
    def steps(self) -> int:
        return self.num_steps or max(1, self.num_draft_tokens - 1)

    @property
    def alloc_page(self) -> int:
        """The token allocator's page (0.5.17 mem_cache/kv_cache_builder.py:212: under DCP the
        allocator, and the tree cache with it, page page_size x dcp_size)."""
        return self.page_size * self.dcp_size


@dataclass
class RowResult:
    case: RowCase
    row_width: int
    row_extra: int
    furthest_column: int  # highest column any prepare wrote in the owner's row
    last_committed: int  # kv_committed_len seen by the last prepare
    canary_clobbered: int  # neighbour-row cells changed
    leaked_slots: int  # KV slots not back in the allocator after release
    prepares: int
    writes: list = field(default_factory=list, repr=False)  # (start, end, row width) per row written
    # (seq_len, kv_allocated_len) of each target_verify: what it runs with, and the row columns the
    # real prepare before it had reserved (its draft KV goes to [seq_len, seq_len + D)).
    verifies: list = field(default_factory=list, repr=False)
    # The decode prepares sglang ran (release.EAGLE_PREPARE, DFLASH_PREPARE, UNO_PREPARE).
    prepares_run: frozenset = frozenset()

    @property
    def longest_verify_seq_len(self) -> Optional[int]:
        """The longest seq_len a target_verify ran with; None if the request never decoded."""
        return max((seq_len for seq_len, _ in self.verifies), default=None)

    @property
    def columns_past_row_end(self) -> int:
        return max(0, self.furthest_column + 1 - self.row_width)

    @property
    def clean(self) -> bool:
        return self.columns_past_row_end == 0 and self.canary_clobbered == 0 and self.leaked_slots == 0


def require_interpreter(device: str = "cpu") -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU")
    if device != "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(f"TRITON_INTERPRET=1: the kernels would not run compiled on {device}")


def sizing_args(server_args) -> tuple:
    """What the release's sizing functions are called with: ``(server_args,)``, or nothing from
    0.5.23, where they read the published runtime context (allocation_sizing.py:96)."""
    module = sizing_module()
    if module is None:
        return (server_args,)
    return (server_args,) if inspect.signature(module.get_req_to_token_extra_context_len).parameters else ()


def server_args_for(case: RowCase) -> SimpleNamespace:
    """The flags the real sizing / prepare / release functions read (sglang's spellings)."""
    return SimpleNamespace(
        speculative_algorithm=case.algorithm,
        speculative_num_steps=case.steps,
        speculative_eagle_topk=case.topk,
        speculative_num_draft_tokens=case.num_draft_tokens,
        max_speculative_num_draft_tokens=case.num_draft_tokens,
        page_size=case.page_size,
        dcp_size=case.dcp_size,
        strip_thinking_cache=False,
        speculative_use_rejection_sampling=False,  # read by EagleDraftInput.create_idle_input
        attention_backend="dsa",  # any CUDA backend: get_last_loc takes its Triton kernel
        enable_mamba_extra_buffer=lambda: False,
        enable_mamba_extra_buffer_lazy=lambda: False,
    )


@contextlib.contextmanager
def global_server_args(server_args):
    """Publish ``server_args`` where this release's code reads them and yield what was published:
    the module global (0.5.14 and older), the runtime context's slot (0.5.15 / 0.5.16), or, from
    0.5.17, a real ``ServerArgs`` carrying these flags through sglang's own scoped test override
    (``RuntimeContext.override_server_args``, 0.5.17 runtime_context.py:938), which also projects
    the config bags (``get_spec()``, ``get_serving()``, ...) that 0.5.17+ reads."""
    from sglang.srt import server_args as holder

    if hasattr(holder, "_global_server_args"):  # 0.5.14 and older
        with mock.patch.object(holder, "_global_server_args", server_args):
            yield server_args
        return
    from sglang.srt.runtime_context import get_context

    context = get_context()
    if not hasattr(context, "override_server_args"):  # 0.5.15 / 0.5.16
        with mock.patch.object(context, "_server_args", server_args):
            yield server_args
        return
    # Only the flags this release's ServerArgs has (a plain class from 0.5.20, not a dataclass);
    # methods such as enable_mamba_extra_buffer stay the real ones.
    probe = holder.ServerArgs(model_path="dummy")
    # max_speculative_num_draft_tokens is sglang's own derivation from the draft-token count
    # (0.5.18's override refuses it as an argument).
    flags = {
        k: v
        for k, v in vars(server_args).items()
        if hasattr(probe, k) and not callable(getattr(probe, k)) and k != "max_speculative_num_draft_tokens"
    }
    with context.override_server_args(**flags) as real, dcp_group_widths(flags.get("dcp_size") or 1):
        yield real


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


def writer_module():
    """The module whose ``assign_req_to_token_pool_func`` the spec-v2 prepare calls: 0.5.16+
    mem_cache/allocation.py (a module global there), before that speculative/spec_utils.py
    (imported at call time)."""
    for name in ("sglang.srt.mem_cache.allocation", "sglang.srt.speculative.spec_utils"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "assign_req_to_token_pool_func"):
                return module
    raise RuntimeError("this sglang has no assign_req_to_token_pool_func")


class _WriteRecorder:
    """Records [start, end) of every real ``assign_req_to_token_pool_func`` call, then runs it."""

    def __init__(self):
        self.module = writer_module()
        self.real = self.module.assign_req_to_token_pool_func
        self.furthest = -1
        self.writes = []  # (start, end, row width) of every row of every call

    def __call__(self, req_pool_indices, req_to_token, start, end, out_cache_loc, bs):
        if bs:
            self.furthest = max(self.furthest, int(end[:bs].max()) - 1)
            row_width = req_to_token.shape[1]
            self.writes += [(s, e, row_width) for s, e in zip(start[:bs].tolist(), end[:bs].tolist())]
        return self.real(req_pool_indices, req_to_token, start, end, out_cache_loc, bs)

    @contextlib.contextmanager
    def installed(self):
        """Around every loaded sglang module that holds the writer as a global: the EAGLE
        prepare imports it at call time, DFLASH's module at import (0.5.14
        speculative/dflash_info_v2.py), as HookRegistry propagates a hook to every importer."""
        import sys

        holders = [self.module] + [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("sglang.")
            and module is not self.module
            and getattr(module, "assign_req_to_token_pool_func", None) is self.real
        ]
        with contextlib.ExitStack() as stack:
            for module in holders:
                stack.enter_context(mock.patch.object(module, "assign_req_to_token_pool_func", self))
            yield


# Where each decode prepare of ``release.DECODE_PREPARE`` lives: (module, class or None, name).
PREPARE_SITES = {
    release.EAGLE_PREPARE: (
        ("sglang.srt.speculative.eagle_utils", None, "eagle_prepare_for_decode"),  # 0.5.15+
        ("sglang.srt.speculative.eagle_info_v2", "EagleDraftInputV2Mixin", "prepare_for_decode"),
    ),
    release.DFLASH_PREPARE: (
        ("sglang.srt.speculative.dflash_info_v2", "DFlashDraftInputV2", "prepare_for_decode"),
    ),
    release.UNO_PREPARE: (("sglang.srt.speculative.uno_info", "UnoDraftInput", "prepare_for_decode"),),
}


class _PrepareSpy:
    """Records which of the release's decode prepares ran (each still runs as it is): the
    observer that says a dispatched algorithm reached the prepare ``release.DECODE_PREPARE``
    names. Sites missing from this release are skipped; the EAGLE prepare is looked up at call
    time by every caller (spec_utils imports it inside the dispatch, a draft input's method
    resolves through its class), so patching the defining module / class reaches them."""

    def __init__(self):
        self.ran = set()

    @contextlib.contextmanager
    def installed(self):
        from importlib.util import find_spec

        with contextlib.ExitStack() as stack:
            for label, sites in PREPARE_SITES.items():
                for module_name, owner_name, name in sites:
                    if find_spec(module_name) is None:
                        continue
                    owner = importlib.import_module(module_name)
                    owner = getattr(owner, owner_name, None) if owner_name else owner
                    real = getattr(owner, name, None) if owner is not None else None
                    if real is None or (owner_name and name not in vars(owner)):
                        continue
                    stack.enter_context(mock.patch.object(owner, name, self._wrap(label, real)))
            yield

    def _wrap(self, label, real):
        def recorded(*args, **kwargs):
            self.ran.add(label)
            return real(*args, **kwargs)

        return recorded


def _kv_state(req, field: str):
    """The object that holds a request's ``field`` in this release: the Req itself, or its
    ``Req.kv`` (ReqKvInfo: kv_allocated_len from 0.5.16, the row and kv_committed_len later)."""
    return req if field in vars(req) else req.kv


def _allocator(case: RowCase, size: int):
    """The release's token allocator: one module ``mem_cache/allocator.py`` up to 0.5.12, a
    package (``allocator/token.py``, ``allocator/paged.py``) from 0.5.13."""
    try:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    except ImportError:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    if case.alloc_page == 1:
        return TokenToKVPoolAllocator(size, torch.bfloat16, case.device, None, False)
    return PagedTokenToKVPoolAllocator(size, case.alloc_page, torch.bfloat16, case.device, None, False)


def _disabled_tree_cache(pool, allocator, page_size: int):
    """What the scheduler builds with the radix cache off: ``ChunkCache`` up to 0.5.21 (the
    0.5.22 wheel has no chunk_cache.py), a disabled ``UnifiedRadixCache`` holding the
    full-attention component after that (0.5.23 mem_cache/registry.py:86-99 ->
    create_unified_radix_cache, :165 and :191)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    params = CacheInitParams(
        disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    )
    try:
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
    except ImportError:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_components = (ComponentType.FULL,)
        return UnifiedRadixCache(params)
    return ChunkCache(params)


def _release(req, tree_cache) -> None:
    """``release_kv_cache`` as the scheduler calls it for a finished request (0.5.23 added a
    keyword-only ``checkpoint``: False = nothing goes into the disabled tree)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if "checkpoint" in inspect.signature(release_kv_cache).parameters:
        release_kv_cache(req, tree_cache, checkpoint=False)
    else:
        release_kv_cache(req, tree_cache)


def run(case: RowCase, sizing_function=None) -> RowResult:
    """One request from its first decode prepare to its release. ``sizing_function`` replaces
    the release's ``get_req_to_token_extra_context_len`` (a fixed one); None = as installed."""
    require_interpreter(case.device)
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    server_args = server_args_for(case)
    if sizing_function is None and sizing_module() is None:
        raise RuntimeError("this sglang sizes the row inline: pass its width as sizing_function")
    sizing = sizing_function or sizing_module().get_req_to_token_extra_context_len
    with global_server_args(server_args) as server_args:
        extra = sizing(*sizing_args(server_args))
        row_width = case.context_len + extra
        pool = ReqToTokenPool(
            size=2, max_context_len=row_width, device=case.device, enable_memory_saver=False
        )
        pages = -(-3 * row_width // case.alloc_page) + 4
        allocator = _allocator(case, pages * case.alloc_page)
        tree_cache = _disabled_tree_cache(pool, allocator, case.alloc_page)
        free_before = allocator.available_size()

        max_new = case.context_len - 2 - case.prompt_len
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        owner = Req("owner", "", list(range(case.prompt_len)), params)
        neighbour = Req("neighbour", "", [0], SamplingParams(max_new_tokens=1))
        pool.alloc([owner, neighbour])
        row, next_row = (
            _kv_state(owner, "req_pool_idx").req_pool_idx,
            _kv_state(neighbour, "req_pool_idx").req_pool_idx,
        )
        assert next_row == row + 1, (row, next_row)
        pool.req_to_token[next_row].fill_(CANARY)

        # Prefill: the prompt's KV slots, whole pages at page > 1 (as extend allocates them).
        aligned = -(-case.prompt_len // case.alloc_page) * case.alloc_page
        slots = allocator.alloc(aligned)[: case.prompt_len]
        pool.req_to_token[row, : case.prompt_len] = slots.to(torch.int32)
        if getattr(owner, "kv", 0) is None:  # 0.5.16 - 0.5.18: Req.kv (ReqKvInfo) set at prefill
            from sglang.srt.managers.schedule_batch import ReqKvInfo

            owner.kv = ReqKvInfo(kv_allocated_len=case.prompt_len, swa_evicted_seqlen=0)
        committed = _kv_state(owner, "kv_committed_len")
        committed.kv_committed_len = case.prompt_len
        _kv_state(owner, "kv_allocated_len").kv_allocated_len = case.prompt_len
        outputs = 1  # prefill samples the first output token

        batch = ScheduleBatch(
            reqs=[owner],
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=tree_cache,
            device=case.device,
        )
        batch.req_pool_indices = torch.tensor([row], dtype=torch.int64, device=case.device)
        # The prompt length: what prefill leaves for the first verify (0.5.14 eagle_worker_v2.py:
        # 1081-1083). 0.5.9 - 0.5.12's prepare copies seq_lens to the host after the row write
        # (eagle_info_v2.py 0.5.12:174); the value is not read by the reservation.
        batch.seq_lens = torch.tensor([case.prompt_len], dtype=torch.int64, device=case.device)
        batch.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False))
        spy = _PrepareSpy()
        recorder = _WriteRecorder()
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
                    allocated = _kv_state(owner, "kv_allocated_len").kv_allocated_len
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
        _release(owner, tree_cache)
        canary_clobbered = int((pool.req_to_token[next_row] != CANARY).sum())
        leaked = free_before - allocator.available_size()
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
