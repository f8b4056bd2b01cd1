"""Shared test setup. Runs before any test module imports sglang (and so triton)."""

import os

import torch

# The CPU tier runs sglang's real Triton kernels with Triton's interpreter; it must be set
# before triton is first imported. On a CUDA host the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
