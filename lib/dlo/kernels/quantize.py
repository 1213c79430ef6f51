"""Symmetric per-channel / per-group weight quantization in Triton (int8 or int4 values).

For a weight W (N, K) cut into groups of G consecutive input features, each group g gets

    s_g = max_{k in g} |W[n, k]| / q_max,   q = clamp(round(W / s_g), -q_max, q_max),   q_max = 2^(b-1) - 1

(symmetric, restricted range, zero-point 0: Gholami et al. 2021, Sec. III). G = K is per-channel,
G = 128 is the group size Q-BERT (Shen et al. 2020) found to lose almost nothing. An all-zero group
gets s = 0 and q = 0 (no division by zero); inf or nan in W is an error.

One program quantizes one group of one row: read the group once, reduce |W| to its max, write q and
s. Rounding is round-half-to-even in both kernel and reference, like torch.round.

Order: kernel, launcher, `quantize_ref` (torch), `pack_int4` helpers, benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo import quant
from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import FP32_MAX, kernel_available

# Elements per program at most: a program quantizes BLOCK_R rows x one group, BLOCK_R = TILE // BLOCK.
# One row-group per program (the first H100 run) launched 131k programs of 128 elements, one per
# thread, for a 4096x4096 weight at G = 128: 6-8% of HBM bandwidth. A 4096-element tile is 32
# rows of a 128-group, 16-byte loads along each row. The whole group used to be one block of
# next_power_of_2(G): compiled for sm_90, per-channel quantization of a row of 65536 spilled 14 KB
# per thread (16384: 167 registers); wider groups now loop. The interpreter's small tile makes the
# tests take the multi-row and the looping paths.
TILE = {"cuda": 4096, "cpu": 64}
NUM_WARPS = 4


def blocks(G: int, device_type: str) -> tuple[int, int]:
    """(BLOCK_R rows, BLOCK columns) of a program for groups of G on `device_type`."""
    block = min(triton.next_power_of_2(G), TILE[device_type])
    return TILE[device_type] // block, block


@triton.jit
def _round_half_even(y):
    # floor(y + 0.5) rounds ties up; move odd results of exact ties one down (rint is not in the interpreter).
    r = tl.floor(y + 0.5)
    tie_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
    return tl.where(tie_odd, r - 1.0, r)


@triton.jit
def _codes(w, scale, q_max):
    safe = tl.where(scale > 0.0, scale, 1.0)  # an all-zero group: q = 0 / 1 = 0, s = 0
    q = _round_half_even(tl.div_rn(w, safe))
    return tl.minimum(tl.maximum(q, -q_max), q_max).to(tl.int8)


@triton.jit
def _quantize_kernel(w_ptr, q_ptr, s_ptr,  # (N, K) float, (N, K) int8, (N, K // G) fp32
                     bad_ptr,  # (1,) int32, set to 1 when W holds inf or nan
                     N, K, n_groups, q_max, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    base = rows[:, None].to(tl.int64) * K + g * G  # (BLOCK_R, 1)
    row_ok = rows[:, None] < N
    if G <= BLOCK:  # the group fits one block: read once, keep it in registers
        mask = row_ok & (offs[None, :] < G)
        w = tl.load(w_ptr + base + offs[None, :], mask=mask, other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK)
        n_bad = tl.sum(tl.sum(tl.where(tl.abs(w) <= FP32_MAX, 0, 1), axis=1), axis=0)
        scale = tl.max(tl.abs(w), axis=1) / q_max  # (BLOCK_R,)
        tl.store(q_ptr + base + offs[None, :], _codes(w, scale[:, None], q_max), mask=mask)
    else:  # a wider group (per-channel on a wide row): a max pass, then a quantize pass, BLOCK at a time
        running = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
        bad = tl.zeros((BLOCK_R, BLOCK), dtype=tl.int32)
        for start in range(0, G, BLOCK):
            mask = row_ok & (start + offs[None, :] < G)
            a = tl.abs(tl.load(w_ptr + base + start + offs[None, :], mask=mask, other=0.0).to(tl.float32))
            running = tl.maximum(running, a)
            bad = bad | tl.where(a <= FP32_MAX, 0, 1)
        n_bad = tl.sum(tl.sum(bad, axis=1), axis=0)
        scale = tl.max(running, axis=1) / q_max
        for start in range(0, G, BLOCK):
            mask = row_ok & (start + offs[None, :] < G)
            w = tl.load(w_ptr + base + start + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + start + offs[None, :], _codes(w, scale[:, None], q_max), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * n_groups + g, scale, mask=rows < N)
    if n_bad > 0:
        tl.store(bad_ptr, 1)  # every writer stores the same value: the race is harmless


def _check_weight(w: Tensor, bits: int, group_size: int) -> int:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (N, K), got shape {tuple(w.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not w.is_floating_point():
        raise TypeError(f"expected a floating-point weight, got {w.dtype}")
    K = w.shape[1]
    G = K if group_size in (-1, None) else group_size
    if G < 1 or K % G != 0:
        raise ValueError(f"group_size={group_size} must divide K={K} (use -1 for per-channel)")
    return G


NON_FINITE = "the weight holds inf or nan: its scale would be inf and every value 0; fix the weight first"


def quantize_weight(w: Tensor, bits: int = 8, group_size: int = -1) -> tuple[Tensor, Tensor]:
    """Triton: (q int8 (N, K) with values in [-q_max, q_max], scale fp32 (N, K // G)); group_size=-1: per-channel."""
    G = _check_weight(w, bits, group_size)
    if not kernel_available(w.device):
        raise RuntimeError(f"the Triton kernel cannot run on {w.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use quantize_ref otherwise)")
    w = w.contiguous()
    N, K = w.shape
    q = torch.empty((N, K), dtype=torch.int8, device=w.device)
    scale = torch.empty((N, K // G), dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return q, scale
    block_r, block = blocks(G, w.device.type)
    bad = torch.zeros(1, dtype=torch.int32, device=w.device)
    _quantize_kernel[(triton.cdiv(N, block_r), K // G)](w, q, scale, bad, N, K, K // G, float(2 ** (bits - 1) - 1),
                                                        G=G, BLOCK_R=block_r, BLOCK=block, num_warps=NUM_WARPS)
    # The finite check rides on the kernel's one read of W, so it is known only after the launch (the
    # outputs are new tensors, dropped on error). Checked before, with torch.isfinite(w).all(), it cost
    # two more passes over W and a host sync in front of the launch: the first H100 run measured 0.176 ms
    # for a 4096x4096 bf16 weight, 12x its 0.015 ms roofline, the GPU idle while Python launched.
    if bad.item():
        raise ValueError(NON_FINITE)
    return q, scale


def quantize_ref(w: Tensor, bits: int = 8, group_size: int = -1) -> tuple[Tensor, Tensor]:
    """The torch reference of `quantize_weight`, same outputs: dlo.quant's symmetric min-max
    quantization with one scale per group of G inputs (G = K is per-channel)."""
    G = _check_weight(w, bits, group_size)
    if not torch.isfinite(w).all():
        raise ValueError(NON_FINITE)
    q, scale, _ = quant.quantize(w, bits, "group", G, symmetric=True)
    return q, scale


def dequantize_weight(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W_hat = q * s, with each scale repeated over its group: (N, K) in `dtype`."""
    return quant.dequantize(q, scale).to(dtype)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) int8 in [-8, 7] -> (N, K // 2) uint8: even k in the low nibble, odd k in the high one, +8 offset."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even K, got {q.shape[-1]}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of `pack_int4`: (N, K // 2) uint8 -> (N, K) int8."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def moved_bytes(N: int, K: int, G: int, itemsize: int) -> int:
    """HBM bytes of one quantization: read W, write the int8 codes and the fp32 scales."""
    return N * K * (itemsize + 1) + 4 * N * (K // G)


def compile_cases(N: int = 8192, K: int = 3072) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot): the tile follows the group size (`blocks`),
    so groups of 128 (32 rows a program), per channel of Llama 3.2 3B's MLP weights, (8192, 3072)
    (one row, the largest one-pass BLOCK) and (3072, 8192) (the looping kernel), for each weight
    dtype; the work: read W, write the int8 codes and the scales."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for G in (128, K, N):
            rows, cols = (N, K) if G <= K else (K, N)  # per channel of 8192: the down-projection, (3072, 8192)
            block_r, block = blocks(G, "cuda")
            args = dict(w_ptr=dtype, q_ptr=torch.int8, s_ptr=torch.float32, bad_ptr=torch.int32, N=rows, K=cols,
                        n_groups=cols // G, q_max=127.0, G=G, BLOCK_R=block_r, BLOCK=block)
            cases.append(CompileCase(_quantize_kernel, args, f"{str(dtype).removeprefix('torch.')} G={G}",
                                     num_warps=NUM_WARPS, shape=f"N={rows} K={cols}", flops=3 * N * K,
                                     bytes=moved_bytes(rows, cols, G, dtype.itemsize)))
    return cases


# ----------------------------------------------------------------------------- benchmark

def bench(shapes: tuple[tuple[int, int], ...] = ((4096, 4096), (11008, 4096)), group_size: int = 128) -> list[dict]:
    """GPU: quantize a bf16 weight per group, Triton vs the torch reference; a pure bandwidth op (GB/s)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the quantize benchmark needs a CUDA GPU")
    from dlo.hardware import peak
    hbm = (peak("cuda") or {}).get("hbm_gbs")
    rows = []
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        moved = moved_bytes(N, K, group_size, 2)  # read bf16, write int8 and the scales
        for impl, fn in (("torch", lambda: quantize_ref(w, 8, group_size)),
                         ("dlo triton", lambda: quantize_weight(w, 8, group_size))):
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            gbs = moved / (ms * 1e-3) / 1e9
            rows.append({"op": "quantize", "size": f"{N}x{K}", "impl": impl, "ms": ms, "GB/s": gbs,
                         "% peak": 100 * gbs / hbm if hbm else None, "work": (moved, 3 * N * K, "fp32_tflops")})
    from dlo.hardware import add_roofline
    return add_roofline(rows, (peak("cuda") or {}).get("name"))
