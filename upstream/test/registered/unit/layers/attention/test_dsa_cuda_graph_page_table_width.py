"""DSA CUDA-graph page_table must be as wide as req_to_token (target_verify past context_len).

Speculative decoding lets seq_len pass context_len; req_to_token is over-allocated for it
(get_req_to_token_extra_context_len). TARGET_VERIFY replay copies req_to_token[idx, :seq_len + D]
into the graph page_table, so a page_table sized max_context_len + D raises
"The size of tensor a (N) must match the size of tensor b (N+j)" (issue #30570).
"""

import unittest
from types import SimpleNamespace
from unittest.mock import patch

import torch
from sglang.srt.layers.attention import dsa_backend
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.mem_cache.common import get_req_to_token_extra_context_len
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

CONTEXT_LEN = 256
BS = 2


def seqlens_expand_torch(extend_seq_lens, seq_lens, total_len, max_q_len):
    """Exact reference of seqlens_expand_triton (CUDA only): request i contributes
    seq_lens[i] - extend_seq_lens[i] + 1 ... seq_lens[i], runs laid end to end."""
    out = torch.zeros(total_len, dtype=torch.int32, device=seq_lens.device)
    pos = 0
    for q, kv in zip(extend_seq_lens.tolist(), seq_lens.tolist()):
        out[pos : pos + q] = torch.arange(kv - q + 1, kv + 1, dtype=torch.int32)
        pos += q
    return out


def make_backend(num_draft_tokens, page_size):
    server_args = SimpleNamespace(
        max_speculative_num_draft_tokens=num_draft_tokens,
        speculative_algorithm="EAGLE",
        speculative_num_steps=num_draft_tokens - 1,
        speculative_eagle_topk=1,
        page_size=page_size,
    )
    width = CONTEXT_LEN + get_req_to_token_extra_context_len(server_args)
    pool = ReqToTokenPool(size=BS, max_context_len=width, device="cpu", enable_memory_saver=False)
    rows, cols = pool.req_to_token.shape
    pool.req_to_token.copy_(torch.arange(rows * cols, dtype=torch.int32).view(rows, cols))

    backend = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    backend.device = torch.device("cpu")
    backend.max_context_len = CONTEXT_LEN
    backend.req_to_token_pool = pool
    backend.req_to_token = pool.req_to_token
    backend.real_page_size = page_size
    backend.speculative_num_draft_tokens = num_draft_tokens
    backend.speculative_num_steps = num_draft_tokens - 1
    backend.speculative_step_id = 0
    backend.topk = 1
    backend.hisparse_coordinator = None
    backend.use_mha = False
    backend.enable_auto_select_prefill_impl = False
    backend._arange_buf = torch.arange(16384, dtype=torch.int32)
    backend.dsa_index_topk = 2048
    backend.dsa_decode_impl = backend.dsa_prefill_impl = "flashmla_sparse"
    backend.dsa_kv_cache_store_fp8 = False
    backend.num_q_heads = backend.flashmla_kv_num_q_heads = 64
    return backend, pool


def forward_batch(req_pool_indices, seq_lens):
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=len(seq_lens),
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=None,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.cpu(),
        spec_info=None,
    )


class TestDSACudaGraphPageTableWidth(CustomTestCase):
    def test_target_verify_replay_past_context_len(self):
        for num_draft_tokens, page_size in ((4, 1), (5, 64)):
            with (
                self.subTest(D=num_draft_tokens, page_size=page_size),
                patch.object(dsa_backend, "seqlens_expand_triton", seqlens_expand_torch),
            ):
                backend, pool = make_backend(num_draft_tokens, page_size)
                backend.init_cuda_graph_state(BS, BS * num_draft_tokens)
                fill = backend.get_cuda_graph_seq_len_fill_value()
                capture = forward_batch(
                    torch.zeros(BS, dtype=torch.int64), torch.full((BS,), fill, dtype=torch.int64)
                )
                backend.init_forward_metadata_out_graph(capture, in_capture=True)

                idx = torch.tensor([2, 1], dtype=torch.int64)
                # Every seq_len whose verify still fits in the request pool, past context_len too.
                last = pool.req_to_token.shape[1] - num_draft_tokens
                for seq_len in range(CONTEXT_LEN - 1, last + 1):
                    seq_lens = torch.tensor([seq_len, seq_len - 1], dtype=torch.int64)
                    backend.init_forward_metadata_out_graph(forward_batch(idx, seq_lens), in_capture=False)
                    page_table_1 = backend.forward_metadata.page_table_1
                    columns = seq_len + num_draft_tokens
                    expected = pool.req_to_token[idx, :columns].repeat_interleave(num_draft_tokens, dim=0)
                    self.assertTrue(
                        torch.equal(page_table_1[: expected.shape[0], :columns], expected), seq_len
                    )

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA for the Triton kernel")
    def test_reference_matches_seqlens_expand_triton(self):
        ext = torch.tensor([5, 1, 3], dtype=torch.int32, device="cuda")
        seq = torch.tensor([614405, 9, 256], dtype=torch.int32, device="cuda")
        total = int(ext.sum())
        self.assertEqual(
            dsa_backend.seqlens_expand_triton(ext, seq, total, 5).tolist(),
            seqlens_expand_torch(ext, seq, total, 5).tolist(),
        )


if __name__ == "__main__":
    unittest.main()
