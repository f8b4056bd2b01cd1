"""One real call of a backend's CUDA-graph replay entry, recorded for ``watch_overhead.py`` to time.

The watch's replay hook runs around a method of the backend class (its unit's ``WATCHES``):
to time it against sglang's own method, this builds the real backend of the installed sglang
on the device, captures a TARGET_VERIFY graph batch of ``bs`` requests and replays one below the
context limit, recording the arguments the method got (``recorded_call``). The timed calls then
repeat that very call, with and without the hook. TARGET_VERIFY because every speculative
decode step replays it; the checks of the other modes read the same host lengths.

- DSA (0.5.13+): ``proof.replay.GraphSession``, the driver the GPU tier and
  ``dsa_replay_cost.py`` run on the H200 (page 64, the flashmla_kv decode path on CUDA);
- Triton: ``TritonAttnBackend`` built with ``__new__`` and the attributes its ``__init__`` sets for
  an MHA decoder without sliding window (0.5.14 triton_backend.py:97-281), graph state from its
  own ``init_cuda_graph_state`` (:788-874), replayed through ``init_forward_metadata_out_graph``
  with the decode runner's own ``build_replay_fb_view`` (decode_cuda_graph_runner.py:116-160).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from types import SimpleNamespace


def owner_of(target: str):
    """(class, method name) of a dotted ``module.Class.method`` target."""
    path, _, name = target.rpartition(".")
    module, _, owner = path.rpartition(".")
    return getattr(importlib.import_module(module), owner), name


def recorded_call(target: str, run) -> tuple:
    """(sglang's method, args, kwargs) of the first call of ``target`` while ``run()`` runs."""
    owner, name = owner_of(target)
    original = owner.__dict__[name]
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(owner, name, record)
    try:
        run()
    finally:
        setattr(owner, name, original)
    if not calls:
        raise RuntimeError(f"the replay never called {target}")
    return (original, *calls[0])


def dsa_replay(target: str, bs: int, context_len: int, D: int, device: str):
    """(method, args, kwargs, context) of a DSA TARGET_VERIFY replay; ``context`` is what every
    call of the method needs around it (on CPU, the GPU-only helper's stand-in)."""
    from sglang_dsa_fix.proof import replay
    from sglang_dsa_fix.proof.cpu_stand_ins import stand_ins_for

    _, backend_cls = replay.import_backend_class()
    session = replay.GraphSession(backend_cls, replay.Case(context_len, D, 64, bs, device))
    session.capture("TARGET_VERIFY", bs)
    seq_len = context_len - 2 * D  # below the boundary: pristine and fixed both replay it
    with stand_ins_for(backend_cls, device):
        call = recorded_call(target, lambda: session.replay("TARGET_VERIFY", bs, seq_len))
    return (*call, lambda: stand_ins_for(backend_cls, device))


class Fields(SimpleNamespace):
    """A ForwardBatch-like namespace whose fields not given read None: newer runners' views read
    fields a plain decode batch leaves unset (0.5.17 decode_cuda_graph_runner.py:182
    mamba_track_indices; 0.5.23 kv_loc_plan, lora_ids, ...)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _mode(name: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


def triton_backend(bs: int, context_len: int, D: int, device: str):
    """A real TritonAttnBackend over a real ReqToTokenPool (bs rows + row 0, context + D + 4 wide)."""
    import torch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(
        size=bs + 1, max_context_len=context_len + D + 4, device=device, enable_memory_saver=False
    )
    rows, cols = pool.req_to_token.shape
    pool.req_to_token.copy_(
        torch.arange(rows * cols, device=device).view(rows, cols).to(pool.req_to_token.dtype)
    )
    b = TritonAttnBackend.__new__(TritonAttnBackend)
    b.skip_prefill, b.sliding_window_size, b.use_sliding_window_kv_pool = False, None, False
    b.req_to_token_pool, b.req_to_token, b.token_to_kv_pool = pool, pool.req_to_token, None
    b.num_draft_tokens, b.speculative_num_steps, b.topk = D, D - 1, 1
    b.use_mla, b.num_head, b.num_kv_head, b.v_head_dim, b.swa_v_head_dim = False, 4, 4, 64, None
    b.max_context_len, b.device = context_len, torch.device(device)
    b.device_core_count = (
        torch.cuda.get_device_properties(device).multi_processor_count if b.device.type == "cuda" else 0
    )
    b.static_kv_splits, b.enable_deterministic, b.split_tile_size, b.max_kv_splits = True, False, None, 8
    b.kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    b.window_kv_indptr = None
    b.qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    b.mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    b.forward_metadata, b.cuda_graph_custom_mask = None, None
    # What later releases' __init__ adds, at the values a single-GPU MHA server gets (0.5.17
    # triton_backend.py:152-302: page 1, no unified-pool translation, no split-KV verify, no
    # decode context parallelism, not the draft runner).
    later = dict(
        page_size=1, _translate_kv_loc=None, token_to_kv_pool_allocator=None, use_verify_splitkv=False
    )
    later.update(dcp_size=1, dcp_rank=0, use_pdl=False, allow_bidirectional_attention_in_extend=False)
    later.update(_verify_mask=None, is_draft_runner=False)
    for name, value in later.items():
        setattr(b, name, value)
    b.init_cuda_graph_state(bs, bs * D)
    return b


def triton_replay(target: str, bs: int, context_len: int, D: int, device: str):
    """(method, args, kwargs, context) of a Triton TARGET_VERIFY replay."""
    import torch

    from sglang_dsa_fix.proof.fa3_backend import replay_view, verify_input

    backend = triton_backend(bs, context_len, D, device)
    spec = verify_input(bs, D, device)
    ones = torch.ones(bs, dtype=torch.int64, device=device)
    capture = Fields(  # the runner's capture batch: seq_lens at the fill value 1, row 0
        batch_size=bs,
        forward_mode=_mode("TARGET_VERIFY"),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=device),
        seq_lens=ones,
        seq_lens_cpu=ones.cpu(),
        seq_lens_sum=bs,
        positions=torch.zeros(bs * D, dtype=torch.int64, device=device),
        encoder_lens=None,
        out_cache_loc=None,
        spec_info=spec,
    )
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    seq_lens = [max(1, context_len - 2 * D - i % 3) for i in range(bs)]
    view = replay_view("TARGET_VERIFY", seq_lens, D, spec, device)
    call = recorded_call(target, lambda: backend.init_forward_metadata_out_graph(view))
    return (*call, contextlib.nullcontext)


REPLAYS = {"dsa": dsa_replay, "triton": triton_replay}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " (prints what it recorded)")
    parser.add_argument(
        "--backend", choices=sorted(REPLAYS), default="dsa", help="attention backend (default dsa)"
    )
    parser.add_argument("--batch-size", type=int, default=2, help="requests in the replay (default 2)")
    parser.add_argument("--context-length", type=int, default=64, help="context_length (default 64)")
    parser.add_argument("--draft-tokens", type=int, default=2, help="D, draft tokens per request (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (Triton interpreter) or cuda (default cpu)")
    return parser


def main(argv=None) -> int:
    import os

    args = build_parser().parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
    from sglang_dsa_fix import watch
    from sglang_dsa_fix.proof.replay import installed_version

    kind = {"dsa": "dsa_replay", "triton": "triton_replay"}[args.backend]
    target = next(c.target for c in watch.select(installed_version(), resolve=False) if c.kind == kind)
    _, call_args, call_kwargs, _ = REPLAYS[args.backend](
        target, args.batch_size, args.context_length, args.draft_tokens, args.device
    )
    print(target, [type(a).__name__ for a in call_args], sorted(call_kwargs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
