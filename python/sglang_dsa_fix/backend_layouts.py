"""Per release, where the attention backends the fixes change live: modules, classes, width expressions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Bug #1, the DSA/NSA attention backend, found by layout:
# - 0.5.13+: layers/attention/dsa_backend.py, class DeepseekSparseAttnBackend
#   (0.5.13 - 0.5.20 also ship nsa_backend.py as a re-export shim: skipped, it has no class body);
# - 0.5.3 - 0.5.12: layers/attention/nsa_backend.py, class NativeSparseAttnBackend.
ATTENTION_DIR = "srt/layers/attention"


@dataclass(frozen=True)
class BackendLayout:
    module: str  # dotted module name
    class_name: str
    multi_step_class_name: str

    @property
    def relative_path(self) -> str:
        """Path under ``sglang/``."""
        return f"{ATTENTION_DIR}/{self.module.rsplit('.', 1)[1]}.py"

    @property
    def hook_target(self) -> str:
        return f"{self.module}.{self.class_name}.init_cuda_graph_state"


# Newest first: the first layout whose file defines the class wins.
LAYOUTS = (
    BackendLayout(
        "sglang.srt.layers.attention.dsa_backend",
        "DeepseekSparseAttnBackend",
        "DeepseekSparseAttnMultiStepBackend",
    ),
    BackendLayout(
        "sglang.srt.layers.attention.nsa_backend",
        "NativeSparseAttnBackend",
        "NativeSparseAttnMultiStepBackend",
    ),
)

# The attention backends whose CUDA-graph page_table is bug #1's (sglang's --attention-backend names).
DSA_BACKENDS = ("dsa", "nsa")

# Bug #3: FlashAttentionBackend's graph page tables, the same file and class in every release
# 0.5.4 - 0.5.23 (init_cuda_graph_state; 0.5.15+ also bound by self.max_num_pages in __init__).
FA3_LAYOUT = BackendLayout(
    "sglang.srt.layers.attention.flashattention_backend",
    "FlashAttentionBackend",
    "FlashAttentionMultiStepBackend",
)
# The --attention-backend names that build it (0.5.23 layers/attention/attention_registry.py:238-274).
FA3_BACKENDS = ("fa3", "fa4")

# Bug #3's relatives: backends whose CUDA-graph table a verify near the context limit outgrows
# the same way (docs/graph-tables-other-backends.md measures each). Each sizes it from
# ``self.max_context_len`` in one expression form per backend, the same in every release that
# ships the file (0.5.4 - 0.5.23 read; MiniMax's file from 0.5.23). ``key`` is the bug's token.


ROW_WIDTH = "self.req_to_token.shape[1]"  # the row's width, as the backends hold it
# TRT-LLM MLA's and FlashMLA's verify tree mask (0.5.13 - 0.5.16): D * (C + D) cells a request.
VERIFY_MASK_EXPR = "max_num_tokens * (self.max_context_len + self.num_draft_tokens)"


@dataclass(frozen=True)
class GraphTableLayout:
    key: str  # verdicts.Bug value
    module: str
    classes: tuple  # (class name, the row's width as that class holds it)
    name: str  # in words
    width_exprs: tuple  # sglang's width expression(s), as ast.unparse writes them
    backends: tuple  # --attention-backend names that build it; () where the model picks it
    page_size: Optional[int] = None  # the page it forces (None: the deployment's)
    # "row": the longest request reads past its row of the table; "batch": flat buffers sized
    # per request, outgrown when every request of the largest batch is near the limit.
    reach: str = "row"
    # Where the eager path (CUDA graphs disabled) sizes the same buffer from context_len per
    # batch, in words; "" where only the graph buffers are: disabling graphs then avoids it.
    eager: str = ""
    # Width expressions added to ``width_exprs`` after an earlier sglang-dsa-fix shipped the
    # change without them: a file carrying every other edit and none of these holds that earlier
    # form (revert, then apply), not a hand edit.
    later: tuple = ()

    @property
    def relative_path(self) -> str:
        return f"{ATTENTION_DIR}/{self.module.rsplit('.', 1)[1]}.py"


GRAPH_TABLE_LAYOUTS = (
    # page_table [max_bs, max_num_pages]: a local in init_cuda_graph_state (0.5.4 :116, 0.5.13
    # :242), self.max_num_pages in __init__ from 0.5.14 (:144-146; 0.5.23 :351-353).
    GraphTableLayout(
        "trtllm_mha_page_table",
        "sglang.srt.layers.attention.trtllm_mha_backend",
        (("TRTLLMHAAttnBackend", ROW_WIDTH),),
        "TRT-LLM MHA",
        ("(self.max_context_len + self.page_size - 1) // self.page_size",),
        ("trtllm_mha",),
    ),
    # decode_cuda_graph_kv_indices [max_bs, _calc_padded_blocks(C)], sized in init_cuda_graph_state
    # and sliced at capture (0.5.4 :356, :412; 0.5.14 :283, :364; 0.5.23 :485, :584).
    # And 0.5.13 - 0.5.16's verify tree mask, max_num_tokens * (C + D) cells (0.5.13 :459, 0.5.14 /
    # 0.5.16 :324), which the spec-v2 worker hands to the FULL_MASK tree builder for every batch
    # (0.5.14 eagle_worker_v2.py:519-555): D * (s + D) cells a request, so every request of the
    # largest captured batch at s = C + D - 4 writes D cells past it from D 5 on. 0.5.17+ size it
    # QLEN_ONLY (is_read=False: 0.5.17 :439-447), D * D a request, no context length in it.
    GraphTableLayout(
        "trtllm_mla_kv_indices",
        "sglang.srt.layers.attention.trtllm_mla_backend",
        (("TRTLLMMLABackend", ROW_WIDTH),),
        "TRT-LLM MLA",
        (
            "self._calc_padded_blocks(self.max_context_len)",
            VERIFY_MASK_EXPR,
        ),
        ("trtllm_mla",),
        later=(VERIFY_MASK_EXPR,),
    ),
    # cuda_graph_kv_indices [max_bs, (C + 64) // 64] (0.5.4 :156, 0.5.14 :188, 0.5.23 :282).
    # And 0.5.16's verify tree mask, max_num_tokens * (C + D) cells (:291-295), TRT-LLM MLA's
    # (above) as the worker fills it (0.5.16 eagle_worker_common.py:346-380); QLEN_ONLY from
    # 0.5.17 (:291-299).
    GraphTableLayout(
        "flashmla_kv_indices",
        "sglang.srt.layers.attention.flashmla_backend",
        (("FlashMLABackend", ROW_WIDTH),),
        "FlashMLA",
        (
            "(self.max_context_len + PAGE_SIZE) // PAGE_SIZE",
            VERIFY_MASK_EXPR,
        ),
        ("flashmla",),
        page_size=64,
        later=(VERIFY_MASK_EXPR,),
    ),
    # The MSA decode plan's page_table [bs, ceil(max_seq_len / 128)], max_seq_len =
    # max_context_len on the graph path (0.5.23 minimax_sparse_nvfp4_backend.py:121-123, :213);
    # picked by the model (MiniMax sparse, NVFP4: attention_registry.py:375-380), not by a flag.
    GraphTableLayout(
        "minimax_nvfp4_page_table",
        "sglang.srt.layers.attention.minimax_sparse_nvfp4_backend",
        (("MiniMaxSparseNvfp4AttnBackend", ROW_WIDTH),),
        "MiniMax sparse NVFP4",
        ("max_seq_len=self.max_context_len",),
        (),
        page_size=128,
    ),
    # Triton: the verify's custom mask, max_num_tokens * C cells (0.5.4 triton_backend.py:466-467, 0.5.14
    # :838-843; the kv_indices beside it has the same expression and is widened with it), and from
    # 0.5.17 D * (C + D) per request through maybe_create_verify_mask (0.5.17 :1018, 0.5.23
    # :1241): a verify with every request at C + D - 4 needs D * (C + 2D - 4).
    # And the draft decode's kv_indices, one row of max_bs * topk * C entries per step (0.5.4
    # :1137, eager :1118; 0.5.14 draft_kv_indices_buffer_width :1528, eager :1507, the slice clamp
    # :1475; 0.5.23 :2763, :2718, :2588); step i writes sum(seq_len + i + 1). The draft class
    # holds the row's width as self.pool_len (0.5.4 :1070; 0.5.14 :1457).
    GraphTableLayout(
        "triton_kv_indices",
        "sglang.srt.layers.attention.triton_backend",
        (("TritonAttnBackend", ROW_WIDTH), ("TritonMultiStepDraftBackend", "self.pool_len")),
        "Triton",
        (
            "max_num_tokens * self.max_context_len",
            "max_context_len=self.max_context_len",
            "forward_batch.batch_size * self.topk * self.max_context_len",
            "num_seqs * self.max_context_len",
            "draft_kv_indices_buffer_width(max_bs, self.topk, self.max_context_len)",
            "draft_kv_indices_buffer_width(forward_batch.batch_size, self.topk, self.max_context_len)",
        ),
        ("triton",),
        reach="batch",
        eager="the eager draft decode's kv_indices, batch_size x topk x context_len "
        "(TritonMultiStepDraftBackend.init_forward_metadata)",
    ),
)
