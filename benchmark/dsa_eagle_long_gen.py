"""End-to-end long generation with EAGLE on a tiny dummy-weight DSA model: pristine vs fixed.

Reproduces the users' symptom with the real engine: EAGLE (steps 4, topk 1, D 5), CUDA graphs
and the overlap scheduler on, acceptance forced with SGLANG_SIMULATE_ACC_LEN, and requests whose
last verify overshoots context_len. Each variant runs in its own process (a crashed scheduler
leaves clients blocked), all in this one run:

  none     the installed sglang as is (expected: the size-mismatch crash)
  apply    the in-tree patch, applied to a temporary copy of the installed sglang
  plugin   this package installed (entry point sglang.srt.plugins), sglang untouched

The variants' engines start one after another and then stay up side by side. A control group
that stays far below context_len runs --control-reps times on each, the reps alternating between
the engines (ABBA) so that drift on the host hits every variant alike; fixed/pristine tok/s is
reported rep by rep with its spread. Then each variant gets the boundary group (every request
crosses context_len in its last verify; `--soak N` sets how many). Per variant: requests
completed / failed (error text from the log), output tok/s, accept length, ITL p50/p99, wall
time, GPU memory after start and at peak, page_table bytes; one JSON line each (--jsonl) and a
table. Exit 0 only if every fixed variant completes every request and the pristine run
reproduces the crash.

    python benchmark/dsa_eagle_long_gen.py [--variants none,plugin,apply] [--server] [--soak 64]

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

# What the plugin logs in a scheduler once it widened the buffer (sglang_dsa_fix/plugin.py):
# present in the plugin variant's log, absent from the others', or the run is not a comparison.
WIDENED_LINE = "sglang-dsa-fix: CUDA-graph page_table widened"
CRASH_PATTERN = re.compile(
    r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)[^\n]*"
)


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
        # The variants' engines stay up side by side so control reps can alternate between them;
        # an idle scheduler otherwise spins a CPU core (scheduler_components/idle_sleeper.py).
        sleep_on_idle=True,
        tp_size=getattr(args, "tp_size", 1),
        dp_size=getattr(args, "dp_size", 1),
        enable_dp_attention=getattr(args, "enable_dp_attention", False),
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
        generator = await self.engine.async_generate(input_ids=input_ids, sampling_params=params, stream=True)
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
            [sys.executable, "-m", "sglang.launch_server", *cli],
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
        "requests": len(requests),
        "completed": len(finished),
        "failed": len(requests) - len(finished),
        "timed_out": len(pending),
        "request_errors": sorted({o["error"] for o in outcomes if o["error"]})[:3],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall else 0.0,
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
        tmp.write_text(json.dumps(result))
        tmp.replace(result_path)  # the parent never reads half a file

    model = write_model(Path(args.model_dir), args.context_len)
    D = args.speculative_num_steps + 1
    t0 = time.perf_counter()
    client = ServerClient(args, model, sys.stderr) if args.server else EngineClient(args, model)
    loop = asyncio.get_event_loop()  # the loop sglang.Engine's tokenizer manager runs on
    loop.run_until_complete(run_group(client, make_requests(2, 16, 8, 0), 2, args.phase_timeout))  # warm-up
    result.update(start_s=time.perf_counter() - t0, ready=True, control=[])
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
            save()
        elif command[:1] == ["boundary"]:
            prompt, max_new = boundary_lengths(args.context_len, D)
            result["boundary_prompt_len"], result["boundary_max_new"] = prompt, max_new
            save()  # before the phase that crashes a pristine scheduler
            # max_new_tokens None, the long-generation case: an explicit max_new_tokens is
            # checked against context_len with the draft tokens added (0.5.14 rejects
            # prompt + D + max_new > context_len), while None is clamped to
            # context_len - prompt - 2 = max_new.
            reqs = make_requests(args.soak, prompt, None, 7)
            summary = loop.run_until_complete(run_group(client, reqs, args.concurrency, args.phase_timeout))
            summary.pop("gaps")
            result["boundary"] = summary
            save()
        else:
            break
    print(f"[{args.worker}] done", file=sys.stderr, flush=True)
    os._exit(0)  # the parent tears the engine's process group down


def itl_percentiles(gaps) -> dict:
    if len(gaps) < 2:
        return {"p50": None, "p99": None}
    return {"p50": 1e3 * statistics.median(gaps), "p99": 1e3 * statistics.quantiles(gaps, n=100)[98]}


# ---------------------------------------------------------------------------- parent
class GpuMemory:
    """Device memory in use, sampled by one long-running `nvidia-smi -lms`, not one nvidia-smi
    start per sample during the timed phases."""

    def __init__(self, interval_ms: int = 200):
        self.samples = []  # (perf_counter, MiB)
        try:
            self.process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.used",
                    "--format=csv,noheader,nounits",
                    "-i",
                    os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
                    "-lms",
                    str(interval_ms),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except FileNotFoundError:
            self.process = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.samples.append((time.perf_counter(), int(line)))

    def latest(self):
        time.sleep(0.5)  # let a sample taken after the caller's event arrive
        return self.samples[-1][1] if self.samples else None

    def peak_between(self, start: float, end: float):
        values = [mib for t, mib in self.samples if start <= t <= end]
        return max(values) if values else None

    def close(self):
        if self.process:
            self.process.kill()


class Variant:
    """A variant's worker process (own process group) and what the parent learns about it."""

    def __init__(self, name: str, env: dict, args, work: Path, index: int):
        self.name, self.args = name, args
        self.log_path, self.result_path = work / f"{name}.log", work / f"{name}.json"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--result",
            str(self.result_path),
            "--model-dir",
            str(work / "model"),
        ] + forward_args(args, port=args.port + 10 * index)
        print(f"[{name}] starting (log: {self.log_path})", flush=True)
        self.began = time.perf_counter()
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.crash = None
        self.start_mib = self.peak_mib = None

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.crash is None

    def result(self) -> dict:
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return {"variant": self.name}

    def wait(self, done, timeout: float) -> bool:
        """Until done(result) holds; False on timeout, exit or the size-mismatch crash."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if done(self.result()):
                return True
            match = CRASH_PATTERN.search(self.log_path.read_text(errors="replace"))
            if match:
                time.sleep(3)  # let the traceback reach the log
                self.crash = match.group(0)
                return False
            if self.process.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def send(self, command: str):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def run_phase(self, command: str, done, memory: GpuMemory) -> bool:
        """One phase with the other engines idle: its memory peak above the phase's start is
        this variant's."""
        before, t0 = memory.latest(), time.perf_counter()
        self.send(command)
        ok = self.wait(done, self.args.phase_timeout + 30)
        peak = memory.peak_between(t0, time.perf_counter())
        if None not in (before, peak, self.start_mib):
            self.peak_mib = max(self.peak_mib or 0, self.start_mib + peak - before)
        return ok

    def stop(self):
        if self.log.closed:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()
        self.wall_s = time.perf_counter() - self.began


