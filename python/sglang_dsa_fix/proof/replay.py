"""Drive the real sglang DSA backend through CUDA-graph capture and replay near context_len.

Shared by the demo, the regression tests and (on CUDA) the GPU tier. The backend is built
with ``__new__`` and only the attributes its graph paths read are set, as upstream's own
backend unit tests do; the request pool is sglang's real ``ReqToTokenPool`` sized the way
``ModelRunner._init_pools`` sizes it (0.5.14 model_executor/model_runner_kv_cache_mixin.py:338-340).

Each capture / replay goes through the entry point the decode / EAGLE cuda-graph runners call
(0.5.13+: ``init_forward_metadata_out_graph``, decode_cuda_graph_runner.py:772 capture, :950
replay; 0.5.4 - 0.5.12: ``init_forward_metadata_{capture,replay}_cuda_graph``), and the buffers
it wrote are compared with ``req_to_token``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_dsa_fix import backend_layouts, width
from sglang_dsa_fix.proof.cpu_stand_ins import stand_ins_for


def import_backend_class(layout=None):
    """Import the installed backend class (importing sglang). Returns (layout, class) or (None, None)."""
    for candidate in (layout,) if layout else backend_layouts.LAYOUTS:
        try:
            module = importlib.import_module(candidate.module)
        except ImportError:
            continue
        cls = module.__dict__.get(candidate.class_name)
        # The 0.5.13+ nsa shim re-exports dsa classes under old names: only a class
        # defined in that very module counts, so the shim never shadows the real one.
        if isinstance(cls, type) and cls.__module__ == candidate.module:
            return candidate, cls
    return None, None


MODES = ("DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2")


@dataclass(frozen=True)
class Case:
    context_len: int
    num_draft_tokens: int  # D = speculative_num_draft_tokens (steps + 1 with topk 1)
    page_size: int
    max_bs: int
    device: str = "cpu"


@dataclass
class ReplayResult:
    mode: str
    bs: int
    seq_len: int  # longest request in the batch
    columns: int  # columns the replay copies out of req_to_token
    buffer_width: int
    error: Optional[str] = None
    mismatched_rows: int = 0  # rows whose written page indices differ from req_to_token
    checked_rows: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.mismatched_rows == 0


def installed_version():
    from sglang_dsa_fix import tree

    return tree.find_tree(None).version


def installed_form():
    """The importable sglang's ``release.Form``, as its files show it (``sites.release_form``)."""
    from sglang_dsa_fix import sites, snapshot, tree

    return sites.release_form(snapshot.read(tree.find_tree(None), lock=False))[0]


def req_to_token_width(case: Case) -> int:
    """Row width of req_to_token for this case, from sglang's own sizing where it exists."""
    try:  # 0.5.13+: mem_cache/common.py:251
        from sglang.srt.mem_cache.common import get_req_to_token_extra_context_len
    except ImportError:  # older releases size it inline, 4 + D (0.5.12 model_runner_kv_cache_mixin.py:245)
        shape = width.SpecShape(
            case.context_len, case.num_draft_tokens, case.num_draft_tokens - 1, page_size=case.page_size
        )
        return case.context_len + width.pristine_row_extra(installed_form(), shape)
    server_args = SimpleNamespace(
        max_speculative_num_draft_tokens=case.num_draft_tokens,
        speculative_num_steps=case.num_draft_tokens - 1,
        speculative_algorithm="EAGLE",
        page_size=case.page_size,
        speculative_eagle_topk=1,
    )
    return case.context_len + get_req_to_token_extra_context_len(server_args)


