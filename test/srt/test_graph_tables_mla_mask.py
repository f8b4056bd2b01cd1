"""Bug #3's relatives: the verify tree mask of TRT-LLM MLA and FlashMLA, on the real classes.

0.5.13 - 0.5.16's TRT-LLM MLA and 0.5.16's FlashMLA allocate a FULL_MASK tree-mask scratch of
``max_num_tokens * (max_context_len + num_draft_tokens)`` cells in ``init_cuda_graph_state``
(0.5.13 trtllm_mla_backend.py:456-462, 0.5.14 / 0.5.16 :321-327; 0.5.16 flashmla_backend.py:
287-295) and hand it out through ``get_verify_buffers_to_fill_after_draft`` (0.5.14 :331-332).
The spec-v2 worker gives it to the tree builder for every batch, whatever its size (0.5.14
eagle_worker_v2.py:517-555, FULL_MASK at :212; 0.5.16 eagle_worker_common.py:346-380, FULL_MASK on
a GPU: eagle_utils.py:134-137). The builder (sgl_kernel's ``build_tree_efficient``, FULL_MASK:
request b's block starts at ``D * D * b + D * sum(s_i, i < b)``, draft token t's row at
``(s_b + D) * t`` in it) writes the last D cells of each of the D rows of ``s + D`` cells, so a
batch's last written cell is ``D * sum(s) + bs * D * D - 1``. The verify kernel never reads the
mask (trtllm-gen / FlashMLA take none: 0.5.17 trtllm_mla_backend.py:436-438), so what matters is
the builder's write past the buffer. The target's verify runner passes ``max_num_tokens =
max_bs * D`` (0.5.14 decode_cuda_graph_runner.py:233-263): D * (C + D) cells a request, against
D * (s + D) written; at ``s = C + D - 4`` (``width.verify_seq_len_bound``) every request of the
largest captured batch writes D cells past the end from D 5 on. 0.5.17+ size the mask QLEN_ONLY
(``is_read=False``: 0.5.17 trtllm_mla_backend.py:439-447, flashmla_backend.py:291-299), D * D
cells a request with no context length in it, and the worker writes it only when the batch fits
(0.5.17 eagle_worker_common.py:344-354).

Driving, as test_graph_tables_other_backends.py does: the release's class built with ``__new__``
and its fields (``o.mla_fields``), its own ``init_cuda_graph_state`` on the host, a TARGET_VERIFY
capture; then the worker's step: sglang's own ``select_top_k_tokens`` / ``organize_draft_results``
make the draft tree (EAGLE topk 1 with D = steps + 1, and topk 2), sglang's own
``build_tree_kernel_efficient`` fills the buffer the backend hands out; then one replay. The
buffer is ``guarded`` (a view of a larger uint8 allocation filled with a sentinel). Stand-in,
only for the GPU-only tree kernel: ``tree_kernel_writes`` writes the cells and positions the CUDA
kernel writes, through the buffer's raw storage as the kernel's pointer does (no bounds); where
sglang ships its own Triton port of that kernel (0.5.15 - 0.5.16 ``sgl_build_tree_kernel_triton``,
run on XPU) the stand-in is checked against it cell for cell.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import unittest

import graph_backends as g
import test_graph_tables_other_backends as o
import torch

from sglang_dsa_fix import width
from sglang_dsa_fix.verdicts import Bug

MAX_BS = o.MAX_BS
SHORT = o.SHORT
SENTINEL = 7  # neither False (0) nor True (1)
EAGLE_UTILS = importlib.import_module("sglang.srt.speculative.eagle_utils")
SPEC_UTILS = importlib.import_module("sglang.srt.speculative.spec_utils")
FULL_MASK = EAGLE_UTILS.TreeMaskMode.FULL_MASK
QLEN_ONLY = EAGLE_UTILS.TreeMaskMode.QLEN_ONLY
# (backend, C, page): TRT-LLM MLA at C 4000, where its block table fits the verify (so only the
# mask is at stake); FlashMLA at C 256 (page 64, a multiple: its block table fits too).
SHAPES = {"trtllm_mla": (4000, 64), "flashmla": (256, 64)}
BUGS = {"trtllm_mla": Bug.TRTLLM_MLA_KV_INDICES, "flashmla": Bug.FLASHMLA_KV_INDICES}


def module_of(kind: str):
    return o.TRTLLM_MLA if kind == "trtllm_mla" else o.FLASHMLA


def mask_form(kind: str) -> str:
    """ "full" where the class allocates the FULL_MASK scratch from max_context_len (0.5.13 -
    0.5.16), "verify_mask" where it builds a VerifyMask (0.5.17+), "" where it has neither."""
    module = module_of(kind)
    if module is None:
        return ""
    source = inspect.getsource(module)
    if "cuda_graph_custom_mask = torch.zeros(" in source:
        return "full"
    return "verify_mask" if "maybe_create_verify_mask(" in source else ""


# ------------------------------------------------------------------------------------ the tree


def draft_tree(bs: int, D: int, topk: int) -> tuple:
    """(parent_list, top_scores_index, draft_tokens) as the worker's draft loop leaves them:
    sglang's own select_top_k_tokens each step over a deterministic top-k, then its own
    organize_draft_results (0.5.14 eagle_worker_v2.py:598-615, :708-710). steps = D - 1."""
    gen = torch.Generator().manual_seed(D * 10 + topk)
    later = SPEC_UTILS._select_top_k_tokens_later
    later = getattr(later, "_torchdynamo_orig_callable", later)  # the function torch.compile wraps
    score_list, token_list, parents_list = [], [], []
    hidden, scores = torch.zeros(bs, 1), None
    for i in range(D - 1):
        rows = bs if i == 0 else bs * topk
        p = torch.rand(rows, topk, generator=gen)
        p, index = p / p.sum(-1, keepdim=True), torch.randint(0, 1000, (rows, topk), generator=gen)
        if i == 0:
            _, hidden, scores, info = SPEC_UTILS.select_top_k_tokens(i, p, index, hidden, scores, topk)
        else:
            _, hidden, scores, info = later(i, p, index, hidden, scores, topk)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
    return EAGLE_UTILS.organize_draft_results(score_list, token_list, parents_list, D)


def tree_kernel_writes(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """The CUDA ``build_tree_efficient``'s mask cells and positions (sgl-kernel csrc/speculative/
    eagle_utils.cu), written through the mask's raw storage as the kernel's pointer does: block
    b's draft token t sets its own cell, clears the D - 1 after it, and sets one cell per
    ancestor along its parent chain. The retrieve lists, which no backend buffer holds, are not
    modelled."""
    D = int(draft_token_num)
    raw = torch.empty(0, dtype=torch.uint8).set_(tree_mask.untyped_storage())
    at = tree_mask.storage_offset()
    seq = [int(x) for x in verified_seq_len]
    for b, s in enumerate(seq):
        block = D * D * b + D * sum(seq[:b])
        for t in range(D):
            if int(tree_mask_mode) == int(FULL_MASK):
                first = block + (s + D) * t + s
            else:
                first = D * D * b + D * t
            raw[at + first] = 1
            raw[at + first + 1 : at + first + D] = 0
            depth_of_t = 0
            cur = t - 1
            while t > 0:
                depth_of_t += 1
                raw[at + first + 1 + cur] = 1
                parent = int(selected_index[b, cur]) // topk
                if parent == 0:
                    break
                token = int(parent_list[b, parent])
                matches = [k for k in range(D - 1) if int(selected_index[b, k]) == token]
                if not matches:
                    break
                cur = matches[0]
            positions[b * D + t] = s + depth_of_t


# The module whose platform branch launches the tree kernel: eagle_utils up to 0.5.17, sglang's
# kernels/ops/speculative/spec_tree.py later (0.5.23 :367-444, eagle_utils.py:12-16 imports it).
_FUNC = getattr(EAGLE_UTILS, "build_tree_kernel_efficient_func", None)
DISPATCH = sys.modules[_FUNC.__module__] if _FUNC is not None else EAGLE_UTILS


@contextlib.contextmanager
def tree_kernel(port: bool = False):
    """sglang's build_tree_kernel_efficient with its GPU op answered here: ``tree_kernel_writes``
    on the CUDA branch, or (``port``) sglang's own Triton port, the branch it takes on XPU (0.5.16
    eagle_utils.py:229-243)."""
    flags = {name: False for name in ("_is_npu", "_is_xpu", "_is_cpu") if hasattr(DISPATCH, name)}
    if hasattr(DISPATCH, "_is_cuda"):
        flags["_is_cuda"] = True  # 0.5.23 refuses a non-CUDA platform on that branch (:427-430)
    if port:
        flags["_is_xpu"] = True
    with g.patched(DISPATCH, sgl_build_tree_kernel_efficient=tree_kernel_writes, **flags):
        yield


def triton_port():
    return getattr(DISPATCH, "sgl_build_tree_kernel_triton", None)


def guard_mask(buffer):
    """The same number of cells as a bool view of a uint8 allocation twice as long, filled with
    SENTINEL: a write past the end lands in owned memory and shows."""
    base = torch.full((2 * buffer.numel(),), SENTINEL, dtype=torch.uint8)
    return base.view(torch.bool)[: buffer.numel()], base


def build_tree(backend, seq_lens: list, D: int, topk: int, port: bool = False):
    """The worker's tree build for this batch, into the buffer the target backend hands out: the
    0.5.13 - 0.5.16 hand-off (``get_verify_buffers_to_fill_after_draft``, FULL_MASK: 0.5.14
    eagle_worker_v2.py:517-555) or 0.5.17+'s (``verify_mask``: its buffer if the batch fits, its
    mode, the prefix filled only if read: 0.5.17 eagle_worker_common.py:344-385)."""
    bs = len(seq_lens)
    parent_list, top_scores_index, draft_tokens = draft_tree(bs, D, topk)
    kwargs = {}
    if hasattr(backend, "get_verify_buffers_to_fill_after_draft"):
        buf, _ = backend.get_verify_buffers_to_fill_after_draft()
        mode = FULL_MASK
    else:
        vm = backend.verify_mask
        buf, mode = (vm.buffer if vm.fits(bs) else None), vm.mode
        kwargs["fill_prefix_mask"] = vm.is_read
    with tree_kernel(port):
        return EAGLE_UTILS.build_tree_kernel_efficient(
            torch.zeros(bs, dtype=torch.int64),
            parent_list,
            top_scores_index,
            draft_tokens,
            torch.tensor(seq_lens, dtype=torch.int64),
            0,  # seq_lens_sum: a preallocated buffer ignores it (eagle_worker_v2.py:523-535)
            topk,
            D - 1,
            D,
            mode,
            buf,
            **kwargs,
        )


# ------------------------------------------------------------------------------------ the backend


def backend_for(kind: str, C: int, D: int, page: int, fixed: bool = False):
    """The target's backend after its own init_cuda_graph_state(max_bs, max_bs * D) on the host,
    its mask ``guarded``: (backend, pool, guarded mask, its uint8 allocation)."""
    module = module_of(kind)
    bug = BUGS[kind]
    cls_name = "TRTLLMMLABackend" if kind == "trtllm_mla" else "FlashMLABackend"
    cls = o.plugin_form(module, bug) if fixed else getattr(module, cls_name)
    pool = o.pool_for(C, D, page)
    b = o.mla_fields(cls.__new__(cls), pool, C, D, page)
    if kind == "trtllm_mla":
        b.decode_cuda_graph_metadata, b.forward_decode_metadata = {}, None
        ctx = o.host_torch(o.TRTLLM_MLA, o.FLASHINFER_MLA)
    else:
        b.cuda_graph_kv_indices = b.cuda_graph_mla_metadata = b.cuda_graph_num_splits = None
        b.cuda_graph_mla_metadata_view = b.cuda_graph_num_splits_view = None
        b.cuda_graph_draft_extend_seq_lens_k, b._eager_kv_indices_buf, b.dcp_world_size = None, None, 1
        ctx = contextlib.ExitStack()
        ctx.enter_context(g.patched(o.FLASHMLA, get_mla_metadata=g._mla_metadata))
        ctx.enter_context(o.host_torch(o.FLASHMLA))
    with o.parallel_defaults(), ctx:
        b.init_cuda_graph_state(MAX_BS, MAX_BS * D)
    if getattr(b, "cuda_graph_custom_mask", None) is not None:
        mask, base = guard_mask(b.cuda_graph_custom_mask)
        b.cuda_graph_custom_mask = mask
    else:
        vm = b._verify_mask
        mask, base = guard_mask(vm.buffer)
        b._verify_mask = type(vm)(buffer=mask, mode=vm.mode, max_bs=vm.max_bs, is_read=vm.is_read)
    return b, pool, mask, base


def run(kind: str, D: int, seq_lens: list, topk: int = 1, fixed: bool = False, C=None) -> dict:
    """Capture, the worker's tree build for the batch, one replay; what the build wrote past."""
    C0, page = SHAPES[kind]
    C = C0 if C is None else C
    b, pool, mask, base = backend_for(kind, C, D, page, fixed)
    stand_ins = (
        g.patched(o.FLASHMLA, get_mla_metadata=g._mla_metadata)
        if kind == "flashmla"
        else contextlib.nullcontext()
    )
    with o.parallel_defaults(), stand_ins:
        o.capture(b, "TARGET_VERIFY", MAX_BS, D)
        tree_mask = build_tree(b, seq_lens, D, topk)[0]
        after_build = base.clone()
        o.replay(b, "TARGET_VERIFY", seq_lens, D)
    n, bs = mask.numel(), len(seq_lens)
    full = mask_form(kind) == "full" or b._verify_mask.mode == FULL_MASK
    out = dict(
        row=int(pool.req_to_token.shape[1]),
        cells=n,
        handed_out=tree_mask.data_ptr() == mask.data_ptr(),
        # One past the last cell the kernel writes: D * sum(s) + bs * D * D (FULL_MASK), bs * D * D
        # (QLEN_ONLY).
        needed=(D * sum(seq_lens) if full else 0) + bs * D * D,
        written_past=int((base[n:] != SENTINEL).sum()),
        replay_left_mask=bool(torch.equal(after_build, base)),  # the verify path does not touch it
    )
    if kind == "trtllm_mla":
        # What the graph replay hands trtllm-gen: max_seq_len = max_seq_len_k + D (0.5.14
        # :906-909, 0.5.23 :1546-1548, no DCP), the lengths seq_lens_k = s + D (0.5.14 :386-388).
        metadata = b.decode_cuda_graph_metadata[MAX_BS]
        out.update(
            kernel_max_seq_len=int(metadata.max_seq_len_k) + D,
            longest_kv=int(metadata.seq_lens_k.max()),
        )
    return out