def install_entry_point(site: Path, dist: str, version: str, sources: list, entry_points: str) -> None:
    """Make ``site`` hold a package with an ``sglang.srt.plugins`` entry point, as pip would,
    without building anything: the GPU host has no index, and building in the checkout would
    leave python/sglang_dsa_fix.egg-info there, whose entry point would reach every variant."""
    site.mkdir(parents=True, exist_ok=True)
    for source in sources:
        if source.is_dir():
            shutil.copytree(source, site / source.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, site / source.name)
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{entry_points}\n")


def install_plugin(site: Path) -> None:
    from sglang_dsa_fix import __version__, plugin

    install_entry_point(
        site,
        "sglang_dsa_fix",
        __version__,
        [REPO / "python" / "sglang_dsa_fix"],
        f"{plugin.ENTRY_POINT_NAME} = sglang_dsa_fix.plugin:register",
    )


def prepare_variant(variant: str, work: Path) -> dict:
    """Environment for a variant's process: PYTHONPATH with a patched copy or the plugin."""
    from sglang_dsa_fix import source_patch, tree

    base = os.environ.get("PYTHONPATH", "")
    if variant == "none":
        # The kill switch keeps our plugin inert should an install of it be visible anyway
        # (an editable install, a python/*.egg-info on PYTHONPATH).
        return {"SGLANG_DSA_FIX": "0", "PYTHONPATH": base}
    env = {"SGLANG_DSA_FIX": "1"}
    if variant == "apply":
        copy = work / "apply-site"
        shutil.copytree(
            tree.find_tree(None).package, copy / "sglang", ignore=shutil.ignore_patterns("__pycache__")
        )
        outcome = source_patch.apply(tree.find_tree(str(copy)))
        print("apply:", ", ".join(str(p) for p in outcome.changed), flush=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), base]))
    elif variant == "plugin":
        target = work / "plugin-site"
        install_plugin(target)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), base]))
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return env


