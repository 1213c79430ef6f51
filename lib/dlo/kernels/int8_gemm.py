"""W8A8 int8 GEMM in Triton: int8 x int8 products summed in int32, rescaled to float in the epilogue.

With per-token activation scales s_x (M,) and per-channel weight scales s_w (N,) (both symmetric),

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]

is exact up to the final float multiply: the int32 sum cannot overflow for K < 2^31 / 127^2 ~ 133k.
Both scales factor out of the sum, which is why per-tensor or per-row (not per-group along K)
granularity is what integer tensor cores can use. A100: 624 int8 TOPS vs 312 bf16 TFLOPS, x2 on paper.

Order: kernel, launcher, `int8_gemm_ref` (torch), `quantize_rows` (dynamic per-token), benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo import quant
from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import bench_matmuls, kernel_available

OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_K = (2 ** 31 - 1) // (127 * 127)  # the int32 accumulator is safe up to this K
# GPU launch configurations, timed by triton.autotune per (M, N, K) on first use: decode tiles for
# M <= 16 (one m16 tensor-core row block; the 128-row tile wasted 7/8 of its math there), GEMM tiles
# above, for Llama 3.2 3B's projections (K = 3072 or 8192, N = 1024 to 8192). Every one is compiled
# for sm_80/90/100 by tests/kernels/test_compile.py. The interpreter keeps one small tile.
# A K that is not a multiple of 16 makes rows unaligned: no vector or asynchronous copies, and the
# tiles above spilled 1-9 KB per thread on every target; such launches take the UNALIGNED tiles.
DECODE_MAX_M = 16
DECODE_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),)
GEMM_CONFIGS = (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3))
UNALIGNED_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
                     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3))
CPU_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr,  # a (M, K) int8, b (N, K) int8, sa (M,), sb (N,), c (M, N)
                      M, N, K, OUT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)  # (BM, BK) int8
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)  # (BN, BK) int8
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)  # exact integer sums
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * sa[:, None] * sb[None, :]  # fused rescale: no int32 round trip through HBM
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], c.to(OUT),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _config(c: dict):
    blocks = {k: v for k, v in c.items() if k.startswith("BLOCK")}
    return triton.Config(blocks, num_warps=c["num_warps"], num_stages=c["num_stages"])


def _configs_for(configs, named_args, **kwargs):
    """The autotuner times only the tiles made for this M (decode or GEMM) and this K (aligned or not)."""
    pool = DECODE_CONFIGS + GEMM_CONFIGS if named_args["K"] % 16 == 0 else UNALIGNED_CONFIGS
    decode = named_args["M"] <= DECODE_MAX_M
    wanted = [str(_config(c)) for c in pool if (c["BLOCK_M"] <= DECODE_MAX_M) == decode]
    return [c for c in configs if str(c) in wanted]


_int8_gemm_tuned = triton.autotune([_config(c) for c in DECODE_CONFIGS + GEMM_CONFIGS + UNALIGNED_CONFIGS],
                                   key=["M", "N", "K"],
                                   prune_configs_by={"early_config_prune": _configs_for})(_int8_gemm_kernel)


def _check(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype) -> tuple[int, int, int]:
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"a and b must be int8 codes, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if sa.shape != (M,) or sb.shape != (N,):
        raise ValueError(f"scales must be (M,)=({M},) and (N,)=({N},), got {tuple(sa.shape)}, {tuple(sb.shape)}")
    if K > MAX_K:
        raise ValueError(f"K={K} could overflow the int32 accumulator (max {MAX_K})")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}")
    return M, N, K


def int8_gemm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """c (M, N) = (a @ b^T in int32) * sa[:, None] * sb[None, :], cast to out_dtype."""
    M, N, K = _check(a, b, sa, sb, out_dtype)
    if not kernel_available(a.device):
        raise RuntimeError(f"the Triton kernel cannot run on {a.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use int8_gemm_ref otherwise)")
    a, b = a.contiguous(), b.contiguous()
    sa, sb = sa.float().contiguous(), sb.float().contiguous()
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"])
    if a.device.type == "cuda":
        _int8_gemm_tuned[grid](a, b, sa, sb, c, M, N, K, OUT=OUT_DTYPES[out_dtype])
    else:
        _int8_gemm_kernel[grid](a, b, sa, sb, c, M, N, K, OUT=OUT_DTYPES[out_dtype], **CPU_BLOCKS)
    return c


def int8_gemm_ref(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """torch: exact integer product (torch._int_mm where its shape rules allow, else an fp64 matmul), then rescale."""
    M, N, K = _check(a, b, sa, sb, out_dtype)
    if M > 16 and K % 8 == 0 and N % 8 == 0:
        acc = torch._int_mm(a, b.T)  # (M, K) @ (K, N) column-major view -> (M, N) int32
    else:  # exact: every partial sum is an integer below 2^31 < 2^53; CUDA has no int64 matmul
        acc = a.double() @ b.double().T
    return (acc.float() * sa.float()[:, None] * sb.float()[None, :]).to(out_dtype)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric per-row int8: (codes (M, K) int8, scales (M,) fp32); an all-zero row gets scale 0."""
    q, scale, _ = quant.quantize(x, 8, "channel", symmetric=True)  # scale (M, 1)
    return q, scale[:, 0]


