"""sglang's attention backends driven through CUDA-graph capture and replay on CPU (test_watch.py).

Each backend is the real class of the installed sglang, built with ``__new__`` and the attributes
its ``__init__`` would set for a small decoder (as ``proof.replay`` builds the DSA backend), over a
real ``ReqToTokenPool``. Capture and replay go through ``init_forward_metadata_out_graph``, the
decode cuda-graph runner's entry (0.5.14 decode_cuda_graph_runner.py:772 capture, :950 replay),
with the replay view built by the runner's own ``build_replay_fb_view`` (:116-160). The Triton
kernels that fill the graph buffers are sglang's, run by Triton's interpreter.

Stand-ins, only where the real thing needs a GPU:
- flashinfer's wrappers (the package is not installed here): they keep the buffers they are
  given; a plan in cuda-graph mode copies the kv indices it is handed into its kv_indices buffer,
  as flashinfer's plan does (prefill: ValueError past the buffer's length; MLA: the
  ``buf[:len(kv_indices)].copy_`` that raises on a shorter slice). Decode plans are recorded only.
- ``sgl_kernel.flash_mla`` (FlashMLA's import): ``get_mla_metadata`` returns zero tensors of the
  shapes FlashMLA copies into its graph buffers; the kernel is never called.
- init_cuda_graph_state, where it allocates on "cuda" (flashinfer, flashinfer MLA, FlashMLA,
  TRT-LLM MLA's parent): the same buffers, sized by the cited lines, on CPU.

A narrowed buffer is the same buffer made smaller than sglang sizes it. The fill kernels do not
all stop at a buffer's end: flat buffers get the sum of the lengths, and the TRT-LLM MHA, FlashMLA
and TRT-LLM MLA table kernels mask by the request's own page count, not the row width (0.5.14
triton_ops/trtllm_mha_page_table.py:38-93, triton_ops/kv_indices.py:99-146). So every buffer a
replay here can overrun, narrowed or at sglang's size, is ``guarded``: a view of a larger
allocation, so that what a kernel writes past its end lands in owned memory, where a test reads it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import SimpleNamespace

import torch

# The FA3 backend, the runners' batches and the guarded buffer live in the product's proof
# package (the demo drives them too); the tests use these names.
from sglang_dsa_fix.proof.fa3_backend import (  # noqa: F401
    FA3,
    Fields,
    PlainTranslator,
    capture_fields,
    draft_input,
    draft_replay_batch,
    fa3_draft_backend,
    fa3_release_backend,
    import_fa3,
    import_fa3_file,
    import_over_stand_in,
    init_assignment,
    replay_view,
    req_to_token_pool,
    verify_input,
)
from sglang_dsa_fix.proof.fa3_backend import mode as _mode
from sglang_dsa_fix.proof.fa3_replay import guarded

ATTENTION = "sglang.srt.layers.attention"
MAX_BS = 2


def past_the_end(buffer) -> torch.Tensor:
    """The owned memory just past a ``guarded`` buffer: the spare row, or the flat remainder."""
    base = buffer._base
    return base[buffer.shape[0] :]


def capture(backend, mode: str, bs: int, tokens_per_req: int, spec_info=None) -> None:
    """Capture-time metadata for (mode, bs) as the runner builds it: seq_lens at the fill value 1,
    pool row 0 (decode_cuda_graph_runner.py:673-680, :760-772)."""
    seq_lens = torch.ones(bs, dtype=torch.int64)
    fb = SimpleNamespace(
        batch_size=bs,
        forward_mode=_mode(mode),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=bs,
        positions=torch.zeros(bs * tokens_per_req, dtype=torch.int64),
        encoder_lens=None,
        out_cache_loc=None,
        spec_info=spec_info,
    )
    backend.init_forward_metadata_out_graph(fb, in_capture=True)


def replay(backend, mode: str, seq_lens: list, tokens_per_req: int, spec_info=None, stale_host=None):
    """One replay update: batch row b is pool row b + 1 with seq_lens[b]; the view is
    build_replay_fb_view's over runner-like buffers. ``stale_host``: a batch that published no
    host lengths (spec-v2, needs_cpu_seq_lens off), so the runner's host buffer keeps these
    earlier values and seq_lens_sum is None (0.5.14 runner_utils/buffers.py:340-343)."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    bs = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    buffers = SimpleNamespace(
        input_ids=torch.zeros(bs * tokens_per_req, dtype=torch.int64),
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64),
        seq_lens=lens,
        seq_lens_cpu=lens.clone() if stale_host is None else torch.tensor(stale_host),
        encoder_lens=None,
    )
    total = int(lens.sum()) if stale_host is None else None
    batch = SimpleNamespace(forward_mode=_mode(mode), seq_lens_sum=total, spec_info=spec_info)
    view = build_replay_fb_view(batch, buffers, bs, bs, bs * tokens_per_req, 1, _mode(mode), False)
    backend.init_forward_metadata_out_graph(view)
    return view


