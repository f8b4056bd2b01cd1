"""A row-overflow case (one request's decode shape) and what driving it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class RowCase:
    context_len: int
    num_draft_tokens: int  # D
    page_size: int
    overlap: bool
    prompt_len: int
    accept_len: int = 1
    topk: int = 1
    num_steps: Optional[int] = None  # default D - 1 (topk 1)
    algorithm: str = "EAGLE"
    dcp_size: int = 1  # decode context parallel: the allocator pages page_size x dcp_size
    # Where the pool, allocator and batch live: "cpu" (the kernels in Triton's interpreter) or
    # "cuda" (compiled: a GPU host, whose Triton's interpreter may not run sglang's kernels).
    device: str = "cpu"

    @property
    def steps(self) -> int:
        return self.num_steps or max(1, self.num_draft_tokens - 1)

    @property
    def alloc_page(self) -> int:
        """The token allocator's page (0.5.17 mem_cache/kv_cache_builder.py:212: under DCP the
        allocator, and the tree cache with it, page page_size x dcp_size)."""
        return self.page_size * self.dcp_size


@dataclass
class RowResult:
    case: RowCase
    row_width: int
    row_extra: int
    furthest_column: int  # highest column any prepare wrote in the owner's row
    last_committed: int  # kv_committed_len seen by the last prepare
    canary_clobbered: int  # neighbour-row cells changed
    leaked_slots: int  # KV slots not back in the allocator after release
    prepares: int
    writes: list = field(default_factory=list, repr=False)  # (start, end, row width) per row written
    # (seq_len, kv_allocated_len) of each target_verify: what it runs with, and the row columns the
    # real prepare before it had reserved (its draft KV goes to [seq_len, seq_len + D)).
    verifies: list = field(default_factory=list, repr=False)
    # The decode prepares sglang ran (release.EAGLE_PREPARE, DFLASH_PREPARE, UNO_PREPARE).
    prepares_run: frozenset = frozenset()

    @property
    def longest_verify_seq_len(self) -> Optional[int]:
        """The longest seq_len a target_verify ran with; None if the request never decoded."""
        return max((seq_len for seq_len, _ in self.verifies), default=None)

    @property
    def columns_past_row_end(self) -> int:
        return max(0, self.furthest_column + 1 - self.row_width)

    @property
    def clean(self) -> bool:
        return self.columns_past_row_end == 0 and self.canary_clobbered == 0 and self.leaked_slots == 0