def make_pool(case: Case):
    """Real ReqToTokenPool; request r owns whole pages so page indices are distinct."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(
        size=case.max_bs,
        max_context_len=req_to_token_width(case),
        device=case.device,
        enable_memory_saver=False,
    )
    rows, cols = pool.req_to_token.shape
    pages_per_row = math.ceil(cols / case.page_size)
    row = torch.arange(rows, dtype=torch.int64, device=case.device).unsqueeze(1)
    col = torch.arange(cols, dtype=torch.int64, device=case.device).unsqueeze(0)
    locations = (row * pages_per_row + col // case.page_size) * case.page_size + col % case.page_size
    pool.req_to_token.copy_(locations.to(torch.int32))
    return pool


def _attribute_prefix(backend_cls) -> str:
    # 0.5.13+ DeepseekSparseAttnBackend says dsa_*, 0.5.4 - 0.5.12 NativeSparseAttnBackend nsa_*.
    return "dsa" if "init_forward_metadata_out_graph" in backend_cls.__dict__ else "nsa"


def make_backend(backend_cls, case: Case, pool, speculative_step_id: int = 0):
    """Real backend object; attributes mirror what __init__ sets (0.5.14 dsa_backend.py:293-410,
    0.5.12 nsa_backend.py:300-400)."""
    backend = backend_cls.__new__(backend_cls)
    prefix = _attribute_prefix(backend_cls)
    backend.device = torch.device(case.device)
    backend.max_context_len = case.context_len
    backend.req_to_token_pool = pool
    backend.req_to_token = pool.req_to_token
    backend.real_page_size = case.page_size
    backend.speculative_num_draft_tokens = case.num_draft_tokens
    backend.speculative_num_steps = case.num_draft_tokens - 1
    backend.speculative_step_id = speculative_step_id
    backend.topk = 1
    backend.hisparse_coordinator = None
    backend.use_mha = False
    backend.enable_auto_select_prefill_impl = False
    backend._arange_buf = torch.arange(16384, device=backend.device, dtype=torch.int32)
    # flashmla_kv needs sgl_kernel's get_mla_metadata (CUDA only); the graph page_table
    # path is identical for every decode impl.
    on_cuda = backend.device.type == "cuda"
    impl = "flashmla_kv" if on_cuda else "flashmla_sparse"
    setattr(backend, f"{prefix}_index_topk", 2048)
    setattr(backend, f"{prefix}_decode_impl", impl)
    setattr(backend, f"{prefix}_prefill_impl", impl)
    setattr(backend, f"{prefix}_kv_cache_store_fp8", on_cuda)
    backend.num_q_heads = backend.flashmla_kv_num_q_heads = 64
    # 0.5.23 allocates the graph buffers inside a memory-saver region (dsa_backend.py 0.5.23:537,
    # :1542); disabled, as __init__ makes it without --enable-memory-saver.
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    backend._memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
    return backend


def _spec_info(num_accept):
    """Draft-extend spec_info carrying per-request accept counts, by release."""
    from sglang.srt.speculative import eagle_info

    cls = getattr(eagle_info, "EagleDraftExtendInput", None) or eagle_info.EagleDraftInput
    spec = cls()
    # 0.5.12+ read num_accept_tokens (nsa_backend.py:1056), 0.5.11 num_accepted_tokens.
    spec.num_accept_tokens = spec.num_accepted_tokens = num_accept
    spec.num_accept_tokens_cpu = num_accept.tolist()
    return spec


def _forward_batch(mode: str, bs: int, req_pool_indices, seq_lens, num_accept=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=getattr(ForwardMode, mode),
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=seq_lens.device),
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=None,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.cpu(),
        spec_info=_spec_info(num_accept) if mode == "DRAFT_EXTEND_V2" else None,
    )


def run_graph_metadata(backend, fb, num_tokens: int, in_capture: bool) -> None:
    """Capture or replay metadata the way each release's cuda-graph runner calls it."""
    if "init_forward_metadata_out_graph" in type(backend).__dict__:  # 0.5.13+
        backend.init_forward_metadata_out_graph(fb, in_capture=in_capture)
    elif in_capture:  # 0.5.4 - 0.5.12
        backend.init_forward_metadata_capture_cuda_graph(
            fb.batch_size,
            num_tokens,
            fb.req_pool_indices,
            fb.seq_lens,
            None,
            fb.forward_mode,
            fb.spec_info,
        )
    else:
        backend.init_forward_metadata_replay_cuda_graph(
            fb.batch_size,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.seq_lens_sum,
            None,
            fb.forward_mode,
            fb.spec_info,
            fb.seq_lens_cpu,
        )


def batch_for(case: Case, mode: str, bs: int, seq_len: int):
    """A batch whose longest request has seq_len; the others trail it by a few tokens."""
    device = case.device
    seq_lens = torch.tensor([max(1, seq_len - (i % 3)) for i in range(bs)], dtype=torch.int64, device=device)
    req_pool_indices = torch.arange(1, bs + 1, dtype=torch.int64, device=device).flip(0)
    D = case.num_draft_tokens
    num_accept = torch.tensor([D - (i % D) for i in range(bs)], dtype=torch.int32, device=device)
    return req_pool_indices, seq_lens, num_accept


def columns_read(case: Case, mode: str, seq_len: int) -> int:
    if mode == "TARGET_VERIFY":
        return width.target_verify_columns(seq_len, case.num_draft_tokens)
    return seq_len


def seq_len_limit(case: Case, mode: str, pool_width: int) -> int:
    """Largest seq_len whose replay read still fits in the request pool."""
    return pool_width - columns_read(case, mode, 0)  # the columns read beyond seq_len


class GraphReader:
    """A real CUDA graph, captured once, that reads the captured metadata buffers.

    Like the model's attention kernels it sees only the static addresses fixed at capture, so
    after each replay update ``read()`` shows what a replayed forward would really read.
    """

    def __init__(self, metadata):
        self.sources = [metadata.page_table_1, metadata.real_page_table]
        self.outputs = [torch.empty_like(t) for t in self.sources]
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for out, src in zip(self.outputs, self.sources):
                out.copy_(src)

    def read(self):
        self.graph.replay()
        torch.cuda.synchronize()
        return self.outputs


