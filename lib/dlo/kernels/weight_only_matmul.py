"""Weight-only quantized matmul (W8A16 and W4A16) in Triton: y = x @ dequant(W)^T, dequantized on the fly.

The weight stays in HBM as int8 (N, K) or packed int4 (N, K // 2) with one fp32 scale per group of
G input features (see dlo.kernels.quantize). Each program loads a (BLOCK_N, BLOCK_K) tile of codes,
multiplies by its scales in registers, casts to the activation dtype (bf16 / fp16) and feeds the
tensor cores with fp32 accumulation. At small batch (LLM decoding) the matmul is bound by reading W,
so 1 byte (or half a byte) per weight instead of 2 is up to a 2x (4x) speed-up; at large batch it is
compute bound and the dequantization is extra work on top of the bf16 GEMM.

Order: kernel, launcher, `weight_only_matmul_ref` (torch), benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.kernels.aot import CompileCase
from dlo.kernels.quantize import dequantize_weight, unpack_int4
from dlo.kernels.runtime import bench_matmuls, kernel_available

ACT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Launch configurations. Decode (M <= 16) reads W once with tall-skinny tiles; larger M uses square
# tensor-core tiles; the interpreter takes small tiles, fewer wasted lanes on tiny test shapes.
# Compiled for sm_80/90/100 (tests/kernels/test_compile.py), on 4 warps the former tiles spilled:
# the GEMM one, 64x128x64, ~1.3 KB per thread in W4A16 (the unpacked int4 tile sits in registers
# beside the accumulator), the decode one, 16x64x64, 8 bytes in W8A16 on sm_100; 16x64x128 spills
# in W4A16. On 8 warps these fit in registers on all three targets (W4A16 decode: ~160 registers).
# A K that is not a multiple of 16 leaves rows unaligned (no vector or asynchronous copies): the GEMM
# tile then spilled ~0.5 KB per thread, so such launches take a 64x64 tile.
DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=8)
GEMM = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8)
GEMM_UNALIGNED_K = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4)
CPU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4)
DECODE_MAX_M = 16


def launch_config(M: int, K: int, device_type: str) -> dict:
    """Blocks and warps of a launch: the interpreter's small tile, decode, GEMM or unaligned-K GEMM."""
    if device_type == "cpu":
        return CPU
    return DECODE if M <= DECODE_MAX_M else GEMM if K % 16 == 0 else GEMM_UNALIGNED_K


