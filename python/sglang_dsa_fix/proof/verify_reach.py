"""How long a target_verify gets, and what the pristine DSA replay does with it (bug #1).

Two real drives composed: ``row_overflow`` runs one request's whole spec-v2 decode through the
release's own prepare / reservation with the scheduler's bookkeeping (admission clamp, overlap
lag) and records the seq_len of every target_verify; ``replay`` then runs the release's own DSA
backend (CUDA-graph buffers from its ``init_cuda_graph_state``, pristine width ``context_len +
D`` on 0.5.14, dsa_backend.py:995-1000) through a TARGET_VERIFY replay at the longest of them.

    python -m sglang_dsa_fix.proof.verify_reach [context_len]

prints, for D 4 and 5 with the overlap scheduler on and off, the longest seq_len measured,
``width.verify_seq_len_bound`` beside it, and the replay's outcome at that seq_len.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from sglang_dsa_fix import width
from sglang_dsa_fix.proof import replay, row_overflow

DSA_PAGE = 64  # the DSA/NSA backends run at page size 64


def prompts_near_the_end(context_len: int, num_draft_tokens: int) -> list[int]:
    """Prompts whose clamped max_new_tokens M is 1 .. D + 1: M - 1 takes every residue mod D
    (the longest verify depends on M only through it), and M = 1 finishes at prefill."""
    return [context_len - 2 - m for m in range(1, num_draft_tokens + 2) if context_len - 2 - m > 0]


@dataclass
class Reach:
    longest: Optional[int]  # the longest target_verify seq_len over the prompts driven
    prompt: Optional[int]  # a prompt that reaches it
    results: list  # row_overflow.RowResult per prompt


def longest_verify(
    context_len: int, num_draft_tokens: int, overlap: bool, accept_len: Optional[int] = None, prompts=None
) -> Reach:
    """Drive each prompt (default ``prompts_near_the_end``) to its release and take the longest
    target_verify seq_len; ``accept_len`` defaults to full acceptance (D)."""
    D = num_draft_tokens
    results = [
        row_overflow.run(
            row_overflow.RowCase(context_len, D, DSA_PAGE, overlap, prompt, accept_len=accept_len or D)
        )
        for prompt in (prompts_near_the_end(context_len, D) if prompts is None else prompts)
    ]
    reached = [r for r in results if r.longest_verify_seq_len is not None]
    best = max(reached, key=lambda r: r.longest_verify_seq_len, default=None)
    if best is None:
        return Reach(None, None, results)
    return Reach(best.longest_verify_seq_len, best.case.prompt_len, results)


def replay_target_verify(context_len: int, num_draft_tokens: int, seq_len: int, backend_cls=None):
    """One TARGET_VERIFY replay (bs 1) of the installed DSA backend at ``seq_len``: a
    ``replay.ReplayResult`` (error = the upstream size-mismatch message past the buffer)."""
    if backend_cls is None:
        backend_cls = replay.import_backend_class()[1]
    session = replay.GraphSession(backend_cls, replay.Case(context_len, num_draft_tokens, DSA_PAGE, 1))
    return session.replay("TARGET_VERIFY", 1, seq_len)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    context_len = int(args[0]) if args else 512
    print(
        f"sglang {replay.installed_version()}, context_len {context_len}, page {DSA_PAGE}, topk 1, full acceptance"
    )
    for D in (4, 5):
        for overlap in (True, False):
            reach = longest_verify(context_len, D, overlap)
            bound = width.verify_seq_len_bound(context_len, D, overlap)
            result = replay_target_verify(context_len, D, reach.longest)
            outcome = result.error or f"OK, {result.checked_rows} rows == req_to_token"
            print(
                f"D {D} overlap {'on ' if overlap else 'off'}: longest target_verify seq_len "
                f"{reach.longest} (prompt {reach.prompt}; verify_seq_len_bound {bound}) -> replay "
                f"copies {result.columns} columns into {result.buffer_width}: {outcome}"
            )
    return 0


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():  # sglang's Triton kernels on CPU: set before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(main())
