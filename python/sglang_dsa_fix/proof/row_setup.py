"""The real sglang parts a row-overflow case runs on: flags, published server args, a prefilled request."""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch

from sglang_dsa_fix.proof.row_case import RowCase
from sglang_dsa_fix.runtime_fix import dcp_group_widths, sizing_module

CANARY = 0x5A5A5A5  # a slot index no allocator of these sizes hands out


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


def kv_state(req, field: str):
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


def release_request(req, tree_cache) -> None:
    """``release_kv_cache`` as the scheduler calls it for a finished request (0.5.23 added a
    keyword-only ``checkpoint``: False = nothing goes into the disabled tree)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if "checkpoint" in inspect.signature(release_kv_cache).parameters:
        release_kv_cache(req, tree_cache, checkpoint=False)
    else:
        release_kv_cache(req, tree_cache)


@dataclass
class Prefilled:
    """The owner request after prefill, in its batch, the next row (its neighbour's) full of
    CANARY, and the parts they run on."""

    pool: object  # ReqToTokenPool, two rows
    allocator: object
    tree_cache: object
    free_before: int  # the allocator's free size before the prompt's slots
    max_new: int  # sglang's clamp of max_new_tokens (module docstring of row_overflow)
    owner: object  # the Req
    next_row: int
    committed: object  # what holds the owner's kv_committed_len (``kv_state``)
    batch: object  # the ScheduleBatch of the owner


def prefill(case: RowCase, row_width: int) -> Prefilled:
    """The pool (rows ``row_width`` wide), allocator and tree cache, the owner request with its
    prompt's KV slots and its neighbour, and the batch the first decode prepare runs on."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=2, max_context_len=row_width, device=case.device, enable_memory_saver=False)
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
        kv_state(owner, "req_pool_idx").req_pool_idx,
        kv_state(neighbour, "req_pool_idx").req_pool_idx,
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
    committed = kv_state(owner, "kv_committed_len")
    committed.kv_committed_len = case.prompt_len
    kv_state(owner, "kv_allocated_len").kv_allocated_len = case.prompt_len

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
    return Prefilled(pool, allocator, tree_cache, free_before, max_new, owner, next_row, committed, batch)
