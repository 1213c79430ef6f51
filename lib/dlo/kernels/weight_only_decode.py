"""W4A16 decoding in Triton: y = x @ dequant(W)^T for a few tokens (M <= 16), K split over programs (split-K).

At M = 1 a matmul reads every weight once and does 2 FLOPs with it: bound by HBM bytes, not by the tensor cores.
bf16 reads 2 bytes per weight; Day 8's W4A16 format (`dlo.kernels.quantize.pack_int4`: two codes per byte,
even k in the low nibble, +8 offset, one fp32 scale per group of G inputs, symmetric, no zero point) reads
1/2 + 4/G bytes: 0.53 at G = 128, 3.8x fewer. Day 8's kernel (dlo.kernels.weight_only_matmul) decodes with its
GEMM tiles made narrow: 16-row tensor-core tiles (15/16 padding at one token), nibbles interleaved back into k
order, up to 8 K slices chosen by the autotuner and added by two torch launches; it ran at 0.41x bf16 at one
token on an H200, 1.17x at 16 tokens with the same tiles. This kernel is laid out for one token instead: each
program owns BLOCK_N outputs and one of SPLIT slices of K, so N / BLOCK_N x SPLIT programs run (`split_k` picks
SPLIT from N, K and the SM count, no autotuning), and multiplies the low and high nibbles by the even and odd
inputs with fp32 FMAs, scaling each group's partial dot product once. The SPLIT fp32 partial results are added
by a second small launch in a fixed order: the same y bit for bit on every run (atomic adds into y would be one
launch less, but their order, and so the rounding, changes from run to run, and a bf16 y cannot take fp32
atomics).

Order: kernels, heuristic and launcher, `w4a16_decode_ref` (torch), compile cases, benchmark.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.kernels.aot import CompileCase
from dlo.kernels.quantize import pack_int4, quantize_ref
from dlo.kernels.runtime import bench_matmuls, kernel_available
from dlo.kernels.weight_only_matmul import (
    ACT_DTYPES,
    DECODE_MAX_M,
    check_args,
    moved_bytes,
    weight_only_matmul,
    weight_only_matmul_ref,
)

# (BLOCK_N outputs, BLOCK_K inputs) of a program by BLOCK_M = next_power_of_2(M): the accumulator, (BLOCK_M,
# BLOCK_N, BLOCK_K / 2) fp32, stays at 4096 values or fewer (32 a thread of 4 warps). Compiled for sm_90
# (tests/kernels/test_compile.py), none spills; at M = 1, 64 x 64 took 63 registers (8 programs an SM, 16 KB of
# codes in flight a step), 64 x 128 96 (5 programs, 20 KB): 64 x 64, more programs for narrow N, two 8-byte
# loads a row. num_stages changes nothing (no tl.dot to pipeline).
BLOCKS = {1: (64, 64), 2: (64, 64), 4: (32, 64), 8: (32, 32), 16: (16, 32)}
CPU_BLOCKS = (8, 16)  # the interpreter: small tiles, so tests cross tile edges in N and K
NUM_WARPS = 4
WAVES = 8  # programs wanted per SM: ~8 x 4 KB of codes in flight per SM is what HBM's latency x bandwidth needs
MIN_STEPS = 2  # K steps per split at least: fewer and the partial sums' traffic grows beside the codes'
SUM_BLOCK = 1024
CPU_SMS = 4  # what `split_k` assumes on a CPU (the interpreter has no SMs), so the default splits there too


@triton.jit
def _w4a16_splitk_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr,  # x (M, K), w (N, K/2) uint8, s (N, K/G) fp32,
                         M, N, K, n_groups, k_split,  # y (M, N) in x's dtype, part (SPLIT, M, N) fp32
                         G: tl.constexpr, ACT: tl.constexpr, PARTIAL: tl.constexpr,  # K split: part, not y
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # bytes of a row's step: codes k0 + 2j (low nibble) and k0 + 2j + 1 (high)
    # Products are summed over K once, after the loop, into an accumulator of the step's shape: a tl.sum every
    # step compiled for sm_90 into 80 warp shuffles and 10 barriers a step beside 16 FMAs (K runs across a
    # warp's lanes). One token keeps everything in the codes' (BN, BK/2) layout, x broadcast down the rows;
    # several go through a (BM, BN, BK/2) one, whose broadcasts cost shared-memory layout conversions a step.
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * k_split)
    for k0 in range(pid_k * k_split, k_end, BLOCK_K):  # k_split is whole steps: a step never spans two splits
        k_even = k0 + 2 * rb  # (BK/2,)
        byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + (k0 // 2 + rb)[None, :],
                       mask=(rn[:, None] < N) & (k0 // 2 + rb[None, :] < K // 2), other=0x88).to(tl.int32)
        # a code as fp32 without an int-to-float conversion (a quarter of the FMA rate): 2^23 + b holds the
        # integer b in its mantissa bits, so one OR and one exact subtraction of 2^23 + 8 give b - 8
        lo = ((byte & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (BN, BK/2)
        hi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        if G % BLOCK_K == 0:  # the step lies in one group: one scale per row
            s_even = tl.load(s_ptr + rn.to(tl.int64) * n_groups + k0 // G, mask=rn < N, other=0.0)[:, None]
            s_odd = s_even
        else:  # groups narrower than a step: each code gathers its scale
            s_row = s_ptr + rn[:, None].to(tl.int64) * n_groups
            ok = (rn[:, None] < N) & (k_even[None, :] < K)
            s_even = tl.load(s_row + (k_even // G)[None, :], mask=ok, other=0.0)
            s_odd = tl.load(s_row + ((k_even + 1) // G)[None, :], mask=ok, other=0.0)
        # x's even and odd inputs loaded apart (2-byte loads, from L1: x is only M x K x 2 bytes)
        x_at = x_ptr + rm[:, None] * K + k_even[None, :]
        x_ok = (rm[:, None] < M) & (k_even[None, :] < K)
        x_even = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)  # (BM, BK/2)
        x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            if G % BLOCK_K == 0:
                acc += (lo * x_even + hi * x_odd) * s_even  # 5 fp32 operations a byte, its 2 subtractions included
            else:
                acc += lo * s_even * x_even + hi * s_odd * x_odd
        else:
            w_even, w_odd = lo * s_even, hi * s_odd
            acc += x_even[:, None, :] * w_even[None, :, :] + x_odd[:, None, :] * w_odd[None, :, :]
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]  # (1, BN)
    else:
        y = tl.sum(acc, axis=2)  # (BM, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if not PARTIAL:
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(ACT), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], y, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, MN, split, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """y = part[0] + part[1] + ... in this order, in fp32, rounded once to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + s * MN + offs, mask=offs < MN, other=0.0)
    tl.store(y_ptr + offs, acc.to(ACT), mask=offs < MN)


