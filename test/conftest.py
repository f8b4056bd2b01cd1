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
