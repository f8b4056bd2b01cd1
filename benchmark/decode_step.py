"""The decode step ``watch_overhead.py`` divides by: a real ``sglang.Engine`` of the configuration, timed.

Why an engine step and not a backend replay: the watch's hooks run inside the scheduler's
speculative decode step, whose time is the draft steps, the verify and draft-extend forwards
(CUDA-graph replays of the whole model), sampling and the scheduler's own host work. A replay of
one backend's metadata and one layer's graph is a small part of that, so it would state the
watch's share of something no server runs. The engine is pristine (no fix, no watch): the only
plugin in it is ``hook_calls.py``, which counts how often each watched function is called per
step, so the per-step cost uses measured call counts, not assumed ones.

Per batch size: ``bs`` requests sent together (random prompts, ``ignore_eos``, the same
``max_new_tokens``), streamed; a request's consecutive chunks are one decode step apart (one
chunk per step, stream_interval 1), and only the gaps inside the window where all ``bs`` requests
are running count: ``step_ms`` is their median. ``steps`` is the most chunks any request got, and
the calls per step of each watched kind are the plugin's counts over the batch / ``steps``.

Configurations (``benchmark/tiny_*_model.json``, dummy weights, as earlier GPU runs):

- ``dsa``: the tiny DeepSeek-V3.2 of ``long_gen_worker.py`` (EAGLE topk 1, D = steps + 1,
  page 64, fp8 KV, flashmla_kv; every verify accepts D tokens: ``SGLANG_SIMULATE_ACC_LEN``);
- ``triton``: the tiny Llama of ``dsa_row_overflow_e2e.py --case llama-ngram-page1`` (NGRAM,
  triton attention, page 1, CUDA graphs on), here with D = steps + 1 draft tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pkgutil
import random
import statistics
import sys
import time
from pathlib import Path

from bench_common import install_entry_point
from hook_calls import DIRECTORY_ENV, ENTRY_POINT, read_counts, register
from long_gen_worker import dummy_model_kwargs, engine_kwargs, variant_env, write_model

HERE = Path(__file__).resolve().parent
MODELS = {"dsa": HERE / "tiny_dsa_model.json", "triton": HERE / "tiny_llama_model.json"}
PROMPT_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The configuration's flags (``watch_overhead.py`` has the same)."""
    parser.add_argument(
        "--backend", choices=sorted(MODELS), default="dsa", help="attention backend (default dsa)"
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[4, 32], help="requests per decode step (default 4 32)"
    )
    parser.add_argument("--context-length", type=int, default=1024, help="context_length (default 1024)")
    parser.add_argument(
        "--speculative-num-steps", type=int, default=5, help="EAGLE steps, topk 1: D = steps + 1 (default 5)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=384,
        help="tokens per request of a timed engine batch (default 384)",
    )


def engine_config(backend: str, args, model: Path) -> tuple:
    """(sglang.Engine kwargs, environment) of the configuration, sized for the largest batch."""
    top = max(args.batch_sizes)
    tokens = max(
        16384, 2 * top * (PROMPT_TOKENS + args.max_new_tokens + 4 * (args.speculative_num_steps + 1))
    )
    if backend == "dsa":
        settings = type("Settings", (), {})()
        settings.context_length, settings.speculative_num_steps = (
            args.context_length,
            args.speculative_num_steps,
        )
        settings.concurrency = top
        kwargs = {**engine_kwargs(settings, model), "max_total_tokens": tokens, "log_level": "warning"}
        return kwargs, variant_env(settings)
    kwargs = dict(
        **dummy_model_kwargs(model, args.context_length),
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=args.speculative_num_steps + 1,
        attention_backend="triton",
        page_size=1,
        sampling_backend="pytorch",
        cuda_graph_max_bs_decode=top,
        max_running_requests=top,
        max_total_tokens=tokens,
        mem_fraction_static=0.5,
        disable_flashinfer_autotune=True,
        log_level="warning",
    )
    return kwargs, {}


def counting_site(work: Path) -> Path:
    """A site dir holding the call-counting plugin (entry point ``watch_hook_calls``)."""
    site = work / "hook-calls-site"
    install_entry_point(
        site, ENTRY_POINT, "0", [HERE / "hook_calls.py"], f"{ENTRY_POINT} = hook_calls:register"
    )
    return site


async def _stream(engine, input_ids, params) -> list:
    times = []
    generator = await engine.async_generate(input_ids=input_ids, sampling_params=params, stream=True)
    async for _ in generator:
        times.append(time.perf_counter())
    return times


async def _batch(engine, bs: int, max_new: int, seed: int) -> list:
    rng = random.Random(seed)
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}
    prompts = [[rng.randrange(200, 2000) for _ in range(PROMPT_TOKENS)] for _ in range(bs)]
    return await asyncio.gather(*(_stream(engine, p, params) for p in prompts))


def step_of(chunk_times: list) -> dict:
    """Median gap between a request's consecutive chunks while every request runs."""
    start = max(times[0] for times in chunk_times)
    end = min(times[-1] for times in chunk_times)
    gaps = [b - a for times in chunk_times for a, b in zip(times, times[1:]) if a >= start and b <= end]
    return {
        "step_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "step_gaps": len(gaps),
        "steps": max(len(times) for times in chunk_times),
    }


def measure(backend: str, args, work: Path) -> dict:
    """{bs: {step_ms, step_gaps, steps, calls, calls_per_step}} from one engine of ``backend``."""
    import sglang

    model = write_model(work / "model", args.context_length, MODELS[backend])
    kwargs, env = engine_config(backend, args, model)
    counts = work / "hook-calls"
    counts.mkdir()
    site = counting_site(work)
    # Inherited by the scheduler process (spawned): the plugin on its path, where to count.
    os.environ.update(env)
    os.environ[DIRECTORY_ENV] = str(counts)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    # multiprocessing's spawn hands the scheduler this process's sys.path, not PYTHONPATH's: the
    # plugin's entry point is found there only if the site dir is on it here.
    sys.path.insert(0, str(site))
    engine = sglang.Engine(**kwargs)
    try:
        loop = asyncio.get_event_loop()
        loop.run_until_complete(_batch(engine, max(args.batch_sizes), 32, seed=0))  # warm-up
        out = {}
        for bs in args.batch_sizes:
            before = read_counts(counts)
            chunks = loop.run_until_complete(_batch(engine, bs, args.max_new_tokens, seed=bs))
            after = read_counts(counts)
            step = step_of(chunks)
            calls = {kind: after[kind] - before.get(kind, 0) for kind in after}
            step["calls"] = calls
            step["calls_per_step"] = {kind: n / step["steps"] for kind, n in calls.items()}
            out[bs] = step
        return out
    finally:
        engine.shutdown()


def counted_once(work: Path, target: str, arguments) -> dict:
    """CPU smoke: the counting plugin registered, sglang's HookRegistry applies it, one call of
    ``target``: the plugin's counts (that kind 1, every other 0)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    counts = work / "hook-calls"
    counts.mkdir()
    os.environ[DIRECTORY_ENV] = str(counts)
    register()
    HookRegistry.apply_hooks()
    pkgutil.resolve_name(target)(*arguments)
    return read_counts(counts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " (GPU; prints JSON)")
    add_arguments(parser)
    return parser


def main(argv=None) -> int:
    import tempfile

    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="decode-step-") as work:
        print(json.dumps(measure(args.backend, args, Path(work))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