def at_bound(C: int, D: int) -> int:
    return width.verify_seq_len_bound(C, D)


def every_row(C: int, D: int) -> list:
    return [at_bound(C, D)] * MAX_BS


def last_row(C: int, D: int) -> list:
    return [SHORT] * (MAX_BS - 1) + [at_bound(C, D)]


def skip_unless(kind: str, form: str):
    have = mask_form(kind)
    return unittest.skipUnless(have == form, f"{kind}: mask form {have or 'none'} here, not {form}")


# ------------------------------------------------------------------------------------ tests


class _FullMask:
    """0.5.13 - 0.5.16: max_bs * D * (C + D) cells, D * (s + D) written a request."""

    kind = ""

    def test_every_row_at_the_bound_writes_past_the_mask(self):
        C = SHAPES[self.kind][0]
        for D, topk in ((4, 1), (5, 1), (8, 1), (8, 2)):
            with self.subTest(D=D, topk=topk):
                m = run(self.kind, D, every_row(C, D), topk)
                self.assertTrue(m["handed_out"])
                self.assertEqual(m["cells"], MAX_BS * D * (C + D))
                self.assertEqual(m["needed"], MAX_BS * D * (C + 2 * D - 4))
                # The last request's last row (its last D cells) lies past the end from D 5 on;
                # at D 4 the mask is exactly full.
                self.assertEqual(m["written_past"], 0 if D == 4 else D)
                self.assertTrue(m["replay_left_mask"])

    def test_last_row_at_the_bound_fits(self):
        C = SHAPES[self.kind][0]
        for D in (5, 8):
            with self.subTest(D=D):
                m = run(self.kind, D, last_row(C, D))
                self.assertLess(m["needed"], m["cells"])
                self.assertEqual(m["written_past"], 0)

    def test_fixed_mask_holds_every_row(self):
        # The rule: the same expression over req_to_token's row, max_bs * D * (row + D) cells.
        C = SHAPES[self.kind][0]
        for D, topk in ((5, 1), (8, 1), (8, 2)):
            with self.subTest(D=D, topk=topk):
                m = run(self.kind, D, every_row(C, D), topk, fixed=True)
                self.assertEqual(m["cells"], MAX_BS * D * (m["row"] + D))
                self.assertLessEqual(m["needed"], m["cells"])
                self.assertEqual(m["written_past"], 0)

    def test_stand_in_writes_what_sglangs_triton_port_writes(self):
        if triton_port() is None:
            self.skipTest("no Triton port of the tree kernel in this release")
        C, page = SHAPES[self.kind]
        for D, topk in ((8, 1), (8, 2)):
            with self.subTest(D=D, topk=topk):
                out = []
                for port in (False, True):
                    b, _, mask, base = backend_for(self.kind, C, D, page)
                    positions = build_tree(b, every_row(C, D), D, topk, port=port)[1]
                    out.append((base.clone(), positions.clone()))
                self.assertTrue(torch.equal(out[0][0], out[1][0]))
                self.assertTrue(torch.equal(out[0][1], out[1][1]))
                self.assertEqual(int((out[1][0][mask.numel() :] != SENTINEL).sum()), D)


