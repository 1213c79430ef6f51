"""Suite-wide set-up.

Without a GPU the Triton kernels run in the CPU interpreter. TRITON_INTERPRET must be set before
any module decorates a kernel with triton.jit, and many test modules import dlo.optim (which
imports the kernels), so it is set here, before collection starts. On a CUDA machine the kernels
are compiled and the same tests run on the GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernels run here: the GPU, or the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                        else "cpu")
