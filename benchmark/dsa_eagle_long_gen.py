"""End-to-end long generation with EAGLE on a tiny dummy-weight DSA model: pristine vs fixed.

Reproduces the users' symptom with the real engine: EAGLE (steps 4, topk 1, D 5), CUDA graphs
and the overlap scheduler on, acceptance forced with SGLANG_SIMULATE_ACC_LEN, and requests whose
last verify overshoots context_length. Each variant runs in its own worker process
(``long_gen_worker.py``; a crashed scheduler leaves clients blocked), all in this one run; this
file is the parent (variants, ABBA reps, report):

  none     the installed sglang as is (expected: the size-mismatch crash)
  none2    a second engine of the installed sglang as is: the A/A control, paired with none,
           measures the noise of the design itself
  apply    the in-tree patch, applied to a temporary copy of the installed sglang
  plugin   this package installed (entry point sglang.srt.plugins), sglang untouched
  watch    plugin with the family watch on (SGLANG_DSA_FIX_WATCH=1), paired with plugin: the
           watch's own cost

The variants' engines start one after another and then stay up side by side. A control group
that stays far below context_length runs --control-reps times on each, the reps alternating between
the engines (ABBA) so that drift on the host hits every variant alike; the first --warmup-reps
rounds run but are discarded, and with --control-until no round starts that many seconds after
the script started (as many reps as a time limit allows). Each variant's tok/s over its baseline's (bench_common.BASELINE)
is reported rep by rep with its spread, the paired reps a +-1 % CI of the median would need, and
for an A/A pair (none, none2) what the noise is made of (bench_common.noise_breakdown): drift
both engines share, steady decode speed, stalls, SM clock. Then each variant gets the boundary group (every request
crosses context_length in its last verify; `--soak N` sets how many). Per variant: requests
completed / failed (error text from the log), output tok/s, accept length, ITL p50/p99, wall
time, GPU memory after start and at peak, page_table bytes; one JSON line each (--output-file,
bench_serving's flag; --jsonl is the old name) and a table. The control group's figures carry
bench_serving's names and meanings: ``output_throughput_per_rep`` holds each rep's
``output_throughput`` (output tokens / that rep's duration); ``output_throughput_median`` is the
median over the reps (not one run's figure, so not called ``output_throughput``). Each row also
records the per-rep median inter-token gap, stall share and mean SM clock, the sglang version, this tool's version and git commit, the UTC date and, with
``--server``, the server's ``/server_info`` (``server_info``, as bench_serving stores it). Exit 0
only if every fixed variant completes every request and the pristine runs reproduce the crash
(``--soak 0`` skips the boundary phase: a throughput-only run).

    python benchmark/dsa_eagle_long_gen.py [--variants none,plugin,apply] [--server] [--soak 64]

No downloads: the model's config.json is written here, weights are dummy, input_ids go in.
Needs a CUDA GPU with sglang 0.5.14 (scripts/gpu/env.sh sets up an offline host).

``--smoke`` (CI, no GPU) runs this parent as it is (every variant prepared, one worker process
each, the phases, the rows, the ratios, the table, --output-file) with tiny sizes (1 warm-up and
3 control rounds of 2 requests, a boundary phase of 2; all five variants unless --variants says
otherwise), but the workers start no engine: a stand-in client answers each request with one
token (``long_gen_worker.py --smoke``). Every row says ``"smoke": true``; its numbers are no
figures and the crash / widening checks cannot hold. Exit 0 when every variant answered every phase.

    python benchmark/dsa_eagle_long_gen.py --smoke [--output-file FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import (
    BENCH_SERVING,
    WorkDir,
    WorkDirError,
    add_disable_tqdm_argument,
    add_output_file_argument,
    append_jsonl,
    baseline_of,
    fail_work_dir,
    install_plugin,
    jsonl_row,
    noise_breakdown,
    per_rep_throughput,
    plot,
    pooled,
    private_work_dir,
    ratio_summary,
    run_metadata,
    tqdm_disabled,
)
from long_gen_worker import (
    add_engine_arguments,
    draft_tokens,
    forward_args,
    variant_env,
)

WORKER = Path(__file__).with_name("long_gen_worker.py")
STARTED = time.perf_counter()  # --control-until counts from here

# What the plugin logs in a scheduler once it widened the buffer (sglang_dsa_fix/plugin.py):
# present in the plugin variant's log, absent from the others', or the run is not a comparison.
WIDENED_LINE = "sglang-dsa-fix: CUDA-graph page_table widened"
WATCH_LINE = "family watch on ("  # plugin.WATCH_ON_LINE, in the plugin's start-up line
VARIANTS = ("none", "none2", "apply", "plugin", "watch")
PRISTINE = ("none", "none2")
FIXED_BY_PLUGIN = ("plugin", "watch")
CRASH_PATTERN = re.compile(
    r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)[^\n]*"
)
# --smoke: tiny sizes; no engine runs (long_gen_worker.py --smoke).
SMOKE_SIZES = {
    "warmup_reps": 1,
    "control_reps": 3,
    "control_requests": 2,
    "control_max_new": 2,
    "soak": 2,
    "concurrency": 2,
    "phase_timeout": 30,
    "start_timeout": 60,
    "control_until": 0,
}


# ---------------------------------------------------------------------------- parent
class GpuMemory:
    """Device memory in use and the SM clock, sampled by one long-running `nvidia-smi -lms`, not
    one nvidia-smi start per sample during the timed phases."""

    def __init__(self, interval_ms: int = 200):
        self.samples = []  # (perf_counter, MiB, SM MHz)
        try:
            self.process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.used,clocks.sm",
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
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 2 and all(f.isdigit() for f in fields):
                self.samples.append((time.perf_counter(), int(fields[0]), int(fields[1])))

    def latest(self):
        if self.process is None:  # no nvidia-smi: no sample will come
            return None
        time.sleep(0.5)  # let a sample taken after the caller's event arrive
        return self.samples[-1][1] if self.samples else None

    def peak_between(self, start: float, end: float):
        values = [mib for t, mib, _ in self.samples if start <= t <= end]
        return max(values) if values else None

    def mean_clock_between(self, start: float, end: float):
        values = [mhz for t, _, mhz in self.samples if start <= t <= end]
        return statistics.mean(values) if values else None

    def close(self):
        if self.process:
            self.process.kill()


def progress(description: str, total: float, disable: bool = False):
    """A tqdm bar in seconds (sglang depends on tqdm, so it is there); a no-op without tqdm, with
    --disable-tqdm, or when stderr is not a terminal (tqdm would write a carriage-return line
    every mininterval into the log)."""
    if tqdm_disabled(disable):
        return contextlib.nullcontext(None)
    try:
        from tqdm import tqdm
    except ImportError:
        return contextlib.nullcontext(None)
    return tqdm(
        total=round(total),
        desc=description,
        leave=False,
        mininterval=2,
        bar_format="{desc}: {bar} {n}/{total} s",
    )


class Variant:
    """A variant's worker process (own process group) and what the parent learns about it."""

    def __init__(self, name: str, env: dict, args, work: WorkDir, index: int):
        self.name, self.args = name, args
        self.log_path, self.result_path = work / f"{name}.log", work / f"{name}.json"
        cmd = [
            sys.executable,
            str(WORKER),
            "--worker",
            name,
            "--result",
            str(self.result_path),
            "--model-dir",
            str(work / "model"),
        ] + forward_args(args, port=args.port + 10 * index)
        print(f"[{name}] starting (log: {self.log_path})", flush=True)
        self.began = time.perf_counter()
        self.log = work.open(self.log_path.name, "w")  # O_NOFOLLOW through the run directory's fd
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
        self.poll_s = 0.05 if args.smoke else 0.5  # a smoke worker answers at once
        self.start_mib = self.peak_mib = None
        self.clocks = []  # mean SM MHz during each control rep

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.crash is None

    def result(self) -> dict:
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return {"variant": self.name}

    def wait(self, done, timeout: float, what: str) -> bool:
        """Until done(result) holds; False on timeout, exit or the size-mismatch crash. A
        progress bar (seconds against the timeout) shows on stderr while it waits."""
        began = time.time()
        deadline = began + timeout
        with progress(f"[{self.name}] {what}", timeout, self.args.disable_tqdm) as bar:
            return self._wait(done, deadline, lambda: bar and bar.update(round(time.time() - began) - bar.n))

    def _wait(self, done, deadline: float, tick) -> bool:
        while time.time() < deadline:
            tick()
            if done(self.result()):
                return True
            match = CRASH_PATTERN.search(self.log_path.read_text(errors="replace"))
            if match:
                time.sleep(3)  # let the traceback reach the log
                self.crash = match.group(0)
                return False
            if self.process.poll() is not None:
                return False
            time.sleep(self.poll_s)
        return False

    def send(self, command: str):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def run_phase(self, command: str, done, memory: GpuMemory) -> bool:
        """One phase with the other engines idle: its memory peak above the phase's start is
        this variant's."""
        before, t0 = memory.latest(), time.perf_counter()
        self.send(command)
        ok = self.wait(done, self.args.phase_timeout + 30, command)
        peak = memory.peak_between(t0, time.perf_counter())
        if command.startswith("control"):
            self.clocks.append(memory.mean_clock_between(t0, time.perf_counter()))
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


