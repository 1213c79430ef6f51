"""Weight-only quantized matmul (W8A16 and W4A16) in Triton: y = x @ dequant(W)^T, dequantized on the fly.

The weight stays in HBM as int8 (N, K) or packed int4 (N, K // 2) with one fp32 scale per group of G
input features (see dlo.kernels.quantize). Each program loads a (BLOCK_N, BLOCK_K) tile of codes,
multiplies by its scales in registers (per channel, G = K: the accumulator, once, after the K loop),
casts to the activation dtype (bf16 / fp16) and feeds the tensor cores with fp32 accumulation. At
small batch (LLM decoding) the matmul is bound by reading W, so 1 byte (or half a byte) per weight
instead of 2 is up to a 2x (4x) speed-up; at large batch it is compute bound and the dequantization
is extra work on top of the bf16 GEMM. Decoding therefore takes narrow tiles and may split K over
several programs (split-K, as in GEMV kernels: more loads in flight for the same W), whose fp32
partial sums the launcher adds; prefill takes tensor-core GEMM tiles. Both are chosen per shape by
triton.autotune among configurations made for that M, K and G.

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
# GPU launch configurations, timed by triton.autotune per (M, N, K) on first use, chosen for Llama 3.2
# 3B's projections (K = 3072 or 8192, N = 1024 to 8192) and the 7B MLP the benchmark uses.
# Decode (M <= 16) is bound by reading W once: narrow column tiles and a split of K over SPLIT_K
# programs put enough loads in flight to fill HBM even at N = 1024 (k/v projections); each split writes
# fp32 partial sums that the launcher adds. Prefill (M > 16) takes tensor-core GEMM tiles. A tile whose
# BLOCK_K divides the group size G takes one scale per row (a (BLOCK_N,) load); otherwise every
# element gathers its scale, which the first H100 run showed cost ~10x (0.38 ms for a 45 MB W8A16
# decode vs 0.047 ms for torch's 90 MB bf16). A K that is not a multiple of 16 leaves rows unaligned
# (no vector or asynchronous copies): such launches take the UNALIGNED tiles, which spilled least.
# Compiled, 128x256x64 spilled on sm_80 (76 B per thread in W8A16, 268 B in W4A16: the dequantized
# tile sits in registers beside the accumulator) and 16x64x128 spilled on sm_100 (16 B per thread in
# W8A16 on 4 warps, 8 B in W4A16 on 8).
# Every configuration is compiled for sm_80/90/100 by tests/kernels/test_compile.py. The interpreter
# takes small tiles, split in two at decode so the tests run the split path too.
DECODE_MAX_M = 16
DECODE_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4),
                  dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),
                  dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=8, num_warps=4, num_stages=4))
GEMM_CONFIGS = (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=4))
UNALIGNED_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3),
                     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=3))
CPU_DECODE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)
CPU_GEMM = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, SPLIT_K=1)  # BLOCK_M > 16: the W-first product of prefill
MAX_SPLIT_K = max(c["SPLIT_K"] for c in DECODE_CONFIGS + GEMM_CONFIGS + UNALIGNED_CONFIGS + (CPU_DECODE,))


@triton.jit
def _weight_only_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr,  # x (M, K), w (N, K) int8 or (N, K/2)
                               M, N, K, n_groups,  # uint8, s (N, K/G) fp32, y (M, N), part (SPLIT_K, M, N) fp32
                               G: tl.constexpr, ONE_GROUP: tl.constexpr,  # G = K: one scale per output channel
                               INT4: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    # Prefill tiles compute y^T = W x^T: the dequantized W tile, made in registers, is then the A operand,
    # which Hopper's wgmma reads from registers. As the B operand (x @ W^T) it had to be stored to shared
    # memory every K step behind a fence, and each wgmma was waited for at once (pendings = 0 in the
    # sm_90 TTGIR): dequantization and tensor cores took turns (0.47x torch bf16 on the H100).
    # Measured on an H100 (bench/results/2026-11-26T0102_*_weight-only-old-vs-new.txt, one process): W-first
    # helps W4A16 (4096x4096x11008, G=128: 1.67 -> 1.56 ms; G=K: 1.36 -> 0.88 ms) but slows W8A16's
    # group-wise tiles (1.09 -> 1.68 ms), whose int8 codes, read from shared memory in the register-operand
    # layout, come as 2-byte loads; so W8A16 keeps x-first.
    W_FIRST: tl.constexpr = INT4 and BLOCK_M > 16
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # whole tiles per split: a tile never spans two
    k_end = tl.minimum(K, (pid_k + 1) * k_split)
    for k0 in range(pid_k * k_split, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # (BM, BK)
        if INT4:
            # Two codes per byte, offset by 8: even k in the low nibble, odd k in the high one. Each
            # byte is loaded once and its nibbles interleaved back into k order (join + reshape).
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # (BK/2,)
            byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + rb[None, :],
                           mask=(rn[:, None] < N) & (rb[None, :] < K // 2), other=0x88).to(tl.int32)
            biased = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))  # (BN, BK) code + 8
            offset: tl.constexpr = 8388616.0  # 2^23 + 8
        else:
            code = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
                           mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)  # (BN, BK)
            biased = code.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80  # code + 128
            offset: tl.constexpr = 8388736.0  # 2^23 + 128
        # code as fp32 without an int-to-float conversion, which issues at a quarter of the rate of fp32
        # arithmetic (CUDA Programming Guide, arithmetic instruction throughput, cc 8.x/9.0: 16 vs 64 per
        # clock per SM) and would compete with the tensor cores for issue slots: 2^23 + b has the
        # integer b < 2^23 exactly in its mantissa bits, so one integer OR and one exact subtraction do it.
        code_f32 = (biased | 0x4B000000).to(tl.float32, bitcast=True) - offset
        if ONE_GROUP:  # per channel: exact codes (|code| <= 127) into the dot, the scale after the loop
            w = code_f32.to(ACT)
        else:
            if G % BLOCK_K == 0:  # the tile lies in one group: one scale per row
                s = tl.load(s_ptr + rn.to(tl.int64) * n_groups + k0 // G, mask=rn < N, other=0.0)[:, None]
            else:
                s = tl.load(s_ptr + rn[:, None].to(tl.int64) * n_groups + rk[None, :] // G,
                            mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            # (BN, BK), dequantized in registers. Scaling a per-group partial accumulator instead would
            # cost as many multiplies (BN x BM per group against BN x BK per tile: equal at G = 2 BK,
            # the benchmark's 128 / 64) and a second accumulator's registers.
            w = (code_f32 * s).to(ACT)
        if UPCAST:  # the CPU interpreter multiplies bf16 tiles wrongly: same values, fp32 dot
            x, w = x.to(tl.float32), w.to(tl.float32)
        if W_FIRST:
            acc = tl.dot(w, tl.trans(x), acc)  # (BN, BM) fp32 accumulation on the tensor cores
        else:
            acc = tl.dot(x, tl.trans(w), acc)  # (BM, BN)
    if ONE_GROUP:
        s_out = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        if W_FIRST:
            acc = acc * s_out[:, None]
        else:
            acc = acc * s_out[None, :]
    if W_FIRST:
        acc = tl.trans(acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(ACT), mask=mask)
    else:  # fp32 partial sums, added by the launcher: deterministic, unlike atomics
        tl.store(part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mask)


def _config(c: dict):
    return triton.Config({k: v for k, v in c.items() if k.isupper()}, num_warps=c["num_warps"],
                         num_stages=c["num_stages"])


def _pool(M: int, K: int, G: int) -> list[dict]:
    """The configurations made for this launch: decode or GEMM by M, aligned K or not; among aligned
    ones, those whose BLOCK_K divides G (one scale per row) when there are any."""
    decode = M <= DECODE_MAX_M
    pool = [c for c in (DECODE_CONFIGS + GEMM_CONFIGS if K % 16 == 0 else UNALIGNED_CONFIGS)
            if (c["BLOCK_M"] <= DECODE_MAX_M) == decode]
    return [c for c in pool if G % c["BLOCK_K"] == 0] or pool


def _configs_for(configs, named_args, **kwargs):
    """The autotuner times only the tiles of `_pool` for this M, K and G."""
    wanted = [str(_config(c)) for c in _pool(named_args["M"], named_args["K"], kwargs["G"])]
    return [c for c in configs if str(c) in wanted]


def _add_partials(y: Tensor, part: Tensor, split: int) -> None:
    """y = the sum of a split launch's `split` fp32 partial sums, rounded once to y's dtype."""
    if split > 1:
        y.copy_(part[:split].sum(dim=0))


def _timed_with_the_sum(nargs: dict, exception=None) -> None:
    """The autotuner's post_hook, run inside each timed call: a split configuration is timed with the
    sum it needs (two small launches, a few microseconds beside a ~20 us decode)."""
    if exception is None:
        _add_partials(nargs["y_ptr"], nargs["part_ptr"], nargs["SPLIT_K"])


_weight_only_matmul_tuned = triton.autotune([_config(c) for c in DECODE_CONFIGS + GEMM_CONFIGS + UNALIGNED_CONFIGS],
                                            key=["M", "N", "K"], post_hook=_timed_with_the_sum,
                                            prune_configs_by={"early_config_prune": _configs_for}
                                            )(_weight_only_matmul_kernel)


def check_args(x: Tensor, w: Tensor, scale: Tensor, bits: int) -> tuple[int, int, int]:
    """(M, N, K) of a weight-only product, or the one-line error of what is wrong (shared with the decode kernel)."""
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
    M, N, K = check_args(x, w, scale, bits)
    if not kernel_available(x.device):
        raise RuntimeError(f"the Triton kernel cannot run on {x.device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use weight_only_matmul_ref otherwise)")
    x, w, scale = x.contiguous(), w.contiguous(), scale.float().contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # Decode may split K: room for the largest split's fp32 partial sums (M <= 16 rows: small).
    part = torch.empty((MAX_SPLIT_K, M, N) if M <= DECODE_MAX_M else (1,), dtype=torch.float32, device=x.device)
    args = dict(G=K // scale.shape[1], ONE_GROUP=scale.shape[1] == 1, INT4=bits == 4, ACT=ACT_DTYPES[x.dtype],
                UPCAST=x.device.type == "cpu")

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"]
    if x.device.type == "cuda":
        _weight_only_matmul_tuned[grid](x, w, scale, y, part, M, N, K, scale.shape[1], **args)
        split = _weight_only_matmul_tuned.best_config.kwargs["SPLIT_K"]
    else:
        config = CPU_DECODE if M <= DECODE_MAX_M else CPU_GEMM
        _weight_only_matmul_kernel[grid(config)](x, w, scale, y, part, M, N, K, scale.shape[1], **args, **config)
        split = config["SPLIT_K"]
    _add_partials(y, part, split)
    return y


def weight_only_matmul_ref(x: Tensor, w: Tensor, scale: Tensor, bits: int = 8) -> Tensor:
    """torch: dequantize the whole weight to x's dtype, then one matmul with fp32 accumulation."""
    check_args(x, w, scale, bits)
    w_hat = dequantize_weight(unpack_int4(w) if bits == 4 else w, scale.float(), x.dtype)
    return (x.float() @ w_hat.float().T).to(x.dtype)


