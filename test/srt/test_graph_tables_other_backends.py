"""Issue 28 (bug #3's relatives): the other backends the family watch flags, on the real classes.

FA3's graph page tables are ceil(context_len / page) wide while a TARGET_VERIFY near the context
limit asks the kernel for seq_len + D keys (test_fa3_cuda_graph.py). The watch
(``sglang_dsa_fix.watch``) flags the same shape in TRT-LLM MHA, TRT-LLM MLA, FlashMLA and
flashinfer MLA. This module gives each a measured verdict on the installed release (run it under
0.5.14, 0.5.17 and 0.5.23 overlays; docs/graph-tables-other-backends.md has the numbers).

Driving: the release's own backend class, built with ``__new__`` and the attributes its
``__init__`` sets for a small model (the width expressions that ``__init__`` owns, e.g. TRT-LLM
MHA's ``max_num_pages``, are evaluated from the release's own source:
``graph_backends.init_assignment``); its own ``init_cuda_graph_state`` (where that allocates on
"cuda", with the module's ``torch`` swapped for one that allocates the same shapes on the host:
``host_torch``); then capture and replay as the decode / draft cuda-graph runners do them
(``init_forward_metadata_out_graph(in_capture=True)`` + ``init_forward_metadata_in_graph`` at
capture, the runner's ``build_replay_fb_view`` + the same two calls at replay; the in-graph call is
what a graph replay re-runs). The Triton table builders are sglang's, run by Triton's interpreter.
Stand-ins, only for GPU-only code: FlashMLA's ``get_mla_metadata`` / kernel import (zero tensors
of its output shapes; the kernel is never called) and flashinfer's MLA wrapper (keeps its buffers;
its plan copies ``kv_indices`` to ``buf[:len]``, as flashinfer's plan does in cuda-graph mode).

Measuring: right after ``init_cuda_graph_state`` the graph table the replay fills is swapped for a
same-shape, same-stride view of a larger allocation filled with a sentinel
(``graph_backends.guarded``), so a builder's writes past its end land in owned memory. What the
kernel reads is computed from the metadata it is handed and its addressing: batch row b reads
table entries j < ceil(kv_len[b] / page) at flat ``b * stride(0) + j`` with no check against the
width (TRT-LLM's trtllm-gen / XQA ``kvCachePageList[maxNbPagesPerSeq * idxReq + idxPage]`` for
``idxPage < divUp(seqLen, tokensPerPage)``; FlashMLA's ``block_table + b * batch_stride``); each
entry is classified as inside its own row (and equal to the request's own page id
``req_to_token[row, j * page] // page`` or not), in another row, or past the buffer's end.

Shapes: EAGLE topk 1, D 4 and 8, max_bs 4 captured and replayed at bs 4, the longest request in the
last row at ``width.verify_seq_len_bound`` (C + D - 4), the others at 100; the request pool's row
as wide as the release sizes it (``width.pristine_row_extra``). Context lengths: one where the
table is exactly full at C (the usual case: C a multiple of the page, of 4096 tokens for
TRT-LLM MLA) and, where the verdict depends on C, one where it is not.

Each "reads past" test asserts the pristine over-read exactly; the matching ``row_wide`` control
sizes the same tables from the request pool's row (in pages; the project's rule) and asserts no
read leaves its row: so the pristine assertions fail once upstream sizes its tables by the rule.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import os
import sys
import unittest
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import graph_backends as g
import torch

from sglang_dsa_fix import graph_tables, live_edit, width
from sglang_dsa_fix.members import graph_table
from sglang_dsa_fix.proof.replay import installed_form
from sglang_dsa_fix.verdicts import Bug

MAX_BS = 4
SHORT = 100  # seq_len of the other requests
DRAFTS = (4, 8)
SENTINEL = -7  # no page id is negative
FORM = installed_form()
ATTENTION = g.ATTENTION
REPORT: dict = {}  # SGLANG_DSA_FIX_OTHER_REPORT=<file>: the measured numbers, as JSON


def version() -> str:
    import sglang

    return sglang.__version__


def pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


def longest(C: int, D: int) -> int:
    return width.verify_seq_len_bound(C, D)


def last_row_batch(C: int, D: int) -> list:
    return [SHORT] * (MAX_BS - 1) + [longest(C, D)]


def pool_for(C: int, D: int, page: int):
    extra = width.pristine_row_extra(FORM, width.SpecShape(C, D, D - 1, 1, page))
    return g.req_to_token_pool(C, extra, page, MAX_BS)


@functools.cache
def plugin_form(module, bug: Bug, class_name: str = ""):
    """The backend class as the plugin runs it: a subclass whose methods that the in-tree change
    edits are those methods compiled from the patched file (``live_edit``, from the bytes
    ``apply`` writes: ``graph_tables.locate`` on the release's own file). ``class_name``: which
    of the layout's classes (default: its first)."""
    class_name = class_name or graph_tables.LAYOUTS[bug].classes[0][0]
    cls = getattr(module, class_name)
    path = Path(module.__file__)
    site = graph_tables.locate(bug, path.read_bytes(), path)
    assert site.edits and not site.patched_here, site
    methods = {m: f for (c, m), f in live_edit.patched_methods(site, module).items() if c == class_name}
    return type(cls.__name__, (cls,), methods)


def holds_rule(test, m, bug: Bug, pool, page: int) -> None:
    """The fixed table: as wide as the rule says (sglang's expression over req_to_token's row),
    every read inside the request's own row and equal to its own page ids, nothing written past."""
    test.assertEqual(
        m.width, graph_table.table_pages(graph_tables.LAYOUTS[bug], int(pool.req_to_token.shape[1]), page)
    )
    for row in m.rows:
        test.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
    test.assertEqual(m.writes_past_end, 0)


def importable(name: str) -> tuple:
    """(module or None, why not)."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # an ImportError, or a release whose import needs a GPU
        return None, f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------ host torch


class _HostCuda:
    """``torch.cuda`` as the graph-state code asks it: the SM count FlashMLA sizes by (H200: 132)."""

    def get_device_properties(self, *args, **kwargs):
        return SimpleNamespace(multi_processor_count=132)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _HostTorch:
    """The module's ``torch`` for one ``init_cuda_graph_state`` call: the same allocations (shape,
    dtype, fill) on the host where the code names ``device="cuda"``; everything else is torch."""

    cuda = _HostCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _host(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return call


for _name in ("zeros", "ones", "full", "empty", "arange"):
    setattr(_HostTorch, _name, staticmethod(_HostTorch._host(getattr(torch, _name))))


def host_torch(*modules):
    """Swap ``torch`` in these modules for ``_HostTorch`` (undone on exit)."""
    stack = contextlib.ExitStack()
    for module in modules:
        stack.enter_context(g.patched(module, torch=_HostTorch()))
    return stack


@contextlib.contextmanager
def parallel_defaults():
    """0.5.23's runtime context refuses to read ``dcp_enabled`` unless set: no DCP here. Releases
    without that field (0.5.14) refuse the override; they do not read it."""
    stack = contextlib.ExitStack()
    with stack:
        try:
            from sglang.srt.runtime_context import get_parallel

            stack.enter_context(get_parallel().override(dcp_enabled=False))
        except (ImportError, ValueError):
            pass
        yield


# ------------------------------------------------------------------------------------ measuring


@dataclass
class Row:
    pages: int  # entries the kernel reads: ceil(kv_len / page)
    own: int = 0  # inside its own buffer row
    right: int = 0  # inside its own row and the request's own page id
    neighbour: int = 0  # in another buffer row
    past: int = 0  # past the buffer's end
    past_right: int = 0  # past the end, and yet the request's own page id (a builder wrote it there)


@dataclass
class Measured:
    width: int  # the table's width in pages, as sglang sized it
    rows: list = field(default_factory=list)  # [Row] per batch row
    writes_past_end: int = 0  # cells the replay wrote past the buffer's end
    error: str = ""

    @property
    def last(self) -> Row:
        return self.rows[-1]


def record(name: str, m: Measured) -> Measured:
    last = m.last
    REPORT.setdefault(version(), {})[name] = {
        "width_pages": m.width,
        "last_row_pages_read": last.pages,
        "last_row_own_page_ids": last.right,
        "last_row_other_rows": last.neighbour,
        "last_row_past_end": last.past,
        "last_row_past_end_own_page_ids": last.past_right,
        "cells_written_past_end": m.writes_past_end,
        "other_rows_all_own": all(r.right == r.pages for r in m.rows[:-1]),
    }
    return m


def kernel_reads(table, view, kv_lens, page: int, r2t) -> Measured:
    """What the kernel reads for batch row b (pool row b + 1): entries j < ceil(kv_lens[b] / page)
    of ``view`` (the table the metadata hands it), flat ``b * view.stride(0) + j``, unchecked."""
    assert view.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    offset = view.storage_offset() - table.storage_offset()
    stride, cols, numel = view.stride(0), table.shape[1], table.numel()
    flat = table._base.reshape(-1)
    out = Measured(int(cols))
    for b, kv_len in enumerate(kv_lens):
        row = Row(pages(int(kv_len), page))
        for j in range(row.pages):
            k = offset + b * stride + j
            own_page = int(r2t[b + 1, j * page]) // page
            if k >= numel:
                row.past += 1
                row.past_right += k < flat.numel() and int(flat[k]) == own_page
            elif j >= cols:
                row.neighbour += 1
            else:
                row.own += 1
                row.right += int(flat[k]) == own_page
        out.rows.append(row)
    out.writes_past_end = int((flat[numel:] != SENTINEL).sum())
    return out


def guard(table):
    """The same table as a view of a larger allocation, filled with SENTINEL."""
    return g.guarded(tuple(table.shape), fill=SENTINEL, dtype=table.dtype)


def capture(backend, mode: str, bs: int, tokens: int, spec=None):
    fields = g.capture_fields(mode, bs, tokens, spec)
    backend.init_forward_metadata_out_graph(fields, in_capture=True)
    backend.init_forward_metadata_in_graph(fields)


def replay(backend, mode: str, seq_lens: list, tokens: int, spec=None):
    if mode == "DRAFT_DECODE":
        view = g.draft_replay_batch(seq_lens, spec)
    else:
        view = g.replay_view(mode, seq_lens, tokens, spec)
    backend.init_forward_metadata_out_graph(view)
    backend.init_forward_metadata_in_graph(view)
    return view


# ------------------------------------------------------------------------------------ TRT-LLM MHA

TRTLLM_MHA, _MHA_WHY = importable(f"{ATTENTION}.trtllm_mha_backend")


def trtllm_mha_step(pool, C: int, D: int, page: int, step: int = 0, row_wide: bool = False, cls=None):
    """TRTLLMHAAttnBackend (0.5.14 trtllm_mha_backend.py:78-160, 0.5.23 :192-440) for an MHA
    model, no SWA, EAGLE topk 1; ``max_num_pages`` is its ``__init__``'s own expression (0.5.14
    :144-146, 0.5.17 :193-195, 0.5.23 :351-353); ``row_wide``: the project's rule instead;
    ``cls``: the class to build (``plugin_form``'s)."""
    cls = cls or TRTLLM_MHA.TRTLLMHAAttnBackend
    b = cls.__new__(cls)
    b.max_context_len, b.page_size, b.device = C, page, torch.device("cpu")
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b._swa_kv_pool, b.use_sliding_window_kv_pool, b._swa_full_to_swa_mapping = None, False, None
    b.decode_cuda_graph_metadata, b.target_verify_metadata, b.forward_metadata = {}, {}, None
    b.topk, b.speculative_step_id, b.speculative_num_draft_tokens = 1, step, D
    b.expand_encoder_only_verify = False  # 0.5.17+
    b.kv_index_translator = g.PlainTranslator()  # 0.5.23
    b.max_num_pages = g.init_assignment(cls, "max_num_pages", b)
    if row_wide:
        b.max_num_pages = pages(int(pool.req_to_token.shape[1]), page)
    return b


def run_trtllm_mha(mode: str, C: int, D: int, page: int, row_wide: bool = False, fixed: bool = False) -> list:
    """[Measured] per step backend (one for the verify). ``fixed``: the plugin's form."""
    step_cls = plugin_form(TRTLLM_MHA, Bug.TRTLLM_MHA_PAGE_TABLE) if fixed else None
    pool = pool_for(C, D, page)
    seq_lens = last_row_batch(C, D)
    if mode == "TARGET_VERIFY":
        backend = trtllm_mha_step(pool, C, D, page, row_wide=row_wide, cls=step_cls)
        steps, key, spec, tokens = [backend], ("target_verify_metadata", "page_table"), None, D
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * D)
    else:  # the draft decode: TRTLLMHAAttnMultiStepDraftBackend, one step backend per step
        cls = TRTLLM_MHA.TRTLLMHAAttnMultiStepDraftBackend
        backend = cls.__new__(cls)
        backend.topk, backend.speculative_num_steps = 1, D - 1
        steps = [trtllm_mha_step(pool, C, D, page, i, row_wide, step_cls) for i in range(D - 2)]
        backend.attn_backends = steps
        key, spec, tokens = ("decode_cuda_graph_metadata", "page_table_draft_decode"), g.draft_input(), 1
        backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    tables = []
    for step in steps:
        metadata = getattr(step, key[0])
        metadata[key[1]] = guard(metadata[key[1]])
        tables.append(metadata[key[1]])
    capture(backend, "TARGET_VERIFY" if mode == "TARGET_VERIFY" else "DECODE", MAX_BS, tokens, spec)
    for table in tables:
        table._base.fill_(SENTINEL)
    replay(backend, mode, seq_lens, tokens, spec)
    out = []
    for step, table in zip(steps, tables):
        source = step.target_verify_metadata if mode == "TARGET_VERIFY" else step.decode_cuda_graph_metadata
        metadata = source[MAX_BS]
        out.append(
            kernel_reads(
                table, metadata.page_table, metadata.cache_seqlens_int32.tolist(), page, pool.req_to_token
            )
        )
    return out