def prepare_variant(variant: str, work: Path) -> dict:
    """Environment for a variant's process: PYTHONPATH with a patched copy or the plugin."""
    from sglang_dsa_fix import source_patch, tree

    base = os.environ.get("PYTHONPATH", "")
    if variant in PRISTINE:
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
    elif variant in FIXED_BY_PLUGIN:
        target = work / f"{variant}-site"
        install_plugin(target)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), base]))
        if variant == "watch":
            env["SGLANG_DSA_FIX_WATCH"] = "1"
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return env


def page_table_bytes(args) -> dict:
    """Per variant, the target-verify graph buffer, max_bs * D rows x width x 4 B; widths as
    `status` reads them from the installed sglang (pristine: its own width expression; fixed:
    req_to_token's)."""
    from sglang_dsa_fix import release, resolve, status, width

    D = draft_tokens(args)
    spec = width.SpecShape(args.context_length, D, args.speculative_num_steps, page_size=64)
    # The configuration as `sglang-dsa-fix status --context-length ...` builds it (cli.py).
    report = status.collect(None, resolve.Request(shape=spec))
    page_table = next(b for b in report["bugs"] if b["bug"] == "page_table")
    pristine = page_table.get("at_configuration") or {}
    fixed_pool = args.context_length + width.fixed_row_extra(release.form_for(report["sglang_version"]), spec)
    rows = args.concurrency * D
    # "none" only where the tree is pristine (with a fix live, status reports the fixed width).
    pristine_bytes = rows * (pristine.get("graph_page_table_width") or 0) * 4
    return {name: pristine_bytes if name in PRISTINE else rows * fixed_pool * 4 for name in VARIANTS}


