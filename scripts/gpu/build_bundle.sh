#!/usr/bin/env bash
# Build, on any machine with package-index access, an offline bundle that makes sglang import
# and run on a GPU host with Python 3.12 + torch 2.11.0+cu130 + triton 3.6 and no index.
#   scripts/gpu/build_bundle.sh [OUT_DIR] [REQUIREMENTS]
#     requirements/gpu-bundle.txt (default)  -> OUT_DIR/sglang-gpu-bundle.tar.xz (sglang 0.5.14)
#     requirements/gpu-bundle-X.txt          -> OUT_DIR/sglang-gpu-bundle-X.tar.xz
# Contents: the cp312 wheels of REQUIREMENTS unpacked into one site dir, with sglang-kernel
# trimmed to what sm90 uses: flash_ops.abi3.so (FA3, over 1 GB) and sm100/ are left out; an
# accidental FA3 call then fails loudly ("Can not import FA3"). A line `# bundle-drop: PATH`
# in REQUIREMENTS leaves PATH (relative to the site dir, a file or a folder) out as well.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.bundle}"
requirements="${2:-requirements/gpu-bundle.txt}"
name="sglang-$(basename "$requirements" .txt).tar.xz"
limit_mb="${BUNDLE_LIMIT_MB:-58}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
target=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}")
python3 -m pip download -q --no-deps "${target[@]}" -d "$work/wheels" -r "$requirements"
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
# Leave out what the requirements file names (e.g. optional kernels this bundle's runs never load).
sed -n 's/^# bundle-drop: *//p' "$requirements" | while read -r drop; do
  [[ -e "$work/site/$drop" ]] || { echo "bundle-drop: no $drop in the site dir" >&2; exit 1; }
  rm -rf "${work:?}/site/$drop"
done
(cd "$work/wheels" && ls) > "$work/site/.bundle-contents"
chmod -R u+w,a+rX "$work/site"
mkdir -p "$out"
tar -C "$work" -cf - site | xz -T0 -6 > "$out/$name.tmp"
mv "$out/$name.tmp" "$out/$name"
size_mb=$(( $(stat -c %s "$out/$name") / 1048576 ))
echo "bundle: $out/$name (${size_mb} MB)"
cp "$work/site/.bundle-contents" "$out/${name%.tar.xz}.contents.txt"
if (( size_mb > limit_mb )); then
  echo "bundle is larger than ${limit_mb} MB" >&2
  exit 1
fi