@triton.jit
def _weight_only_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr,  # x (M, K), w (N, K) int8 or (N, K/2) uint8, s (N, K/G)
                               M, N, K, n_groups,
                               G: tl.constexpr, INT4: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # (BM, BK)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        if INT4:
            # Two codes per byte: byte k // 2, low nibble for even k, high nibble for odd k, offset by 8.
            byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + rk[None, :] // 2, mask=w_mask, other=8)
            code = ((byte.to(tl.int32) >> ((rk[None, :] % 2) * 4)) & 0xF) - 8  # (BN, BK)
        else:
            code = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=w_mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + rn[:, None].to(tl.int64) * n_groups + rk[None, :] // G, mask=w_mask, other=0.0)
        w = (code.to(tl.float32) * s).to(ACT)  # (BN, BK), dequantized in registers
        if UPCAST:  # the CPU interpreter multiplies bf16 tiles wrongly: same values, fp32 dot
            acc = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)  # (BM, BN) fp32 accumulation on the tensor cores
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(ACT),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _check(x: Tensor, w: Tensor, scale: Tensor, bits: int) -> tuple[int, int, int]:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or w.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"x, w, scale must be 2-D, got shapes {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{tuple(scale.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"activations must be bf16 or fp16 (the A16 of W8A16), got {x.dtype}")
    want = torch.int8 if bits == 8 else torch.uint8
    if w.dtype != want:
        packing = "packed with pack_int4" if bits == 4 else "codes"
        raise TypeError(f"a {bits}-bit weight must be {want} ({packing}), got {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] * (2 if bits == 4 else 1) != K:
        raise ValueError(f"x has K={K} but the {bits}-bit weight has shape {tuple(w.shape)}")
    if scale.shape[0] != N or scale.shape[1] < 1 or K % scale.shape[1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} must be (N={N}, K/G) with G dividing K={K}")
    return M, N, K


def weight_only_matmul(x: Tensor, w: Tensor, scale: Tensor, bits: int = 8) -> Tensor:
    """y (M, N) = x (M, K) @ (codes * scale)^T in x's dtype; w: int8 (N, K) or packed int4 uint8 (N, K // 2)."""
    M, N, K = _check(x, w, scale, bits)
    if not kernel_available(x.device):
        raise RuntimeError(f"the Triton kernel cannot run on {x.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use weight_only_matmul_ref otherwise)")
    x, w, scale = x.contiguous(), w.contiguous(), scale.float().contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    config = launch_config(M, K, x.device.type)
    grid = (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(N, config["BLOCK_N"]))
    _weight_only_matmul_kernel[grid](
        x, w, scale, y, M, N, K, scale.shape[1], G=K // scale.shape[1], INT4=bits == 4, ACT=ACT_DTYPES[x.dtype],
        UPCAST=x.device.type == "cpu", **config)
    return y


def weight_only_matmul_ref(x: Tensor, w: Tensor, scale: Tensor, bits: int = 8) -> Tensor:
    """torch: dequantize the whole weight to x's dtype, then one matmul with fp32 accumulation."""
    _check(x, w, scale, bits)
    w_hat = dequantize_weight(unpack_int4(w) if bits == 4 else w, scale.float(), x.dtype)
    return (x.float() @ w_hat.float().T).to(x.dtype)


def compile_cases(K: int = 3072, N: int = 8192, group_size: int = 128, unaligned_k: int = 3000) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot): both activation dtypes, 8 and 4 bits, every
    tile of `launch_config`; the work at Llama 3.2 3B's MLP up-projection (decode: M = 16 tokens,
    GEMM: 4096), at `unaligned_k` (one group per row) for a K that is not a multiple of 16: read x,
    the codes and the scales once, write y."""
    cases = []
    launches = [(M, k, group_size if k == K else k) for M in (DECODE_MAX_M, 4096) for k in (K, unaligned_k)]
    for act, tl_act in ACT_DTYPES.items():
        for bits in (8, 4):
            for M, k, G in launches:
                config = launch_config(M, k, "cuda")
                blocks = {name: v for name, v in config.items() if name != "num_warps"}
                tile = "x".join(str(b) for b in blocks.values()) + ("" if k % 16 == 0 else " K%16!=0")
                args = dict(x_ptr=act, w_ptr=torch.int8 if bits == 8 else torch.uint8, s_ptr=torch.float32,
                            y_ptr=act, M=M, N=N, K=k, n_groups=k // G, G=G, INT4=bits == 4,
                            ACT=tl_act, UPCAST=False, **blocks)
                moved = 2 * M * k + N * k * bits // 8 + 4 * N * k // G + 2 * M * N
                cases.append(CompileCase(_weight_only_matmul_kernel, args, num_warps=config["num_warps"],
                                         label=f"W{bits}A16 {str(act).removeprefix('torch.')} {tile}",
                                         shape=f"M={M} K={k} N={N} G={G}", bytes=moved,
                                         flops=2 * M * N * k, peak="bf16_tflops",
                                         torch=(2 * (M * k + N * k + M * N), 2 * M * N * k, "bf16_tflops")))
    return cases


# ----------------------------------------------------------------------------- benchmark

def bench(shapes: tuple[tuple[int, int, int], ...] = ((1, 4096, 11008), (16, 4096, 11008), (4096, 4096, 11008)),
          group_size: int = 128) -> list[dict]:
    """GPU: x (M, K) @ W^T with W (N, K) of a Llama-7B MLP: bf16 cuBLAS vs W8A16 vs W4A16 (TFLOP/s)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the weight-only matmul benchmark needs a CUDA GPU")
    from dlo.hardware import peak
    from dlo.kernels.quantize import pack_int4, quantize_weight
    bf16_peak = (peak("cuda") or {}).get("bf16_tflops")
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        q8, s8 = quantize_weight(w, 8, group_size)
        q4, s4 = quantize_weight(w, 4, group_size)
        p4 = pack_int4(q4)
        impls = {"torch bf16": (lambda: x @ w.T, bf16_peak),
                 "dlo W8A16": (lambda: weight_only_matmul(x, q8, s8, 8), bf16_peak),
                 "dlo W4A16": (lambda: weight_only_matmul(x, p4, s4, 4), bf16_peak)}
        rows += bench_matmuls("weight_only_matmul", M, K, N, impls)
    return rows
