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


def bench_matmuls(op: str, M: int, K: int, N: int, impls: dict) -> list[dict]:
    """Time implementations of one (M, K) x (K, N) product for `dlo bench` (GPU only).

    `impls` maps a name to (fn, peak TFLOP/s or None); the first entry is the dense bf16 baseline
    that "speed-up" refers to. TFLOP/s counts the dense work 2 M N K, whatever the format, so rates
    of sparse and quantized products compare with dense ones. "size" groups rows for dlo.bench's ratios.
    """
    rows, base = [], None
    for impl, (fn, pk) in impls.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        base = base or ms
        tflops = 2 * M * N * K / (ms * 1e-3) / 1e12
        rows.append({"op": op, "size": f"{M}x{K}x{N}", "M": M, "K": K, "N": N, "impl": impl, "ms": ms,
                     "TFLOP/s": tflops, "% peak": 100 * tflops / pk if pk else None, "speed-up": base / ms})
    return rows
