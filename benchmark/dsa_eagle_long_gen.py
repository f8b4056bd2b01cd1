"""End-to-end long generation with EAGLE on a tiny dummy-weight DSA model: pristine vs fixed.

Reproduces the users' symptom with the real engine: EAGLE (steps 4, topk 1, D 5), CUDA graphs
and the overlap scheduler on, acceptance forced with SGLANG_SIMULATE_ACC_LEN, and requests whose
last verify overshoots context_len. Each variant runs in its own process (a crashed scheduler
leaves clients blocked), one after the other, in this one run:

  none     the installed sglang as is (expected: the size-mismatch crash)
  apply    the in-tree patch, applied to a temporary copy of the installed sglang
  plugin   this package installed (entry point sglang.srt.plugins), sglang untouched

Phases per variant: a control group that stays far below context_len (repeated, for tok/s
with spread), then the boundary group (every request crosses context_len in its last verify;
`--soak N` sets how many). Per variant: requests completed / failed (error text from the log),
output tok/s, accept length, ITL p50/p99, wall time, peak GPU memory, page_table bytes; one JSON
line each (--jsonl) and a table. Exit 0 only if every fixed variant completes every request and
the pristine run reproduces the crash.

    python benchmark/dsa_eagle_long_gen.py [--variants none,plugin] [--server] [--soak 64]

No downloads: the model's config.json is written here, weights are dummy, input_ids go in.
Needs a CUDA GPU with sglang 0.5.14 (scripts/gpu/env.sh sets up an offline host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

CRASH_PATTERN = re.compile(r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)[^\n]*")


# ---------------------------------------------------------------------------- the model
def write_model(directory: Path, context_len: int) -> Path:
    """A 1-layer DeepSeek-V3.2 (DSA) config that fits sm90 kernels' hard constraints."""
    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 2048,  # > 100: forced acceptance predicts token id 100
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_nextn_predict_layers": 1,  # the EAGLE/MTP draft layer (MoE, DSA)
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 256,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 2048,
        "n_routed_experts": 6,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "moe_layer_freq": 1,
        "ep_size": 1,
        "hidden_act": "silu",
        "max_position_embeddings": max(4096, context_len),
        "rope_theta": 10000,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def engine_kwargs(args, model: Path) -> dict:
    return dict(
        model_path=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        context_length=args.context_len,
        speculative_algorithm="EAGLE",
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=args.speculative_num_steps + 1,
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
        log_level="info",
    )


def variant_env(args) -> dict:
    D = args.speculative_num_steps + 1
    return {
        "SGLANG_SIMULATE_ACC_LEN": str(D),  # every verify accepts all D tokens
        "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
        "SGLANG_IS_FLASHINFER_AVAILABLE": "false",  # pytorch sampling, no flashinfer JIT
        "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",  # no FA3 dense prefill
    }


# ---------------------------------------------------------------------------- workload
def boundary_lengths(context_len: int, D: int):
    """(prompt, max_new) whose overlapped last verify reads past context_len.

    Admission keeps prompt + max_new <= context_len - 2; with full acceptance the verify after
    the finishing one sees seq_len - context_len = k*D - M - 2, k = ceil((M-1)/D): it crosses
    iff k*D - M >= 3 (needs D >= 5).
    """
    for max_new in range(D + 1, 8 * D):
        k = math.ceil((max_new - 1) / D)
        if k * D - max_new >= 3:
            return context_len - 2 - max_new, max_new
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
        generator = await self.engine.async_generate(
            input_ids=input_ids, sampling_params=params, stream=True
        )
        async for chunk in generator:
            times.append(time.perf_counter())
            meta = chunk.get("meta_info", meta)
        return times, meta


class ServerClient:
    def __init__(self, args, model, log):
        import requests

        self.requests = requests
        self.port = args.port
        cli = ["--port", str(args.port), "--host", "127.0.0.1"]
        for key, value in engine_kwargs(args, model).items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cli.append(flag)
            elif value not in (False, None):
                cli += [flag, str(value)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *cli], stdout=log, stderr=log
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

    def _post(self, input_ids, params):
        times, meta = [], {}
        body = {"input_ids": input_ids, "sampling_params": params, "stream": True}
        with self.requests.post(f"http://127.0.0.1:{self.port}/generate", json=body,
                                stream=True, timeout=(5, None)) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    times.append(time.perf_counter())
                    meta = json.loads(line[5:]).get("meta_info", meta)
        return times, meta

    async def stream(self, input_ids, params):
        return await asyncio.to_thread(self._post, input_ids, params)


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
    finished = [o for o in outcomes if o["error"] is None
                and (o["meta"].get("finish_reason") or {}).get("type") == "length"]
    tokens = sum(o["meta"].get("completion_tokens", 0) for o in finished)
    gaps = [b - a for o in finished for a, b in zip(o["times"], o["times"][1:])]
    accept = [o["meta"]["spec_accept_length"] for o in finished if "spec_accept_length" in o["meta"]]
    return {
        "requests": len(requests),
        "completed": len(finished),
        "failed": len(requests) - len(finished),
        "timed_out": len(pending),
        "request_errors": sorted({o["error"] for o in outcomes if o["error"]})[:3],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall else 0.0,
        "accept_length": statistics.mean(accept) if accept else None,
        "itl_ms_p50": 1e3 * statistics.median(gaps) if gaps else None,
        "itl_ms_p99": 1e3 * statistics.quantiles(gaps, n=100)[98] if len(gaps) >= 2 else None,
    }


