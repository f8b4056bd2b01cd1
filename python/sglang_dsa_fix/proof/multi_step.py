"""Drive the real multi-step draft backend through its precompute + fused metadata-copy path.

``DeepseekSparseAttnMultiStepBackend`` (0.5.14 dsa_backend.py:2546-2762; the nsa class of
0.5.9 - 0.5.12 works the same) replays draft-decode
metadata for steps-1 sub-backends. With the defaults (SGLANG_DSA_ENABLE_MTP_PRECOMPUTE_METADATA
and SGLANG_USE_FUSED_METADATA_COPY on) it precomputes ``req_to_token[idx, :max_len]`` once and
writes it into every sub-backend's ``page_table_1`` with a JIT CUDA kernel
(jit_kernel/csrc/elementwise/fused_metadata_copy.cuh:167-172, 300-309) that indexes
``row * page_table_1_stride + col`` for ``col < max_len`` with no check against the row width:
with a too-narrow buffer a row's tail lands in the next row, and the last row's past the
buffer. To see that, each sub-backend's graph page_table is moved, after
init_cuda_graph_state and before capture, into the middle of a larger allocation filled with a
sentinel (same shape, strides and zero fill as the original).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dsa_fix import width
from sglang_dsa_fix.proof.cpu_stand_ins import stand_ins_for
from sglang_dsa_fix.proof.replay import (
    Case,
    _forward_batch,
    batch_for,
    make_backend,
    make_pool,
    mismatched_rows,
)

SENTINEL = -0x5A5A5A5
GUARD = 4096  # int32 elements of sentinel before and after each buffer


@dataclass
class MultiStepResult:
    bs: int
    seq_len: int
    buffer_width: int
    copy_path: str  # "fused multi-backend kernel", "fallback: ..." or "per-backend copy"
    error: Optional[str] = None
    mismatched_rows: int = 0  # summed over sub-backends
    checked_rows: int = 0
    sentinel_clobbered: int = 0  # guard elements overwritten, summed over sub-backends
    rows_beyond_bs_clobbered: int = 0  # buffer rows the replay must not touch, but did

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and not self.mismatched_rows
            and not self.sentinel_clobbered
            and not self.rows_beyond_bs_clobbered
        )


def _guarded(table: torch.Tensor):
    """(storage, view): ``table``'s shape inside a sentinel-filled allocation."""
    rows, cols = table.shape
    storage = torch.full((GUARD + rows * cols + GUARD,), SENTINEL, dtype=table.dtype, device=table.device)
    view = storage[GUARD : GUARD + rows * cols].view(rows, cols)
    view.zero_()
    return storage, view


class MultiStepSession:
    def __init__(self, multi_step_cls, backend_cls, case: Case):
        self.case = case
        self.backend_cls = backend_cls
        steps = case.num_draft_tokens - 1  # topk 1: D = steps + 1
        if steps < 2:
            raise ValueError("draft decode needs speculative_num_steps >= 2")
        self.pool = make_pool(case)
        ms = multi_step_cls.__new__(multi_step_cls)
        ms.topk = 1
        ms.speculative_num_steps = steps
        ms.attn_backends = [make_backend(backend_cls, case, self.pool, i) for i in range(steps - 1)]
        # The draft cuda-graph runner passes max_num_tokens = max_bs * topk
        # (speculative/eagle_draft_cuda_graph_runner.py:142-147).
        ms.init_cuda_graph_state(case.max_bs, case.max_bs)
        self.multi_step = ms
        self.storages = []
        for backend in ms.attn_backends:
            storage, view = _guarded(width.graph_page_table(backend))
            backend.decode_cuda_graph_metadata["page_table"] = view
            self.storages.append(storage)
        self.captured = set()

    @property
    def buffer_width(self) -> int:
        return width.graph_page_table(self.multi_step.attn_backends[0]).shape[1]

    def _run(self, bs, seq_lens, idx, in_capture):
        fb = _forward_batch("DECODE", bs, idx, seq_lens)
        ms = self.multi_step
        with stand_ins_for(self.backend_cls, self.case.device):
            if hasattr(ms, "init_forward_metadata_out_graph"):  # 0.5.13+
                ms.init_forward_metadata_out_graph(fb, in_capture=in_capture)
            elif in_capture:  # 0.5.4 - 0.5.12
                ms.init_forward_metadata_capture_cuda_graph(fb)
            else:
                ms.init_forward_metadata_replay_cuda_graph(fb, bs)

    def capture(self, bs: int) -> None:
        if bs in self.captured:
            return
        device = self.case.device
        fill = self.multi_step.attn_backends[0].get_cuda_graph_seq_len_fill_value()
        self._run(
            bs,
            torch.full((bs,), fill, dtype=torch.int64, device=device),
            torch.zeros(bs, dtype=torch.int64, device=device),
            in_capture=True,
        )
        self.captured.add(bs)

    def replay(self, bs: int, seq_len: int) -> MultiStepResult:
        self.capture(bs)
        idx, seq_lens, _ = batch_for(self.case, "DECODE", bs, seq_len)
        backends = self.multi_step.attn_backends
        untouched = [width.graph_page_table(b)[bs:].clone() for b in backends]
        printed = io.StringIO()
        result = MultiStepResult(bs, seq_len, self.buffer_width, copy_path="")
        try:
            with contextlib.redirect_stdout(printed):
                self._run(bs, seq_lens, idx, in_capture=False)
        except RuntimeError as exc:
            result.error = str(exc).splitlines()[0]
        if self.case.device != "cpu":
            torch.cuda.synchronize()
        log = printed.getvalue().strip()
        if "falling back" in log:
            result.copy_path = "fallback: " + log.splitlines()[0]
        elif len(backends) >= 3:
            result.copy_path = "fused multi-backend kernel"
        else:
            result.copy_path = "per-backend copy"
        expected = self.pool.req_to_token[idx, :seq_len]
        for backend, storage, before in zip(backends, self.storages, untouched):
            metadata = backend.decode_cuda_graph_metadata[bs]
            if result.error is None:
                result.checked_rows += expected.shape[0]
                result.mismatched_rows += mismatched_rows(
                    metadata.page_table_1, metadata.real_page_table, expected, self.case.page_size
                )
            guards = torch.cat([storage[:GUARD], storage[-GUARD:]])
            result.sentinel_clobbered += int((guards != SENTINEL).sum())
            after = width.graph_page_table(backend)[bs:]
            result.rows_beyond_bs_clobbered += int((after != before).any(dim=1).sum())
        return result


def sweep(multi_step_cls, backend_cls, case: Case, bs: int):
    """Draft-decode replays for seq_len = context_len-2 ... req_to_token width."""
    session = MultiStepSession(multi_step_cls, backend_cls, case)
    limit = session.pool.req_to_token.shape[1]
    return [session.replay(bs, s) for s in range(case.context_len - 2, limit + 1)]