def mismatched_rows(page_table_1, real_page_table, expected, page_size: int) -> int:
    """Rows whose page indices differ from ``expected`` (req_to_token rows, replay order)."""
    rows, k = expected.shape
    if k > page_table_1.shape[1]:
        return rows  # the buffer cannot hold these rows: nothing a graph reads can be right
    bad = (page_table_1[:rows, :k] != expected).any(dim=1)
    if page_size > 1:
        real_expected = expected[:, ::page_size] // page_size
        bad |= (real_page_table[:rows, : real_expected.shape[1]] != real_expected).any(dim=1)
    return int(bad.sum())


class GraphSession:
    """One backend: init_cuda_graph_state, capture per (mode, bs), then replays."""

    def __init__(self, backend_cls, case: Case):
        self.case = case
        self.backend_cls = backend_cls
        self.pool = make_pool(case)
        self.backend = make_backend(backend_cls, case, self.pool)
        D = case.num_draft_tokens
        self.backend.init_cuda_graph_state(case.max_bs, case.max_bs * D)
        self.captured = set()
        self.readers = {}  # bs -> GraphReader (CUDA only)

    @property
    def buffer_width(self) -> int:
        return width.graph_page_table(self.backend).shape[1]

    def _run(self, mode, bs, seq_lens, req_pool_indices, num_accept, in_capture):
        fb = _forward_batch(mode, bs, req_pool_indices, seq_lens, num_accept)
        tokens = bs if mode == "DECODE" else bs * self.case.num_draft_tokens
        with stand_ins_for(self.backend_cls, self.case.device):
            run_graph_metadata(self.backend, fb, tokens, in_capture)

    def capture(self, mode: str, bs: int) -> None:
        # Like the runners: seq_lens filled with the backend's fill value, pool index 0.
        if (mode, bs) in self.captured:
            return
        device = self.case.device
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        seq_lens = torch.full((bs,), fill, dtype=torch.int64, device=device)
        idx = torch.zeros(bs, dtype=torch.int64, device=device)
        accept = torch.full((bs,), self.case.num_draft_tokens, dtype=torch.int32, device=device)
        # Capture builds per-bs metadata keyed by bs: one backend serves one mode at a time.
        self.backend.decode_cuda_graph_metadata.pop(bs, None)
        self._run(mode, bs, seq_lens, idx, accept, in_capture=True)
        self.captured = {(m, b) for (m, b) in self.captured if b != bs} | {(mode, bs)}
        if torch.device(self.case.device).type == "cuda":
            self.readers[bs] = GraphReader(self.backend.decode_cuda_graph_metadata[bs])

    def replay(self, mode: str, bs: int, seq_len: int) -> ReplayResult:
        self.capture(mode, bs)
        idx, seq_lens, accept = batch_for(self.case, mode, bs, seq_len)
        result = ReplayResult(mode, bs, seq_len, columns_read(self.case, mode, seq_len), self.buffer_width)
        try:
            self._run(mode, bs, seq_lens, idx, accept, in_capture=False)
        except RuntimeError as exc:
            result.error = str(exc).splitlines()[0]
            return result
        self._compare(result, idx, accept)
        return result

    def _compare(self, result: ReplayResult, idx, accept) -> None:
        """Every written row of page_table_1 (and real_page_table at page>1) vs req_to_token.

        On CUDA the rows compared are the ones a captured graph read after this update.
        """
        expected = self.pool.req_to_token[idx, : result.columns]
        if result.mode == "TARGET_VERIFY":
            expected = expected.repeat_interleave(self.case.num_draft_tokens, dim=0)
        elif result.mode == "DRAFT_EXTEND_V2":
            expected = expected.repeat_interleave(accept.to(torch.int64), dim=0)
        reader = self.readers.get(result.bs)
        if reader is not None:
            page_table_1, real_page_table = reader.read()
        else:
            metadata = self.backend.forward_metadata
            page_table_1, real_page_table = metadata.page_table_1, metadata.real_page_table
        result.checked_rows = expected.shape[0]
        result.mismatched_rows = mismatched_rows(page_table_1, real_page_table, expected, self.case.page_size)


def sweep(backend_cls, case: Case, mode: str, bs: int, first_seq_len: Optional[int] = None):
    """Replay seq_len = context_len-2 ... the pool's limit; one ReplayResult per seq_len."""
    session = GraphSession(backend_cls, case)
    limit = seq_len_limit(case, mode, session.pool.req_to_token.shape[1])
    start = case.context_len - 2 if first_seq_len is None else first_seq_len
    return [session.replay(mode, bs, s) for s in range(start, limit + 1)]