def trtllm_mha_pages() -> tuple:
    """The page sizes the release lets TRT-LLM MHA run with: 16, 32, 64 (0.5.14 server_args.py:
    4638-4642), and 128 from 0.5.17 (arg_groups/overrides.py: 0.5.17 :2092, 0.5.23 :1183-1187).
    Read from the release's argument code."""
    import sglang

    root = Path(sglang.__file__).parent / "srt"
    texts = [
        p.read_text() for p in (root / "server_args.py", root / "arg_groups" / "overrides.py") if p.exists()
    ]
    with_128 = any("only supports page_size of 16, 32, 64 or 128" in text for text in texts)
    return (16, 32, 64, 128) if with_128 else (16, 32, 64)


def trtllm_mha_builder_clamps() -> bool:
    """0.5.17+ rebuild the graph tables with the fused ``update_trtllm_mha_graph_metadata``, which
    writes ``min(cdiv(seq_len, page), max_seq_pages)`` pages (0.5.17
    kernels/ops/kvcache/trtllm_mha_graph_metadata.py:80, 0.5.23 kernels/ops/attention/
    trtllm_mha_graph_metadata.py:86); 0.5.14's ``build_trtllm_mha_page_table``
    masks by the request's page count only (triton_ops/trtllm_mha_page_table.py:77, :85-86). Read
    from the file, not the version."""
    source = inspect.getsource(TRTLLM_MHA.TRTLLMHAAttnBackend._apply_cuda_graph_metadata)
    return "update_trtllm_mha_graph_metadata" in source


