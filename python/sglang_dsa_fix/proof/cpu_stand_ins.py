"""The one GPU-only helper replaced when the backend runs on CPU, with its exact reference.

``seqlens_expand_triton`` (0.5.14 layers/attention/triton_ops/pad.py:327-390, imported into
dsa_backend.py:50) asserts CUDA tensors. Request i of ``extend_seq_lens`` contributes the
run ``seq_lens[i] - extend_seq_lens[i] + 1 ... seq_lens[i]``, runs laid end to end.
The test suite checks this reference against a brute-force loop.
"""

from __future__ import annotations

import contextlib
import sys

import torch


def seqlens_expand_reference(
    extend_seq_lens: torch.Tensor, seq_lens: torch.Tensor, total_len: int, max_q_len: int
) -> torch.Tensor:
    lengths = extend_seq_lens.to(torch.int64)
    starts = (seq_lens.to(torch.int64) - lengths + 1).repeat_interleave(lengths)
    run_begin = (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    position_in_run = torch.arange(starts.numel(), device=starts.device) - run_begin
    out = torch.zeros(total_len, dtype=torch.int32, device=extend_seq_lens.device)
    out[: starts.numel()] = (starts + position_in_run).to(torch.int32)
    return out


@contextlib.contextmanager
def stand_ins_for(backend_cls, device):
    """Swap the Triton helper in the backend's module namespace while on CPU; no-op on CUDA."""
    module = sys.modules[backend_cls.__module__]
    name = "seqlens_expand_triton"
    if torch.device(device).type == "cuda" or not hasattr(module, name):
        yield
        return
    original = getattr(module, name)
    setattr(module, name, seqlens_expand_reference)
    try:
        yield
    finally:
        setattr(module, name, original)
