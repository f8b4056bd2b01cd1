#!/usr/bin/env bash
# Build, on any machine with package-index access, the offline bundle that makes sglang 0.5.14
# import and run on a GPU host with Python 3.12 + torch 2.11.0+cu130 + triton 3.6 and no index.
#   scripts/gpu/build_bundle.sh [OUT_DIR]      -> OUT_DIR/sglang-gpu-bundle.tar.xz (< 58 MB)
# Contents: the cp312 wheels of requirements/gpu-bundle.txt unpacked into one site dir, with
# sglang-kernel trimmed to what DSA on sm90 uses: flash_ops.abi3.so (FA3, 1.7 GB) and sm100/
# are left out; an accidental FA3 call then fails loudly ("Can not import FA3").
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.bundle}"
limit_mb="${BUNDLE_LIMIT_MB:-58}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
target=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}")
python3 -m pip download -q --no-deps "${target[@]}" -d "$work/wheels" -r requirements/gpu-bundle.txt
mkdir -p "$work/site"
kernel_wheel="$(ls "$work"/wheels/sglang_kernel-*.whl)"
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python "${target[@]}" --target "$work/site" \
  $(ls "$work"/wheels/*.whl | grep -v -e '/sglang_kernel-')
# sglang-kernel by hand: unzip without FA3 and the Blackwell build (keeps the .dist-info that
# the Engine's version check reads).
python3 - "$kernel_wheel" "$work/site" <<'PY'
import sys, zipfile
wheel, site = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    keep = [n for n in zf.namelist()
            if not n.endswith("flash_ops.abi3.so") and "/sm100/" not in n]
    zf.extractall(site, keep)
PY
(cd "$work/wheels" && ls) > "$work/site/.bundle-contents"
chmod -R u+w,a+rX "$work/site"
mkdir -p "$out"
tar -C "$work" -cf - site | xz -T0 -6 > "$out/sglang-gpu-bundle.tar.xz.tmp"
mv "$out/sglang-gpu-bundle.tar.xz.tmp" "$out/sglang-gpu-bundle.tar.xz"
size_mb=$(( $(stat -c %s "$out/sglang-gpu-bundle.tar.xz") / 1048576 ))
echo "bundle: $out/sglang-gpu-bundle.tar.xz (${size_mb} MB)"
cp "$work/site/.bundle-contents" "$out/sglang-gpu-bundle.contents.txt"
if (( size_mb > limit_mb )); then
  echo "bundle is larger than ${limit_mb} MB" >&2
  exit 1
fi