@unittest.skipUnless(TRTLLM_MHA is not None, f"trtllm_mha_backend does not import here: {_MHA_WHY}")
class TestTrtllmMha(unittest.TestCase):
    """page_table [max_bs, ceil(C / page)] (verify and draft decode); the kernel is told
    cache_seqlens = seq_len + D (verify), seq_len + step + 1 (draft decode). Reads past iff
    ceil((C + 2D - 4) / page) > ceil(C / page): every C that is a multiple of the page."""

    C = 256  # a multiple of every page size: the table is exactly full at C

    def test_verify_and_draft_decode_read_past_the_buffer(self):
        writes = not trtllm_mha_builder_clamps()
        for page in trtllm_mha_pages():
            for D in DRAFTS:
                for mode in ("TARGET_VERIFY", "DRAFT_DECODE"):
                    with self.subTest(page=page, D=D, mode=mode):
                        measured = run_trtllm_mha(mode, self.C, D, page)
                        s = longest(self.C, D)
                        for step, m in enumerate(measured):
                            record(f"trtllm_mha {mode} C {self.C} page {page} D {D} step {step}", m)
                            kv_len = s + D if mode == "TARGET_VERIFY" else s + step + 1
                            over = pages(kv_len, page) - pages(self.C, page)
                            self.assertEqual(m.width, pages(self.C, page))
                            self.assertGreater(over, 0)
                            self.assertEqual(m.last.pages, pages(kv_len, page))
                            for row in m.rows[:-1]:  # the short requests: all inside, all right
                                self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
                            self.assertEqual(m.last.right, m.width)
                            self.assertEqual((m.last.neighbour, m.last.past), (0, over))
                            # 0.5.14's builder writes the over-read pages past the buffer too (its
                            # own pages, in memory it does not own); 0.5.17+ clamp the write only.
                            self.assertEqual(m.writes_past_end, over if writes else 0)
                            self.assertEqual(m.last.past_right, over if writes else 0)

    def test_table_fits_when_C_leaves_room(self):
        # C 250, page 16: ceil(250 / 16) = 16 pages = 256 tokens. D 4: s + D = 254 fits; D 8: 262
        # does not: the verdict follows ceil((C + 2D - 4) / page) > ceil(C / page).
        C, page = 250, 16
        for D, past in ((4, 0), (8, 1)):
            with self.subTest(D=D):
                (m,) = run_trtllm_mha("TARGET_VERIFY", C, D, page)
                record(f"trtllm_mha TARGET_VERIFY C {C} page {page} D {D}", m)
                self.assertEqual((m.width, m.last.past), (16, past))

    def test_row_wide_tables_read_inside_their_rows(self):
        # The control: tables (and the builder's bound) as wide as req_to_token's row, in pages.
        for mode in ("TARGET_VERIFY", "DRAFT_DECODE"):
            for page, D in ((16, 8), (64, 4)):
                with self.subTest(mode=mode, page=page, D=D):
                    for m in run_trtllm_mha(mode, self.C, D, page, row_wide=True):
                        for row in m.rows:
                            self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
                        self.assertEqual(m.writes_past_end, 0)

    def test_fixed_tables_read_the_requests_own_pages(self):
        # The fix (the plugin's form, compiled from the bytes `apply` writes): the same shapes that
        # read past above read only their own pages; fails if the fix is removed.
        for mode in ("TARGET_VERIFY", "DRAFT_DECODE"):
            for page, D in ((16, 8), (64, 4)):
                with self.subTest(mode=mode, page=page, D=D):
                    for m in run_trtllm_mha(mode, self.C, D, page, fixed=True):
                        holds_rule(self, m, Bug.TRTLLM_MHA_PAGE_TABLE, pool_for(self.C, D, page), page)