# --------------------------------------------------------------------------------------------
# Stand-ins for flashinfer's wrappers.


class _Wrapper:
    """flashinfer wrapper in cuda-graph mode: keeps the buffers it was built with."""

    is_cuda_graph_enabled = True

    def __init__(self, *args, **kwargs):
        self.buffers = kwargs
        self.plans = []
        self._paged_kv_indices_buf = kwargs.get("paged_kv_indices_buffer", kwargs.get("paged_kv_indices_buf"))
        self._kv_indices_buf = kwargs.get("kv_indices")

    def begin_forward(self, *args, **kwargs):  # decode: the indices are already in the buffer
        self.plans.append(args)

    plan = begin_forward


class _PrefillWrapper(_Wrapper):
    def begin_forward(self, qo_indptr, kv_indptr, kv_indices, *args, **kwargs):
        # flashinfer prefill.py plan(), use_cuda_graph: refuses indices longer than the buffer,
        # else copies them to its start.
        if len(kv_indices) > len(self._paged_kv_indices_buf):
            raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
        self._paged_kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
        self.plans.append((qo_indptr, kv_indptr, kv_indices))


class _MlaWrapper(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, kv_indices, *args, **kwargs):
        # flashinfer mla.py plan(), use_cuda_graph: copies into buf[:len(kv_indices)] unchecked,
        # which raises when that slice is shorter.
        self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
        self.plans.append((qo_indptr, kv_indptr, kv_indices))


def _fast_plan(wrapper, *args, **kwargs):
    """sglang's fast_decode_plan / fast_mla_decode_plan call flashinfer's compiled planner."""
    wrapper.plans.append(args)


