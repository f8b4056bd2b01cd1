"""The speculative decode reservation must stay inside the request's req_to_token row.

Each spec-v2 decode prepare reserves KV ahead of the verify: it writes the request's row up to
column kv_committed_len + reserve with assign_req_to_token_pool, which addresses the pool as
row * row_width + col and masks only col < end (0.5.23 mem_cache/allocation.py:692, :837).
The reserve is get_alloc_reserve_per_decode() for EAGLE and NGRAM (speculative/eagle_utils.py:866)
and 2 x block for DFLASH and DSPARK (speculative/dflash_info_v2.py:147); spec_prepare_for_decode
(speculative/spec_utils.py:1249) dispatches between them.

A request still decoding has kv_committed_len <= context_len - 4: admission clamps
prompt + max_new_tokens to context_len - 2 (managers/scheduler.py:2709-2716), a request with
max_new_tokens outputs is finished, and the newest output token has no KV yet. The row is
context_len + get_req_to_token_extra_context_len() wide (mem_cache/allocation_sizing.py:96-119);
at page 1 that headroom is 4 + num_draft_tokens whatever the algorithm reserves, so the last
reservation passes the row end once reserve > 8 + num_draft_tokens: EAGLE topk 1 and NGRAM from
9 draft tokens, DFLASH / DSPARK from a block of 9, EAGLE topk > 1 once 2 * topk * num_steps does.
"""

import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocation_sizing import (
    get_alloc_reserve_per_decode,
    get_req_to_token_extra_context_len,
)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import spec_prepare_for_decode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CONTEXT_LEN = 256
CANARY = 0x5A5A5A5


def spec_args(algorithm, num_draft_tokens, topk=None, num_steps=None):
    args = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=num_draft_tokens)
    if topk is not None:
        args.update(speculative_eagle_topk=topk, speculative_num_steps=num_steps)
    return args


# Page 1. EAGLE 4 draft tokens fits (the control); NGRAM's launch default is 12 draft tokens
# (arg_groups/speculative_hook.py _handle_ngram); a DFLASH / DSPARK block is its draft count.
CASES = (
    spec_args("EAGLE", 4, topk=1, num_steps=3),
    spec_args("EAGLE", 9, topk=1, num_steps=8),
    spec_args("EAGLE", 12, topk=1, num_steps=11),
    spec_args("EAGLE", 8, topk=4, num_steps=3),
    spec_args("NGRAM", 12),
    spec_args("DFLASH", 16),
    spec_args("DSPARK", 16),
)


def assign_req_to_token_pool_torch(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, bs
):
    """Exact reference of the Triton kernel assign_req_to_token_pool (GPU only): it addresses
    the flat pool as row * row_width + col and masks only col < end, so a write may cross into
    the next row."""
    flat = req_to_token.view(-1)
    width, offset = req_to_token.shape[1], 0
    for i in range(bs):
        start, end = int(start_offset[i]), int(end_offset[i])
        base = int(req_pool_indices[i]) * width
        flat[base + start : base + end] = out_cache_loc[offset : offset + end - start].to(flat.dtype)
        offset += end - start


def last_decode_prepare(args):
    """One request at its last decode prepare (kv_committed_len = context_len - 4) through
    sglang's spec_prepare_for_decode, its neighbour's row full of a canary."""
    algorithm = SpeculativeAlgorithm.from_string(args["speculative_algorithm"])
    width = CONTEXT_LEN + get_req_to_token_extra_context_len()
    pool = ReqToTokenPool(size=2, max_context_len=width, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(4 * width, torch.bfloat16, "cpu", None, False)
    params = CacheInitParams(
        disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=1
    )
    params.tree_components = (ComponentType.FULL,)  # the radix cache off, as --disable-radix-cache
    committed = CONTEXT_LEN - 4
    req = Req("r", "", list(range(100)), SamplingParams(max_new_tokens=CONTEXT_LEN - 2 - 100))
    neighbour = Req("n", "", [0], SamplingParams(max_new_tokens=1))
    pool.alloc([req, neighbour])
    row, next_row = req.kv.req_pool_idx, neighbour.kv.req_pool_idx
    assert next_row == row + 1
    pool.req_to_token[row, :committed] = allocator.alloc(committed).to(torch.int32)
    pool.req_to_token[next_row].fill_(CANARY)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = committed
    batch = ScheduleBatch(
        reqs=[req],
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=UnifiedRadixCache(params),
        device="cpu",
    )
    batch.req_pool_indices = torch.tensor([row], dtype=torch.int64)
    batch.seq_lens = torch.tensor([committed], dtype=torch.int64)
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False))
    batch.spec_algorithm = algorithm
    if algorithm.is_dflash_family():
        batch.spec_info = DFlashDraftInputV2.create_idle_input("cpu")
    with patch.object(allocation, "assign_req_to_token_pool_func", assign_req_to_token_pool_torch):
        spec_prepare_for_decode(batch)
    return req, pool.req_to_token[next_row], width


class TestReqToTokenRowReservation(CustomTestCase):
    def test_last_reservation_stays_in_the_row(self):
        for args in CASES:
            with self.subTest(**args), get_context().override_server_args(page_size=1, **args):
                extra = get_req_to_token_extra_context_len()
                if args["speculative_algorithm"] in ("DFLASH", "DSPARK"):
                    reserve = 2 * args["speculative_num_draft_tokens"]
                else:
                    reserve = get_alloc_reserve_per_decode()
                req, neighbour_row, width = last_decode_prepare(args)
                # The prepare reserved what the sizing says, from the committed length.
                self.assertEqual(req.kv.kv_allocated_len, CONTEXT_LEN - 4 + reserve)
                clobbered = int((neighbour_row != CANARY).sum())
                self.assertEqual(
                    clobbered, 0, f"the reservation wrote {clobbered} slots into the next request's row"
                )
                self.assertLessEqual(req.kv.kv_allocated_len, width)
                self.assertGreaterEqual(extra, reserve - 4, "the row headroom does not hold the reservation")

    def test_reference_writes_like_the_kernel(self):
        req_to_token = torch.zeros(3, 4, dtype=torch.int32)
        assign_req_to_token_pool_torch(
            torch.tensor([1]),
            req_to_token,
            torch.tensor([2]),
            torch.tensor([6]),
            torch.tensor([7, 8, 9, 10]),
            1,
        )
        self.assertEqual(req_to_token.tolist(), [[0, 0, 0, 0], [0, 0, 7, 8], [9, 10, 0, 0]])

    @unittest.skipUnless(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        "needs CUDA (or TRITON_INTERPRET=1) for the Triton kernel",
    )
    def test_reference_matches_the_kernel(self):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        args = (
            torch.tensor([1, 0], device=device),
            torch.tensor([2, 1], device=device),
            torch.tensor([6, 3], device=device),
            torch.arange(7, 13, device=device),
            2,
        )
        expected = torch.zeros(3, 4, dtype=torch.int32, device=device)
        got = expected.clone()
        assign_req_to_token_pool_torch(args[0], expected, *args[1:])
        allocation.assign_req_to_token_pool_func(args[0], got, *args[1:])
        self.assertEqual(got.tolist(), expected.tolist())


if __name__ == "__main__":
    unittest.main()