# ------------------------------------------------------------------------------------ MLA parents

FLASHINFER_MLA, _FI_MLA_WHY = importable(f"{ATTENTION}.flashinfer_mla_backend")


def mla_fields(b, pool, C: int, D: int, page: int, max_bs: int = MAX_BS):
    """What FlashInferMLAAttnBackend.__init__ sets that the graph paths read (0.5.14
    flashinfer_mla_backend.py:203-299), plus the later releases' fields (read where present)."""
    b.max_context_len, b.device = C, torch.device("cpu")
    b.skip_prefill, b.enable_chunk_kv = False, False
    b.req_to_token_pool, b.token_to_kv_pool, b.page_size = pool, None, page
    b.req_to_token = pool.req_to_token
    b.workspace_buffer = None
    b.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32)
    b.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32)
    b.q_indptr_decode = torch.arange(0, max_bs + 1, dtype=torch.int32)
    b.prefill_wrapper_ragged = None
    b.forward_metadata = None
    b.decode_cuda_graph_metadata, b.prefill_cuda_graph_metadata = {}, {}
    b.num_q_heads = b.num_kv_heads = b.num_local_heads = 1
    b.kv_lora_rank, b.qk_rope_head_dim, b.qk_nope_head_dim, b.v_head_dim = 8, 8, 8, 8
    b.kv_cache_dim, b.scaling = 16, 1.0
    b.data_type = b.q_data_type = torch.bfloat16
    b.num_draft_tokens, b.cuda_graph_custom_mask = D, None
    b.is_draft_runner, b.is_fp8_kvcache = False, False
    b.kv_index_translator = g.PlainTranslator()  # 0.5.23
    b._unified_mla, b._v2p_page_table, b._kernel_page_multiplier = False, None, 1  # 0.5.17
    b._translate_kv_loc_dense = None  # 0.5.17
    b._verify_mask = None
    return b


# ------------------------------------------------------------------------------------ TRT-LLM MLA

TRTLLM_MLA, _MLA_WHY = importable(f"{ATTENTION}.trtllm_mla_backend")


def run_trtllm_mla(
    mode: str, C: int, D: int, page: int, row_wide: bool = False, fixed: bool = False
) -> Measured:
    """TRTLLMMLABackend (0.5.14 trtllm_mla_backend.py:134-207) over the flashinfer MLA parent; its
    own init_cuda_graph_state (0.5.14 :275-329: block table [max_bs, _calc_padded_blocks(C)]),
    capture and replay. ``row_wide``: ``_calc_padded_blocks`` of the request pool's row instead
    of C (its two call sites, init_cuda_graph_state and _init_cuda_graph_metadata); ``fixed``: the
    plugin's form."""
    cls = plugin_form(TRTLLM_MLA, Bug.TRTLLM_MLA_KV_INDICES) if fixed else TRTLLM_MLA.TRTLLMMLABackend
    pool = pool_for(C, D, page)
    b = mla_fields(cls.__new__(cls), pool, C, D, page)
    b.decode_cuda_graph_metadata, b.forward_decode_metadata = {}, None
    if row_wide:
        row = int(pool.req_to_token.shape[1])
        b._calc_padded_blocks = lambda _context_len: cls._calc_padded_blocks(b, row)
    with parallel_defaults():
        with host_torch(TRTLLM_MLA, FLASHINFER_MLA):
            b.init_cuda_graph_state(MAX_BS, MAX_BS * D)
        b.decode_cuda_graph_kv_indices = table = guard(b.decode_cuda_graph_kv_indices)
        tokens = D if mode == "TARGET_VERIFY" else 1
        capture(b, mode, MAX_BS, tokens)
        table._base.fill_(SENTINEL)
        view = replay(b, mode, last_row_batch(C, D), tokens)
    metadata = b.decode_cuda_graph_metadata[MAX_BS]
    # The kernel's lengths: seq_lens_k (s + D) for the verify (0.5.14 :963-967, 0.5.23 :1640);
    # the decode's, the batch's seq_lens (0.5.14 :796-800; 0.5.23 copies them into seq_lens_k).
    kv_lens = metadata.seq_lens_k.tolist() if mode == "TARGET_VERIFY" else view.seq_lens.tolist()
    return kernel_reads(table, metadata.block_kv_indices, kv_lens, page, pool.req_to_token)


