# The two commands (README): `make demo` runs the main job, `make test` the test suite
# (lint, the fast pytest tier on test/, then the release matrix, which installs other sglang
# releases from PyPI into .matrix/). `make test-full` runs every shape of the sweeps.
# All create the pinned environment in .venv first (scripts/bootstrap.sh, idempotent).
VENV ?= .venv
PYTHONWARNINGS ?= ignore
export PYTHONWARNINGS

.PHONY: demo test test-full lint env
env:
	@SGLANG_DSA_FIX_VENV=$(VENV) scripts/bootstrap.sh
lint: env
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
demo: env
	$(VENV)/bin/sglang-dsa-fix demo
test: lint
	$(VENV)/bin/python -m pytest -q -rs test
	$(VENV)/bin/python scripts/release_matrix.py
test-full: lint
	SGLANG_DSA_FIX_FULL=1 $(VENV)/bin/python -m pytest -q -rs test
	$(VENV)/bin/python scripts/release_matrix.py --full