class _VerifyMask:
    """0.5.17+: QLEN_ONLY, max_bs * D * D cells whatever C; the worker writes it when bs fits."""

    kind = ""

    def test_mask_has_no_context_length_and_holds_every_row(self):
        C = SHAPES[self.kind][0]
        for D in (5, 8):
            with self.subTest(D=D):
                m = run(self.kind, D, every_row(C, D))
                self.assertTrue(m["handed_out"])
                self.assertEqual(m["cells"], MAX_BS * D * D)
                self.assertEqual(run(self.kind, D, every_row(2 * C, D), C=2 * C)["cells"], m["cells"])
                self.assertEqual(m["written_past"], 0)


@unittest.skipUnless(o.TRTLLM_MLA is not None and o.FLASHINFER_MLA is not None, "trtllm_mla_backend")
@unittest.skipUnless(mask_form("trtllm_mla"), "trtllm_mla_backend without a verify mask")
class TestTrtllmMlaMaxSeqLen(unittest.TestCase):
    """Not covered by the rule, recorded: the graph path tells trtllm-gen ``max_seq_len =
    max_context_len + D`` (``metadata.max_seq_len_k = self.max_context_len``: 0.5.14 :367, 0.5.23
    :587) while the longest request at s = C + D - 4 has C + 2D - 4 keys. flashinfer's launcher
    uses it on the host to split the KV sequence across CTAs and to pick a kernel (fmhaKernels.cuh
    ``computeCtaAndClusterConfig``, ``maxNumCtasPerSeqKv``); whether the closed cubin also stops at
    it cannot be read or run here."""

    def test_kernel_max_seq_len_is_below_the_longest_request_from_D_5(self):
        C = SHAPES["trtllm_mla"][0]
        for D in (4, 8):
            with self.subTest(D=D):
                m = run("trtllm_mla", D, every_row(C, D))
                self.assertEqual(m["kernel_max_seq_len"], C + D)
                self.assertEqual(m["longest_kv"] - m["kernel_max_seq_len"], max(0, D - 4))


