"""Attention forward as FlashAttention-2 computes it (Dao 2023, Algorithm 1), in Triton.

O = softmax(Q K^T / sqrt(d)) V for (B, H, T, d) inputs, without ever writing the (T, T) scores: one
program owns a block Q_i of BLOCK_M queries and streams the key and value blocks K_j, V_j past it,
keeping per row a running maximum m_i, a running sum l_i of exp(S_ij - m_i) and an unnormalised
output acc_i. A new block may raise the maximum; then everything summed so far is rescaled by
exp(m_old - m_new) (the online softmax of Milakov & Gimelshein 2018):

    S_ij = Q_i K_j^T / sqrt(d)              m_new = max(m_i, rowmax(S_ij))
    P_ij = exp(S_ij - m_new)                l_i = exp(m_i - m_new) l_i + rowsum(P_ij)
    acc_i = exp(m_i - m_new) acc_i + P_ij V_j,   m_i = m_new

and after the last block O_i = acc_i / l_i and L_i = m_i + log(l_i), the log-sum-exp of each row,
which is all the backward pass needs to recompute P (FlashAttention-2's Algorithm 2). Memory beyond
the inputs: O and L, O(T) per head, against the O(T^2) scores of naive attention
(`attention_memory` below measures both). Products run on the tensor cores in the input dtype
(P is cast to it, as in the paper), sums in fp32; fp32 inputs get true fp32 products ("ieee", not
TF32). With `causal`, a query block stops at its diagonal: key blocks past it are never read.

Order: kernel, launcher, `flash_attention_ref` (torch, fp32, the scores written out) and
`flash_attention_blocked_ref` (the kernel's loop in torch, block by block), compile cases, benchmark, and
the memory of one forward of each (`attention_memory`, Day 2's table).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.attention import attention_scores, naive_attention, qkv, sdpa_attention
from dlo.errors import BadInput
from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import kernel_available, round_to_bf16, time_ms
from dlo.measure import allocated_peak

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128)  # tl.arange needs a power of two; tensor-core tiles need >= 16
MAX_PROGRAMS_Y = 65535  # a CUDA grid's second axis: one program row per (batch, head)
# GPU tiles, from the compile report (dlo.kernels.aot) and timed on an H200 (bench/block_sweep.py,
# bench/results/2026-11-26T0548_nvidia-h200_block-sweep.json; causal bf16, B=4, H=16, T=4096).
# d = 64: 64 x 64 on 4 warps, 0.572 ms (240 TFLOP/s), the fastest of six tiles; 128 x 64 on 4 warps,
# the tile of Dao 2023 Sec. 3.3 and Triton's tutorial, took 0.835 ms and spilled 12 B per thread on
# sm_80 (255 registers: the scores, P and the accumulator of 128 rows over 128 threads, and the masks).
# d = 128: 64 x 64 on 4 warps, 0.792 ms (347 TFLOP/s), against 1.33 ms for the 128 x 32 on 8 warps
# chosen before any GPU timed it; on sm_80 it takes 255 registers (no spill, half the occupancy of
# 128 x 32: docs/kernels-compile-report.txt), untimed on an A100. Only d = 64 and d = 128 have compile
# cases (the compile test's budget); d = 16 and 32 take d = 64's tile, with smaller K, V tiles and
# accumulator.
# The interpreter takes small blocks, BLOCK_M = 2 BLOCK_N, so T = 17 and 67 cross several blocks, pad
# the last one and cut the diagonal block of a causal query block in two.
GPU_BLOCKS = {d: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3) for d in HEAD_DIMS}
CPU_BLOCKS = dict(BLOCK_M=32, BLOCK_N=16)


@triton.jit
def _flash_attention_fwd_kernel(q_ptr, k_ptr, v_ptr,  # (B, H, T, D) contiguous, one dtype
                                o_ptr, lse_ptr,  # (B, H, T, D) in the input dtype, (B, H, T) fp32
                                T, scale,  # scale = 1 / sqrt(D)
                                D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                UPCAST: tl.constexpr,  # the interpreter on bf16, see below
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * T * D  # this (batch, head)'s (T, D) matrices
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions of Q_i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + base + rows[:, None] * D + offs_d[None, :], mask=rows[:, None] < T, other=0.0)
    if UPCAST:  # the CPU interpreter multiplies bf16 tiles wrongly: the same values, fp32 dots
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    # Causal: keys after the block's last query are masked for every row, so the loop stops there.
    # Key 0 is in every row's first block, so m_i is finite after it (no exp(-inf - -inf) = nan).
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, T)
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # key positions of K_j, V_j
        kv_offs = base + cols[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=cols[:, None] < T, other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_ptr + kv_offs, mask=cols[:, None] < T, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # S_ij (BLOCK_M, BLOCK_N), fp32
        keep = cols[None, :] < T  # padding keys of the last block
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])  # masked entries: exp(-inf) = 0
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old maximum
        l_i = alpha * l_i + tl.sum(p, axis=1)
        if UPCAST:  # the interpreter truncates fp32 -> bf16; a GPU rounds to nearest: do it by hand
            p = round_to_bf16(p)
        else:
            p = p.to(v.dtype)  # P_ij in the input dtype for the tensor cores (a no-op for fp32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    if UPCAST:
        o = round_to_bf16(o)
    tl.store(o_ptr + base + rows[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < T)
    tl.store(lse_ptr + tl.program_id(1).to(tl.int64) * T + rows, m_i + tl.log(l_i), mask=rows < T)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """One-line BadInput for anything the kernel does not take, before any work."""
    if not all(isinstance(x, Tensor) for x in (q, k, v)):
        raise BadInput(f"q, k, v must be tensors, got {', '.join(type(x).__name__ for x in (q, k, v))}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise BadInput(f"q, k, v must be (B, H, T, D) of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                       f"{tuple(v.shape)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise BadInput(f"head_dim D={q.shape[-1]} is not one of {HEAD_DIMS}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise BadInput(f"q, k, v must share one dtype of {', '.join(str(d) for d in DTYPES)}, got {q.dtype}, "
                       f"{k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise BadInput(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] * q.shape[1] > MAX_PROGRAMS_Y:
        raise BadInput(f"B * H = {q.shape[0] * q.shape[1]} exceeds {MAX_PROGRAMS_Y} (a CUDA grid's second axis)")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> tuple[Tensor, Tensor]:
    """Triton: (O (B, H, T, D) in the input dtype, L (B, H, T) fp32) with O = softmax(q k^T / sqrt(D)) v
    (a query sees only keys at or before it with `causal`) and L the log-sum-exp of each score row.
    q, k, v: one shape, dtype (fp32 / bf16 / fp16) and device; D in HEAD_DIMS; CUDA, or CPU under
    TRITON_INTERPRET=1."""
    _check(q, k, v)
    if not kernel_available(q.device):
        raise BadInput(f"the Triton kernel cannot run on {q.device} here: it needs CUDA tensors, or CPU tensors "
                       f"with TRITON_INTERPRET=1 (use flash_attention_ref otherwise)")
    B, H, T, D = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    cpu = q.device.type == "cpu"
    blocks = CPU_BLOCKS if cpu else GPU_BLOCKS[D]
    grid = (triton.cdiv(T, blocks["BLOCK_M"]), B * H)
    _flash_attention_fwd_kernel[grid](q, k, v, o, lse, T, 1.0 / math.sqrt(D), D=D, CAUSAL=bool(causal),
                                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                      UPCAST=cpu and q.dtype == torch.bfloat16, **blocks)
    return o, lse


def flash_attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> tuple[Tensor, Tensor]:
    """The torch reference of `flash_attention`, in fp32 whatever the inputs: softmax(S) v with the
    scores S written out (dlo.attention.attention_scores), and L = logsumexp(S) per row."""
    _check(q, k, v)
    s = attention_scores(q.float(), k.float(), causal)  # (B, H, T, T)
    return torch.softmax(s, dim=-1) @ v.float(), torch.logsumexp(s, dim=-1)


def flash_attention_blocked_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                                block_k: int = CPU_BLOCKS["BLOCK_N"]) -> tuple[Tensor, Tensor]:
    """`flash_attention`'s loop in torch, fp32 whatever the inputs, returning what `flash_attention_ref`
    returns without writing the (T, T) scores: all queries at once against one block of `block_k` keys
    at a time, the running maximum m, sum l and unnormalised output rescaled by exp(m_old - m_new)
    (Dao 2023, Algorithm 1, without the query blocks a GPU program owns). Scores held at once:
    (B, H, T, block_k). Day 2's Exercise 5 asks for this function (its check forbids it)."""
    _check(q, k, v)
    if not isinstance(block_k, int) or block_k < 1:
        raise BadInput(f"block_k must be a positive int, got {block_k!r}")
    q, k, v = q.float(), k.float(), v.float()
    T = q.shape[-2]
    query = torch.arange(T, device=q.device)[:, None]  # (T, 1): the position of each query row
    m = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)  # running max, (B, H, T, 1)
    ell = torch.zeros_like(m)  # running sum of exp(S - m)
    acc = torch.zeros_like(q)  # unnormalised output
    for start in range(0, T, block_k):
        k_j, v_j = k[..., start:start + block_k, :], v[..., start:start + block_k, :]
        s = q @ k_j.transpose(-2, -1) / math.sqrt(q.shape[-1])  # S_j, (B, H, T, block_k)
        if causal:  # keys after the query: -inf (a row may have all of a block masked: its m stays)
            s = s.masked_fill(torch.arange(start, start + k_j.shape[-2], device=q.device) > query, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # finite once key 0 (every row's) is seen
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)  # 0 at the first block (m = -inf), <= 1 after
        ell = alpha * ell + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + p @ v_j
        m = m_new
    return acc / ell, (m + torch.log(ell)).squeeze(-1)