@contextlib.contextmanager
def patched(module, **names):
    saved = {name: module.__dict__.get(name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# --------------------------------------------------------------------------------------------
# Backends. Each returns (backend, stand-ins context): call capture / replay inside the context.


def triton_backend(context_len: int, D: int, kv_indices=None):
    """TritonAttnBackend (0.5.14 triton_backend.py:97-281), MHA, no sliding window; graph state
    from its own init_cuda_graph_state (:788-874), max_num_tokens = max_bs * D."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    pool = req_to_token_pool(context_len, D + 4)
    b = TritonAttnBackend.__new__(TritonAttnBackend)
    b.skip_prefill, b.sliding_window_size, b.use_sliding_window_kv_pool = False, None, False
    b.req_to_token_pool, b.req_to_token = pool, pool.req_to_token
    b.token_to_kv_pool = None
    b.num_draft_tokens, b.speculative_num_steps, b.topk = D, D - 1, 1
    b.use_mla, b.num_head, b.num_kv_head, b.v_head_dim, b.swa_v_head_dim = False, 1, 1, 8, None
    b.max_context_len, b.device, b.device_core_count = context_len, torch.device("cpu"), 0
    b.static_kv_splits, b.enable_deterministic, b.split_tile_size, b.max_kv_splits = True, False, None, 2
    b.kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32)
    b.window_kv_indptr = None
    b.qo_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64)
    b.mask_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64)
    b.forward_metadata, b.cuda_graph_custom_mask = None, None
    b.init_cuda_graph_state(MAX_BS, MAX_BS * D, kv_indices_buf=kv_indices)
    return b, contextlib.nullcontext()


def flashinfer_updaters(module, b, pool, **fields) -> None:
    """The decode and prefill indices updaters FlashInferAttnBackend.__init__ builds, over ``b``'s
    indptr buffers (``fields``: what a later release's updater also reads)."""
    for name in ("FlashInferIndicesUpdaterDecode", "FlashInferIndicesUpdaterPrefill"):
        updater = getattr(module, name).__new__(getattr(module, name))
        updater.num_qo_heads = updater.num_kv_heads = 1
        updater.head_dim, updater.data_type, updater.q_data_type = 8, torch.float16, torch.float16
        updater.sliding_window_size, updater.attn_backend = None, b
        updater.kv_indptr, updater.kv_last_page_len = b.kv_indptr, b.kv_last_page_len
        updater.qo_indptr, updater.req_to_token = b.qo_indptr, pool.req_to_token
        updater._swa_kv_pool, updater.prefill_wrapper_ragged = None, None
        updater.update = updater.update_single_wrapper
        for field, value in fields.items():
            setattr(updater, field, value)
        setattr(b, "indices_updater_" + ("decode" if "Decode" in name else "prefill"), updater)


def flashinfer_backend(context_len: int, D: int, kv_indices=None):
    """FlashInferAttnBackend (0.5.14 flashinfer_backend.py:294-480), one wrapper, with its real
    indices updaters; graph state as init_cuda_graph_state (:830-870) sizes it, on CPU."""
    module = importlib.import_module(f"{ATTENTION}.flashinfer_backend")
    pool = req_to_token_pool(context_len, D + 4)
    max_num_tokens = MAX_BS * D
    b = module.FlashInferAttnBackend.__new__(module.FlashInferAttnBackend)
    b.prefill_backend = b.decode_backend = "fa2"
    b.req_to_token_pool, b.token_to_kv_pool = pool, None
    b._swa_kv_pool, b.use_sliding_window_kv_pool = None, False
    b.max_context_len, b.skip_prefill, b.is_multimodal = context_len, False, False
    b.num_wrappers, b.dispatch_reason, b.decode_use_tensor_cores = 1, None, False
    b.disable_cuda_graph_kv_split, b.workspace_buffer = False, None
    b.kv_indptr = [torch.zeros(MAX_BS + 1, dtype=torch.int32)]
    b.kv_last_page_len = torch.ones(MAX_BS, dtype=torch.int32)
    b.qo_indptr = [torch.zeros(MAX_BS + 1, dtype=torch.int32)]
    b.prefill_wrapper_ragged = None
    b.forward_metadata = None
    b.decode_cuda_graph_metadata, b.prefill_cuda_graph_metadata = {}, {}
    b.draft_extend_cuda_graph_metadata = {}
    flashinfer_updaters(module, b, pool)
    if kv_indices is None:
        kv_indices = torch.zeros(max_num_tokens * context_len, dtype=torch.int32)
    b.cuda_graph_kv_indices = [kv_indices]
    b.cuda_graph_swa_out_cache_loc = None
    b.cuda_graph_custom_mask = torch.zeros(max_num_tokens * context_len, dtype=torch.uint8)
    b.cuda_graph_qk_indptr = [x.clone() for x in b.kv_indptr]
    b.cuda_graph_qo_indptr = [x.clone() for x in b.kv_indptr]
    stand_ins = patched(
        module,
        BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
        BatchPrefillWithPagedKVCacheWrapper=_PrefillWrapper,
        fast_decode_plan=_fast_plan,
    )
    return b, stand_ins


def _mla_updater(cls, backend, pool):
    updater = cls.__new__(cls)
    updater.num_local_heads, updater.kv_lora_rank = 1, 8
    updater.qk_nope_head_dim = updater.qk_rope_head_dim = updater.v_head_dim = 8
    updater.scaling, updater.data_type, updater.q_data_type = 1.0, torch.float16, torch.float16
    updater.attn_backend, updater.req_to_token = backend, pool.req_to_token
    updater.kv_indptr, updater.qo_indptr = backend.kv_indptr, backend.qo_indptr
    updater.q_indptr, updater.prefill_wrapper_ragged = backend.q_indptr_decode, None
    return updater


def _mla_common(b, module, pool, context_len):
    """What FlashInferMLAAttnBackend.__init__ sets (0.5.14 flashinfer_mla_backend.py:203-299)."""
    b.max_context_len, b.device = context_len, torch.device("cpu")
    b.skip_prefill, b.enable_chunk_kv = False, False
    b.req_to_token_pool, b.token_to_kv_pool, b.page_size = pool, None, 1
    b.workspace_buffer = None
    b.kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32)
    b.qo_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int32)
    b.q_indptr_decode = torch.arange(0, MAX_BS + 1, dtype=torch.int32)
    b.prefill_wrapper_ragged = None
    b.indices_updater_prefill = _mla_updater(module.FlashInferMLAIndicesUpdaterPrefill, b, pool)
    b.indices_updater_decode = _mla_updater(module.FlashInferMLAIndicesUpdaterDecode, b, pool)
    b.forward_metadata = None
    b.decode_cuda_graph_metadata, b.prefill_cuda_graph_metadata = {}, {}


def flashinfer_mla_backend(context_len: int, D: int, kv_indices=None):
    """FlashInferMLAAttnBackend with its real updaters; its own init_cuda_graph_state (0.5.14
    flashinfer_mla_backend.py:418-447) given the max_bs * max_context_len buffer on CPU. Decode
    capture allocates on "cuda" (:680-700): only target_verify runs here."""
    module = importlib.import_module(f"{ATTENTION}.flashinfer_mla_backend")
    pool = req_to_token_pool(context_len, D + 4)
    b = module.FlashInferMLAAttnBackend.__new__(module.FlashInferMLAAttnBackend)
    _mla_common(b, module, pool, context_len)
    if kv_indices is None:
        kv_indices = torch.zeros(MAX_BS * context_len, dtype=torch.int32)
    b.init_cuda_graph_state(MAX_BS, MAX_BS * D, kv_indices_buf=kv_indices)
    return b, patched(module, BatchMLAPagedAttentionWrapper=_MlaWrapper, fast_mla_decode_plan=_fast_plan)


def trtllm_mla_backend(context_len: int, D: int, page: int = 64, width=None):
    """TRTLLMMLABackend (0.5.14 trtllm_mla_backend.py:134-207) over the flashinfer MLA parent; its
    own init_cuda_graph_state (:275-329), the parent's flat buffer given on CPU. ``width``
    narrows the block table [max_bs, _calc_padded_blocks(C)] (:283-286)."""
    module = importlib.import_module(f"{ATTENTION}.trtllm_mla_backend")
    parent = importlib.import_module(f"{ATTENTION}.flashinfer_mla_backend")
    pool = req_to_token_pool(context_len, D + 4 + page, page)
    b = module.TRTLLMMLABackend.__new__(module.TRTLLMMLABackend)
    _mla_common(b, parent, pool, context_len)
    b.num_q_heads = b.num_kv_heads = b.num_local_heads = 1
    b.kv_lora_rank, b.qk_rope_head_dim, b.kv_cache_dim = 8, 8, 16
    b.data_type = b.q_data_type = torch.bfloat16
    b.page_size, b.req_to_token = page, pool.req_to_token
    b.decode_cuda_graph_metadata, b.forward_decode_metadata = {}, None
    b.num_draft_tokens, b.cuda_graph_custom_mask = D, None
    b.init_cuda_graph_state(MAX_BS, MAX_BS * D, torch.zeros(MAX_BS * context_len, dtype=torch.int32))
    full = b.decode_cuda_graph_kv_indices.shape[1]
    b.decode_cuda_graph_kv_indices = guarded((MAX_BS, full if width is None else width), fill=-1)
    return b, contextlib.nullcontext()


def trtllm_mha_backend(context_len: int, D: int, page: int = 16, width=None):
    """TRTLLMHAAttnBackend (0.5.14 trtllm_mha_backend.py:78-160), no SWA, EAGLE topk 1; its own
    init_cuda_graph_state (:302-392). ``width`` narrows the target_verify page_table."""
    module = importlib.import_module(f"{ATTENTION}.trtllm_mha_backend")
    pool = req_to_token_pool(context_len, D + 4 + page, page)
    b = module.TRTLLMHAAttnBackend.__new__(module.TRTLLMHAAttnBackend)
    b.max_context_len, b.page_size, b.device = context_len, page, torch.device("cpu")
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b._swa_kv_pool, b.use_sliding_window_kv_pool = None, False
    b.decode_cuda_graph_metadata, b.target_verify_metadata, b.forward_metadata = {}, {}, None
    b.topk, b.speculative_step_id, b.speculative_num_draft_tokens = 1, 0, D
    b.max_num_pages = (context_len + page - 1) // page
    b.init_cuda_graph_state(MAX_BS, MAX_BS * D)
    table = guarded((MAX_BS, b.max_num_pages if width is None else width))
    b.target_verify_metadata["page_table"] = table
    return b, contextlib.nullcontext()


def verify_table(backend):
    """The graph table a target_verify replay fills (TRT-LLM MHA, TRT-LLM MLA, FlashMLA)."""
    if hasattr(backend, "target_verify_metadata"):
        return backend.target_verify_metadata["page_table"]
    if hasattr(backend, "decode_cuda_graph_kv_indices"):
        return backend.decode_cuda_graph_kv_indices
    return backend.cuda_graph_kv_indices


FLASHMLA = f"{ATTENTION}.flashmla_backend"


def import_flashmla():
    """flashmla_backend over a stand-in sgl_kernel.flash_mla (its kernel and metadata planner)."""
    return import_over_stand_in(
        FLASHMLA,
        {"sgl_kernel": (), "sgl_kernel.flash_mla": ("flash_mla_with_kvcache", "get_mla_metadata")},
    )


def fa3_backend(context_len: int, D: int, page: int = 64):
    """FlashAttentionBackend (0.5.14 flashattention_backend.py:118-240) as __init__ leaves it for a
    decoder-only MHA model, FA3, EAGLE topk 1; graph state from its own init_cuda_graph_state
    (:1600-1700): target_verify page_table [max_bs, ceil(C / page)]."""
    module = sys.modules[FA3]  # import_fa3() first
    pool = req_to_token_pool(context_len, D + 4 + page, page)
    b = module.FlashAttentionBackend.__new__(module.FlashAttentionBackend)
    b.device, b.max_context_len, b.page_size = torch.device("cpu"), context_len, page
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b.use_mla = b.is_encoder_decoder = b.has_local_attention = False
    b.use_sliding_window_kv_pool = b.has_swa = b.skip_prefill = b.is_draft_runner = False
    b.sliding_window_size = b.local_attn_builder = b._get_scheduler_metadata = None
    b.topk, b.speculative_num_draft_tokens, b.speculative_num_steps, b.speculative_step_id = 1, D, D - 1, 0
    b.fa_impl_ver, b.attn_cp_size, b.num_splits = 3, 1, 0
    b.forward_metadata = b.forward_metadata_spec_decode_expand = None
    b.decode_cuda_graph_metadata, b.target_verify_metadata, b.draft_extend_metadata = {}, {}, {}
    b.init_cuda_graph_state(MAX_BS, MAX_BS * D)
    return b, contextlib.nullcontext()


def _mla_metadata(seq_lens, num_heads, num_heads_k, is_fp8_kvcache=False):
    """get_mla_metadata's shapes: [num_sm_parts, 8] scheduling metadata, [bs + 1] splits."""
    return torch.zeros((1, 8), dtype=torch.int32), torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)