@unittest.skipUnless(o.TRTLLM_MLA is not None and o.FLASHINFER_MLA is not None, "trtllm_mla_backend")
@skip_unless("trtllm_mla", "full")
class TestTrtllmMlaFullMask(_FullMask, unittest.TestCase):
    kind = "trtllm_mla"


@unittest.skipUnless(o.FLASHMLA is not None, "flashmla_backend")
@skip_unless("flashmla", "full")
class TestFlashMlaFullMask(_FullMask, unittest.TestCase):
    kind = "flashmla"


@unittest.skipUnless(o.TRTLLM_MLA is not None and o.FLASHINFER_MLA is not None, "trtllm_mla_backend")
@skip_unless("trtllm_mla", "verify_mask")
class TestTrtllmMlaVerifyMask(_VerifyMask, unittest.TestCase):
    kind = "trtllm_mla"


@unittest.skipUnless(o.FLASHMLA is not None, "flashmla_backend")
@skip_unless("flashmla", "verify_mask")
class TestFlashMlaVerifyMask(_VerifyMask, unittest.TestCase):
    kind = "flashmla"


# ------------------------------------------------------------------------------------ earlier form


@contextlib.contextmanager
def earlier_layouts():
    """The layouts as the earlier sglang-dsa-fix had them: without the ``later`` expressions."""
    import dataclasses

    from sglang_dsa_fix import graph_tables

    saved = dict(graph_tables.LAYOUTS)
    for bug, layout in saved.items():
        if layout.later:
            kept = tuple(e for e in layout.width_exprs if e not in layout.later)
            graph_tables.LAYOUTS[bug] = dataclasses.replace(layout, width_exprs=kept, later=())
    try:
        yield
    finally:
        graph_tables.LAYOUTS.update(saved)


