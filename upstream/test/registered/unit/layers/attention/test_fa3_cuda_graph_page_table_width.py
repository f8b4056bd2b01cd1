# ruff: noqa: E402
"""FA3 CUDA-graph page tables must hold every page a TARGET_VERIFY / draft decode replay reads.

Speculative decoding lets a request's seq_len pass context_len; req_to_token is over-allocated
for it (get_req_to_token_extra_context_len). With topk 1 the TARGET_VERIFY replay asks FA3 for
cache_seqlens = seq_len + num_draft_tokens keys and draft decode step i for seq_len + i + 1
(0.5.23 layers/attention/flashattention_backend.py:3186, :887), but init_cuda_graph_state sizes
each graph page_table ceil(context_len / page_size) pages wide (:2432, :2563) and the replay fills
at most self.max_num_pages (:196) of them (kernels/ops/attention/metadata.py:247). FA3 reads
ceil(cache_seqlens / page_size) entries of a row at row * stride(0) + j, unchecked against the
width (flash-attention hopper/paged_kv.h, load_page_table): the missing pages come from the next
row (another request's pages) or, for the last row at the largest captured batch size, from past
the end of the buffer.
"""

import inspect
import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.test.test_utils import CustomTestCase, maybe_stub_sgl_kernel

maybe_stub_sgl_kernel()  # flashattention_backend imports sgl_kernel at module level