# ----------------------------------------------------------------------------- heuristic and launcher

def blocks_for(M: int, G: int, device_type: str = "cuda") -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a launch: BLOCK_M the next power of two of M, the tile of `BLOCKS`; its
    BLOCK_K halved (down to 16) until it divides G, when one does, so a step takes one scale per row."""
    block_m = triton.next_power_of_2(M)
    block_n, block_k = CPU_BLOCKS if device_type == "cpu" else BLOCKS[block_m]
    k = block_k
    while k > 16 and G % k:
        k //= 2
    return block_m, block_n, k if G % k == 0 else block_k


def split_k(N: int, K: int, sms: int, block_n: int, block_k: int) -> int:
    """How many slices of K: enough programs for WAVES per SM (N / block_n of them per slice), each slice
    at least MIN_STEPS steps of block_k (and whole steps), so at most K / (MIN_STEPS block_k) slices."""
    tiles, steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    want = max(1, triton.cdiv(WAVES * sms, tiles))
    split = max(1, min(want, steps // MIN_STEPS))
    return triton.cdiv(steps, triton.cdiv(steps, split))  # no empty slice once each is whole steps


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (CPU_SMS on a CPU, where the interpreter runs the kernel)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_SMS


def w4a16_decode(x: Tensor, w: Tensor, scale: Tensor, split: int | None = None) -> Tensor:
    """y (M, N) = x (M, K) @ (codes * scale)^T in x's dtype, M <= 16; w: packed int4 (N, K // 2) uint8, scale
    (N, K // G) fp32. `split`: the number of K slices (default: `split_k` for this GPU)."""
    M, N, K = check_args(x, w, scale, 4)
    if M > DECODE_MAX_M:
        raise ValueError(f"w4a16_decode is for decoding, M <= {DECODE_MAX_M} tokens; got M={M}: use "
                         "dlo.kernels.weight_only_matmul for prefill")
    if not kernel_available(x.device):
        raise RuntimeError(f"the Triton kernel cannot run on {x.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use w4a16_decode_ref otherwise)")
    G = K // scale.shape[1]
    block_m, block_n, block_k = blocks_for(M, G, x.device.type)
    steps = triton.cdiv(K, block_k)
    if split is None:
        split = split_k(N, K, sm_count(x.device), block_n, block_k)
    if not 1 <= split <= steps:
        raise ValueError(f"split={split} must lie in [1, {steps}] (K={K} is {steps} steps of {block_k})")
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # whole steps per slice, none empty
    x, w, scale = x.contiguous(), w.contiguous(), scale.float().contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    act = ACT_DTYPES[x.dtype]
    _w4a16_splitk_kernel[(triton.cdiv(N, block_n), split)](
        x, w, scale, y, part, M, N, K, scale.shape[1], triton.cdiv(steps, split) * block_k, G=G, ACT=act,
        PARTIAL=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](part, y, M * N, split, ACT=act, BLOCK=SUM_BLOCK)
    return y


def pack_weight(w: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor]:
    """Day 8's W4A16 format of a float weight (N, K): (packed int4 codes (N, K // 2) uint8, fp32 scales (N, K // G)),
    by its torch reference quantizer (the same codes and scales as its Triton kernel) and `pack_int4`."""
    q, scale = quantize_ref(w.float(), 4, group_size)
    return pack_int4(q), scale


def w4a16_decode_ref(x: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    """torch: Day 8's reference, dequantize the whole weight to x's dtype, then one matmul in fp32."""
    return weight_only_matmul_ref(x, w, scale, 4)


def decode_bytes(M: int, K: int, N: int, G: int, split: int) -> int:
    """HBM bytes of one decode: Day 8's count (x, codes, scales, y, and the split's fp32 partial sums
    written and read back)."""
    return moved_bytes(M, K, N, 4, G, split)


# ----------------------------------------------------------------------------- compile cases

def compile_cases(K: int = 3072, N: int = 8192, group_size: int = 128) -> list[CompileCase]:
    """What a GPU launch compiles (dlo.kernels.aot): each BLOCK_M's tile at Llama 3.2 3B's MLP up-projection
    (K = 3072, N = 8192), bf16 and fp16, split and not (M = 1 is a constant: its own compilation), groups of
    128 and per channel; and the sum of the slices."""
    cases = []
    for block_m in BLOCKS:
        for act, tl_act in ACT_DTYPES.items():
            for G in ((group_size, K) if act == torch.bfloat16 else (group_size,)):
                _, block_n, block_k = blocks_for(block_m, G)
                split = split_k(N, K, 132, block_n, block_k)
                args = dict(x_ptr=act, w_ptr=torch.uint8, s_ptr=torch.float32, y_ptr=act, part_ptr=torch.float32,
                            M=block_m, N=N, K=K, n_groups=K // G, k_split=triton.cdiv(K, split * block_k) * block_k,
                            G=G, ACT=tl_act, PARTIAL=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
                cases.append(CompileCase(_w4a16_splitk_kernel, args, num_warps=NUM_WARPS, num_stages=3,
                                         label=f"{str(act).removeprefix('torch.')} M={block_m} G={G} split{split}",
                                         shape=f"M={block_m} K={K} N={N} G={G}",
                                         bytes=decode_bytes(block_m, K, N, G, split), flops=2 * block_m * N * K,
                                         peak="fp32_tflops",
                                         torch=(2 * (block_m * K + N * K + block_m * N), 2 * block_m * N * K,
                                                "bf16_tflops")))
    for act, tl_act in ACT_DTYPES.items():
        args = dict(part_ptr=torch.float32, y_ptr=act, MN=N, split=8, ACT=tl_act, BLOCK=SUM_BLOCK)
        cases.append(CompileCase(_sum_splits_kernel, args, num_warps=NUM_WARPS, label=f"{act} split8".replace(
            "torch.", ""), shape=f"M=1 N={N}", bytes=(8 * 4 + 2) * N, flops=8 * N))
    return cases


# ----------------------------------------------------------------------------- benchmark

# Llama 3.2 1B and 3B's projections (in features K, out features N): q/o, k/v, gate/up, down
LLAMA_LAYERS = {"1B": {"q,o": (2048, 2048), "k,v": (2048, 512), "gate,up": (2048, 8192), "down": (8192, 2048)},
                "3B": {"q,o": (3072, 3072), "k,v": (3072, 1024), "gate,up": (3072, 8192), "down": (8192, 3072)}}


def decode_impls(x: Tensor, w: Tensor, packed: Tensor, scale: Tensor, split: int | None = None) -> dict:
    """The three ways to compute y = x @ W^T that a decode measurement compares, as name -> call: torch bf16 on
    the unquantized `w`, Day 8's W4A16 kernel and this split-K kernel on the same codes and scales."""
    return {"torch bf16": lambda: x @ w.T, "W4A16 Day 8 (GEMM tiles)": lambda: weight_only_matmul(x, packed, scale, 4),
            "W4A16 split-K": lambda: w4a16_decode(x, packed, scale, split)}


def bench(ms: tuple[int, ...] = (1, 4, 16), group_size: int = 128, models: tuple[str, ...] = ("1B", "3B"),
          splits: tuple[float, ...] = (0.5, 2.0)) -> list[dict]:
    """GPU: x (M, K) @ W^T on Llama 3.2's layers: torch bf16, Day 8's W4A16 kernel, this split-K kernel at
    `split_k`'s choice, and at that choice x each factor of `splits` (what the heuristic left on the table)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the W4A16 decode benchmark needs a CUDA GPU")
    rows = []
    for model in models:
        for layer, (K, N) in LLAMA_LAYERS[model].items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            p4, s4 = pack_weight(w, group_size)
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                _, block_n, block_k = blocks_for(M, group_size)
                best = split_k(N, K, sm_count(x.device), block_n, block_k)
                steps = triton.cdiv(K, block_k)
                others = sorted({min(steps, max(1, round(best * f))) for f in splits} - {best})
                calls = decode_impls(x, w, p4, s4)
                impls = {"torch bf16": (calls["torch bf16"], "bf16_tflops", 2 * (M * K + N * K + M * N)),
                         "dlo W4A16 (Day 8)": (calls["W4A16 Day 8 (GEMM tiles)"], "bf16_tflops",
                                               moved_bytes(M, K, N, 4, group_size)),
                         f"dlo W4A16 split-K {best}": (calls["W4A16 split-K"], "bf16_tflops",
                                                       decode_bytes(M, K, N, group_size, best))}
                impls.update({f"dlo W4A16 split-K {s}": (lambda s=s: w4a16_decode(x, p4, s4, s), "bf16_tflops",
                                                         decode_bytes(M, K, N, group_size, s)) for s in others})
                for row in bench_matmuls("weight_only_decode", M, K, N, impls):
                    rows.append({**row, "layer": f"Llama 3.2 {model} {layer}", "heuristic_split": best})
    return rows