# ---------------------------------------------------------------------------- worker
def worker(args) -> int:
    """One variant, in its own process: start, control phases, boundary phase."""
    result_path = Path(args.result)
    result = {"variant": args.worker}

    def save():
        result_path.write_text(json.dumps(result))

    model = write_model(Path(args.model_dir), args.context_len)
    D = args.speculative_num_steps + 1
    t0 = time.perf_counter()
    client = ServerClient(args, model, sys.stderr) if args.server else EngineClient(args, model)
    result["start_s"] = time.perf_counter() - t0
    save()
    loop = asyncio.get_event_loop()  # the loop sglang.Engine's tokenizer manager runs on
    loop.run_until_complete(run_group(client, make_requests(2, 16, 8, 0), 2, args.phase_timeout))
    control = []
    for rep in range(args.control_reps):
        reqs = make_requests(args.control_requests, 64, args.control_max_new, 100 + rep)
        control.append(loop.run_until_complete(
            run_group(client, reqs, args.concurrency, args.phase_timeout)))
        result["control"] = control
        save()
    prompt, max_new = boundary_lengths(args.context_len, D)
    result["boundary_prompt_len"], result["boundary_max_new"] = prompt, max_new
    save()  # before the phase that crashes a pristine scheduler
    # max_new_tokens None, the long-generation case: an explicit max_new_tokens is checked
    # against context_len with the draft tokens added (0.5.14 rejects prompt + D + max_new >
    # context_len), while None is clamped to context_len - prompt - 2 = max_new.
    reqs = make_requests(args.soak, prompt, None, 7)
    result["boundary"] = loop.run_until_complete(
        run_group(client, reqs, args.concurrency, args.phase_timeout))
    save()
    print(f"[{args.worker}] done", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(0)  # the parent tears the engine's process group down


# ---------------------------------------------------------------------------- parent
def gpu_memory_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else -1


def prepare_variant(variant: str, work: Path) -> dict:
    """Environment for a variant's process: PYTHONPATH with a patched copy or the plugin."""
    from sglang_dsa_fix import source_patch

    base = os.environ.get("PYTHONPATH", "")
    env = {"SGLANG_DSA_FIX": "1"}
    if variant == "none":
        env["PYTHONPATH"] = base
    elif variant == "apply":
        installed = source_patch.find_tree(None)
        copy = work / "apply-site"
        shutil.copytree(installed.package_parent / "sglang", copy / "sglang",
                        ignore=shutil.ignore_patterns("__pycache__"))
        print("apply:", source_patch.apply(source_patch.find_tree(str(copy))), flush=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), base]))
    elif variant == "plugin":
        target = work / "plugin-site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-build-isolation", "--target", str(target), str(REPO)], check=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), base]))
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return env


def page_table_bytes(variant: str, args) -> int:
    """Target-verify graph buffer, max_bs * D rows x width x 4 B; widths as `status` reads them
    from the installed sglang (pristine: its own width expression; fixed: req_to_token's)."""
    from sglang_dsa_fix import status

    D = args.speculative_num_steps + 1
    shape = status.collect(None, args.context_len, D, 64, 1)["shape"]
    key = "graph_page_table_width_in_source" if variant == "none" else "req_to_token_width"
    return args.concurrency * D * shape[key] * 4