import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention import flashattention_backend
from sglang.srt.layers.attention.flashattention_backend import (
    FlashAttentionBackend,
    FlashAttentionMultiStepBackend,
)
from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CONTEXT_LEN = 256
NUM_DRAFT_TOKENS = 4
MAX_BS = 4
CAPTURE_BS = (1, 2, MAX_BS)
SHORT = 100  # seq_len of the other requests in the batch
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The metadata builder is a Triton kernel; on a CPU without TRITON_INTERPRET=1 it is replaced by
# the exact torch reference below (checked against the kernel in test_reference_matches_kernel).
KERNEL_RUNS = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def normal_decode_set_metadata_torch(
    cache_seqlens_int32,
    cu_seqlens_k,
    page_table,
    req_to_token,
    req_pool_indices,
    max_seq_pages,
    seq_lens,
    seq_len_delta,
    page_size,
    swa_page_table=None,
    full_to_swa_index_mapping=None,
    skip_page_table=False,
    full_v2p=None,
    swa_v2p=None,
    zero_tail=False,
):
    """Exact reference of kernels/ops/attention/metadata.py normal_decode_set_metadata without
    SWA or address translation: cache_seqlens = seq_lens + delta, their prefix sum, and for row b
    the first min(ceil(cache_seqlens[b] / page), max_seq_pages) columns set to
    req_to_token[pool row, j * page] // page, stored at row * stride(0) + j * stride(1) (no bound
    on the table's width); zero_tail also zeroes the columns up to max_seq_pages."""
    assert swa_page_table is None and full_v2p is None and swa_v2p is None
    bs = cache_seqlens_int32.shape[0]
    lens = (seq_lens[:bs] + seq_len_delta).to(torch.int32)
    cache_seqlens_int32.copy_(lens)
    cu_seqlens_k[0] = 0
    cu_seqlens_k[1 : bs + 1] = torch.cumsum(lens, 0).to(cu_seqlens_k.dtype)
    if skip_page_table or max_seq_pages == 0:
        return
    tokens = req_to_token.view(-1)
    table = page_table.as_strided(
        (page_table.untyped_storage().nbytes() // page_table.element_size(),), (1,), 0
    )
    for b in range(bs):
        live = min(-(-int(lens[b]) // page_size), max_seq_pages)
        cols = torch.arange(max_seq_pages if zero_tail else live, device=page_table.device)
        src = int(req_pool_indices[b]) * req_to_token.stride(0)
        pages = tokens[src + cols[:live] * page_size * req_to_token.stride(1)] // page_size
        values = torch.zeros(len(cols), dtype=page_table.dtype, device=page_table.device)
        values[:live] = pages.to(page_table.dtype)
        dst = page_table.storage_offset() + b * page_table.stride(0) + cols * page_table.stride(1)
        table[dst] = values


def make_pool(page_size):
    """The request pool as sglang sizes it (context_len + get_req_to_token_extra_context_len());
    req_to_token[r, c] = (r * pages_per_row + c // page) * page + c % page, so the page id
    req_to_token[r, j * page] // page names the row and the page."""
    width = CONTEXT_LEN + get_req_to_token_extra_context_len()
    pool = ReqToTokenPool(size=MAX_BS + 1, max_context_len=width, device=DEVICE, enable_memory_saver=False)
    rows, cols = pool.req_to_token.shape
    per_row = -(-cols // page_size)
    r = torch.arange(rows, device=DEVICE).unsqueeze(1)
    c = torch.arange(cols, device=DEVICE).unsqueeze(0)
    pool.req_to_token.copy_((r * per_row + c // page_size) * page_size + c % page_size)
    return pool


def make_model_runner(pool, page_size, is_draft_worker):
    """What FlashAttentionBackend.__init__ reads of a decoder-only MHA model runner."""
    model_config = SimpleNamespace(
        is_encoder_decoder=False,
        is_local_attention_model=False,
        context_len=CONTEXT_LEN,
        attention_arch=AttentionArch.MHA,
        head_dim=64,
        hf_text_config=SimpleNamespace(num_attention_heads=8),
        get_num_kv_heads=lambda tp_size: 8,
    )
    return SimpleNamespace(
        model_config=model_config,
        sliding_window_size=None,
        device=DEVICE,
        req_to_token_pool=pool,
        token_to_kv_pool=None,
        kv_cache_dtype=torch.bfloat16,
        kv_cache_dtype_str="auto",
        page_size=page_size,
        kv_index_translator=KVIndexTranslator(  # a plain pool: no address translation
            req_to_token=pool.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=None,
            page_size=page_size,
            device=DEVICE,
        ),
        is_draft_worker=is_draft_worker,
        # read by 0.5.19 - 0.5.21
        attention_chunk_size=None,
        attn_cp_size=1,
        ps=SimpleNamespace(attn_cp_size=1, tp_size=1),
    )


def forward_batch(mode, req_pool_indices, seq_lens, tokens_per_req, spec_info=None):
    bs = len(seq_lens)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(bs * tokens_per_req, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=DEVICE),
        seq_lens=seq_lens,
        out_cache_loc=torch.zeros(bs * tokens_per_req, dtype=torch.int64, device=DEVICE),
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.cpu(),
        positions=torch.zeros(bs * tokens_per_req, dtype=torch.int64, device=DEVICE),
        spec_info=spec_info,
    )


class TestFA3CudaGraphPageTableWidth(CustomTestCase):
    def setUp(self):
        if not KERNEL_RUNS:
            stand_in = patch.object(
                flashattention_backend,
                "normal_decode_set_metadata",
                normal_decode_set_metadata_torch,
            )
            stand_in.start()
            self.addCleanup(stand_in.stop)

    def published(self, page_size):
        return get_context().override_server_args(
            speculative_algorithm="EAGLE",
            speculative_eagle_topk=1,
            speculative_num_steps=NUM_DRAFT_TOKENS - 1,
            speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
            page_size=page_size,
        )

    def assert_reads_own_pages(self, metadata, pool, page_size, seq_lens, delta, where):
        """Every page-table entry FA3 reads for each batch row (row b is pool row b + 1) lies in
        that row of the buffer and is the request's own page id."""
        table = metadata.page_table
        lens = metadata.cache_seqlens_int32.tolist()
        self.assertEqual(lens, [s + delta for s in seq_lens], where)
        for b, length in enumerate(lens):
            pages = -(-length // page_size)  # what FA3 reads: ceil(cache_seqlens / page)
            self.assertLessEqual(
                pages,
                table.shape[1],
                f"{where}, row {b}: FA3 reads {pages} page-table entries, the row holds "
                f"{table.shape[1]}; the rest come from the next row or past the buffer",
            )
            own = pool.req_to_token[b + 1, : pages * page_size : page_size] // page_size
            self.assertEqual(table[b, :pages].tolist(), own.tolist(), f"{where}, row {b}")

    def batches(self):
        # The overlap scheduler runs one more verify for a request that finished at the
        # admission clamp (prompt + max_new_tokens <= context_len - 2): its seq_len reaches
        # context_len + num_draft_tokens - 4.
        for seq_len in range(CONTEXT_LEN - 1, CONTEXT_LEN + NUM_DRAFT_TOKENS - 3):
            yield f"seq_len {seq_len} last row", [SHORT] * (MAX_BS - 1) + [seq_len]
            yield f"seq_len {seq_len} every row", [seq_len] * MAX_BS

    def test_target_verify_replay_past_context_len(self):
        D = NUM_DRAFT_TOKENS
        for page_size in (1, 16):
            with self.subTest(page_size=page_size), self.published(page_size):
                pool = make_pool(page_size)
                backend = FlashAttentionBackend(make_model_runner(pool, page_size, False))
                backend.init_cuda_graph_state(MAX_BS, MAX_BS * D)
                for bs in CAPTURE_BS:
                    capture = forward_batch(
                        ForwardMode.TARGET_VERIFY,
                        [0] * bs,
                        [backend.get_cuda_graph_seq_len_fill_value()] * bs,
                        D,
                    )
                    backend.init_forward_metadata_out_graph(capture, in_capture=True)
                for name, seq_lens in self.batches():
                    replay = forward_batch(ForwardMode.TARGET_VERIFY, range(1, MAX_BS + 1), seq_lens, D)
                    backend.init_forward_metadata_out_graph(replay)
                    self.assert_reads_own_pages(
                        backend.target_verify_metadata[MAX_BS],
                        pool,
                        page_size,
                        seq_lens,
                        D,
                        f"verify page {page_size} {name}",
                    )

    def test_draft_decode_replay_past_context_len(self):
        steps = NUM_DRAFT_TOKENS - 1
        for page_size in (1, 16):
            with self.subTest(page_size=page_size), self.published(page_size):
                pool = make_pool(page_size)
                backend = FlashAttentionMultiStepBackend(
                    make_model_runner(pool, page_size, True), topk=1, speculative_num_steps=steps
                )
                backend.init_cuda_graph_state(MAX_BS, MAX_BS)  # max_bs * topk tokens
                spec_info = EagleDraftInput()
                for bs in CAPTURE_BS:
                    capture = forward_batch(ForwardMode.DECODE, [0] * bs, [1] * bs, 1, spec_info)
                    backend.init_forward_metadata_out_graph(capture, in_capture=True)
                for name, seq_lens in self.batches():
                    replay = forward_batch(ForwardMode.DECODE, range(1, MAX_BS + 1), seq_lens, 1, spec_info)
                    backend.init_forward_metadata_out_graph(replay)
                    for step, inner in enumerate(backend.attn_backends):
                        self.assert_reads_own_pages(
                            inner.decode_cuda_graph_metadata[MAX_BS],
                            pool,
                            page_size,
                            seq_lens,
                            step + 1,
                            f"draft step {step} page {page_size} {name}",
                        )

    @unittest.skipUnless(KERNEL_RUNS, "needs CUDA (or TRITON_INTERPRET=1) for the Triton kernel")
    def test_reference_matches_kernel(self):
        kernel = flashattention_backend.normal_decode_set_metadata
        req_to_token = torch.randint(0, 1 << 20, (5, 40), dtype=torch.int32, device=DEVICE)
        # Rows 0 and 1 fit the 8-wide view; the last one asks for up to 41 pages, so with
        # max_seq_pages 36 the kernel writes past its row (into memory no other row writes).
        seq_lens = torch.tensor([3, 2, 37], dtype=torch.int64, device=DEVICE)
        idx = torch.tensor([4, 1, 2], dtype=torch.int64, device=DEVICE)
        for page_size, delta, max_pages, zero_tail in (
            (1, 4, 36, False),
            (1, 4, 8, True),
            (16, 2, 2, False),
            (16, 3, 3, True),
        ):
            with self.subTest(page_size=page_size, max_pages=max_pages, zero_tail=zero_tail):
                if zero_tail and "zero_tail" not in inspect.signature(kernel).parameters:
                    self.skipTest("this kernel has no zero_tail")
                outs = []
                for fn in (kernel, normal_decode_set_metadata_torch):
                    # A 3-row view of a 12 x 8 buffer of -1: what lands past the view shows.
                    buffer = torch.full((12, 8), -1, dtype=torch.int32, device=DEVICE)
                    lens = torch.zeros(3, dtype=torch.int32, device=DEVICE)
                    cu = torch.zeros(4, dtype=torch.int32, device=DEVICE)
                    args = (lens, cu, buffer[:3], req_to_token, idx, max_pages, seq_lens, delta)
                    fn(*args, page_size, **({"zero_tail": True} if zero_tail else {}))
                    outs.append((lens.tolist(), cu.tolist(), buffer.tolist()))
                self.assertEqual(outs[0], outs[1])
                if max_pages > 8:  # the kernel did write past the view's last row
                    self.assertNotEqual(outs[0][2][3], [-1] * 8)


if __name__ == "__main__":
    unittest.main()
