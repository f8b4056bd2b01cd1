#!/usr/bin/env bash
# Install the offline bundle (scripts/gpu/build_bundle.sh) on a GPU host and run, from this
# repository's root, the GPU tier of test/srt/test_dsa_cuda_graph.py and the replay-cost
# benchmark. Nothing is fetched; the host needs Python 3.12 with torch 2.11 (CUDA) and pytest.
#   scripts/gpu/run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR
# RESULTS_DIR gets: env.txt, gpu-tier.log, cases.jsonl (one JSON line per sweep),
# junit-pristine.xml, junit-fixed.xml, replay_cost.txt, replay_cost.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle="${1:?usage: run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR}"
results="${2:?usage: run_gpu_tier.sh BUNDLE.tar.xz RESULTS_DIR}"
python="${PYTHON:-python3}"
site="${SGLANG_DSA_FIX_SITE:-/tmp/sglang-dsa-fix-site}"
mkdir -p "$results"
# shellcheck source=scripts/gpu/env.sh
source scripts/gpu/env.sh "$bundle" "$site" || exit 1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
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
  echo "bundle: $(cat "$site/.bundle-contents" 2>/dev/null | tr '\n' ' ')"
} > "$results/env.txt" 2>&1
cat "$results/env.txt"

run_tier() {  # name, pytest node ids...
  local name="$1"; shift
  SGLANG_DSA_FIX_FULL=1 SGLANG_DSA_FIX_RESULTS="$results/cases.jsonl" timeout "${TIER_TIMEOUT:-300}" \
    "$python" -m pytest -q -rs -p no:cacheprovider --junitxml="$results/junit-$name.xml" "$@" \
    2>&1 | tee -a "$results/gpu-tier.log"
}
t=test/srt/test_dsa_cuda_graph.py
# Pristine and fixed in separate processes: a pristine out-of-bounds write must not be able to
# disturb the fixed runs.
run_tier pristine "$t::TestSeqlensExpandReference" "$t::TestPristineBackendCUDA"
run_tier fixed "$t::TestRuntimeFixCUDA" "$t::TestInTreePatchCUDA"
if [[ "${RUN_REPLAY_COST:-1}" == 1 ]]; then
  timeout "${BENCH_TIMEOUT:-120}" "$python" benchmark/dsa_replay_cost.py \
    --json "$results/replay_cost.jsonl" 2>&1 | tee "$results/replay_cost.txt"
fi
