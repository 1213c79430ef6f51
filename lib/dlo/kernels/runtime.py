"""Where a Triton kernel runs, and what the kernels share (launch tables, bf16 rounding, timing).

Kernels are compiled for CUDA tensors, or run in numpy on CPU tensors with TRITON_INTERPRET=1 (the
tests on a machine without GPU). `triton.jit` picks compiled vs interpreted when a kernel module is
imported, so TRITON_INTERPRET must be set before dlo.kernels is imported: tests/conftest.py does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels then run in numpy on CPU tensors (tests, no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device` in this process."""
    device = torch.device(device)
    return device.type == "cuda" if not interpreting() else device.type == "cpu"


FP32_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= FP32_MAX is false exactly for inf and nan


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32. Done by hand because the CPU
    interpreter truncates on fp32 -> bf16, which would bias small updates downwards; this way GPU
    and interpreter agree bit for bit. inf keeps its class under this rounding; a nan is passed through
    as it is: the canonical nan of NVIDIA's arithmetic is 0x7FFFFFFF, whose rounding carry would run into
    the sign bit and make it -0.0 (seen on an H100: nan * 0.5 unscaled to -0.0, hiding an overflow)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


def block_map(numels: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-tensor launch map (as torch's multi_tensor_apply): program i works on tensor
    `block_tensor[i]` from element `block_start[i]`, so one launch covers every tensor of a list."""
    counts = torch.tensor([triton.cdiv(n, block_size) for n in numels])
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first_block = torch.cumsum(counts, 0) - counts
    block_start = (torch.arange(len(block_tensor)) - first_block[block_tensor]) * block_size
    return block_tensor, block_start.to(torch.int64)


_tables: dict[tuple, tuple] = {}


def launch_tables(lists: list[list[Tensor]], device: torch.device, block_size: int) -> tuple:
    """Tables of one multi-tensor launch over parallel tensor lists (e.g. params, grads, m, v):
    (L, T) int64 addresses, (T,) sizes (of lists[0]), the per-program map of `block_map`, and
    whether every address is 16-byte aligned. A pure function of addresses, sizes and block size,
    so the cache is always right; it saves rebuilding and copying the tables every step."""
    # map over the unbound methods and flat tuples: this runs every optimizer step, and with ~150
    # tensors its Python time is what a small model's step costs (host-bound, first H100 run).
    addrs = tuple(tuple(map(Tensor.data_ptr, lst)) for lst in lists)
    numels = tuple(map(Tensor.numel, lists[0]))
    key = (device, block_size, addrs, numels)
    if key not in _tables:
        block_tensor, block_start = block_map(numels, block_size)
        if len(_tables) >= 64:
            _tables.pop(next(iter(_tables)))
        tables = [torch.tensor(addrs, dtype=torch.int64), torch.tensor(numels, dtype=torch.int64),
                  block_tensor, block_start]
        # torch allocations are aligned; only views with an odd storage offset are not.
        aligned = all(a % 16 == 0 for lst in addrs for a in lst)
        _tables[key] = (*(x.to(device) for x in tables), aligned)
    return _tables[key]


def time_ms(fn, device: torch.device | str = "cuda", warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of one call of `fn`: triton's do_bench on CUDA (it flushes the L2 cache
    between calls), dlo.measure.time_fn on CPU (after one warm-up call, e.g. an optimizer's state
    allocation on its first step; at least 3 calls and 0.2 s)."""
    if torch.device(device).type == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    from dlo.measure import time_fn

    return time_fn(fn, device=device, warmup=1, reps=3, min_time_s=0.2, max_reps=50).median_ms


def bench_matmuls(op: str, M: int, K: int, N: int, impls: dict, peaks: dict | None = None) -> list[dict]:
    """Time implementations of one (M, K) x (K, N) product for `dlo bench` (GPU only).

    `impls` maps a name to (fn, peak key such as "bf16_tflops", bytes it must move at least or None:
    then no roofline columns);
    the first entry is the dense bf16 baseline that "speed-up" refers to. TFLOP/s counts the dense
    work 2 M N K, whatever the format, so rates of sparse and quantized products compare with dense
    ones. `peaks`: dlo.hardware figures (default: this GPU's). "size" groups rows for dlo.bench's ratios.
    """
    if peaks is None:
        from dlo.hardware import peak
        peaks = peak("cuda") or {}
    rows, base = [], None
    for impl, (fn, key, moved) in impls.items():
        ms = time_ms(fn, warmup=10, rep=50)
        base = base or ms
        tflops = 2 * M * N * K / (ms * 1e-3) / 1e12
        pk = peaks.get(key)
        rows.append({"op": op, "size": f"{M}x{K}x{N}", "M": M, "K": K, "N": N, "impl": impl, "ms": ms,
                     "TFLOP/s": tflops, "% peak": 100 * tflops / pk if pk else None, "speed-up": base / ms,
                     **({"work": (moved, 2 * M * N * K, key)} if moved else {})})
    from dlo.bench import add_roofline
    return add_roofline(rows, peaks.get("name"))