def attention_flops(B: int, H: int, T: int, D: int, causal: bool) -> int:
    """Multiply-adds x 2 of S = Q K^T and O = P V (2 B H T^2 D each); causal does about half."""
    flops = 4 * B * H * T * T * D
    return flops // 2 if causal else flops


def moved_bytes(B: int, H: int, T: int, D: int, itemsize: int, naive: bool = False) -> int:
    """HBM bytes of one forward at least: read q, k, v, write O and L (fp32). `naive`: also write the
    (T, T) scores, read them into the softmax, write P and read it into P V, in the input dtype."""
    flash = B * H * T * (4 * D * itemsize + 4)
    return flash + (4 * B * H * T * T * itemsize if naive else 0)


def compile_cases(B: int = 1, H: int = 24, T: int = 4096) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot), four cases for the compile test's budget:
    bf16 and fp16 at D = 64 causal (GPT-2's heads), bf16 at D = 128 causal and not (Llama 3.2 3B's 24
    query heads); the work at B x H heads of T tokens, against naive attention's in the same dtype
    (which writes and reads the T x T scores and P, and computes all of them even when causal)."""
    cases = []
    for dtype, D, causal in ((torch.bfloat16, 64, True), (torch.float16, 64, True),
                             (torch.bfloat16, 128, True), (torch.bfloat16, 128, False)):
        config = GPU_BLOCKS[D]
        blocks = {name: value for name, value in config.items() if name.startswith("BLOCK")}
        args = dict(q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, o_ptr=dtype, lse_ptr=torch.float32, T=T,
                    scale=1.0 / math.sqrt(D), D=D, CAUSAL=causal, DOT_PRECISION="tf32", UPCAST=False, **blocks)
        flops = attention_flops(B, H, T, D, causal)
        cases.append(CompileCase(_flash_attention_fwd_kernel, args,
                                 f"{str(dtype).removeprefix('torch.')} D={D}{' causal' if causal else ''}",
                                 num_warps=config["num_warps"], num_stages=config["num_stages"],
                                 shape=f"B={B} H={H} T={T}", flops=flops, peak="bf16_tflops",
                                 bytes=moved_bytes(B, H, T, D, dtype.itemsize),
                                 torch=(moved_bytes(B, H, T, D, dtype.itemsize, naive=True),  # all T x T scores
                                        attention_flops(B, H, T, D, causal=False), "bf16_tflops")))
    return cases


# ----------------------------------------------------------------------------- benchmark

def bench(lengths: tuple[int, ...] = (1024, 4096), B: int = 4, H: int = 16, D: int = 64,
          causal: bool = True) -> list[dict]:
    """GPU: bf16 attention forward, naive torch (scores written out) vs torch's fused
    scaled_dot_product_attention vs this kernel; TFLOP/s on the work causal attention needs."""
    if not torch.cuda.is_available() or not kernel_available("cuda"):
        raise RuntimeError("the flash_attention benchmark needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from dlo.hardware import add_roofline, peak
    figures = peak("cuda") or {}
    rows = []
    for T in lengths:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = attention_flops(B, H, T, D, causal)
        impls = {"torch naive": (lambda: naive_attention(q, k, v, causal), True),
                 "torch sdpa": (lambda: sdpa_attention(q, k, v, causal), False),
                 "dlo triton": (lambda: flash_attention(q, k, v, causal), False)}
        for impl, (fn, naive) in impls.items():
            ms = time_ms(fn)
            tflops = flops / (ms * 1e-3) / 1e12
            pk = figures.get("bf16_tflops")
            rows.append({"op": "flash_attention", "size": f"B={B} H={H} T={T} D={D}", "dtype": "bfloat16",
                         "impl": impl, "ms": ms, "TFLOP/s": tflops, "% peak": 100 * tflops / pk if pk else None,
                         "work": (moved_bytes(B, H, T, D, 2, naive=naive),  # naive computes every score
                                  attention_flops(B, H, T, D, causal and not naive), "bf16_tflops")})
        q = k = v = None
        torch.cuda.empty_cache()
    return add_roofline(rows, figures.get("name"))


# ----------------------------------------------------------------------------- memory (Day 2)

def attention_memory(lengths, *, batch: int = 1, heads: int = 2, head_dim: int = 16, causal: bool = True,
                     device="cpu", dtype=torch.float32) -> list[dict]:
    """Per sequence length T: the peak bytes torch allocates in one forward (no autograd) of naive
    attention, of the tiled kernel (`flash_attention`; None where it cannot run here) and of
    the same loop in torch (`flash_attention_blocked_ref`, measurable on any device: its blocks of S are
    tensors in memory, (B, H, T, block_k) fp32, so it allocates O(T) but more than the kernel), counted by
    dlo.measure.allocated_peak, beside the formulas: naive writes the scores S, B H T^2 elements, then
    P = softmax(S) beside them; the tiled kernel writes only O (B H T d) and its fp32 log-sum-exp L
    (B H T); its blocks of S live in on-chip memory, a size that does not grow with T."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for t in lengths:
        q, k, v = (x.detach() for x in qkv(batch, heads, t, head_dim, device=device, dtype=dtype))
        tiled = allocated_peak(partial(flash_attention, q, k, v, causal)) if kernel_available(device) else None
        rows.append({"T": t, "naive_bytes": allocated_peak(partial(naive_attention, q, k, v, causal)),
                     "tiled_bytes": tiled, "blocked_bytes": allocated_peak(partial(flash_attention_blocked_ref, q, k,
                                                                                   v, causal)),
                     "scores_bytes": batch * heads * t * t * itemsize,
                     "o_lse_bytes": batch * heads * t * (head_dim * itemsize + 4)})
    return rows