def run_variant(variant: str, args, work: Path) -> dict:
    log_path = work / f"{variant}.log"
    result_path = work / f"{variant}.json"
    env = {**os.environ, **variant_env(args), **prepare_variant(variant, work)}
    cmd = [sys.executable, __file__, "--worker", variant, "--result", str(result_path),
           "--model-dir", str(work / "model")] + forward_args(args)
    baseline = gpu_memory_used_mib()
    peak = [baseline]
    stop = threading.Event()

    def poll():
        while not stop.wait(0.5):
            peak[0] = max(peak[0], gpu_memory_used_mib())

    threading.Thread(target=poll, daemon=True).start()
    began = time.perf_counter()
    print(f"[{variant}] starting (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            # A crashed scheduler leaves the client blocked: stop as soon as the log has it.
            deadline = time.time() + args.variant_timeout
            while proc.poll() is None and time.time() < deadline:
                time.sleep(1)
                if CRASH_PATTERN.search(log_path.read_text(errors="replace")):
                    time.sleep(3)
                    break
        finally:
            with_group_killed(proc)
            stop.set()
    wall = time.perf_counter() - began
    result = json.loads(result_path.read_text()) if result_path.exists() else {"variant": variant}
    text = log_path.read_text(errors="replace")
    crash = CRASH_PATTERN.search(text)
    boundary = result.get("boundary") or {"requests": args.soak, "completed": 0,
                                           "failed": args.soak, "timed_out": args.soak}
    control = result.get("control") or []
    rates = [c["output_tok_per_s"] for c in control]
    row = {
        "variant": variant,
        "mode": "server" if args.server else "engine",
        "exit_code": proc.returncode,
        "start_s": result.get("start_s"),
        "wall_s": wall,
        "crash": crash.group(0) if crash else None,
        "boundary_requests": boundary["requests"],
        "boundary_completed": boundary["completed"],
        "boundary_failed": boundary["failed"],
        "boundary_prompt_len": result.get("boundary_prompt_len"),
        "boundary_max_new": result.get("boundary_max_new"),
        "control_completed": sum(c["completed"] for c in control),
        "control_failed": sum(c["failed"] for c in control),
        "control_tok_per_s": rates,
        "control_tok_per_s_median": statistics.median(rates) if rates else None,
        "accept_length": (control[-1]["accept_length"] if control else None),
        "itl_ms_p50": (control[-1]["itl_ms_p50"] if control else None),
        "itl_ms_p99": (control[-1]["itl_ms_p99"] if control else None),
        "boundary_tok_per_s": boundary.get("output_tok_per_s"),
        "peak_gpu_mem_mib": peak[0] - baseline if baseline >= 0 else None,
        "page_table_bytes_computed": page_table_bytes(variant, args),
    }
    print(f"[{variant}] {'CRASH ' + row['crash'] if row['crash'] else 'no crash'}; boundary "
          f"{row['boundary_completed']}/{row['boundary_requests']} completed", flush=True)
    return row


def with_group_killed(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def forward_args(args) -> list:
    out = []
    for key in ("context_len", "speculative_num_steps", "concurrency", "soak", "control_requests",
                "control_max_new", "control_reps", "phase_timeout", "start_timeout", "port"):
        out += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    return out + (["--server"] if args.server else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none,plugin", help="none, apply, plugin (comma list)")
    parser.add_argument("--server", action="store_true", help="launch_server + HTTP /generate")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--speculative-num-steps", type=int, default=4, help="D = steps + 1")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--soak", type=int, default=8, help="boundary-crossing requests")
    parser.add_argument("--control-requests", type=int, default=32)
    parser.add_argument("--control-max-new", type=int, default=192)
    parser.add_argument("--control-reps", type=int, default=5)
    parser.add_argument("--phase-timeout", type=float, default=90)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--variant-timeout", type=float, default=420)
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--jsonl", help="append one JSON line per variant to this file")
    parser.add_argument("--work-dir", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dsa-eagle-long-gen-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows = [run_variant(v, args, work) for v in variants]

    D = args.speculative_num_steps + 1
    print(f"\nEAGLE steps {args.speculative_num_steps}, topk 1, D {D}; context_len "
          f"{args.context_len}; concurrency {args.concurrency}; "
          f"{'launch_server' if args.server else 'Engine'}; logs in {work}")
    header = (f"{'variant':<8} {'boundary ok/n':>13} {'ctrl tok/s (reps)':>26} {'accept':>6} "
              f"{'ITL p50/p99 ms':>15} {'peak MiB':>8} {'page_table B':>12}  crash")
    # page_table B: the target-verify graph buffer, max_bs * D rows x width x 4, computed.
    print(header)
    for r in rows:
        rates = "/".join(f"{x:.0f}" for x in r["control_tok_per_s"]) or "-"
        itl = (f"{r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f}" if r["itl_ms_p50"] is not None else "-")
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
        print(f"{r['variant']:<8} {r['boundary_completed']:>6}/{r['boundary_requests']:<6} "
              f"{rates:>26} {acc:>6} {itl:>15} {r['peak_gpu_mem_mib'] or 0:>8} "
              f"{r['page_table_bytes_computed']:>12}  {r['crash'] or '-'}")
    pristine = [r for r in rows if r["variant"] == "none"]
    fixed = [r for r in rows if r["variant"] != "none"]
    if pristine and fixed and pristine[0]["control_tok_per_s"] and fixed[0]["control_tok_per_s"]:
        ratios = [f / p for f, p in zip(fixed[0]["control_tok_per_s"], pristine[0]["control_tok_per_s"])]
        print(f"control tok/s {fixed[0]['variant']}/none per rep: "
              + ", ".join(f"{x:.3f}" for x in ratios))
        for r in rows:
            r["control_ratio_vs_none"] = ratios if r is fixed[0] else None
    if args.jsonl:
        with open(args.jsonl, "a") as handle:
            for r in rows:
                handle.write(json.dumps(r) + "\n")
    ok = all(r["crash"] is None and r["boundary_completed"] == r["boundary_requests"]
             and r["control_failed"] == 0 for r in fixed)
    reproduced = all(r["crash"] for r in pristine)
    print(f"fixed variants complete every request: {ok}; pristine reproduces the crash: {reproduced}")
    return 0 if ok and reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
