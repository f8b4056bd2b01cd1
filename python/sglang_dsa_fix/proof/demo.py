"""``sglang-dsa-fix demo``: the crash and both fixes, on the real backend, in one table.

Drives the installed sglang's backend class through init_cuda_graph_state, capture and
TARGET_VERIFY replay for seq_len = context_len-2 ... the pool's limit, three times:
pristine, with the runtime fix, and from a patched temporary copy (in-tree patch). The
installed backend file is hashed before and after: it must not change.
"""

from __future__ import annotations

import hashlib

import torch

from sglang_dsa_fix import runtime_fix, sites
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.proof import replay
from sglang_dsa_fix.proof.patched_copy import patched_copy


def _cell(result: replay.ReplayResult) -> str:
    if result.error:
        return f"FAIL {result.error}"
    if result.mismatched_rows:
        return f"FAIL {result.mismatched_rows}/{result.checked_rows} rows differ from req_to_token"
    return f"OK   {result.checked_rows} rows == req_to_token"


def run(context_len: int, num_draft_tokens: int, page_size: int, bs: int, device: str) -> int:
    tree = trees.find_tree(None)
    layout, backend_cls = replay.import_backend_class()
    if backend_cls is None:
        print(f"sglang {tree.version} has no DSA/NSA backend: nothing to demonstrate")
        return 1
    site = sites.page_table_site(tree)
    digest_before = hashlib.sha256(site.path.read_bytes()).hexdigest()

    case = replay.Case(context_len, num_draft_tokens, page_size, bs, device)
    mode = "TARGET_VERIFY"
    pristine = replay.sweep(backend_cls, case, mode, bs)
    runtime_fix.install_page_table_fix(backend_cls)
    try:
        runtime = replay.sweep(backend_cls, case, mode, bs)
    finally:
        runtime_fix.uninstall_page_table_fix(backend_cls)
    with patched_copy() as patched:
        in_tree = replay.sweep(patched.backend_class, case, mode, bs)
    digest_after = hashlib.sha256(site.path.read_bytes()).hexdigest()

    pool_width = replay.req_to_token_width(case)
    print(
        f"sglang {tree.version} {layout.class_name} ({site.path})\n"
        f"{mode} replay on {device}: context_len={context_len} D={num_draft_tokens} "
        f"page_size={page_size} bs={bs}; req_to_token width {pool_width}; graph page_table "
        f"width pristine {pristine[0].buffer_width}, fixed {runtime[0].buffer_width}\n"
    )
    header = f"{'seq_len':>8} {'cols':>6}  {'runtime fix':<28} {'in-tree patch':<28} pristine"
    print(header)
    print("-" * (len(header) + 70))
    for p, r, t in zip(pristine, runtime, in_tree):
        print(f"{p.seq_len:>8} {p.columns:>6}  {_cell(r):<28} {_cell(t):<28} {_cell(p)}")

    crashed = sum(1 for p in pristine if p.error and "must match the size" in p.error)
    fixed_failures = sum(1 for r in runtime + in_tree if not r.ok)
    unchanged = digest_before == digest_after
    print(
        f"\npristine: {crashed}/{len(pristine)} replays raise the size mismatch; "
        f"fixed: {fixed_failures} failures in {len(runtime) + len(in_tree)} replays; "
        f"installed {site.path.name} {'unchanged' if unchanged else 'CHANGED'} (sha256 {digest_after[:12]})"
    )
    return 0 if crashed and not fixed_failures and unchanged else 1


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
