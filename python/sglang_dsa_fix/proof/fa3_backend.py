"""sglang's real FlashAttentionBackend (FA3) built on CPU, with the cuda-graph runners' batches.

Shared by the demo (bug #3's table, ``fa3_replay``) and the tests (test/graph_backends.py
re-exports these). The backend is the installed release's class (or a patched copy's), built
with ``__new__`` and the attributes its ``__init__`` sets for a decoder-only MHA model, FA3, EAGLE
topk 1, over a real ``ReqToTokenPool``; ``init_cuda_graph_state`` and capture / replay are its
own, through ``init_forward_metadata_out_graph`` (the decode and draft cuda-graph runners' entry:
0.5.14 decode_cuda_graph_runner.py:772 capture, :950 replay; eagle_draft_cuda_graph_runner.py:432,
:598), the verify's replay batch built by the runner's own ``build_replay_fb_view``.

The one stand-in: where ``sgl_kernel`` is absent (CPU), the module imports over a stand-in
``sgl_kernel`` whose functions raise if called (0.5.14 flashattention_backend.py:34 imports
``merge_state_v2``, which only topk > 1 cascades call; nothing here calls it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import sys
import types

import torch

FA3 = "sglang.srt.layers.attention.flashattention_backend"


def _not_on_cpu(*args, **kwargs):
    raise RuntimeError("sgl_kernel stand-in: this kernel is CUDA-only")


@contextlib.contextmanager
def _stand_in_modules(stand_ins: dict):
    """Stand-in modules (name -> attributes, each ``_not_on_cpu``) in sys.modules while inside."""
    modules = {name: types.ModuleType(name) for name in stand_ins}
    for name, module in modules.items():
        for attribute in stand_ins[name]:
            setattr(module, attribute, _not_on_cpu)
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    saved = {key: sys.modules.get(key) for key in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def import_over_stand_in(target: str, stand_ins: dict):
    """Import ``target``, over stand-in modules (``_stand_in_modules``) where a real one is
    absent; the stand-ins leave sys.modules right after (the module keeps its names). Returns the
    undo: where a stand-in was used, the module is forgotten again (sys.modules and the package
    attribute), so that the watch does not see a backend it could not import itself."""
    if target in sys.modules:
        return lambda: None
    try:
        importlib.import_module(target)
        return lambda: None
    except ImportError:
        pass
    with _stand_in_modules(stand_ins):
        importlib.import_module(target)

    def undo():
        sys.modules.pop(target, None)
        parent, _, name = target.rpartition(".")
        if parent in sys.modules:
            sys.modules[parent].__dict__.pop(name, None)

    return undo


FA3_STAND_IN = {"sgl_kernel": ("merge_state_v2",)}


def import_fa3():
    """flashattention_backend over the stand-in sgl_kernel where it is absent; returns the undo."""
    return import_over_stand_in(FA3, FA3_STAND_IN)


def import_fa3_file(path, name: str):
    """Execute ``path`` (e.g. a patched copy of the release's flashattention_backend.py) as the
    module ``name``, over the stand-in sgl_kernel where it is absent. Returns (module, undo);
    undo forgets the module."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    try:
        importlib.import_module("sgl_kernel")
        stand_in = contextlib.nullcontext()
    except ImportError:
        stand_in = _stand_in_modules(FA3_STAND_IN)
    sys.modules[name] = module
    try:
        with stand_in:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module, lambda: sys.modules.pop(name, None)


def req_to_token_pool(context_len: int, extra: int, page: int = 1, max_bs: int = 2):
    """Real ReqToTokenPool, max_bs rows + row 0 (the runner's capture row), context_len + extra
    wide; the slot of (row r, column c) is (r * pages_per_row + c // page) * page + c % page, so
    req_to_token[r, j * page] // page = r * pages_per_row + j names its own row and page."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(
        size=max_bs + 1, max_context_len=context_len + extra, device="cpu", enable_memory_saver=False
    )
    rows, cols = pool.req_to_token.shape
    per_row = math.ceil(cols / page)
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    pool.req_to_token.copy_(((r * per_row + c // page) * page + c % page).to(pool.req_to_token.dtype))
    return pool


class Fields(types.SimpleNamespace):
    """A ForwardBatch-like namespace whose fields not given read None: the newer runners' views
    (0.5.23 decode_cuda_graph_runner.py:170-240, forward_batch_info.py build_inner_fb_view) read
    fields (kv_loc_plan, lora_ids, mamba_track_indices, ...) a plain decode batch leaves unset."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class PlainTranslator:
    """0.5.23 ``model_runner.kv_index_translator`` of an ordinary (not unified-memory) pool."""

    is_translating = False
    reads_are_translated = False


def init_assignment(cls, attribute: str, backend):
    """The value ``cls.__init__`` gives ``self.<attribute>``, evaluated from the class's own source
    with ``self`` = ``backend`` (its fields set first); None where the release has no such line.
    So a patched file's own ``__init__`` line is what the built backend carries."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == attribute and getattr(t.value, "id", "") == "self"
            for t in node.targets
        ):
            code = compile(ast.Expression(node.value), "<init>", "eval")
            return eval(code, vars(sys.modules[cls.__module__]), {"self": backend})
    return None


def fa3_release_backend(pool, context_len: int, D: int, page: int, step_id: int = 0, module=None):
    """FlashAttentionBackend of the imported release (or of ``module``, e.g. a patched copy) as
    its ``__init__`` leaves it for a decoder-only MHA model, FA3, EAGLE topk 1, no SWA / local
    attention / encoder: 0.5.14 flashattention_backend.py:118-240, 0.5.17 :120-330 (adds
    max_num_pages :180, needs_cpu_seq_lens, _unified_hooks), 0.5.23 (+ kv_index_translator :204).
    ``max_num_pages`` is the release's own ``__init__`` expression (``init_assignment``).
    init_cuda_graph_state is left to the caller."""
    module = module or sys.modules[FA3]
    cls = module.FlashAttentionBackend
    b = cls.__new__(cls)
    b.device, b.max_context_len, b.page_size = torch.device("cpu"), context_len, page
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b.use_mla = b.is_encoder_decoder = b.has_local_attention = False
    b.use_sliding_window_kv_pool = b.has_swa = b.skip_prefill = b.is_draft_runner = False
    b.sliding_window_size = b.local_attn_builder = b._get_scheduler_metadata = None
    b.topk, b.speculative_num_draft_tokens, b.speculative_num_steps = 1, D, D - 1
    b.speculative_step_id = step_id
    b.fa_impl_ver, b.attn_cp_size, b.num_splits = 3, 1, 0
    b.forward_metadata = b.forward_metadata_spec_decode_expand = None
    b.decode_cuda_graph_metadata, b.target_verify_metadata, b.draft_extend_metadata = {}, {}, {}
    # 0.5.17+ fields (harmless where the release does not read them).
    b.needs_cpu_seq_lens, b.is_prefill_aware_swa = False, False
    b._unified_hooks = types.SimpleNamespace(enabled=False, v2p_page_table=None, kernel_page_multiplier=1)
    b._unified_dense, b._verify_mask, b._kv_shard_pool = False, None, None
    b._decode_uses_static_max_seqlen_k = False
    b.kv_index_translator = PlainTranslator()
    max_num_pages = init_assignment(cls, "max_num_pages", b)
    if max_num_pages is not None:
        b.max_num_pages = max_num_pages
    return b


def fa3_draft_backend(pool, context_len: int, D: int, page: int, module=None):
    """FlashAttentionMultiStepBackend (0.5.14 flashattention_backend.py:2760-2790): one step
    backend per step 0 .. num_steps - 2, num_steps = D - 1 (EAGLE topk 1), sharing the pool."""
    module = module or sys.modules[FA3]
    cls = module.FlashAttentionMultiStepBackend
    m = cls.__new__(cls)
    m.model_runner, m.topk, m.speculative_num_steps = None, 1, D - 1
    m.kv_index_translator, m.forward_metadata = PlainTranslator(), None
    m.attn_backends = [fa3_release_backend(pool, context_len, D, page, i, module) for i in range(D - 2)]
    m.attn_backend_list = m.attn_backends
    return m


def mode(name: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


def draft_input():
    """A real EagleDraftInput (is_draft_input() True) with no tensors: what the draft graph
    runner's batch carries into init_forward_metadata_out_graph."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    return EagleDraftInput()


def capture_fields(mode_name: str, bs: int, tokens_per_req: int, spec_info=None) -> Fields:
    """A capture batch as the runners build it: seq_lens at the fill value 1, pool row 0
    (0.5.14 decode_cuda_graph_runner.py:673-680, :760-772)."""
    seq_lens = torch.ones(bs, dtype=torch.int64)
    return Fields(
        batch_size=bs,
        forward_mode=mode(mode_name),
        actual_forward_mode=mode(mode_name),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=bs,
        input_ids=torch.zeros(bs * tokens_per_req, dtype=torch.int64),
        positions=torch.zeros(bs * tokens_per_req, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs * tokens_per_req, dtype=torch.int64),
        spec_info=spec_info,
    )


def verify_input(bs: int, D: int, device: str = "cpu"):
    """A real EagleVerifyInput (topk 1) of a target_verify batch of bs requests, on ``device``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
    return EagleVerifyInput(
        draft_token=zeros(bs * D),
        custom_mask=torch.ones(bs * D * D, dtype=torch.bool, device=device),
        positions=zeros(bs * D),
        retrieve_index=zeros(bs, D),
        retrieve_next_token=zeros(bs, D),
        retrieve_next_sibling=zeros(bs, D),
        retrieve_cum_len=None,
        spec_steps=D - 1,
        topk=1,
        draft_token_num=D,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=0,
        seq_lens_cpu=torch.zeros(bs, dtype=torch.int64),
    )


def replay_view(mode_name: str, seq_lens: list, tokens_per_req: int, spec_info=None, device: str = "cpu"):
    """The decode cuda-graph runner's replay view (its own build_replay_fb_view, whatever its
    signature: 0.5.23 adds global_num_tokens_cpu) of a batch whose row b is pool row b + 1."""
    try:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
    except ImportError:  # 0.5.13 keeps the runner in model_executor/cuda_graph_runner.py (:109)
        from sglang.srt.model_executor.cuda_graph_runner import build_replay_fb_view

    bs = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    n = bs * tokens_per_req
    buffers = Fields(
        input_ids=torch.zeros(n, dtype=torch.int64, device=device),
        positions=torch.zeros(n, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64, device=device),
        seq_lens=lens,
        seq_lens_cpu=lens.cpu(),
        encoder_lens=None,
    )
    batch = Fields(
        forward_mode=mode(mode_name),
        seq_lens_sum=int(lens.sum()),
        seq_lens_cpu=lens.cpu(),
        spec_info=spec_info,
        out_cache_loc=torch.zeros(n, dtype=torch.int64, device=device),
    )
    given = dict(
        forward_batch=batch,
        buffers=buffers,
        bs=bs,
        raw_bs=bs,
        num_tokens=n,
        global_num_tokens_cpu=None,
        seq_len_fill_value=1,
        capture_forward_mode=mode(mode_name),
        is_encoder_decoder=False,
    )
    names = inspect.signature(build_replay_fb_view).parameters
    return build_replay_fb_view(**{k: v for k, v in given.items() if k in names})


def draft_replay_batch(seq_lens: list, spec_info):
    """The draft graph runner's batch at replay (0.5.14 eagle_draft_cuda_graph_runner.py:560-598:
    the ForwardBatch itself, bs rows, host lengths): row b is pool row b + 1."""
    bs = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return Fields(
        batch_size=bs,
        forward_mode=mode("DECODE"),
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        seq_lens_sum=int(lens.sum()),
        positions=torch.zeros(bs, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        encoder_lens=None,
        spec_info=spec_info,
    )
