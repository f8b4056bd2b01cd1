"""Probe: FA3 (FlashAttentionBackend) TARGET_VERIFY CUDA-graph metadata near context_len.

Drives sglang's REAL FlashAttentionBackend graph-metadata code on CPU:
  init_cuda_graph_state(max_bs, max_bs * D)
  init_forward_metadata_out_graph(fb, in_capture=True)     # capture
  init_forward_metadata_out_graph(fb_view)                 # replay
which is what the decode cuda-graph runner calls (0.5.14
model_executor/runner/decode_cuda_graph_runner.py:772 capture, :950 replay; the replay view has
the fields of build_replay_fb_view, same file :116-160).

Nothing of sglang is copied here. The one stand-in is the CUDA-only `sgl_kernel` wheel, imported
at module top only for `merge_state_v2` (flashattention_backend.py 0.5.14:34, 0.5.23:62): a module
whose function raises if called (the metadata paths never call it). The FA3 kernel itself is not
run. Triton metadata kernels (0.5.23 `normal_decode_set_metadata`, 0.5.14 draft decode) are the
real kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set below before import).

From the buffers a replay leaves, the probe then lists what the FA3 paged-KV kernel reads: for
batch row b it reads page_table[b, j] for j < ceil(cache_seqlens[b] / page_size), addressed as
flat element b * page_table.stride(0) + j of the [max_bs, W] buffer, with no check against W
(flash-attention hopper/paged_kv.h, PagedKVManager::load_page_table).

usage:  python upstream/fa3_target_verify_probe.py                          (the installed sglang)
        PYTHONPATH=.matrix/sglang-0.5.23 python upstream/fa3_target_verify_probe.py
"""

from __future__ import annotations

import math
import os
import sys
import types
import warnings
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # real Triton kernels, CPU interpreter
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def _install_sgl_kernel_stand_in():
    if "sgl_kernel" in sys.modules:
        return
    mod = types.ModuleType("sgl_kernel")

    def merge_state_v2(*args, **kwargs):  # only topk>1 cascade attention calls it
        raise RuntimeError("sgl_kernel.merge_state_v2 stand-in called (CUDA-only)")

    mod.merge_state_v2 = merge_state_v2
    sys.modules["sgl_kernel"] = mod


_install_sgl_kernel_stand_in()

import sglang  # noqa: E402
from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402

VERSION = sglang.__version__
MAX_BS = 4
SHORT = 100  # seq_len of the other requests in the batch