def run_all(names, args, work: WorkDir):
    """Start the variants one after another (no two JIT-compiling at once), alternate the control
    reps between the running engines (ABBA order, so drift and warm-up hit every variant alike),
    then give each its boundary phase in start order, stopping it right after."""
    # Every variant's files first: a variant that cannot be prepared stops the run before any
    # engine starts.
    envs = [{**os.environ, **variant_env(args), **prepare_variant(name, work)} for name in names]
    memory = GpuMemory()
    variants = []
    try:
        if args.start_together:  # warm JIT caches only: no per-variant start-up memory then
            variants = [Variant(name, env, args, work, i) for i, (name, env) in enumerate(zip(names, envs))]
        for index, (name, env) in enumerate(zip(names, envs)):
            before = memory.latest()
            if not args.start_together:
                variants.append(Variant(name, env, args, work, index))
            variant = variants[index]
            if variant.wait(lambda r: r.get("ready"), args.start_timeout, "engine start"):
                after = memory.latest()
                if None not in (before, after) and not args.start_together:
                    variant.start_mib = variant.peak_mib = after - before
                print(f"[{name}] ready in {variant.result()['start_s']:.0f} s", flush=True)
            else:
                print(f"[{name}] did not start: {variant.crash or 'see its log'}", flush=True)
                variant.stop()
        for rep in range(args.warmup_reps + args.control_reps):
            if args.control_until and time.perf_counter() - STARTED > args.control_until:
                print(f"--control-until {args.control_until:.0f} s reached after {rep} rounds", flush=True)
                break
            order = variants if rep % 2 == 0 else variants[::-1]
            for variant in [v for v in order if v.alive]:
                variant.run_phase(
                    f"control {rep}", lambda r, rep=rep: len(r.get("control", [])) > rep, memory
                )
            rates = ", ".join(
                f"{v.name} {v.result()['control'][rep]['output_throughput']:.0f}"
                for v in variants
                if len(v.result().get("control", [])) > rep
            )
            kind = "warm-up" if rep < args.warmup_reps else "control"
            print(f"{kind} round {rep + 1}/{args.warmup_reps + args.control_reps} tok/s: {rates}", flush=True)
        for variant in variants:
            if variant.alive and args.soak:
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
    metadata = run_metadata()
    return [build_row(v, args, table_bytes[v.name], metadata) for v in variants]


