"""Where a Triton kernel runs: compiled on a CUDA GPU, or in the interpreter on CPU tensors.

With TRITON_INTERPRET=1 (the tests on a machine without GPU) kernels run in numpy on CPU tensors.
`triton.jit` picks compiled vs interpreted when a module is imported, but tests and notebooks may
set the variable later, so launchers go through `jit_for_mode`, which wraps the same Python
function again in the mode asked for now.
"""

from __future__ import annotations

import os

import torch
import triton

_rejitted: dict = {}


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels then run in numpy on CPU tensors (tests, no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device` in this process."""
    device = torch.device(device)
    return device.type == "cuda" if not interpreting() else device.type == "cpu"


def jit_for_mode(kernel):
    """`kernel` compiled or interpreted as TRITON_INTERPRET says now."""
    from triton.runtime.interpreter import InterpretedFunction
    want = interpreting()
    if isinstance(kernel, InterpretedFunction) == want:
        return kernel
    key = (kernel.fn, want)
    if key not in _rejitted:
        _rejitted[key] = triton.jit(kernel.fn)
    return _rejitted[key]


def block_map(numels: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-tensor launch map (as torch's multi_tensor_apply): program i works on tensor
    `block_tensor[i]` from element `block_start[i]`, so one launch covers every tensor of a list."""
    counts = torch.tensor([triton.cdiv(n, block_size) for n in numels])
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first_block = torch.cumsum(counts, 0) - counts
    block_start = (torch.arange(len(block_tensor)) - first_block[block_tensor]) * block_size
    return block_tensor, block_start.to(torch.int64)