def trtllm_mla_width(C: int, page: int) -> int:
    """_calc_padded_blocks(C): ceil(C / page) rounded up to lcm(128 / page, 4096 / page) pages,
    i.e. to a multiple of 4096 tokens at page 32 and 64 (0.5.14 trtllm_mla_backend.py:209-230)."""
    return -(-pages(C, page) // (4096 // page)) * (4096 // page)


@unittest.skipUnless(
    TRTLLM_MLA is not None and FLASHINFER_MLA is not None, f"trtllm_mla_backend does not import: {_MLA_WHY}"
)
class TestTrtllmMla(unittest.TestCase):
    """One block table [max_bs, W] for decode and verify, W = ceil(C / page) padded to 4096 tokens.
    The verify tells the kernel seq_len + D; reads past iff C + 2D - 4 > 4096 * ceil(C / 4096):
    every C that is a multiple of 4096 (DeepSeek's 163840 = 40 x 4096 included)."""

    def test_verify_reads_past_the_buffer_at_a_4096_multiple(self):
        C = 4096
        for page in (32, 64):
            for D in DRAFTS:
                with self.subTest(page=page, D=D):
                    m = record(
                        f"trtllm_mla TARGET_VERIFY C {C} page {page} D {D}",
                        run_trtllm_mla("TARGET_VERIFY", C, D, page),
                    )
                    over = pages(longest(C, D) + D, page) - trtllm_mla_width(C, page)
                    self.assertEqual(m.width, trtllm_mla_width(C, page))
                    self.assertEqual(over, 1)
                    for row in m.rows[:-1]:
                        self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
                    self.assertEqual((m.last.right, m.last.neighbour, m.last.past), (m.width, 0, over))
                    # The fill launches whole 4096-token blocks, the width is a multiple of one:
                    # the extra page is not written anywhere; the kernel reads what lies there.
                    self.assertEqual((m.writes_past_end, m.last.past_right), (0, 0))

    def test_decode_at_the_verify_bound(self):
        # The decode metadata (the draft decode's multi-step backend calls this class in DECODE
        # mode) at the same seq_len C + D - 4: fits at D 4 (C exactly), one page past at D 8.
        C, page = 4096, 64
        for D, past in ((4, 0), (8, 1)):
            with self.subTest(D=D):
                m = record(f"trtllm_mla DECODE C {C} page {page} D {D}", run_trtllm_mla("DECODE", C, D, page))
                self.assertEqual((m.last.pages, m.last.past), (pages(longest(C, D), page), past))

    def test_table_fits_below_a_4096_multiple(self):
        C = 4000
        for page in (32, 64):
            for D in DRAFTS:
                with self.subTest(page=page, D=D):
                    m = record(
                        f"trtllm_mla TARGET_VERIFY C {C} page {page} D {D}",
                        run_trtllm_mla("TARGET_VERIFY", C, D, page),
                    )
                    for row in m.rows:
                        self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))

    def test_row_wide_table_reads_inside_its_rows(self):
        for page, D in ((32, 8), (64, 4)):
            with self.subTest(page=page, D=D):
                m = run_trtllm_mla("TARGET_VERIFY", 4096, D, page, row_wide=True)
                for row in m.rows:
                    self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))

    def test_fixed_table_reads_the_requests_own_pages(self):
        for mode, page, D in (("TARGET_VERIFY", 32, 8), ("TARGET_VERIFY", 64, 4), ("DECODE", 64, 8)):
            with self.subTest(mode=mode, page=page, D=D):
                m = run_trtllm_mla(mode, 4096, D, page, fixed=True)
                holds_rule(self, m, Bug.TRTLLM_MLA_KV_INDICES, pool_for(4096, D, page), page)


# ------------------------------------------------------------------------------------ FlashMLA

FLASHMLA_NAME = f"{ATTENTION}.flashmla_backend"
# Where each release imports FlashMLA's kernel and metadata planner from (CUDA-only packages):
# 0.5.14 / 0.5.17 ``sgl_kernel.flash_mla`` (flashmla_backend.py:13), 0.5.23 sglang's own
# ``kernels/ops/attention/flash_mla_interface.py`` over the ``flash_mla`` wheel (:14-17).
_FLASHMLA_STAND_INS = (
    {"sgl_kernel": (), "sgl_kernel.flash_mla": ("flash_mla_with_kvcache", "get_mla_metadata")},
    {"sglang.kernels.ops.attention.flash_mla_interface": ("flash_mla_with_kvcache", "get_mla_metadata")},
)


def import_flashmla():
    """(module or None, undo, why not): flashmla_backend over a stand-in for its kernel import."""
    why = ""
    for stand_ins in _FLASHMLA_STAND_INS:
        try:
            undo = g.import_over_stand_in(FLASHMLA_NAME, stand_ins)
            return sys.modules[FLASHMLA_NAME], undo, ""
        except ImportError as exc:
            why = f"{type(exc).__name__}: {exc}"
    return None, lambda: None, why


FLASHMLA, _UNDO_FLASHMLA, _FLASHMLA_WHY = import_flashmla()


def tearDownModule():
    _UNDO_FLASHMLA()  # the watch must not see a backend it could not import itself
    target = os.environ.get("SGLANG_DSA_FIX_OTHER_REPORT")
    if target:
        path = Path(target)
        old = json.loads(path.read_text()) if path.exists() else {}
        for ver, entries in REPORT.items():
            old.setdefault(ver, {}).update(entries)
        path.write_text(json.dumps(old, indent=1, sort_keys=True))