def _patch_tool_case():
    try:
        import helpers
    except Exception as exc:  # no importable sglang tree for the CLI
        return None, f"{type(exc).__name__}: {exc}"
    return helpers.PatchToolTestCase, ""


_CASE, _CASE_WHY = _patch_tool_case()


@unittest.skipUnless(_CASE is not None and mask_form("trtllm_mla") == "full", f"no mask here {_CASE_WHY}")
class TestEarlierFormRevertsThenApplies(_CASE or unittest.TestCase):
    """A tree the earlier sglang-dsa-fix patched (block tables only, the mask as sglang wrote it)
    reads as that earlier form: check says so, revert restores the original bytes, apply then
    writes the whole change. Without ``later`` it would refuse both (neither pristine nor this
    change: 'changed since sglang-dsa-fix applied it')."""

    def test_check_revert_apply(self):
        pristine, fixed = (
            f"max_num_tokens * ({width} + self.num_draft_tokens)".encode()
            for width in ("self.max_context_len", "self.req_to_token.shape[1]")
        )
        files = {
            path: data
            for path, data in self.relatives.items()
            if path.name in ("trtllm_mla_backend.py", "flashmla_backend.py") and pristine in data
        }
        self.assertTrue(files)
        with earlier_layouts():
            self.assertEqual(self.cli("apply")[0], 0)
        for path, original in files.items():
            self.assertNotEqual(path.read_bytes(), original)  # the block table's edits
            self.assertTrue(pristine in path.read_bytes(), path)  # the mask as sglang wrote it
        rc, out, err = self.cli("check", "-v")
        # The mask is as sglang wrote it: an older, partial change is no fix (issue 34 item 8).
        self.assertEqual(rc, 1, (out, err))
        self.assertIn("an earlier sglang-dsa-fix form of this change", out)
        self.assertIn("run `sglang-dsa-fix revert`, then `sglang-dsa-fix apply`", out.splitlines()[0])
        self.assertEqual(self.cli("revert")[0], 0)
        for path, original in files.items():
            self.assertEqual(path.read_bytes(), original)
        self.assertEqual(self.cli("apply")[0], 0)
        for path in files:
            self.assertTrue(fixed in path.read_bytes(), path)
        rc, out, _ = self.cli("check", "-v")
        self.assertEqual(rc, 0, out)
        self.assertNotIn("an earlier sglang-dsa-fix form", out)