def page_table_bytes(args) -> dict:
    """Per variant, the target-verify graph buffer, max_bs * D rows x width x 4 B; widths as
    `status` reads them from the installed sglang (pristine: its own width expression; fixed:
    req_to_token's)."""
    from sglang_dsa_fix import status, width

    D = args.speculative_num_steps + 1
    spec = width.SpecShape(args.context_len, D, args.speculative_num_steps, page_size=64)
    report = status.collect(None, spec)
    pristine = next(b for b in report["bugs"] if b["bug"] == "page_table").get("shape", {})
    fixed_pool = args.context_len + width.fixed_row_extra(report["sglang_version"], spec)
    rows = args.concurrency * D
    # "none" only where the tree is pristine (with a fix live, status reports the fixed width).
    return {
        "none": rows * pristine.get("graph_page_table_width", 0) * 4,
        "apply": rows * fixed_pool * 4,
        "plugin": rows * fixed_pool * 4,
    }


def forward_args(args, port: int) -> list:
    out = ["--port", str(port)]
    for key in (
        "context_len",
        "speculative_num_steps",
        "concurrency",
        "soak",
        "control_requests",
        "control_max_new",
        "phase_timeout",
        "start_timeout",
        "tp_size",
        "dp_size",
    ):
        out += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    return (
        out
        + (["--server"] if args.server else [])
        + (["--enable-dp-attention"] if args.enable_dp_attention else [])
    )


def run_all(names, args, work: Path):
    """Start the variants one after another (no two JIT-compiling at once), alternate the control
    reps between the running engines (ABBA order, so drift and warm-up hit every variant alike),
    then give each its boundary phase in start order, stopping it right after."""
    # Every variant's files first: a variant that cannot be prepared stops the run before any
    # engine starts.
    envs = [{**os.environ, **variant_env(args), **prepare_variant(name, work)} for name in names]
    memory = GpuMemory()
    variants = []
    try:
        for index, (name, env) in enumerate(zip(names, envs)):
            before = memory.latest()
            variant = Variant(name, env, args, work, index)
            variants.append(variant)
            if variant.wait(lambda r: r.get("ready"), args.start_timeout):
                after = memory.latest()
                if None not in (before, after):
                    variant.start_mib = variant.peak_mib = after - before
                print(f"[{name}] ready in {variant.result()['start_s']:.0f} s", flush=True)
            else:
                print(f"[{name}] did not start: {variant.crash or 'see its log'}", flush=True)
                variant.stop()
        for rep in range(args.control_reps):
            order = variants if rep % 2 == 0 else variants[::-1]
            for variant in [v for v in order if v.alive]:
                variant.run_phase(
                    f"control {rep}", lambda r, rep=rep: len(r.get("control", [])) > rep, memory
                )
            rates = ", ".join(
                f"{v.name} {v.result()['control'][rep]['output_tok_per_s']:.0f}"
                for v in variants
                if len(v.result().get("control", [])) > rep
            )
            print(f"control rep {rep + 1}/{args.control_reps} tok/s: {rates}", flush=True)
        for variant in variants:
            if variant.alive:
                variant.run_phase("boundary", lambda r: "boundary" in r, memory)
                print(
                    f"[{variant.name}] boundary: {'CRASH ' + variant.crash if variant.crash else 'no crash'}",
                    flush=True,
                )
            variant.stop()
    finally:
        for variant in variants:
            variant.stop()  # no-op for those already stopped
        memory.close()
    table_bytes = page_table_bytes(args)
    return [summarize(v, args, table_bytes[v.name]) for v in variants]


