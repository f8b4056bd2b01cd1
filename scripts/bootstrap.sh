#!/usr/bin/env bash
# Create (or reuse) the project's pinned environment in .venv. Idempotent: a stamp holding the
# hash of the pins skips the install when nothing changed; a failed install leaves no stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SGLANG_DSA_FIX_VENV:-.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp="$venv/.sglang-dsa-fix-stamp"
want="$(cat requirements/cpu.txt pyproject.toml | sha256sum | cut -c1-32)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
echo "bootstrap: creating $venv from requirements/cpu.txt (first run: a few minutes)" >&2
rm -f "$stamp"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu.txt
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$venv/bin/python" -W ignore -c "import sglang.srt.layers.attention.dsa_backend, sglang_dsa_fix.cli"
echo "$want" > "$stamp"
