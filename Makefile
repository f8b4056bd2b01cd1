# The two commands (README): `make demo` runs the main job, `make test` the test suite
# (pytest on test/, then the release matrix, which installs other sglang releases from PyPI
# into .matrix/).
# Both create the pinned environment in .venv first (scripts/bootstrap.sh, idempotent).
VENV ?= .venv
PYTHONWARNINGS ?= ignore
export PYTHONWARNINGS

.PHONY: demo test env
env:
	@SGLANG_DSA_FIX_VENV=$(VENV) scripts/bootstrap.sh
demo: env
	$(VENV)/bin/sglang-dsa-fix demo
test: env
	$(VENV)/bin/python -m pytest -q -rs test
	$(VENV)/bin/python scripts/release_matrix.py
