# Sourced by the GPU scripts: unpack the offline bundle once and point Python at it.
#   source scripts/gpu/env.sh BUNDLE.tar.xz SITE_DIR
_bundle="$1"; _site="$2"
if [[ ! -f "$_site/.complete" ]]; then
  rm -rf "$_site" && mkdir -p "$_site" || return 1
  tar -C "$_site" --strip-components=1 -xJf "$_bundle" || { echo "cannot unpack $_bundle" >&2; return 1; }
  touch "$_site/.complete"
fi
# The bundle goes first: the host's own transformers/tokenizers are too new for sglang 0.5.14.
export PYTHONPATH="$_site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"   # deep_gemm asserts one at import
export PATH="$CUDA_HOME/bin:$PATH"
# JIT caches (tvm-ffi, deep_gemm, Triton, inductor) next to the site dir: reused by later runs.
_cache="${_site%/}-cache"
export TVM_FFI_CACHE_DIR="$_cache/tvm-ffi" DG_JIT_CACHE_DIR="$_cache/deep-gemm"
export TRITON_CACHE_DIR="$_cache/triton" TORCHINDUCTOR_CACHE_DIR="$_cache/inductor"
mkdir -p "$_cache"
