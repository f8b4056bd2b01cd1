"""One vocabulary for ``check``, ``status``, ``status --url``, the plugin and the README.

- ``Verdict``: what the tree's files alone say about one bug (``classify.states``), in the
  tokens of ``State`` (JSON ``tree_state``);
- ``State``: what that means for a deployment once the plugin and (with ``status``) the
  configuration are taken into account (JSON ``state``; the plugin's own report per bug too).
  Every ``State`` has exactly one exit code and one text; the README's exit-code table lists
  them and a test compares the two;
- ``Hook``: what the plugin's hook did in a server process (JSON ``hook``, beside its ``state``).
"""

from __future__ import annotations

import enum
from typing import Optional

from sglang_dsa_fix.errors import EXIT_AFFECTED, EXIT_CANNOT_TELL, EXIT_PROTECTED


class Bug(enum.Enum):
    PAGE_TABLE = "page_table"  # bug #1: CUDA-graph page_table narrower than req_to_token (crash)
    ROW_OVERFLOW = "req_to_token_row"  # bug #2: spec-v2 row write past the row end (corruption)
    FA3_PAGE_TABLE = "fa3_page_table"  # bug #3: FA3 CUDA-graph page tables a verify outgrows (crash)
    # bug #3's relatives, the same shape in other backends (backend_layouts.GRAPH_TABLE_LAYOUTS)
    TRTLLM_MHA_PAGE_TABLE = "trtllm_mha_page_table"
    TRTLLM_MLA_KV_INDICES = "trtllm_mla_kv_indices"
    FLASHMLA_KV_INDICES = "flashmla_kv_indices"
    MINIMAX_NVFP4_PAGE_TABLE = "minimax_nvfp4_page_table"
    TRITON_KV_INDICES = "triton_kv_indices"


class Verdict(enum.Enum):
    """What the files say (no plugin, no configuration), as ``State`` tokens."""

    AFFECTED = "affected"
    STALE_BYTECODE = "stale_bytecode"
    FIXED_IN_TREE = "fixed_in_tree"
    FIXED_UPSTREAM = "fixed_upstream"
    NOT_APPLICABLE = "not_applicable"
    NOT_COVERED = "cannot_tell"

    @property
    def state(self) -> State:
        return _FROM_VERDICT[self]


class State(enum.Enum):
    """A bug's state for one deployment: (token, text, exit code)."""

    AFFECTED = ("affected", "affected", EXIT_AFFECTED)
    STALE_BYTECODE = ("stale_bytecode", "fixed in source, but Python loads stale bytecode", EXIT_AFFECTED)
    PROTECTED_BY_PLUGIN = (
        "protected_by_plugin",
        "protected by the plugin once sglang loads it (confirm with `status --url`)",
        EXIT_PROTECTED,
    )
    FIXED_IN_TREE = ("fixed_in_tree", "fixed in-tree by sglang-dsa-fix", EXIT_PROTECTED)
    FIXED_UPSTREAM = ("fixed_upstream", "fixed upstream", EXIT_PROTECTED)
    NOT_REACHABLE = ("not_reachable", "not reachable at this configuration", EXIT_PROTECTED)
    NOT_APPLICABLE = ("not_applicable", "not applicable", EXIT_PROTECTED)
    CANNOT_TELL = ("cannot_tell", "cannot tell", EXIT_CANNOT_TELL)

    @property
    def token(self) -> str:
        return self.value[0]

    @property
    def text(self) -> str:
        return self.value[1]

    @property
    def exit_code(self) -> int:
        return self.value[2]

    @classmethod
    def of_token(cls, token: str) -> Optional[State]:
        return next((state for state in cls if state.token == token), None)


class Hook(enum.Enum):
    """What the plugin's hook for one bug did in a server process (``plugin.STATE``)."""

    NONE = "none"  # nothing to hook: the files hold it, no such code, or not hookable
    INSTALLED = "installed"  # registered through sglang's HookRegistry, not yet called
    APPLIED = "applied"  # ran: the width holds
    NOT_REACHED = "not_reached"  # this process never ran the hooked function
    DISABLED = "disabled"  # the kill switch
    UNSUPPORTED = "unsupported"  # could not be registered here
    FAILED = "failed"  # raised (sglang's own value kept) or sglang did not apply it


_FROM_VERDICT = {
    Verdict.AFFECTED: State.AFFECTED,
    Verdict.STALE_BYTECODE: State.STALE_BYTECODE,
    Verdict.FIXED_IN_TREE: State.FIXED_IN_TREE,
    Verdict.FIXED_UPSTREAM: State.FIXED_UPSTREAM,
    Verdict.NOT_APPLICABLE: State.NOT_APPLICABLE,
    Verdict.NOT_COVERED: State.CANNOT_TELL,
}


def judge(
    verdict: Verdict, plugin_fixes: bool, reachable: Optional[bool] = None, fix_holds: bool = True
) -> State:
    """The one place a tree verdict becomes a deployment state.

    ``plugin_fixes``: the plugin is installed and enabled in the target environment and can fix
    this bug there (it hooks stale bytecode too: what runs then is the pristine code).
    ``reachable``: None without a configuration; False when the configuration cannot hit the bug
    (for a tree fixed in-tree: when the patched code holds it). ``fix_holds``: the fix's width
    covers what this configuration needs (False: it would still write past the row end, so it
    is no protection here); without a configuration, False where the files hold an older,
    partial form of the change (``Site.legacy``).
    """
    if verdict in (Verdict.AFFECTED, Verdict.STALE_BYTECODE):
        if reachable is False:
            return State.NOT_REACHABLE
        if plugin_fixes and fix_holds:
            return State.PROTECTED_BY_PLUGIN
    if verdict in (Verdict.FIXED_IN_TREE, Verdict.FIXED_UPSTREAM) and (
        reachable or (reachable is None and not fix_holds)
    ):
        # The files' own width does not hold this configuration, or (no configuration) the
        # change in the files is an older, partial form of this tool's: affected somewhere.
        return State.AFFECTED
    return _FROM_VERDICT[verdict]


def combined_exit(codes) -> int:
    """1 if any bug is affected and unprotected (actionable), else 2 if any cannot be told, else 0."""
    codes = set(codes)
    if EXIT_AFFECTED in codes:
        return EXIT_AFFECTED
    return EXIT_CANNOT_TELL if EXIT_CANNOT_TELL in codes else EXIT_PROTECTED