def run_flashmla(mode: str, C: int, D: int, row_wide: bool = False, fixed: bool = False) -> Measured:
    """FlashMLABackend (0.5.14 flashmla_backend.py:51-89) over the flashinfer MLA parent; its own
    init_cuda_graph_state (0.5.14 :180-211, 0.5.23 :274-316: block table
    [max_bs, (C + 64) // 64]), capture and replay. ``row_wide``: the block table handed in
    (its ``block_kv_indices`` argument) as wide as the request pool's row in pages."""
    page = FLASHMLA.PAGE_SIZE
    cls = plugin_form(FLASHMLA, Bug.FLASHMLA_KV_INDICES) if fixed else FLASHMLA.FlashMLABackend
    pool = pool_for(C, D, page)
    b = mla_fields(cls.__new__(cls), pool, C, D, page)
    b.cuda_graph_kv_indices = b.cuda_graph_mla_metadata = b.cuda_graph_num_splits = None
    b.cuda_graph_mla_metadata_view = b.cuda_graph_num_splits_view = None
    b.cuda_graph_draft_extend_seq_lens_k, b._eager_kv_indices_buf, b.dcp_world_size = None, None, 1
    given = None
    if row_wide:
        given = torch.ones(MAX_BS, pages(int(pool.req_to_token.shape[1]), page), dtype=torch.int32)
    with parallel_defaults(), g.patched(FLASHMLA, get_mla_metadata=g._mla_metadata):
        with host_torch(FLASHMLA):
            b.init_cuda_graph_state(MAX_BS, MAX_BS * D, block_kv_indices=given)
        b.cuda_graph_kv_indices = table = guard(b.cuda_graph_kv_indices)
        tokens = D if mode == "TARGET_VERIFY" else 1
        capture(b, mode, MAX_BS, tokens)
        table._base.fill_(SENTINEL)
        view = replay(b, mode, last_row_batch(C, D), tokens)
    # The kernel's cache_seqlens: seq_lens + D for the verify (0.5.14 :427-428, 0.5.23 :546-548),
    # seq_lens for the decode (0.5.14 :351, 0.5.23 :482); block_table = block_kv_indices[:bs],
    # a view of the graph table with its row stride.
    extra = D if mode == "TARGET_VERIFY" else 0
    kv_lens = [s + extra for s in view.seq_lens.tolist()]
    return kernel_reads(table, b.forward_metadata.block_kv_indices, kv_lens, page, pool.req_to_token)