def build_row(variant: Variant, args, table_bytes: int, metadata: dict | None = None) -> dict:
    """A variant's JSONL row: provenance (bench_common.jsonl_row), the summary, server_info."""
    result = variant.result()
    server_info = result.get("server_info") if args.server else None
    return jsonl_row(summarize(variant, args, table_bytes), server_info=server_info, metadata=metadata)


def summarize(variant: Variant, args, table_bytes: int) -> dict:
    result = variant.result()
    text = variant.log_path.read_text(errors="replace")
    crash = variant.crash or (m.group(0) if (m := CRASH_PATTERN.search(text)) else None)
    boundary = result.get("boundary") or {
        "skipped": not args.soak,
        "requests": args.soak,
        "completed": 0,
        "failed": args.soak,
        "timed_out": args.soak,
    }
    reps = [{**c, "sm_clock_mhz": clock} for c, clock in zip(result.get("control") or [], variant.clocks)]
    warmup, control = reps[: args.warmup_reps], reps[args.warmup_reps :]
    rates = [c["output_throughput"] for c in control]
    accept = [c["accept_length"] for c in control if c["accept_length"] is not None]
    itl = result.get("control_itl_ms") or {"p50": None, "p99": None}
    return {
        "variant": variant.name,
        **({"smoke": True} if getattr(args, "smoke", False) else {}),
        "mode": "server" if args.server else "engine",
        "exit_code": variant.process.returncode,
        "start_s": result.get("start_s"),
        "wall_s": variant.wall_s,
        "crash": crash,
        "plugin_widened": WIDENED_LINE in text,
        "watch_on": WATCH_LINE in text,
        "boundary_requests": boundary["requests"],
        "boundary_completed": boundary["completed"],
        "boundary_failed": boundary["failed"],
        "boundary_prompt_len": result.get("boundary_prompt_len"),
        "boundary_max_new": result.get("boundary_max_new"),
        # bench_serving's output_throughput of the boundary run (was boundary_tok_per_s)
        "boundary_output_throughput": boundary.get("output_throughput"),
        "control_reps": len(control),
        "control_completed": sum(c["completed"] for c in control),
        "control_failed": sum(c["failed"] for c in control),
        # bench_serving's names and meanings (sglang.benchmark.serving) for the control group:
        # each rep is one run, its output_throughput = its output tokens / its duration.
        "output_throughput_per_rep": rates,
        "total_output_tokens_per_rep": [c["total_output_tokens"] for c in control],
        "duration_per_rep": [c["duration"] for c in control],
        "warmup_output_throughput": [c["output_throughput"] for c in warmup],
        # What the noise breakdown reads (bench_common.noise_breakdown), per counted rep.
        "itl_median_ms_per_rep": [c.get("itl_median_ms") for c in control],
        "stall_share_per_rep": [c.get("stall_share") for c in control],
        "sm_clock_mhz_per_rep": [c.get("sm_clock_mhz") for c in control],
        # The median over the reps: not one run's output_throughput, hence not that name (rows
        # before this change held it as "output_throughput").
        "output_throughput_median": statistics.median(rates) if rates else None,
        "accept_length": statistics.mean(accept) if accept else None,
        "median_itl_ms": itl["p50"],
        "p99_itl_ms": itl["p99"],
        "gpu_mem_after_start_mib": variant.start_mib,
        "peak_gpu_mem_mib": variant.peak_mib,
        "page_table_bytes_computed": table_bytes,
    }


