"""``sglang-dsa-fix demo``: three bugs and both fixes, on the real sglang code, in three tables.

Bug #1: the installed backend class through init_cuda_graph_state, capture and TARGET_VERIFY
replay for seq_len = context_len-2 ... the pool's limit (``replay``). Bug #2: one request driven
to its last spec-v2 decode reservation with a canary in the next request's row
(``row_overflow``; its Triton kernel runs on CPU under Triton's interpreter). Bug #3: the real
FlashAttentionBackend (FA3) through init_cuda_graph_state, capture and target_verify / draft
decode replays near and past context_len, what its kernel would read from the graph page tables
against the request's req_to_token row (``fa3_replay``). Each three ways: pristine, runtime fix
(what the plugin's hooks do), in-tree patch (a patched temporary copy of the installed sglang).
Bugs #2 and #3 run on CPU only. The installed files are hashed before and after: they must not
change. The summary says per bug whether it came out as expected.
"""

from __future__ import annotations

import hashlib

import torch

from sglang_dsa_fix import runtime_fix, sites, snapshot, width
from sglang_dsa_fix import tree as trees
from sglang_dsa_fix.members.fa3 import sites as fa3_sites
from sglang_dsa_fix.proof import fa3_backend, fa3_replay, replay, row_overflow
from sglang_dsa_fix.proof.patched_copy import patched_copy

ROW_DRAFT_TOKENS = (7, 8, 9, 12)
# Bug #3's table: D 8 so that the longest verify's seq_len passes context_len (C + D - 4).
FA3_CONTEXT_LEN, FA3_DRAFT_TOKENS, FA3_PAGES, FA3_BS = 256, 8, (1, 16), 4


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


def _fa3_cell(result: fa3_replay.Replay) -> str:
    if result.error:
        return f"FAIL {result.error}"
    if not result.clean:
        text = f"FAIL {result.not_own}/{result.reads} not own page ids, {result.past} past the end"
        return text + (f", {result.writes_outside} written outside" if result.writes_outside else "")
    return f"OK   {result.reads}/{result.reads} own page ids"


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


def fa3_entries(patched_module, form) -> list:
    """Bug #3's replays at the demo's shape (``fa3_replay.compare``), the installed module
    imported over the CPU stand-in for the time it takes."""
    undo = fa3_backend.import_fa3()
    try:
        return fa3_replay.compare(FA3_CONTEXT_LEN, FA3_DRAFT_TOKENS, FA3_PAGES, FA3_BS, patched_module, form)
    finally:
        undo()


def fa3_table(entries) -> bool:
    C, D, bs = FA3_CONTEXT_LEN, FA3_DRAFT_TOKENS, FA3_BS
    print(
        f"Bug #3 (crash): the real FlashAttentionBackend (FA3) on cpu, target_verify and draft decode "
        f"replays: context_len={C} D={D} bs={bs}, every request at seq_len; what the kernel reads "
        "from the graph page table vs the request's req_to_token row\n"
    )
    header = (
        f"{'mode':<6} {'page':>4} {'seq_len':>7} {'read':>4} {'table':>8}  "
        f"{'runtime fix':<28} {'in-tree patch':<28} pristine"
    )
    print(header + "\n" + "-" * (len(header) + 50))
    for e in entries:
        table = f"{e.pristine.width}->{e.runtime.width}"
        print(
            f"{e.mode:<6} {e.page:>4} {e.seq_len:>7} {e.pages:>4} {table:>8}  {_fa3_cell(e.runtime):<28} "
            f"{_fa3_cell(e.in_tree):<28} {_fa3_cell(e.pristine)}"
        )
    bad = sum(1 for e in entries if not e.pristine.clean)
    failures = sum(1 for e in entries for r in (e.runtime, e.in_tree) if not r.clean)
    print(
        "\n'read': pages the longest request's read spans (verify: seq_len + D keys; draft decode: "
        "its last step, seq_len + D - 2); 'table': the graph page table's pages, sglang's -> fixed"
    )
    print(
        f"pristine: {bad}/{len(entries)} replays read outside the request's row or raise; fixed: "
        f"{failures} failures in {2 * len(entries)} replays\n"
    )
    return fa3_replay.as_expected(entries)


def _verdict(ok, device: str) -> str:
    if ok is None:
        return f"not shown ({'CPU only' if device != 'cpu' else 'the in-tree patch changes nothing here'})"
    return "as expected" if ok else "NOT as expected"


def run(context_len: int, num_draft_tokens: int, page_size: int, bs: int, device: str) -> int:
    tree = trees.find_tree(None)
    layout, backend_cls = replay.import_backend_class()
    if backend_cls is None:
        print(f"sglang {tree.version} has no DSA/NSA backend: nothing to demonstrate")
        return 1
    read = snapshot.read(tree)
    fa3_site = fa3_sites.fa3_page_table_site(read)
    found = (sites.page_table_site(read), sites.row_site(read), fa3_site)
    files = [s.path for s in found if s is not None]
    before = _digests(files)
    print(f"sglang {tree.version} at {tree.package}\n")
    on_cpu = device == "cpu"
    form = sites.release_form(read)[0]
    ok = {}  # bug -> as expected, or None: not shown
    with patched_copy(fa3=on_cpu and fa3_site is not None) as patched:
        case = replay.Case(context_len, num_draft_tokens, page_size, bs, device)
        ok["#1"] = page_table_table(backend_cls, patched.backend_class, case)
        rows_shown = patched.sizing_function is not None and on_cpu
        ok["#2"] = row_table(form, patched.sizing_function) if rows_shown else None
        fa3_shown = patched.fa3_module is not None
        ok["#3"] = fa3_table(fa3_entries(patched.fa3_module, form)) if fa3_shown else None
    unchanged = _digests(files) == before
    print(f"installed files {'unchanged' if unchanged else 'CHANGED'}: {', '.join(p.name for p in files)}")
    for bug, result in ok.items():
        print(f"bug {bug}: {_verdict(result, device)}")
    good = unchanged and False not in ok.values()
    print("demo:", "as expected" if good else "NOT as expected")
    return 0 if good else 1


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
