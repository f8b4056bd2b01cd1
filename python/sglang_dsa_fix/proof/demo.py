"""``sglang-dsa-fix demo``: both bugs and both fixes, on the real sglang code, in two tables.

Bug #1: the installed backend class through init_cuda_graph_state, capture and TARGET_VERIFY
replay for seq_len = context_len-2 ... the pool's limit (``replay``). Bug #2: one request driven
to its last spec-v2 decode reservation with a canary in the next request's row
(``row_overflow``; its Triton kernel runs on CPU under Triton's interpreter). Each three ways:
pristine, runtime fix (what the plugin's hooks do), in-tree patch (a patched temporary copy of
the installed sglang). The installed files are hashed before and after: they must not change.
"""

from __future__ import annotations

import hashlib

import torch

from sglang_dsa_fix import runtime_fix, sites, snapshot, width
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.proof import replay, row_overflow
from sglang_dsa_fix.proof.patched_copy import patched_copy

ROW_DRAFT_TOKENS = (7, 8, 9, 12)


def _cell(result: replay.ReplayResult) -> str:
    if result.error:
        return f"FAIL {result.error}"
    if result.mismatched_rows:
        return f"FAIL {result.mismatched_rows}/{result.checked_rows} rows differ from req_to_token"
    return f"OK   {result.checked_rows} rows == req_to_token"


def _row_cell(result: row_overflow.RowResult) -> str:
    if result.clean:
        return f"OK   width {result.row_width}, last write col {result.furthest_column}"
    return (
        f"FAIL {result.columns_past_row_end} col past row end, {result.canary_clobbered} "
        f"neighbour cells overwritten, {result.leaked_slots} slots leaked"
    )


def _digests(paths) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def page_table_table(backend_cls, patched_cls, case) -> bool:
    mode = "TARGET_VERIFY"
    pristine = replay.sweep(backend_cls, case, mode, case.max_bs)
    runtime_fix.install_page_table_fix(backend_cls)
    try:
        runtime = replay.sweep(backend_cls, case, mode, case.max_bs)
    finally:
        runtime_fix.uninstall_page_table_fix(backend_cls)
    in_tree = replay.sweep(patched_cls, case, mode, case.max_bs)
    print(
        f"Bug #1 (crash): {mode} replay on {case.device}: context_len={case.context_len} "
        f"D={case.num_draft_tokens} page_size={case.page_size} bs={case.max_bs}; req_to_token width "
        f"{replay.req_to_token_width(case)}; graph page_table width pristine {pristine[0].buffer_width}, "
        f"fixed {runtime[0].buffer_width}\n"
    )
    header = f"{'seq_len':>8} {'cols':>6}  {'runtime fix':<28} {'in-tree patch':<28} pristine"
    print(header + "\n" + "-" * (len(header) + 70))
    for p, r, t in zip(pristine, runtime, in_tree):
        print(f"{p.seq_len:>8} {p.columns:>6}  {_cell(r):<28} {_cell(t):<28} {_cell(p)}")
    crashed = sum(1 for p in pristine if p.error == width.size_mismatch_message(p.buffer_width, p.columns))
    failures = sum(1 for r in runtime + in_tree if not r.ok)
    print(
        f"\npristine: {crashed}/{len(pristine)} replays raise the size mismatch; fixed: {failures} "
        f"failures in {len(runtime) + len(in_tree)} replays\n"
    )
    return bool(crashed) and not failures


def row_table(form, patched_sizing) -> bool:
    sizing = row_overflow.sizing_module()
    hook = runtime_fix.row_extra_fix(sizing.__name__)
    original = sizing.get_req_to_token_extra_context_len

    def runtime_sizing(*args, **kwargs):  # what the plugin's AFTER hook returns
        return hook(original(*args, **kwargs), *args, **kwargs)

    print(
        "Bug #2 (silent corruption): one request (prompt 100, max_new_tokens unset, 1 token per "
        "verify, overlap on) to its last decode reservation, context_len=256, canary in the next row\n"
    )
    header = f"{'D':>3} {'page':>4} {'rule':>4}  {'runtime fix':<34} {'in-tree patch':<34} pristine"
    print(header + "\n" + "-" * (len(header) + 60))
    ok = True
    for D in ROW_DRAFT_TOKENS:
        for page in (1, 64):
            case = row_overflow.RowCase(256, D, page, True, 100)
            expected = width.row_overflow_columns(form, width.SpecShape(256, D, D - 1, page_size=page))
            results = [row_overflow.run(case, f) for f in (runtime_sizing, patched_sizing, None)]
            fixed_runtime, fixed_in_tree, pristine = results
            print(
                f"{D:>3} {page:>4} {expected:>4}  {_row_cell(fixed_runtime):<34} {_row_cell(fixed_in_tree):<34} "
                f"{_row_cell(pristine)}"
            )
            ok &= fixed_runtime.clean and fixed_in_tree.clean
            ok &= pristine.columns_past_row_end == expected == pristine.canary_clobbered
    print("\n'rule': columns past the row end that width.row_overflow_columns predicts for this release\n")
    return ok


def run(context_len: int, num_draft_tokens: int, page_size: int, bs: int, device: str) -> int:
    tree = trees.find_tree(None)
    layout, backend_cls = replay.import_backend_class()
    if backend_cls is None:
        print(f"sglang {tree.version} has no DSA/NSA backend: nothing to demonstrate")
        return 1
    read = snapshot.read(tree)
    files = [s.path for s in (sites.page_table_site(read), sites.row_site(read)) if s is not None]
    before = _digests(files)
    print(f"sglang {tree.version} at {tree.package}\n")
    with patched_copy() as patched:
        case = replay.Case(context_len, num_draft_tokens, page_size, bs, device)
        ok = page_table_table(backend_cls, patched.backend_class, case)
        if patched.sizing_function is not None and device == "cpu":
            ok &= row_table(sites.release_form(read)[0], patched.sizing_function)
    unchanged = _digests(files) == before
    print(f"installed files {'unchanged' if unchanged else 'CHANGED'}: {', '.join(p.name for p in files)}")
    print("demo:", "as expected" if ok and unchanged else "NOT as expected")
    return 0 if ok and unchanged else 1


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