class CopyLog(TorchDispatchMode):
    """Records (dst shape, src shape) of every 2-D aten copy_ issued while active."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].dim() == 2:
            self.copies.append((list(args[0].shape), list(args[1].shape)))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- setup
def row_width(C, D, page):
    """req_to_token row width for EAGLE topk 1: C + 4 + D at page 1 (0.5.14
    mem_cache/common.py:251-267, 0.5.23 mem_cache/allocation_sizing.py:96-117). At page > 1
    0.5.23 may widen it; we use a generous C + 2D + page + 4. Any width >= C gives the same FA3
    graph metadata: the backend never gathers past ceil(C / page) pages (see the results)."""
    return C + 4 + D if page == 1 else C + 2 * D + page + 4


def make_pool(C, D, page):
    """Real ReqToTokenPool. Slot id of (pool row r, column c) is chosen so that its page index
    is r * pages_per_row + c // page: every page index read back names its owner row/column."""
    pool = ReqToTokenPool(
        size=MAX_BS, max_context_len=row_width(C, D, page), device="cpu", enable_memory_saver=False
    )
    rows, cols = pool.req_to_token.shape
    ppr = math.ceil(cols / page)
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    pool.req_to_token.copy_(((r * ppr + c // page) * page + c % page).to(pool.req_to_token.dtype))
    return pool, ppr


class _PlainTranslator:
    """0.5.23 kv_index_translator of an ordinary (not unified-memory) pool."""

    is_translating = False
    reads_are_translated = False


def make_backend(C, D, page, pool, step_id=0):
    """FlashAttentionBackend as __init__ would leave it for a decoder-only MHA model, FA3, EAGLE
    topk 1, no SWA / local attention / encoder (0.5.14 flashattention_backend.py:118-240;
    0.5.23 adds max_num_pages :196-198, needs_cpu_seq_lens, kv_index_translator)."""
    b = FlashAttentionBackend.__new__(FlashAttentionBackend)
    b.device = torch.device("cpu")
    b.max_context_len = C
    b.page_size = page
    b.req_to_token_pool = pool
    b.req_to_token = pool.req_to_token
    b.token_to_kv_pool = None
    b.use_mla = False
    b.is_encoder_decoder = False
    b.has_local_attention = False
    b.use_sliding_window_kv_pool = False
    b.has_swa = False
    b.sliding_window_size = None
    b.topk = 1
    b.speculative_num_draft_tokens = D
    b.speculative_num_steps = D - 1
    b.speculative_step_id = step_id
    b.fa_impl_ver = 3
    b._get_scheduler_metadata = None  # sgl_kernel get_scheduler_metadata: normal decode only
    b.forward_metadata = None
    b.forward_metadata_spec_decode_expand = None
    b.decode_cuda_graph_metadata = {}
    b.target_verify_metadata = {}
    b.draft_extend_metadata = {}
    b.skip_prefill = False
    b.attn_cp_size = 1
    b.num_splits = 0
    b.max_num_pages = (C + page - 1) // page
    b.needs_cpu_seq_lens = False
    b.kv_index_translator = _PlainTranslator()
    b.is_draft_runner = False
    b.local_attn_builder = None
    b._decode_uses_static_max_seqlen_k = False
    return b


def batch(mode, bs, seq_lens, req_pool_indices, tokens_per_req, spec_info):
    n = bs * tokens_per_req
    return SimpleNamespace(
        batch_size=bs,
        forward_mode=mode,
        actual_forward_mode=mode,
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.clone(),
        num_padding=0,
        encoder_lens=None,
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        spec_info=spec_info,
        kv_loc_plan=None,
    )


# ----------------------------------------------------------------------------- target verify
class VerifySession:
    """One target-verify graph state; capture bs 2 and 4, replay on demand."""

    def __init__(self, C, D, page):
        self.C, self.D, self.page = C, D, page
        self.pool, self.ppr = make_pool(C, D, page)
        self.be = make_backend(C, D, page, self.pool)
        self.be.init_cuda_graph_state(MAX_BS, MAX_BS * D)
        self.buffer = self.be.target_verify_metadata["page_table"]
        fill = self.be.get_cuda_graph_seq_len_fill_value()
        for bs in (2, MAX_BS):  # like the runner: seq_lens = fill value, pool index 0
            cap = batch(
                ForwardMode.TARGET_VERIFY,
                bs,
                torch.full((bs,), fill, dtype=torch.int64),
                torch.zeros(bs, dtype=torch.int64),
                D,
                None,
            )
            self.be.init_forward_metadata_out_graph(cap, in_capture=True)

    def replay(self, seq_lens):
        bs = len(seq_lens)
        idx = torch.arange(1, bs + 1, dtype=torch.int64)  # batch row b is pool row b + 1
        fb = batch(
            ForwardMode.TARGET_VERIFY, bs, torch.tensor(seq_lens, dtype=torch.int64), idx, self.D, None
        )
        log, err = CopyLog(), None
        try:
            with log:
                self.be.init_forward_metadata_out_graph(fb)
        except Exception as e:  # noqa: BLE001 - report what the real code raises
            err = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return self.be.target_verify_metadata[bs], idx, log.copies, err

    def reads(self, md, idx, b):
        """(needed pages, own pages read correctly, list of wrong reads) for batch row b."""
        flat = self.buffer.reshape(-1)
        stride0, width = md.page_table.stride(0), md.page_table.shape[1]
        need = -(-int(md.cache_seqlens_int32[b]) // self.page)
        own_row, good, wrong = int(idx[b]), 0, []
        for j in range(need):
            k = b * stride0 + j
            if k >= flat.numel():
                wrong.append("past-alloc")
                continue
            row, col = divmod(int(flat[k]), self.ppr)
            if j < width and row == own_row and col == j:
                good += 1
            else:  # an entry of buffer row k // stride0, i.e. another request's pages
                wrong.append(f"bufrow{k // stride0}:pool{row}[{col}]")
        return need, good, wrong


def summarize(wrong):
    if not wrong:
        return "none"
    if all(w == "past-alloc" for w in wrong):
        return f"{len(wrong)} past the buffer's allocation"
    first, last = wrong[0], wrong[-1]
    return f"{len(wrong)} = {first} .. {last}"


def verify_table(cases):
    print(
        "\n## TARGET_VERIFY graph replay, EAGLE topk 1, max_bs 4 "
        "(other requests seq_len 100; batch row b = pool row b+1)"
    )
    print(
        "C | page | D | seq_len | cache_seqlens | W_pt pages | pages FA3 reads | page_table copy "
        "(dst <- src) | replay error | wrong entries read: middle row (bs 4, row 1) | "
        "last row, bs = max_bs (row 3) | last row, bs 2 < max_bs (row 1), after a bs-4 replay | "
        "query positions seeing wrong keys"
    )
    for C, page, D in cases:
        ses = VerifySession(C, D, page)
        for name, s in (("C+D-4", C + D - 4), ("C", C), ("C-1", C - 1), ("C-3", C - 3)):
            md, idx, copies, err = ses.replay([SHORT, s, SHORT, SHORT])
            need, good, wrong_mid = ses.reads(md, idx, 1)
            md, idx, _, _ = ses.replay([SHORT, SHORT, SHORT, s])
            _, _, wrong_last = ses.reads(md, idx, 3)
            ses.replay([s] * 4)  # leaves pool rows 1..4 in buffer rows 0..3
            md, idx, _, _ = ses.replay([SHORT, s])
            _, _, wrong_stale = ses.reads(md, idx, 1)
            width = md.page_table.shape[1]
            first_bad = width * page
            q = f"[{first_bad}, {s + D - 1}] ({s + D - first_bad})" if s + D > first_bad else "none"
            cp = ", ".join(f"{d}<-{src}" for d, src in copies) or "Triton kernel (no aten copy)"
            print(
                " | ".join(
                    str(x)
                    for x in (
                        C,
                        page,
                        D,
                        f"{s} ({name})",
                        s + D,
                        width,
                        need,
                        cp,
                        err or "none",
                        summarize(wrong_mid),
                        summarize(wrong_last),
                        summarize(wrong_stale),
                        q,
                    )
                )
            )


# ----------------------------------------------------------------------------- draft decode
def draft_decode_table(C, D, page):
    """Side check: the per-step draft-decode backends (topk 1) of the same multi-step draft run
    with seq_lens = the verify's seq_lens and read seq_len + step_id + 1 keys."""
    print(f"\n## DRAFT DECODE graph replay (multi-step draft, topk 1), C {C}, page {page}, D {D}")
    print("seq_len | step_id | cache_seqlens | W_pt pages | pages read | replay result")
    pool, ppr = make_pool(C, D, page)
    # FlashAttentionMultiStepBackend holds num_steps - 1 = D - 2 step backends
    # (0.5.14 flashattention_backend.py:2760-2790), step_id 0 .. D - 3.
    for s in (C - 4, C - 3, C, C + D - 4):
        for step in range(D - 2):
            be = make_backend(C, D, page, pool, step_id=step)
            be.init_cuda_graph_state(MAX_BS, MAX_BS)
            spec = EagleDraftInput()
            cap = batch(
                ForwardMode.DECODE,
                MAX_BS,
                torch.ones(MAX_BS, dtype=torch.int64),
                torch.zeros(MAX_BS, dtype=torch.int64),
                1,
                spec,
            )
            try:
                be.init_forward_metadata_out_graph(cap, in_capture=True)
                fb = batch(
                    ForwardMode.DECODE,
                    MAX_BS,
                    torch.tensor([SHORT, s, SHORT, SHORT], dtype=torch.int64),
                    torch.arange(1, MAX_BS + 1, dtype=torch.int64),
                    1,
                    spec,
                )
                be.init_forward_metadata_out_graph(fb)
                md = be.decode_cuda_graph_metadata[MAX_BS]
                cs = int(md.cache_seqlens_int32[1])
                res = "no error (silent)"
            except Exception as e:  # noqa: BLE001
                cs, md = s + step + 1, None
                res = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            width = be.decode_cuda_graph_metadata["page_table_draft_decode"].shape[1]
            print(f"{s} | {step} | {cs} | {width} | {-(-cs // page)} | {res}")


def main():
    print(
        f"sglang {VERSION} ({os.path.dirname(sglang.__file__)}), torch {torch.__version__}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    )
    cases = [(256, 1, 4), (256, 1, 8), (256, 16, 8), (250, 16, 8), (256, 64, 8), (250, 64, 8)]
    verify_table(cases)
    draft_decode_table(256, 8, 1)


if __name__ == "__main__":
    main()
