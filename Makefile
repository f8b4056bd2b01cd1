# The two commands (README): `make demo` runs the main job, `make test` the test suite
# (lint, the fast pytest tier on test/, then the release matrix, which installs other sglang
# releases from PyPI into .matrix/). `make test-full` runs every shape of the sweeps.
# All create the pinned environment in .venv first (scripts/bootstrap.sh, idempotent).
VENV ?= .venv
PYTHONWARNINGS ?= ignore
# The pytest tier in two worker processes (pytest-xdist), one test file each at a time: the
# module-scoped fixtures (the benchmark smoke runs) and the in-file children stay in one process.
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
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
	$(VENV)/bin/python -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadfile test
	$(VENV)/bin/python scripts/release_matrix.py
test-full: lint
	SGLANG_DSA_FIX_FULL=1 $(VENV)/bin/python -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadfile test
	$(VENV)/bin/python scripts/release_matrix.py --full