@unittest.skipUnless(FLASHMLA is not None, f"flashmla_backend does not import here: {_FLASHMLA_WHY}")
class TestFlashMla(unittest.TestCase):
    """Block table [max_bs, (C + 64) // 64]: one page more than C needs when C is a multiple of
    64, so a verify at C + D - 4 (C + 2D - 4 keys) fits; reads past iff C mod 64 > 68 - 2D."""

    def test_verify_fits_at_a_multiple_of_64(self):
        C = 256
        for D in DRAFTS:
            for mode in ("TARGET_VERIFY", "DECODE"):
                with self.subTest(D=D, mode=mode):
                    m = record(f"flashmla {mode} C {C} page 64 D {D}", run_flashmla(mode, C, D))
                    self.assertEqual(m.width, (C + 64) // 64)
                    for row in m.rows:
                        self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
                    self.assertEqual(m.writes_past_end, 0)

    def test_verify_reads_past_when_C_mod_64_is_high(self):
        # C 254 (254 mod 64 = 62 > 68 - 2D for D 4 and 8): 4 pages; s + D = 254 + 2D - 4 needs 5.
        # The fill launches a 4096-token block and masks by the request's pages, so it writes
        # the 5th page past the table (the request's own page, in memory the table does not own).
        C = 254
        for D in DRAFTS:
            with self.subTest(D=D):
                m = record(f"flashmla TARGET_VERIFY C {C} page 64 D {D}", run_flashmla("TARGET_VERIFY", C, D))
                self.assertEqual((m.width, m.last.pages), (4, 5))
                self.assertEqual((m.last.right, m.last.neighbour, m.last.past), (4, 0, 1))
                self.assertEqual((m.writes_past_end, m.last.past_right), (1, 1))

    def test_row_wide_table_reads_inside_its_rows(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_flashmla("TARGET_VERIFY", 254, D, row_wide=True)
                for row in m.rows:
                    self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))
                self.assertEqual(m.writes_past_end, 0)

    def test_fixed_table_reads_the_requests_own_pages(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_flashmla("TARGET_VERIFY", 254, D, fixed=True)
                holds_rule(self, m, Bug.FLASHMLA_KV_INDICES, pool_for(254, D, 64), 64)


# ------------------------------------------------------------------------------------ flashinfer MLA


class _MlaWrapper(g._MlaWrapper):
    """flashinfer's BatchMLAPagedAttentionWrapper in cuda-graph mode: the buffers it is built with
    (its ``_*_buf`` names, which 0.5.23's own ``fast_mla_prefill_plan`` writes), a plan that copies
    ``kv_indices`` to ``buf[:len]`` (flashinfer mla.py plan, use_cuda_graph), and a compiled
    planner that does nothing."""

    def __init__(self, workspace, use_cuda_graph=True, **buffers):
        super().__init__(**buffers)
        self._qo_indptr_buf, self._kv_indptr_buf = buffers["qo_indptr"], buffers["kv_indptr"]
        self._kv_len_arr_buf = buffers["kv_len_arr"]
        self._float_workspace_buffer = self._int_workspace_buffer = None
        self._pin_memory_int_workspace_buffer = None
        self._cached_module = SimpleNamespace(plan=lambda *args, **kwargs: None)


def _translator(pool):
    """0.5.23: the runner's KVIndexTranslator of a plain (not unified, not fused-draft) pool
    (model_runner.py:954-961); earlier releases have none."""
    try:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:
        return g.PlainTranslator()
    return KVIndexTranslator(
        req_to_token=pool.req_to_token,
        token_to_kv_pool_allocator=None,
        token_to_kv_pool=None,
        page_size=1,
        device="cpu",
    )


def run_flashinfer_mla(C: int, D: int, seq_lens: list, row_wide: bool = False):
    """FlashInferMLAAttnBackend with its real indices updaters, its own init_cuda_graph_state
    (flat kv_indices [max_bs * C], 0.5.14 flashinfer_mla_backend.py:418-447, 0.5.23 :499-528),
    a TARGET_VERIFY capture and one replay. Returns (backend, guarded buffer, error or None)."""
    module = FLASHINFER_MLA
    cls = module.FlashInferMLAAttnBackend
    pool = pool_for(C, D, 1)
    b = mla_fields(cls.__new__(cls), pool, C, D, 1)
    for name in ("fast_plan_qo_indptr_cpu", "fast_plan_kv_indptr_cpu"):  # 0.5.23 __init__ :328-336
        setattr(b, name, torch.zeros(MAX_BS + 1, dtype=torch.int32))
    b.fast_plan_kv_len_arr_cpu = torch.zeros(MAX_BS, dtype=torch.int32)
    b.indices_updater_prefill = g._mla_updater(module.FlashInferMLAIndicesUpdaterPrefill, b, pool)
    b.indices_updater_decode = g._mla_updater(module.FlashInferMLAIndicesUpdaterDecode, b, pool)
    for updater in (b.indices_updater_prefill, b.indices_updater_decode):
        updater.v_head_dim, updater._translate_kv_loc_dense = 8, None
    error = None
    with parallel_defaults():
        b.kv_index_translator = _translator(pool)
        given = torch.zeros(MAX_BS * int(pool.req_to_token.shape[1]), dtype=torch.int32) if row_wide else None
        with host_torch(module):
            b.init_cuda_graph_state(MAX_BS, MAX_BS * D, kv_indices_buf=given)
        b.cuda_graph_kv_indices = buffer = g.guarded(tuple(b.cuda_graph_kv_indices.shape), fill=SENTINEL)
        b.fast_decode_kwargs["kv_indices"] = buffer
        with g.patched(module, BatchMLAPagedAttentionWrapper=_MlaWrapper, fast_mla_decode_plan=g._fast_plan):
            spec = g.verify_input(MAX_BS, D)
            b.init_forward_metadata_out_graph(
                g.capture_fields("TARGET_VERIFY", MAX_BS, D, spec), in_capture=True
            )
            buffer._base.fill_(SENTINEL)
            try:
                b.init_forward_metadata_out_graph(g.replay_view("TARGET_VERIFY", seq_lens, D, spec))
            except RuntimeError as exc:  # the plan's copy into a shorter slice
                error = exc
    return b, buffer, error


def flat_verify_indices(pool, seq_lens: list, D: int) -> torch.Tensor:
    """What a verify hands the kernel: request b's first s + D slots of pool row b + 1, end to end
    (generate_attn_arg_prefill: paged_kernel_lens + draft_token_num, 0.5.14 eagle_info.py)."""
    rows = pool.req_to_token
    return torch.cat([rows[b + 1, : s + D] for b, s in enumerate(seq_lens)]).to(torch.int32)


@unittest.skipUnless(FLASHINFER_MLA is not None, f"flashinfer_mla_backend does not import: {_FI_MLA_WHY}")
class TestFlashinferMla(unittest.TestCase):
    """A flat kv_indices buffer [max_bs * C], read through kv_indptr: no per-request row to read
    past. A verify needs sum(s + D) entries: with the longest request alone at C + D - 4 they fit;
    with every request there (max_bs * (C + 2D - 4) > max_bs * C) the plan's copy into the buffer
    raises instead (a crash at the replay, like bug #1, not a silent read)."""

    C = 256

    def record(self, name, buffer, expected, error):
        REPORT.setdefault(version(), {})[f"flashinfer_mla TARGET_VERIFY {name}"] = {
            "buffer_entries": int(buffer.numel()),
            "entries_needed": int(expected.numel()),
            "error": "" if error is None else str(error).splitlines()[0],
        }

    def test_last_row_at_the_bound_fits_and_reads_its_own_slots(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                seq_lens = last_row_batch(self.C, D)
                b, buffer, error = run_flashinfer_mla(self.C, D, seq_lens)
                self.assertIsNone(error)
                expected = flat_verify_indices(b.req_to_token_pool, seq_lens, D)
                self.record(f"last row C {self.C} D {D}", buffer, expected, error)
                self.assertEqual(buffer.numel(), MAX_BS * self.C)
                self.assertLessEqual(expected.numel(), buffer.numel())
                self.assertTrue(torch.equal(buffer[: expected.numel()], expected))
                self.assertTrue(bool((g.past_the_end(buffer) == SENTINEL).all()))

    def test_every_row_at_the_bound_raises_in_the_plan(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                seq_lens = [longest(self.C, D)] * MAX_BS
                b, buffer, error = run_flashinfer_mla(self.C, D, seq_lens)
                self.record(
                    f"every row C {self.C} D {D}",
                    buffer,
                    flat_verify_indices(b.req_to_token_pool, seq_lens, D),
                    error,
                )
                self.assertIsInstance(error, RuntimeError)
                fast_plan = getattr(FLASHINFER_MLA, "fast_mla_prefill_plan", None)
                if fast_plan is not None:  # 0.5.23: the replay's plan is sglang's own (:1401-1431)
                    self.assertIs(b.prefill_cuda_graph_metadata[MAX_BS].plan.func, fast_plan)
                self.assertIn("must match the size", str(error))
                self.assertTrue(bool((g.past_the_end(buffer) == SENTINEL).all()))  # nothing past

    def test_row_wide_buffer_takes_every_row_at_the_bound(self):
        D = 8
        seq_lens = [longest(self.C, D)] * MAX_BS
        b, buffer, error = run_flashinfer_mla(self.C, D, seq_lens, row_wide=True)
        self.assertIsNone(error)
        expected = flat_verify_indices(b.req_to_token_pool, seq_lens, D)
        self.assertTrue(torch.equal(buffer[: expected.numel()], expected))


# ------------------------------------------------------------------------------------ MiniMax NVFP4

MINIMAX_NVFP4, _MINIMAX_WHY = importable(f"{ATTENTION}.minimax_sparse_nvfp4_backend")
MSA_PLAN, _ = importable(f"{ATTENTION}.minimax_sparse_ops.msa_plan")


def run_minimax_nvfp4(C: int, D: int, row_wide: bool = False, fixed: bool = False) -> Measured:
    """MiniMaxSparseNvfp4AttnBackend (0.5.23 minimax_sparse_nvfp4_backend.py:28-95), a TARGET_VERIFY
    capture and replay through its own init_forward_metadata_out_graph (:111-124) and
    _prepare_msa_v1_decode_plan (:200-300, table [bs, ceil(C / page)]). The two plan classes are
    built without their constructors (which bind the ``inference.msa_v1`` CUDA kernels, absent
    here): the indexer plan gets the fields refresh() reads and keeps the real refresh()
    (msa_plan.py:396-431), which runs sglang's Triton update_msa_v1_decode_plan; the attention
    plan shares its page_table / final_seq_lens as the real one does (msa_plan.py:598-609)."""
    page = 128
    cls = (
        plugin_form(MINIMAX_NVFP4, Bug.MINIMAX_NVFP4_PAGE_TABLE)
        if fixed
        else MINIMAX_NVFP4.MiniMaxSparseNvfp4AttnBackend
    )
    pool = pool_for(C, D, page)
    b = cls.__new__(cls)
    b.req_to_token_pool, b.req_to_token, b.max_context_len, b.page_size = pool, pool.req_to_token, C, page
    b.speculative_num_draft_tokens, b.idx_head_dim = D, 128
    b._msa_v1_num_q_heads, b._msa_v1_num_kv_heads, b._msa_v1_num_index_heads = 64, 4, 4
    b._msa_v1_qmul4_available, b._msa_v1_index_fp8_scratch = True, None
    b._msa_v1_attention_workspace = torch.empty(0, dtype=torch.uint8)
    b._msa_v1_cuda_graph_plans, b._msa_v1_cuda_graph_attention_plans = {}, {}
    b._msa_v1_using_cuda_graph_plan, b.forward_metadata = False, None
    if row_wide:  # the plan's max_seq_len (:121-123) from the request pool's row instead of C
        b.max_context_len = int(pool.req_to_token.shape[1])
    tables = []

    def indexer_plan(*, batch_size, query_length, max_pages, device, **_):
        plan = MSA_PLAN.MSAV1DecodeIndexerPlan.__new__(MSA_PLAN.MSAV1DecodeIndexerPlan)
        plan.batch_size, plan.query_length, plan.max_pages = batch_size, query_length, max_pages
        plan.use_cuda_graph, plan.shared_plans = True, []
        plan.page_table = guard(torch.empty(batch_size, max_pages, dtype=torch.int32))
        plan.final_seq_lens = torch.empty(batch_size, dtype=torch.int32)
        chunks = -(-query_length // 16)
        plan._chunk_seq_lens_buffer = torch.empty(chunks, batch_size, dtype=torch.int32)
        tables.append(plan.page_table)
        return plan

    def attention_plan(*, batch_size, query_length, page_table_buffer, final_seq_lens_buffer, **_):
        return SimpleNamespace(
            page_table=page_table_buffer,
            final_seq_lens=final_seq_lens_buffer,
            fp8_attention=None,
            query_seq_lens=torch.empty(batch_size * query_length, dtype=torch.int32),
        )

    with g.patched(
        MINIMAX_NVFP4, MSAV1DecodeIndexerPlan=indexer_plan, MSAV1DecodeAttentionPlan=attention_plan
    ):
        b.init_forward_metadata_out_graph(g.capture_fields("TARGET_VERIFY", MAX_BS, D), in_capture=True)
        (table,) = tables
        table._base.fill_(SENTINEL)
        b.init_forward_metadata_out_graph(g.replay_view("TARGET_VERIFY", last_row_batch(C, D), D))
    plan = b.forward_metadata.msa_v1_decode_plan
    return kernel_reads(table, plan.page_table, plan.final_seq_lens.tolist(), page, pool.req_to_token)


@unittest.skipUnless(
    MINIMAX_NVFP4 is not None and MSA_PLAN is not None,
    f"no minimax_sparse_nvfp4_backend in this release ({_MINIMAX_WHY})",
)
class TestMinimaxNvfp4(unittest.TestCase):
    """0.5.23's MiniMax sparse NVFP4 backend: FA3's shape. The decode plan's page table is
    ceil(C / page) pages (max_seq_len = max_context_len), its builder writes every column below
    that and no more, and the lengths it hands the MSA indexer and attention are seq_len + D. The
    MSA kernels (``inference.msa_v1``) are not available here: the reads are counted as for the
    other tables (pages below ceil(length / 128)); whether those kernels clamp is not shown."""

    def test_verify_lengths_outgrow_the_page_table(self):
        C = 1024  # a multiple of the 128-token page
        for D in DRAFTS:
            with self.subTest(D=D):
                m = record(f"minimax_nvfp4 TARGET_VERIFY C {C} page 128 D {D}", run_minimax_nvfp4(C, D))
                self.assertEqual(m.width, C // 128)
                self.assertEqual(m.last.pages, pages(longest(C, D) + D, 128))
                self.assertEqual((m.last.right, m.last.neighbour, m.last.past), (m.width, 0, 1))
                self.assertEqual(m.writes_past_end, 0)
                for row in m.rows[:-1]:
                    self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))

    def test_row_wide_table_reads_inside_its_rows(self):
        m = run_minimax_nvfp4(1024, 8, row_wide=True)
        for row in m.rows:
            self.assertEqual((row.right, row.neighbour, row.past), (row.pages, 0, 0))

    def test_fixed_table_reads_the_requests_own_pages(self):
        for D in DRAFTS:
            with self.subTest(D=D):
                m = run_minimax_nvfp4(1024, D, fixed=True)
                holds_rule(self, m, Bug.MINIMAX_NVFP4_PAGE_TABLE, pool_for(1024, D, 128), 128)
