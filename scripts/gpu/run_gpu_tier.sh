#!/usr/bin/env bash
# Install the offline bundle (scripts/gpu/build_bundle.sh) on a GPU host and run, from this
# repository's root, the GPU tier of test/srt/test_dsa_cuda_graph.py and the replay-cost
# benchmark. Nothing is fetched; the host needs Python 3.12 with torch 2.11 (CUDA) and pytest.
#   scripts/gpu/run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR
# RESULTS_DIR gets: env.txt, gpu-tier.log, cases.jsonl (one JSON line per sweep),
# junit-pristine.xml, junit-fixed.xml, replay_cost.txt, replay_cost.jsonl, fa3_report.json
# (bug #3: the fixed FA3 tables' memory on the GPU).
# Exit status: 0 only if both tiers and the benchmark exit 0.
#
# CI smoke run (no bundle, no GPU; the CPU test environment's $PYTHON):
#   scripts/gpu/run_gpu_tier.sh --smoke RESULTS_DIR
# runs the same steps with this checkout's python/ on PYTHONPATH instead of a bundle: the tiers'
# pytest node ids in one process, junit-smoke.xml (the CUDA classes skip on CPU; a renamed one
# is an error) and dsa_replay_cost.py --smoke (CPU, tiny sizes; its row says "smoke": true).
set -uo pipefail
cd "$(dirname "$0")/../.."
smoke=0
if [[ "${1:-}" == --smoke ]]; then
  smoke=1
  results="${2:?usage: run_gpu_tier.sh --smoke RESULTS_DIR}"
else
  bundle="${1:?usage: run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR}"
  results="${2:?usage: run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR}"
fi
python="${PYTHON:-python3}"
site="${SGLANG_DSA_FIX_SITE:-/tmp/sglang-dsa-fix-site}"
mkdir -p "$results"
if [[ $smoke == 1 ]]; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
else
  # shellcheck source=scripts/gpu/env.sh
  source scripts/gpu/env.sh "$bundle" "$site" || exit 1
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if [[ $smoke == 1 ]]; then
    echo "smoke: CPU run (--smoke), no GPU"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  fi
  "$python" - <<'PY'
import importlib.metadata as md, platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__)
for name in ("sglang", "sglang-kernel", "flashinfer-python", "sgl-deep-gemm", "apache-tvm-ffi",
             "transformers"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
try:
    import flashinfer.sampling, flashinfer.gemm  # noqa: F401  (sglang imports these on CUDA)
    print("flashinfer import: ok")
except Exception as exc:  # reported, not fatal for the backend-level tier
    print("flashinfer import: FAILED", type(exc).__name__, exc)
PY
  if [[ $smoke == 1 ]]; then
    echo "bundle: none (--smoke)"
  else
    echo "bundle: $(cat "$site/.bundle-contents" 2>/dev/null | tr '\n' ' ')"
  fi
} > "$results/env.txt" 2>&1
cat "$results/env.txt"

status=0
run_tier() {  # name, pytest node ids...
  local name="$1"; shift
  SGLANG_DSA_FIX_FULL=1 SGLANG_DSA_FIX_RESULTS="$results/cases.jsonl" \
    SGLANG_DSA_FIX_FA3_REPORT="$results/fa3_report.json" timeout "${TIER_TIMEOUT:-300}" \
    "$python" -m pytest -q -rs -p no:cacheprovider --junitxml="$results/junit-$name.xml" "$@" \
    2>&1 | tee -a "$results/gpu-tier.log"
}
t=test/srt/test_dsa_cuda_graph.py
pristine=("$t::TestSeqlensExpandReference" "$t::TestPristineBackendCUDA")
# Bug #3: the fixed FA3 tables' memory on the GPU (FA3's kernel is not in the bundle; not run).
fixed=("$t::TestRuntimeFixCUDA" "$t::TestInTreePatchCUDA" "test/srt/test_fa3_cuda_graph.py::TestMemoryCUDA")
if [[ $smoke == 1 ]]; then
  # On CPU the CUDA classes skip: one process (junit-smoke.xml) checks every node id both name.
  run_tier smoke "${pristine[@]}" "${fixed[@]}" || status=1
else
  # Pristine and fixed in separate processes: a pristine out-of-bounds write must not be able
  # to disturb the fixed runs.
  run_tier pristine "${pristine[@]}" || status=1
  run_tier fixed "${fixed[@]}" || status=1
fi
if [[ "${RUN_REPLAY_COST:-1}" == 1 ]]; then
  smoke_flag=()
  [[ $smoke == 1 ]] && smoke_flag=(--smoke)
  timeout "${BENCH_TIMEOUT:-120}" "$python" benchmark/dsa_replay_cost.py "${smoke_flag[@]}" \
    --json "$results/replay_cost.jsonl" 2>&1 | tee "$results/replay_cost.txt" || status=1
fi
exit "$status"
