"""The worker of ``dsa_eagle_long_gen.py``: one variant's engine in its own process.

Started by the parent (never by hand): writes the tiny model's config (``tiny_dsa_model.json``),
starts ``sglang.Engine`` or ``launch_server``, warms up, then runs the phases the parent sends on
stdin ("control REP", "boundary"), saving its result file after each. The parent reads that file;
a crashed scheduler leaves this process's clients blocked, so the parent owns the timeouts.

With ``--smoke`` (CI, no GPU) it builds the engine's arguments and the launch_server command line
but starts neither: a stand-in client answers every request with one token at once, so the
parent's protocol, the result file and the rows run through; the result says ``"smoke": true``
and its numbers measure nothing (no engine ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import fetch_server_info, itl_percentiles, output_throughput, write_no_follow

MODEL_CONFIG = Path(__file__).with_name("tiny_dsa_model.json")


# ---------------------------------------------------------------------------- the model
def write_model(directory: Path, context_length: int, config_file: Path = MODEL_CONFIG) -> Path:
    """A dummy-weight model directory. The default is a 1-layer DeepSeek-V3.2 (DSA) config that
    fits sm90 kernels' hard constraints (tiny_dsa_model.json: vocab > 100 since forced acceptance
    predicts token id 100; one NextN draft layer, MoE and DSA like the target)."""
    config = {**json.loads(config_file.read_text()), "max_position_embeddings": max(4096, context_length)}
    directory.mkdir(parents=True, exist_ok=True)
    write_no_follow(directory / "config.json", json.dumps(config, indent=2))
    return directory


def draft_tokens(args) -> int:
    """D = speculative_num_draft_tokens: steps + 1 with topk 1."""
    return args.speculative_num_steps + 1


def dummy_model_kwargs(model: Path, context_length: int) -> dict:
    """What every benchmark engine shares: dummy weights, token ids in, no tokenizer."""
    return dict(
        model_path=str(model), load_format="dummy", skip_tokenizer_init=True, context_length=context_length
    )


def engine_kwargs(args, model: Path) -> dict:
    return dict(
        **dummy_model_kwargs(model, args.context_length),
        speculative_algorithm="EAGLE",
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=draft_tokens(args),
        kv_cache_dtype="fp8_e4m3",
        dsa_prefill_backend="flashmla_kv",
        dsa_decode_backend="flashmla_kv",
        cuda_graph_backend_prefill="disabled",
        cuda_graph_max_bs_decode=args.concurrency,
        moe_runner_backend="triton",
        disable_flashinfer_autotune=True,
        max_total_tokens=16384,
        max_running_requests=args.concurrency,
        mem_fraction_static=0.5,
        # The variants' engines stay up side by side so control reps can alternate between them;
        # an idle scheduler otherwise spins a CPU core (scheduler_components/idle_sleeper.py).
        sleep_on_idle=True,
        tp_size=getattr(args, "tp_size", 1),
        dp_size=getattr(args, "dp_size", 1),
        enable_dp_attention=getattr(args, "enable_dp_attention", False),
        log_level="info",
    )


def variant_env(args) -> dict:
    D = draft_tokens(args)
    return {
        "SGLANG_SIMULATE_ACC_LEN": str(D),  # every verify accepts all D tokens
        "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
        "SGLANG_IS_FLASHINFER_AVAILABLE": "false",  # pytorch sampling, no flashinfer JIT
        "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",  # no FA3 dense prefill
    }


# ---------------------------------------------------------------------------- workload
def boundary_lengths(context_length: int, D: int):
    """(prompt, max_new) whose overlapped last verify reads past context_length.

    Admission keeps prompt + max_new <= context_length - 2; with full acceptance the verify after
    the finishing one sees seq_len - context_length = k*D - M - 2, k = ceil((M-1)/D): it crosses
    iff k*D - M >= 3 (needs D >= 5).
    """
    for max_new in range(D + 1, 8 * D):
        k = math.ceil((max_new - 1) / D)
        if k * D - max_new >= 3:
            return context_length - 2 - max_new, max_new
    raise SystemExit(f"no boundary-crossing length for D={D}: needs speculative_num_steps >= 4")


def make_requests(n: int, prompt_len: int, max_new, seed: int):
    """max_new None: generate until the context is full (sglang clamps it to what fits)."""
    rng = random.Random(seed)
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}
    return [([rng.randrange(200, 2000) for _ in range(prompt_len)], params) for _ in range(n)]


# ---------------------------------------------------------------------------- clients
class EngineClient:
    def __init__(self, args, model):
        import sglang

        self.engine = sglang.Engine(**engine_kwargs(args, model))

    async def stream(self, input_ids, params):
        times, meta = [], {}
        generator = await self.engine.async_generate(input_ids=input_ids, sampling_params=params, stream=True)
        async for chunk in generator:
            times.append(time.perf_counter())
            meta = chunk.get("meta_info", meta)
        return times, meta


def server_command(kwargs: dict, port: int) -> list:
    """``python -m sglang.launch_server`` with sglang.Engine's ``kwargs`` as its flags."""
    cli = ["--port", str(port), "--host", "127.0.0.1"]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cli.append(flag)
        elif value not in (False, None):
            cli += [flag, str(value)]
    return [sys.executable, "-m", "sglang.launch_server", *cli]