def rep_records(row) -> list:
    """A row's counted control reps as noise_breakdown takes them."""
    keys = ("itl_median_ms", "stall_share", "sm_clock_mhz")
    columns = [row.get(f"{k}_per_rep") or [] for k in keys]
    return [
        {"output_throughput": rate, **{k: (c[i] if i < len(c) else None) for k, c in zip(keys, columns)}}
        for i, rate in enumerate(per_rep_throughput(row))
    ]


def add_control_ratios(rows):
    """Each variant's control tok/s over its baseline's (bench_common.BASELINE), rep by rep (same
    round of reps); for the A/A control, the noise breakdown of the pair."""
    by_name = {r["variant"]: r for r in rows}
    for row in rows:
        base = baseline_of(row["variant"], by_name)
        if base is None:
            continue
        pairs = list(zip(per_rep_throughput(row), per_rep_throughput(by_name[base])))
        if pairs:
            row["control_ratio"] = {"baseline": base, **ratio_summary(pairs)}
        if row["variant"] == "none2":
            row["noise"] = noise_breakdown(rep_records(by_name[base]), rep_records(row))


def write_plot(jsonl: Path, rows) -> None:
    """Per-rep tok/s per variant and the fixed/pristine ratios, PNG next to the JSONL (this run's
    rows only); skipped where matplotlib is missing: then
    ``python benchmark/long_gen_report.py JSONL --plot PNG`` draws it anywhere."""
    runs = [(jsonl.name, {r["variant"]: r for r in rows})]
    png = jsonl.with_suffix(".png")
    try:
        plot(runs, pooled(runs), png)
    except ImportError:
        print(f"plot skipped (no matplotlib): python benchmark/long_gen_report.py {jsonl} --plot {png}")
        return
    print(f"plot: {png}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Figures and --output-file rows follow sglang's serving benchmark: {BENCH_SERVING}.",
    )
    parser.add_argument(
        "--variants",
        help="comma list of none (installed sglang as is), none2 (a second pristine engine: the A/A "
        "control), apply (in-tree patch on a copy), plugin (this package's plugin), watch (plugin "
        "with SGLANG_DSA_FIX_WATCH=1); default none,plugin (with --smoke all five)",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--control-reps",
        type=int,
        default=10,
        help="control-group reps per variant, alternated between the engines ABBA (default 10)",
    )
    parser.add_argument(
        "--warmup-reps",
        type=int,
        default=1,
        help="rounds run before the control reps and discarded (default 1)",
    )
    parser.add_argument(
        "--control-until",
        type=float,
        default=0,
        metavar="SECONDS",
        help="start no control round later than this many seconds after this script started, so "
        "that a run fits a time limit with as many reps as it allows (0: run all --control-reps; "
        "default 0)",
    )
    add_output_file_argument(
        parser,
        "--jsonl",
        what="variant",
        extra="; also draws the per-rep plot as FILE with .png for .jsonl where matplotlib is installed",
    )
    parser.add_argument(
        "--start-together",
        action="store_true",
        help="start every variant's engine at once (only with warm JIT caches: cold ones compile "
        "the same kernels side by side); start-up memory per variant is then not measured",
    )
    parser.add_argument(
        "--work-dir",
        help="keep the run's logs in a new private directory under this one (default: under the system temporary directory)",
    )
    add_disable_tqdm_argument(parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        print("SMOKE RUN (--smoke): no engine starts; a stand-in client answers, nothing is a figure")
        for name, value in SMOKE_SIZES.items():
            setattr(args, name, value)
    if args.variants is None:
        args.variants = ",".join(VARIANTS) if args.smoke else "none,plugin"

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or len(set(variants)) != len(variants) or not variants:
        parser.error(f"--variants: each of {', '.join(VARIANTS)} at most once (got {args.variants!r})")
    # The engines run in their own sessions: on SIGTERM (a `timeout`), unwind so that
    # run_all's cleanup kills them instead of leaving them on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        work = private_work_dir("dsa-eagle-long-gen-", args.work_dir)
    except WorkDirError as exc:
        return fail_work_dir(parser.prog, exc)
    rows = run_all(variants, args, work)
    add_control_ratios(rows)

    D = draft_tokens(args)
    if args.smoke:
        print("\nSMOKE RUN: no engine ran; every number below comes from a stand-in client, not a figure")
    print(
        f"\nEAGLE steps {args.speculative_num_steps}, topk 1, D {D}; context_length "
        f"{args.context_length}; concurrency {args.concurrency}; "
        f"{'launch_server' if args.server else 'Engine'}; {min(r['control_reps'] for r in rows)} counted "
        f"control reps (after {args.warmup_reps} warm-up) of {args.control_requests} x "
        f"{args.control_max_new} tokens; logs in {work}"
    )
    # page_table B: the target-verify graph buffer, max_bs * D rows x width x 4, computed.
    print(
        f"{'variant':<8} {'boundary ok/n':>13} {'ctrl tok/s median':>17} {'accept':>6} "
        f"{'ITL p50/p99 ms':>15} {'MiB start/peak':>14} {'page_table B':>12}  crash"
    )
    for r in rows:
        median = r["output_throughput_median"]
        itl = f"{r['median_itl_ms']:.2f}/{r['p99_itl_ms']:.2f}" if r["median_itl_ms"] is not None else "-"
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
        ratio = r.get("control_ratio")
        if ratio:
            need = ratio["reps_for_1pct"]
            print(
                f"control tok/s {r['variant']}/{ratio['baseline']}, {len(ratio['per_rep'])} paired reps: "
                f"median {ratio['median']:.3f} [p10 {ratio['p10']:.3f}, p90 {ratio['p90']:.3f}; "
                f"bootstrap 95 % CI of the median {ratio['median_ci95'][0]:.3f} - "
                f"{ratio['median_ci95'][1]:.3f}], ratio of medians {ratio['of_medians']:.3f}; "
                f"+-1 % would need {need if need is not None else '-'} paired reps"
            )
        noise = r.get("noise")
        if noise and "rep_log_sd" in noise:
            share = lambda x: "-" if x is None else f"{100 * x:.0f} %"  # noqa: E731
            print(
                f"A/A noise over {noise['reps']} rounds: one engine's reps spread {100 * noise['rep_log_sd']:.1f} % "
                f"(sd of log tok/s), {share(noise['common_mode_share'])} of it shared by both engines "
                f"(cancelled by pairing); paired ratio spread {100 * noise['paired_log_sd']:.1f} %. "
                f"Variance explained: steady decode speed {share(noise['r2_steady_speed'])}, stalls "
                f"{share(noise['r2_stalls'])}, SM clock {share(noise['r2_sm_clock'])}"
            )
    if args.output_file:
        append_jsonl(args.output_file, rows)
        write_plot(Path(args.output_file), rows)
    pristine = [r for r in rows if r["variant"] in PRISTINE]
    fixed = [r for r in rows if r["variant"] not in PRISTINE]
    counted = {r["control_reps"] for r in rows}
    ok = (
        len(counted) == 1
        and 0 not in counted
        and all(
            r["crash"] is None
            and (not args.soak or r["boundary_completed"] == r["boundary_requests"])
            and r["control_failed"] == 0
            for r in fixed
        )
    )
    reproduced = not args.soak or all(r["crash"] for r in pristine)
    said = (
        "not run (--soak 0)" if not args.soak else reproduced if pristine else "not run (no pristine variant)"
    )
    print(f"fixed variants complete every request: {ok}; pristine reproduces the crash: {said}")
    misrouted = [
        r["variant"]
        for r in rows
        if r["plugin_widened"] != (r["variant"] in FIXED_BY_PLUGIN)
        or r["watch_on"] != (r["variant"] == "watch")
    ]
    if misrouted:
        print(
            "NOT A VALID COMPARISON: the plugin's widening line or the watch's start-up line is "
            f"not where the variant says in the log of {', '.join(misrouted)}"
        )
    if args.smoke:
        answered = all(
            r["control_reps"] == args.control_reps and r["boundary_completed"] == args.soak for r in rows
        )
        print(f"SMOKE RUN: the checks above cannot hold without an engine; every phase answered: {answered}")
        return 0 if answered and len(rows) == len(variants) else 1
    return 0 if ok and reproduced and not misrouted else 1


if __name__ == "__main__":
    sys.exit(main())