def summarize(variant: Variant, args, table_bytes: int) -> dict:
    result = variant.result()
    text = variant.log_path.read_text(errors="replace")
    crash = variant.crash or (m.group(0) if (m := CRASH_PATTERN.search(text)) else None)
    boundary = result.get("boundary") or {
        "requests": args.soak,
        "completed": 0,
        "failed": args.soak,
        "timed_out": args.soak,
    }
    control = result.get("control") or []
    rates = [c["output_tok_per_s"] for c in control]
    accept = [c["accept_length"] for c in control if c["accept_length"] is not None]
    itl = result.get("control_itl_ms") or {"p50": None, "p99": None}
    return {
        "variant": variant.name,
        "mode": "server" if args.server else "engine",
        "exit_code": variant.process.returncode,
        "start_s": result.get("start_s"),
        "wall_s": variant.wall_s,
        "crash": crash,
        "plugin_widened": WIDENED_LINE in text,
        "boundary_requests": boundary["requests"],
        "boundary_completed": boundary["completed"],
        "boundary_failed": boundary["failed"],
        "boundary_prompt_len": result.get("boundary_prompt_len"),
        "boundary_max_new": result.get("boundary_max_new"),
        "boundary_tok_per_s": boundary.get("output_tok_per_s"),
        "control_reps": len(control),
        "control_completed": sum(c["completed"] for c in control),
        "control_failed": sum(c["failed"] for c in control),
        "control_tok_per_s": rates,
        "control_tok_per_s_median": statistics.median(rates) if rates else None,
        "accept_length": statistics.mean(accept) if accept else None,
        "itl_ms_p50": itl["p50"],
        "itl_ms_p99": itl["p99"],
        "gpu_mem_after_start_mib": variant.start_mib,
        "peak_gpu_mem_mib": variant.peak_mib,
        "page_table_bytes_computed": table_bytes,
    }


