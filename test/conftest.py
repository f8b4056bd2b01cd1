"""Shared test setup. Runs before any test module imports sglang (and so triton)."""

import os

try:
    import torch
except ImportError:  # the pure tests (test_release, test_verdicts) need neither torch nor sglang
    torch = None

# The CPU tier runs sglang's real Triton kernels with Triton's interpreter; it must be set
# before triton is first imported. On a CUDA host the kernels run compiled.
if torch is None or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread, here and in the children the tests start (they inherit it): the CPU
    # tier's tensor work is small, and on a busy 2-core machine torch's OpenMP pool spun instead
    # (test/srt/test_dsa_cuda_graph.py 140 s -> 66 s, its CPU time 94 s -> 48 s).
    if os.environ.setdefault("OMP_NUM_THREADS", "1") == "1" and torch is not None:
        torch.set_num_threads(1)


def pytest_runtest_teardown(item):
    """A test that runs the plugin's ``register()`` in this process leaves its import hooks
    waiting (``plugin._ON_IMPORT`` and the finder on ``sys.meta_path``): a later test importing
    that backend would then get the plugin's REPLACE hooks applied to sglang's real classes, so
    its pristine case would read fixed. Each test leaves none behind."""
    import sys

    plugin = sys.modules.get("sglang_dsa_fix.plugin")
    if plugin is None:
        return
    plugin._ON_IMPORT.clear()
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, plugin._OnImport)]