def moved_bytes(M: int, K: int, N: int, bits: int, G: int, split: int = 1) -> int:
    """HBM bytes of one launch: read x (bf16/fp16) once, the codes and their fp32 scales once, write y;
    with K split over `split` programs, also write and read back the fp32 partial sums."""
    return 2 * M * K + N * K * bits // 8 + 4 * N * (K // G) + 2 * M * N + (8 * split * M * N if split > 1 else 0)


def compile_cases(K: int = 3072, N: int = 8192, group_size: int = 128, unaligned_k: int = 3000) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot): every autotuner configuration with 8 and 4
    bits and both activation dtypes; decode tiles also at M = 1 (the launcher makes M a constant
    there), in bf16. The work at Llama 3.2 3B's MLP up-projection (decode: M tokens, GEMM: 4096), or at
    `unaligned_k` (one group per row) for the unaligned tiles: read x, the codes and the scales once,
    write y (and at a split K, write and read back the fp32 partial sums)."""
    cases = []
    for config in DECODE_CONFIGS + GEMM_CONFIGS + UNALIGNED_CONFIGS:
        unaligned = config in UNALIGNED_CONFIGS
        k = unaligned_k if unaligned else K
        G = k if unaligned else group_size
        blocks = {name: v for name, v in config.items() if name.isupper()}
        tile = (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']}" + (" K%16!=0" if unaligned else "")
                + (f" split{config['SPLIT_K']}" if config["SPLIT_K"] > 1 else ""))
        decode = config["BLOCK_M"] <= DECODE_MAX_M
        for act, tl_act in ACT_DTYPES.items():
            for bits in (8, 4):
                for M in ((1, DECODE_MAX_M) if act == torch.bfloat16 else (DECODE_MAX_M,)) if decode else (4096,):
                    args = dict(x_ptr=act, w_ptr=torch.int8 if bits == 8 else torch.uint8, s_ptr=torch.float32,
                                y_ptr=act, part_ptr=torch.float32, M=M, N=N, K=k, n_groups=k // G, G=G,
                                ONE_GROUP=k == G, INT4=bits == 4, ACT=tl_act, UPCAST=False, **blocks)
                    moved = moved_bytes(M, k, N, bits, G, config["SPLIT_K"])
                    cases.append(CompileCase(_weight_only_matmul_kernel, args, num_warps=config["num_warps"],
                                             num_stages=config["num_stages"],
                                             label=f"W{bits}A16 {str(act).removeprefix('torch.')} {tile} M={M}",
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
    from dlo.kernels.quantize import pack_int4, quantize_weight
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        q8, s8 = quantize_weight(w, 8, group_size)
        q4, s4 = quantize_weight(w, 4, group_size)
        p4 = pack_int4(q4)
        impls = {"torch bf16": (lambda: x @ w.T, "bf16_tflops", 2 * (M * K + N * K + M * N)),
                 "dlo W8A16": (lambda: weight_only_matmul(x, q8, s8, 8), "bf16_tflops",
                               moved_bytes(M, K, N, 8, group_size)),
                 "dlo W4A16": (lambda: weight_only_matmul(x, p4, s4, 4), "bf16_tflops",
                               moved_bytes(M, K, N, 4, group_size))}
        rows += bench_matmuls("weight_only_matmul", M, K, N, impls)
    return rows