def flashmla_backend(context_len: int, D: int, width=None):
    """FlashMLABackend (0.5.14 flashmla_backend.py:51-89) over the flashinfer MLA parent; graph
    state as init_cuda_graph_state (:180-211) sizes it: block table [max_bs, (C + 64) // 64]."""
    module = sys.modules[FLASHMLA]  # import_flashmla() first
    parent = importlib.import_module(f"{ATTENTION}.flashinfer_mla_backend")
    pool = req_to_token_pool(context_len, D + 4 + module.PAGE_SIZE, module.PAGE_SIZE)
    b = module.FlashMLABackend.__new__(module.FlashMLABackend)
    _mla_common(b, parent, pool, context_len)
    b.num_q_heads = b.num_local_heads = 1
    b.req_to_token, b.is_fp8_kvcache, b.num_draft_tokens = pool.req_to_token, False, D
    pages = width if width is not None else (context_len + module.PAGE_SIZE) // module.PAGE_SIZE
    b.cuda_graph_kv_indices = guarded((MAX_BS, pages), fill=1)
    b.cuda_graph_mla_metadata = torch.empty((1, 8), dtype=torch.int32)
    b.cuda_graph_num_splits = torch.empty(MAX_BS + 1, dtype=torch.int32)
    b.cuda_graph_mla_metadata_view = b.cuda_graph_num_splits_view = None
    return b, patched(module, get_mla_metadata=_mla_metadata)


# --------------------------------------------------------------------------------------------
# FA3 on any release (0.5.14, 0.5.17, 0.5.23): bug #3's CPU proof (test/srt/test_fa3_cuda_graph.py);
# the backend and the runners' batches are proof.fa3_backend's.


def import_fa3_patched(case, name: str):
    """For a test class's ``setUpClass``: the release's flashattention_backend.py located by
    ``fa3_sites`` (``case.site``), its in-tree change written to a temporary copy and executed as
    the module ``name`` (``case.module``); every cleanup registered on ``case``."""
    import tempfile
    from pathlib import Path

    from sglang_dsa_fix.members.fa3 import sites as fa3_sites

    case.addClassCleanup(import_fa3())
    source = Path(sys.modules[FA3].__file__)
    case.site = fa3_sites.locate(source.read_bytes(), source)
    tmp = tempfile.TemporaryDirectory()
    case.addClassCleanup(tmp.cleanup)
    path = Path(tmp.name) / source.name
    path.write_bytes(case.site.patched_bytes())
    case.module, undo = import_fa3_file(path, name)
    case.addClassCleanup(undo)
