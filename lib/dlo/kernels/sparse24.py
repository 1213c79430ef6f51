"""2:4 semi-structured sparsity in Triton: mask and compress in one pass.

In every group of 4 consecutive weights along K, keep the 2 largest in magnitude (ties: the lower
index wins) and zero the other 2. Sparse tensor cores (A100 and later, Mishra et al. 2021) store the
2 kept values, (N, K / 2), plus 2-bit positions, and skip the zeros: at most 2x the dense math rate,
less in practice because the metadata and the unchanged activations still have to be read.

One program handles BLOCK groups; each group's 4 values are ranked by pairwise comparison (no sort).

Order: kernel, launcher, `sparse24_ref` (torch), `decompress24`, benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import bench_matmuls, kernel_available
from dlo.prune import mask_2to4

GPU_BLOCK, CPU_BLOCK = 1024, 64  # groups of 4 per program


@triton.jit
def _beats(a, b, a_first: tl.constexpr):
    # 1 where a outranks b: larger magnitude, or equal magnitude and a has the lower index.
    if a_first:
        return (a >= b).to(tl.int32)
    return (a > b).to(tl.int32)


@triton.jit
def _sparse24_kernel(w_ptr, v_ptr, i_ptr, m_ptr,  # w (n_groups*4,), values (n_groups*2,), idx int8 (n_groups*2,), mask
                     n_groups, BLOCK: tl.constexpr):
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) group ids
    ok = g < n_groups
    base = g.to(tl.int64) * 4
    w0 = tl.load(w_ptr + base + 0, mask=ok, other=0.0)
    w1 = tl.load(w_ptr + base + 1, mask=ok, other=0.0)
    w2 = tl.load(w_ptr + base + 2, mask=ok, other=0.0)
    w3 = tl.load(w_ptr + base + 3, mask=ok, other=0.0)
    a0, a1 = tl.abs(w0.to(tl.float32)), tl.abs(w1.to(tl.float32))
    a2, a3 = tl.abs(w2.to(tl.float32)), tl.abs(w3.to(tl.float32))
    # rank = how many of the other three outrank this one; keep rank < 2.
    k0 = (_beats(a1, a0, False) + _beats(a2, a0, False) + _beats(a3, a0, False)) < 2
    k1 = (_beats(a0, a1, True) + _beats(a2, a1, False) + _beats(a3, a1, False)) < 2
    k2 = (_beats(a0, a2, True) + _beats(a1, a2, True) + _beats(a3, a2, False)) < 2
    k3 = (_beats(a0, a3, True) + _beats(a1, a3, True) + _beats(a2, a3, True)) < 2
    # The first kept position is the lowest kept index, the second the highest.
    first = tl.where(k0, 0, tl.where(k1, 1, 2))
    second = tl.where(k3, 3, tl.where(k2, 2, 1))
    v_first = tl.where(k0, w0, tl.where(k1, w1, w2))
    v_second = tl.where(k3, w3, tl.where(k2, w2, w1))
    tl.store(v_ptr + g.to(tl.int64) * 2, v_first, mask=ok)
    tl.store(v_ptr + g.to(tl.int64) * 2 + 1, v_second, mask=ok)
    tl.store(i_ptr + g.to(tl.int64) * 2, first.to(tl.int8), mask=ok)
    tl.store(i_ptr + g.to(tl.int64) * 2 + 1, second.to(tl.int8), mask=ok)
    tl.store(m_ptr + base + 0, k0.to(tl.int8), mask=ok)
    tl.store(m_ptr + base + 1, k1.to(tl.int8), mask=ok)
    tl.store(m_ptr + base + 2, k2.to(tl.int8), mask=ok)
    tl.store(m_ptr + base + 3, k3.to(tl.int8), mask=ok)


def _check(w: Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (N, K), got shape {tuple(w.shape)}")
    if w.shape[1] % 4:
        raise ValueError(f"2:4 sparsity groups 4 consecutive values along K; K={w.shape[1]} is not a multiple of 4")
    if not w.is_floating_point():
        raise TypeError(f"expected a floating-point weight, got {w.dtype}")
    if torch.isnan(w).any():
        raise ValueError("the weight holds nan: its magnitude ranks are undefined")


def sparse24(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Triton: (values (N, K/2) in w's dtype, positions (N, K/2) int8 in 0..3, mask (N, K) bool)."""
    _check(w)
    if not kernel_available(w.device):
        raise RuntimeError(f"the Triton kernel cannot run on {w.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use sparse24_ref otherwise)")
    w = w.contiguous()
    N, K = w.shape
    values = torch.empty((N, K // 2), dtype=w.dtype, device=w.device)
    idx = torch.empty((N, K // 2), dtype=torch.int8, device=w.device)
    mask = torch.empty((N, K), dtype=torch.int8, device=w.device)
    n_groups = N * K // 4
    if n_groups:
        BLOCK = GPU_BLOCK if w.device.type == "cuda" else CPU_BLOCK
        _sparse24_kernel[(triton.cdiv(n_groups, BLOCK),)](w, values, idx, mask, n_groups, BLOCK=BLOCK)
    return values, idx, mask.bool()


def sparse24_ref(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """torch: dlo.prune.mask_2to4's mask (the same ranking: magnitude, then lower index), compressed."""
    _check(w)
    N, K = w.shape
    mask = mask_2to4(w)
    groups, group_mask = w.reshape(N, K // 4, 4), mask.reshape(N, K // 4, 4)
    # Boolean indexing walks each group in order, so the 2 kept positions come out increasing.
    kept = torch.arange(4, device=w.device).expand(N, K // 4, 4)[group_mask].reshape(N, K // 4, 2)
    values = torch.gather(groups, -1, kept)
    return values.reshape(N, K // 2), kept.to(torch.int8).reshape(N, K // 2), mask


def decompress24(values: Tensor, idx: Tensor) -> Tensor:
    """Dense (N, K) weight with zeros back in place: the inverse of the compression."""
    N, half = values.shape
    dense = torch.zeros(N, half // 2, 4, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, idx.long().reshape(N, half // 2, 2), values.reshape(N, half // 2, 2))
    return dense.reshape(N, 2 * half)


def compress_bytes(N: int, K: int, itemsize: int) -> int:
    """HBM bytes of one compression: read W, write half of it, the int8 positions and the int8 mask."""
    return N * K * itemsize * 3 // 2 + N * K // 2 + N * K


def compile_cases(N: int = 8192, K: int = 3072) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot), per weight dtype; the work at Llama 3.2 3B's
    (8192, 3072) MLP weight: read W, write half of it, the int8 positions and the int8 mask."""
    return [CompileCase(_sparse24_kernel, dict(w_ptr=dtype, v_ptr=dtype, i_ptr=torch.int8, m_ptr=torch.int8,
                                               n_groups=N * K // 4, BLOCK=GPU_BLOCK),
                        f"{str(dtype).removeprefix('torch.')} BLOCK={GPU_BLOCK}", shape=f"N={N} K={K}",
                        bytes=compress_bytes(N, K, dtype.itemsize), flops=0)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)]


# ----------------------------------------------------------------------------- benchmark

def bench(shapes: tuple[tuple[int, int, int], ...] = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096))
          ) -> list[dict]:
    """GPU: dense bf16 x @ W^T vs torch's 2:4 semi-structured W (cuSPARSELt/CUTLASS), plus our compress pass."""
    if not torch.cuda.is_available():
        raise RuntimeError("the 2:4 sparsity benchmark needs a CUDA GPU")
    from torch.sparse import to_sparse_semi_structured

    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        w24 = w * sparse24(w)[2]
        w_sparse = to_sparse_semi_structured(w24)
        # 2:4: half the values, plus 2 bits of position metadata per kept value.
        impls = {"torch bf16 dense": (lambda: torch.nn.functional.linear(x, w24), "bf16_tflops",
                                      2 * (M * K + N * K + M * N)),
                 "2:4 semi-structured": (lambda: torch.nn.functional.linear(x, w_sparse), "bf16_tflops",
                                         2 * (M * K + M * N) + N * K + N * K // 8)}
        rows += bench_matmuls("sparse24_matmul", M, K, N, impls)  # TFLOP/s: dense-equivalent work
        ms = triton.testing.do_bench(lambda: sparse24(w), warmup=10, rep=50, return_mode="median")
        rows.append({"op": "sparse24_compress", "size": f"{N}x{K}", "K": K, "N": N, "impl": "dlo triton", "ms": ms,
                     "TFLOP/s": None, "% peak": None, "speed-up": None,
                     "work": (compress_bytes(N, K, 2), 0, "bf16_tflops")})
    from dlo.hardware import add_roofline, peak
    return add_roofline(rows, (peak("cuda") or {}).get("name"))