def moved_bytes(M: int, K: int, N: int, out_itemsize: int) -> int:
    """HBM bytes of one launch: read a, b (int8) and the fp32 scales once, write c."""
    return M * K + N * K + 4 * (M + N) + M * N * out_itemsize


def compile_cases(K: int = 3072, N: int = 8192, unaligned_k: int = 3000) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot): every output dtype in every autotuner
    configuration; the work at Llama 3.2 3B's MLP up-projection over M tokens (decode: 16, GEMM:
    4096), or at `unaligned_k` for the unaligned tiles: read a, b and the scales, write c."""
    cases = []
    for config in DECODE_CONFIGS + GEMM_CONFIGS + UNALIGNED_CONFIGS:
        unaligned = config in UNALIGNED_CONFIGS
        k = unaligned_k if unaligned else K
        blocks = {name: v for name, v in config.items() if name.startswith("BLOCK")}
        tile = "x".join(map(str, blocks.values())) + (" K%16!=0" if unaligned else "")
        # M = 1 is a constant to the launcher (one token): decode tiles also compile that specialization.
        launches = [(out, 4096 if config["BLOCK_M"] > DECODE_MAX_M else DECODE_MAX_M) for out in OUT_DTYPES]
        if config["BLOCK_M"] <= DECODE_MAX_M:
            launches.append((torch.bfloat16, 1))
        for out, M in launches:
            tl_out = OUT_DTYPES[out]
            args = dict(a_ptr=torch.int8, b_ptr=torch.int8, sa_ptr=torch.float32, sb_ptr=torch.float32, c_ptr=out,
                        M=M, N=N, K=k, OUT=tl_out, **blocks)
            cases.append(CompileCase(_int8_gemm_kernel, args, num_warps=config["num_warps"],
                                     num_stages=config["num_stages"],
                                     label=f"{str(out).removeprefix('torch.')} {tile}" + (" M=1" if M == 1 else ""),
                                     shape=f"M={M} K={k} N={N}", flops=2 * M * N * k, peak="int8_tops",
                                     bytes=moved_bytes(M, k, N, out.itemsize),
                                     torch=(2 * (M * k + N * k + M * N), 2 * M * N * k, "bf16_tflops")))
    return cases


# ----------------------------------------------------------------------------- benchmark

def bench(shapes: tuple[tuple[int, int, int], ...] = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 4096, 11008))
          ) -> list[dict]:
    """GPU: bf16 cuBLAS vs torch._int_mm vs this kernel (with its fused rescale), TOPS and speed-up."""
    if not torch.cuda.is_available():
        raise RuntimeError("the int8 GEMM benchmark needs a CUDA GPU")
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        qa, sa = quantize_rows(x)
        qb, sb = quantize_rows(w)
        qbt = qb.T  # (K, N) column-major view, the layout cuBLASLt int8 wants
        impls = {"torch bf16": (lambda: x @ w.T, "bf16_tflops", 2 * (M * K + N * K + M * N)),
                 "torch._int_mm": (lambda: torch._int_mm(qa, qbt), "int8_tops", M * K + N * K + 4 * M * N),
                 "dlo int8 + rescale": (lambda: int8_gemm(qa, qb, sa, sb), "int8_tops", moved_bytes(M, K, N, 2))}
        rows += bench_matmuls("int8_gemm", M, K, N, impls)
    return rows