class ServerClient:
    def __init__(self, args, model, log, kwargs=None):
        """``launch_server`` with ``kwargs`` (sglang.Engine's names; default: the DSA model's)."""
        import requests

        self.requests = requests
        self.port = args.port
        self.process = subprocess.Popen(
            server_command(kwargs or engine_kwargs(args, model), args.port),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        deadline = time.time() + args.start_timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"launch_server exited with {self.process.returncode}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError("launch_server did not become healthy in time")

    def server_info(self):
        """The server's /server_info JSON (None if it cannot be read), as bench_serving records it."""
        return fetch_server_info(f"http://127.0.0.1:{self.port}")

    def _post(self, input_ids, params):
        times, meta = [], {}
        body = {"input_ids": input_ids, "sampling_params": params, "stream": True}
        with self.requests.post(
            f"http://127.0.0.1:{self.port}/generate", json=body, stream=True, timeout=(5, None)
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    times.append(time.perf_counter())
                    meta = json.loads(line[5:]).get("meta_info", meta)
        return times, meta

    async def stream(self, input_ids, params):
        return await asyncio.to_thread(self._post, input_ids, params)


class SmokeClient:
    """--smoke: no engine. Each request gets one token at once (finish_reason length): the
    protocol and the rows run through, and nothing in them is a figure."""

    def __init__(self, kwargs: dict, port: int):
        self.command = server_command(kwargs, port)  # built as for launch_server, not run

    async def stream(self, input_ids, params):
        await asyncio.sleep(0)
        return [time.perf_counter()], {"completion_tokens": 1, "finish_reason": {"type": "length"}}

    def server_info(self):
        return None


def gap_profile(gaps) -> dict:
    """A rep's steady decode speed and its stalls, for the benchmark's noise breakdown: the median
    gap between streamed chunks, and the share of all streamed time spent in gaps longer than
    five medians (beyond the median each such gap would have taken)."""
    if not gaps:
        return {"itl_median_ms": None, "stall_share": None}
    median = statistics.median(gaps)
    stalled = sum(g - median for g in gaps if g > 5 * median)
    return {"itl_median_ms": median * 1000, "stall_share": stalled / sum(gaps) if sum(gaps) else 0.0}


async def run_group(client, requests, concurrency: int, timeout: float) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    outcomes = []

    async def one(input_ids, params):
        async with semaphore:
            start = time.perf_counter()
            try:
                times, meta = await client.stream(input_ids, params)
                outcomes.append({"start": start, "times": times, "meta": meta, "error": None})
            except Exception as exc:  # noqa: BLE001 - reported per request
                outcomes.append({"start": start, "times": [], "meta": {}, "error": repr(exc)})

    began = time.perf_counter()
    tasks = [asyncio.ensure_future(one(*r)) for r in requests]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    wall = time.perf_counter() - began
    finished = [
        o
        for o in outcomes
        if o["error"] is None and (o["meta"].get("finish_reason") or {}).get("type") == "length"
    ]
    tokens = sum(o["meta"].get("completion_tokens", 0) for o in finished)
    gaps = [b - a for o in finished for a, b in zip(o["times"], o["times"][1:])]
    accept = [o["meta"]["spec_accept_length"] for o in finished if "spec_accept_length" in o["meta"]]
    return {
        **gap_profile(gaps),
        "requests": len(requests),
        "completed": len(finished),
        "failed": len(requests) - len(finished),
        "timed_out": len(pending),
        "request_errors": sorted({o["error"] for o in outcomes if o["error"]})[:3],
        # bench_serving's names and meanings: output tokens of the completed requests over this
        # run's duration (first request sent to the last one done, or to the phase timeout).
        "duration": wall,
        "total_output_tokens": tokens,
        "output_throughput": output_throughput(tokens, wall),
        "accept_length": statistics.mean(accept) if accept else None,
        "gaps": gaps,  # inter-token intervals, pooled over the control reps by the worker
    }


# ---------------------------------------------------------------------------- worker
def worker(args) -> int:
    """One variant, in its own process: start the engine, then run the phases the parent asks
    for on stdin ("control REP", "boundary"), saving the result file after each."""
    result_path = Path(args.result)
    result = {"variant": args.worker}

    def save():
        tmp = result_path.with_suffix(".tmp")
        write_no_follow(tmp, json.dumps(result))
        tmp.replace(result_path)  # the parent never reads half a file

    model = write_model(Path(args.model_dir), args.context_length)
    D = draft_tokens(args)
    t0 = time.perf_counter()
    if args.smoke:
        client = SmokeClient(engine_kwargs(args, model), args.port)
        result["smoke"] = True
        print(f"[{args.worker}] smoke: no engine; would run {' '.join(client.command)}", file=sys.stderr)
    elif args.server:
        client = ServerClient(args, model, sys.stderr)
    else:
        client = EngineClient(args, model)
    loop = asyncio.get_event_loop()  # the loop sglang.Engine's tokenizer manager runs on
    loop.run_until_complete(run_group(client, make_requests(2, 16, 8, 0), 2, args.phase_timeout))  # warm-up
    result.update(start_s=time.perf_counter() - t0, ready=True, control=[])
    # Where a server is used, its /server_info after each phase, as bench_serving records it after
    # its run (None in Engine mode: no server). The last one read is kept: a scheduler that died in
    # the boundary phase leaves the control phases' copy.
    result["server_info"] = client.server_info() if args.server else None
    save()
    gaps = []
    for line in iter(sys.stdin.readline, ""):  # one command per line, as the parent sends it
        command = line.split()
        if command[:1] == ["control"]:
            reqs = make_requests(args.control_requests, 64, args.control_max_new, 100 + int(command[1]))
            summary = loop.run_until_complete(run_group(client, reqs, args.concurrency, args.phase_timeout))
            gaps += summary.pop("gaps")
            result["control"].append(summary)
            result["control_itl_ms"] = itl_percentiles(gaps)
            if args.server:
                result["server_info"] = client.server_info() or result["server_info"]
            save()
        elif command[:1] == ["boundary"]:
            prompt, max_new = boundary_lengths(args.context_length, D)
            result["boundary_prompt_len"], result["boundary_max_new"] = prompt, max_new
            save()  # before the phase that crashes a pristine scheduler
            # max_new_tokens None, the long-generation case: an explicit max_new_tokens is
            # checked against context_length with the draft tokens added (0.5.14 rejects
            # prompt + D + max_new > context_length), while None is clamped to
            # context_length - prompt - 2 = max_new.
            reqs = make_requests(args.soak, prompt, None, 7)
            summary = loop.run_until_complete(run_group(client, reqs, args.concurrency, args.phase_timeout))
            summary.pop("gaps")
            result["boundary"] = summary
            if args.server:
                result["server_info"] = client.server_info() or result["server_info"]
            save()
        else:
            break
    print(f"[{args.worker}] done", file=sys.stderr, flush=True)
    os._exit(0)  # the parent tears the engine's process group down


ENGINE_FLAGS = (
    "context_length",
    "speculative_num_steps",
    "concurrency",
    "tp_size",
    "dp_size",
    "soak",
    "control_requests",
    "control_max_new",
    "phase_timeout",
    "start_timeout",
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the parent forwards to each worker (sglang's spellings where sglang has one)."""
    parser.add_argument(
        "--server",
        action="store_true",
        help="run each engine as python -m sglang.launch_server and send HTTP /generate "
        "(default: sglang.Engine in the worker process)",
    )
    parser.add_argument(
        "--context-length", type=int, default=512, help="the engine's context_length (default 512)"
    )
    parser.add_argument(
        "--speculative-num-steps",
        type=int,
        default=4,
        help="EAGLE steps, topk 1; D = speculative_num_draft_tokens = steps + 1 (default 4)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="requests in flight at once; also the engine's max_running_requests and "
        "cuda_graph_max_bs_decode (default 4)",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor parallel size (GPUs per engine)")
    parser.add_argument(
        "--dp-size", type=int, default=1, help="data parallel size (with --enable-dp-attention)"
    )
    parser.add_argument(
        "--enable-dp-attention", action="store_true", help="sglang's --enable-dp-attention (with --dp-size)"
    )
    parser.add_argument(
        "--soak", type=int, default=64, help="boundary-crossing requests of the boundary phase (default 64)"
    )
    parser.add_argument(
        "--control-requests", type=int, default=32, help="requests per control rep (default 32)"
    )
    parser.add_argument(
        "--control-max-new",
        type=int,
        default=192,
        help="max_new_tokens of a control request, far below context_length (default 192)",
    )
    parser.add_argument(
        "--phase-timeout", type=float, default=90, help="seconds per phase (control rep or boundary)"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=420,
        help="seconds for an engine to start (a cold JIT cache needs minutes)",
    )
    parser.add_argument("--port", type=int, default=30123, help="server mode: first variant's port")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run without a GPU: no engine starts, a stand-in client answers each request "
        'with one token; every row says "smoke": true, its numbers measure nothing',
    )


def forward_args(args, port: int) -> list:
    """The parent's settings as this worker's command line."""
    out = ["--port", str(port)]
    for key in ENGINE_FLAGS:
        out += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    return (
        out
        + ["--server"] * args.server
        + ["--enable-dp-attention"] * args.enable_dp_attention
        + ["--smoke"] * args.smoke
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one variant of dsa_eagle_long_gen.py (started by it)")
    add_engine_arguments(parser)
    parser.add_argument("--worker", required=True, help="the variant's name (none, apply, plugin)")
    parser.add_argument("--result", required=True, help="JSON file the parent reads")
    parser.add_argument(
        "--model-dir", required=True, help="where to write the tiny dummy-weight model's config.json"
    )
    return parser


def main(argv=None) -> int:
    return worker(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