def add_control_ratios(rows):
    """Each fixed variant's control tok/s over pristine's, rep by rep (same round of reps)."""
    pristine = next((r for r in rows if r["variant"] == "none"), None)
    for row in rows:
        pairs = (
            list(zip(row["control_tok_per_s"], pristine["control_tok_per_s"]))
            if pristine and row is not pristine
            else []
        )
        if not pairs:
            continue
        ratios = [f / p for f, p in pairs]
        deciles = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) > 1 else ratios * 9
        row["control_ratio_vs_none"] = {
            "per_rep": ratios,
            "median": statistics.median(ratios),
            "p10": deciles[0],
            "p90": deciles[8],
            "of_medians": statistics.median(f for f, _ in pairs) / statistics.median(p for _, p in pairs),
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none,plugin", help="none, apply, plugin (comma list)")
    parser.add_argument("--server", action="store_true", help="launch_server + HTTP /generate")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--speculative-num-steps", type=int, default=4, help="D = steps + 1")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor parallel size (GPUs per engine)")
    parser.add_argument(
        "--dp-size", type=int, default=1, help="data parallel size (with --enable-dp-attention)"
    )
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--soak", type=int, default=64, help="boundary-crossing requests")
    parser.add_argument("--control-requests", type=int, default=32)
    parser.add_argument("--control-max-new", type=int, default=192)
    parser.add_argument("--control-reps", type=int, default=10)
    parser.add_argument("--phase-timeout", type=float, default=90, help="seconds per phase")
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=420,
        help="seconds for an engine to start (a cold JIT cache needs minutes)",
    )
    parser.add_argument("--port", type=int, default=30123, help="server mode: first variant's port")
    parser.add_argument("--jsonl", help="append one JSON line per variant to this file")
    parser.add_argument("--work-dir", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - {"none", "apply", "plugin"})
    if unknown or len(set(variants)) != len(variants) or not variants:
        parser.error(f"--variants: each of none, apply, plugin at most once (got {args.variants!r})")
    # The engines run in their own sessions: on SIGTERM (a `timeout`), unwind so that
    # run_all's cleanup kills them instead of leaving them on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dsa-eagle-long-gen-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = run_all(variants, args, work)
    add_control_ratios(rows)

    D = args.speculative_num_steps + 1
    print(
        f"\nEAGLE steps {args.speculative_num_steps}, topk 1, D {D}; context_len "
        f"{args.context_len}; concurrency {args.concurrency}; "
        f"{'launch_server' if args.server else 'Engine'}; {args.control_reps} control reps of "
        f"{args.control_requests} x {args.control_max_new} tokens; logs in {work}"
    )
    # page_table B: the target-verify graph buffer, max_bs * D rows x width x 4, computed.
    print(
        f"{'variant':<8} {'boundary ok/n':>13} {'ctrl tok/s median':>17} {'accept':>6} "
        f"{'ITL p50/p99 ms':>15} {'MiB start/peak':>14} {'page_table B':>12}  crash"
    )
    for r in rows:
        median = r["control_tok_per_s_median"]
        itl = f"{r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f}" if r["itl_ms_p50"] is not None else "-"
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
        mem = f"{r['gpu_mem_after_start_mib']}/{r['peak_gpu_mem_mib']}"
        done, asked, table = (
            "-" if r[k] is None else r[k]
            for k in ("boundary_completed", "boundary_requests", "page_table_bytes_computed")
        )  # a variant that never started has no numbers: a clean row of dashes
        print(
            f"{r['variant']:<8} {done:>6}/{asked:<6} "
            f"{'-' if median is None else round(median):>17} {acc:>6} {itl:>15} {mem:>14} "
            f"{table:>12}  {r['crash'] or '-'}"
        )
    for r in rows:
        ratio = r.get("control_ratio_vs_none")
        if ratio:
            print(
                f"control tok/s {r['variant']}/none, paired reps: median {ratio['median']:.3f} "
                f"[p10 {ratio['p10']:.3f}, p90 {ratio['p90']:.3f}], ratio of medians "
                f"{ratio['of_medians']:.3f} (target >= 0.99)"
            )
    if args.jsonl:
        with open(args.jsonl, "a") as handle:
            for r in rows:
                handle.write(json.dumps(r) + "\n")
    pristine = [r for r in rows if r["variant"] == "none"]
    fixed = [r for r in rows if r["variant"] != "none"]
    ok = all(
        r["crash"] is None
        and r["boundary_completed"] == r["boundary_requests"]
        and r["control_failed"] == 0
        and r["control_reps"] == args.control_reps
        for r in fixed
    )
    reproduced = all(r["crash"] for r in pristine)
    said = reproduced if pristine else "not run (no 'none' variant)"
    print(f"fixed variants complete every request: {ok}; pristine reproduces the crash: {said}")
    misrouted = [r["variant"] for r in rows if r["plugin_widened"] != (r["variant"] == "plugin")]
    if misrouted:
        print(
            f"NOT A VALID COMPARISON: the plugin's widening line is "
            f"{'missing from' if 'plugin' in misrouted else 'present in'} the log of "
            f"{', '.join(misrouted)}"
        )
    return 0 if ok and reproduced and not misrouted else 1


if __name__ == "__main__":
    sys.exit(main())
