"""The spec-v2 decode reservation must stay inside the request's req_to_token row.

prepare_for_decode reserves nxt = max(cur, kv_committed_len + get_alloc_reserve_per_decode())
and writes req_to_token[row, cur:nxt] with assign_req_to_token_pool, whose mask is only
col < nxt. Admission clamps prompt + max_new_tokens to context_len - 2; with the overlap
scheduler the request's last prepare sees kv_committed_len = context_len - 3 (the bonus slot is
pre-claimed in prepare). The row is context_len + get_req_to_token_extra_context_len() wide, so
with topk 1 and num_draft_tokens >= 8 the reservation wrote into the next request's row.
"""

import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

import torch
from sglang.srt import server_args as server_args_module
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import get_req_to_token_extra_context_len
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative import spec_utils
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

CONTEXT_LEN = 256
CANARY = 0x5A5A5A5


def assign_req_to_token_pool_torch(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, bs
):
    """Exact reference of the Triton kernel (CUDA only): it addresses the flat buffer as
    row * row_width + col and masks only col < end, so a write may cross into the next row."""
    flat = req_to_token.view(-1)
    width, offset = req_to_token.shape[1], 0
    for i in range(bs):
        start, end = int(start_offset[i]), int(end_offset[i])
        base = int(req_pool_indices[i]) * width
        flat[base + start : base + end] = out_cache_loc[offset : offset + end - start].to(flat.dtype)
        offset += end - start


def last_decode_prepare(num_draft_tokens):
    """One request at its last decode prepare, its neighbour's row full of a canary."""
    args = SimpleNamespace(
        speculative_algorithm="EAGLE",
        speculative_num_steps=num_draft_tokens - 1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=num_draft_tokens,
        max_speculative_num_draft_tokens=num_draft_tokens,
        page_size=1,
        strip_thinking_cache=False,
    )
    width = CONTEXT_LEN + get_req_to_token_extra_context_len(args)
    pool = ReqToTokenPool(size=2, max_context_len=width, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(4 * width, torch.bfloat16, "cpu", None, False)
    cache = ChunkCache(
        CacheInitParams(
            disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=1
        )
    )
    committed = CONTEXT_LEN - 3
    req = Req("r", "", list(range(100)), SamplingParams(max_new_tokens=CONTEXT_LEN - 2 - 100))
    neighbour = Req("n", "", [0], SamplingParams(max_new_tokens=1))
    pool.alloc([req, neighbour])
    pool.req_to_token[req.req_pool_idx, :committed] = allocator.alloc(committed).to(torch.int32)
    pool.req_to_token[neighbour.req_pool_idx].fill_(CANARY)
    req.kv_committed_len = req.kv_allocated_len = committed
    batch = ScheduleBatch(
        reqs=[req],
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=cache,
        device="cpu",
    )
    batch.req_pool_indices = torch.tensor([req.req_pool_idx], dtype=torch.int64)
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False))
    with (
        patch.object(server_args_module, "_global_server_args", args),
        patch.object(spec_utils, "assign_req_to_token_pool_func", assign_req_to_token_pool_torch),
    ):
        EagleDraftInput.prepare_for_decode(EagleDraftInput.__new__(EagleDraftInput), batch)
    return req, pool.req_to_token[neighbour.req_pool_idx], width


class TestReqToTokenRowOverflow(CustomTestCase):
    def test_last_reservation_stays_in_the_row(self):
        for num_draft_tokens in (4, 8, 12):
            with self.subTest(num_draft_tokens=num_draft_tokens):
                req, neighbour_row, width = last_decode_prepare(num_draft_tokens)
                self.assertLessEqual(req.kv_allocated_len, width)
                self.assertTrue(bool((neighbour_row == CANARY).all()), "wrote into the next request's row")

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
        spec_utils.assign_req_to_token_pool_func(args[0], got, *args[1:])
        self.assertEqual(got.tolist(), expected.tolist())


if __name__ == "__main__":
    unittest.main()
