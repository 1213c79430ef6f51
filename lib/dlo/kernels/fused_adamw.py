"""Multi-tensor fused AdamW in Triton: one pass reads p, g, m, v and writes p, m, v.

AdamW is Adam (Kingma & Ba 2015, Alg. 1, with bias correction) plus the decoupled weight decay of
Loshchilov & Hutter 2019 (Alg. 2), written as torch.optim.AdamW computes it:

    p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The update does ~10 flops per element and moves 3 param-sized and 4 fp32 values, so it is bound by
memory bandwidth: the unfused for-loop costs ~12 kernel launches per tensor and re-reads m, v and p
several times. Here every parameter of one (device, dtype) goes through a single launch: a table of
data addresses and sizes, plus a per-program (tensor, offset) map, lets one grid cover all tensors,
like torch's multi_tensor_apply. exp_avg and exp_avg_sq are fp32 optimizer state whatever the
param dtype (fp32 / bf16 / fp16), the usual mixed-precision layout, and all arithmetic is in fp32.

Order: kernel, launcher, `fused_adamw_ref` (torch), benchmarks.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.optim.adamw import adamw

from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import interpreting, kernel_available, launch_tables, round_to_bf16

BLOCK_SIZE = 1024  # elements per program: 4 KiB of fp32 per stream, 4 per thread with 8 warps
# 8 warps, not Triton's default 4: compiled for sm_80, the fp16 kernel spilled 16 bytes per thread
# at 4 warps; at 8 it needs 32 registers and no shared memory (tests/kernels/test_compile.py).
NUM_WARPS = 8
MAX_TENSORS_PER_LAUNCH = 2048  # longer tables are split so the per-launch metadata stays small
FLOPS_PER_ELEMENT = 10  # the update's multiplies, adds, one sqrt and one division, counted as one each
PARAM_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _fused_adamw_kernel(p_addr_ptr, g_addr_ptr, m_addr_ptr, v_addr_ptr,  # (T,) int64 data addresses
                        numel_ptr,  # (T,) int64 element count of each tensor
                        block_tensor_ptr, block_start_ptr,  # (n_programs,) which tensor, first element
                        decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,  # plain float arguments,
                        step_size, bc2_sqrt,  # so a new lr or step never triggers a recompile
                        P_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_start_ptr + pid)
    n = tl.load(numel_ptr + t)
    # The table holds raw addresses; casting them back to typed pointers is what lets one launch
    # reach tensors that are not one contiguous buffer.
    p_ptr = tl.load(p_addr_ptr + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_addr_ptr + t).to(tl.pointer_type(P_DTYPE))
    m_ptr = tl.load(m_addr_ptr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addr_ptr + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # the launcher checked every address is 16-byte aligned: allows 128-bit accesses
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        m_ptr, v_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
    offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)  # int64: tensors may exceed 2^31 elements
    mask = offs < n
    full = start + BLOCK <= n  # true for all but a tensor's last block: unmasked accesses vectorize
    if full:
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    p = p * decay  # decoupled weight decay: acts on w, never passes through m or v
    m = m + one_minus_beta1 * (g - m)  # = b1 m + (1 - b1) g, in the lerp form torch uses
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # IEEE sqrt/div: memory-bound, exactness is free
    p = p - step_size * tl.div_rn(m, denom)

    if P_DTYPE == tl.bfloat16:
        p = round_to_bf16(p)  # the interpreter would truncate: round to nearest even on both paths
    if full:
        tl.store(p_ptr + offs, p.to(P_DTYPE))
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
    else:
        tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def _check_inputs(params, grads, exp_avgs, exp_avg_sqs, step, need_contiguous):
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(f"params, grads, exp_avgs, exp_avg_sqs have lengths {len(params)}, {len(grads)}, "
                         f"{len(exp_avgs)}, {len(exp_avg_sqs)}; they must be equal")
    if int(step) != step or step < 1:
        raise ValueError(f"step is the 1-based count after incrementing, got {step}")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"params[{i}] has dtype {p.dtype}; supported: {list(PARAM_DTYPES)}")
        if g.is_sparse:
            raise RuntimeError(f"grads[{i}] is sparse; fused AdamW needs dense gradients")
        if g.dtype != p.dtype:
            raise TypeError(f"grads[{i}] has dtype {g.dtype} but params[{i}] has {p.dtype}")
        for name, t in (("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)):
            if t.shape != p.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)} but params[{i}] has {tuple(p.shape)}")
            if t.device != p.device:
                raise ValueError(f"{name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError(f"exp_avgs[{i}] / exp_avg_sqs[{i}] must be fp32 optimizer state, "
                            f"got {m.dtype} / {v.dtype}")
        if need_contiguous and not all(t.is_contiguous() for t in (p, g, m, v)):
            raise ValueError(f"params[{i}], its grad and its state must be contiguous for the kernel")


def _scalars(step, lr, beta1, beta2, eps, weight_decay):
    """Host-side, step-dependent numbers, in double as torch computes them (Kingma & Ba Alg. 1)."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    return dict(decay=1 - lr * weight_decay, beta1=beta1, beta2=beta2, one_minus_beta1=1 - beta1,
                one_minus_beta2=1 - beta2, eps=eps,
                step_size=lr / bias_correction1, bc2_sqrt=math.sqrt(bias_correction2))


@torch.no_grad()
def fused_adamw_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 check: bool = True) -> None:
    """One AdamW step on every tensor, in place, one kernel launch per (device, dtype) group.

    params and grads share a dtype (fp32, bf16 or fp16); exp_avgs and exp_avg_sqs are fp32. All on
    CUDA, or on CPU with TRITON_INTERPRET=1. `step` is t, 1-based, already incremented.
    check=False skips the per-tensor validation (Python time that shows at ~100 tensors per step);
    only for callers that guarantee it, as FusedAdamW does: the kernel trusts every address and size.
    """
    if check:
        _check_inputs(params, grads, exp_avgs, exp_avg_sqs, step, need_contiguous=True)
    scalars = _scalars(step, float(lr), beta1, beta2, eps, weight_decay)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel() > 0:
            groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        if not kernel_available(device):
            raise RuntimeError(f"the Triton kernel cannot run on {device} here: it needs CUDA tensors, or CPU "
                               f"tensors with TRITON_INTERPRET=1 (use fused_adamw_ref otherwise)")
        for c in range(0, len(idx), MAX_TENSORS_PER_LAUNCH):
            chunk = idx[c:c + MAX_TENSORS_PER_LAUNCH]
            quads = [[lst[i] for i in chunk] for lst in (params, grads, exp_avgs, exp_avg_sqs)]
            addrs, numels, block_tensor, block_start, aligned = launch_tables(quads, device, BLOCK_SIZE)
            # Triton launches on the current CUDA device, which need not be the tensors' one.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                _fused_adamw_kernel[(len(block_tensor),)](*addrs, numels, block_tensor, block_start, **scalars,
                                                          P_DTYPE=PARAM_DTYPES[dtype], ALIGNED=aligned,
                                                          BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS)


@torch.no_grad()
def fused_adamw_ref(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                    *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The reference: torch's own single-tensor AdamW (`torch.optim.adamw.adamw`, foreach=False) on
    each tensor, in fp32.

    For fp32 params this is torch.optim.AdamW's update; for bf16/fp16 params the update runs on an
    fp32 copy with fp32 state and is rounded once on the way back, as the kernel does. (The course's
    hand-written step, dlo.optim.reference.adamw_step, is checked against the same torch code.)
    """
    _check_inputs(params, grads, exp_avgs, exp_avg_sqs, step, need_contiguous=False)
    copies = [p.float() for p in params]  # p itself for fp32, so the update lands in place
    # torch increments the step counts before using them: pass t - 1 to get bias corrections for t
    steps = [torch.tensor(float(step - 1)) for _ in params]
    adamw(copies, [g.float() for g in grads], list(exp_avgs), list(exp_avg_sqs), [], steps, foreach=False,
          amsgrad=False, beta1=beta1, beta2=beta2, lr=float(lr), weight_decay=weight_decay, eps=eps, maximize=False)
    for p, p32 in zip(params, copies):
        if p32 is not p:
            p.copy_(p32)


LLAMA_3B_PARAMS = 3_212_749_824  # Llama 3.2 3B, tied embedding: the optimizer's flat buffers


def compile_cases(numel: int = LLAMA_3B_PARAMS) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot): each param dtype, aligned or not; the work
    of one step over `numel` parameters (~10 flops per element, the bytes of `_bytes_per_step`)."""
    scalars = _scalars(2, 1e-3, 0.9, 0.999, 1e-8, 1e-2)
    return [CompileCase(_fused_adamw_kernel,
                        dict(p_addr_ptr=torch.int64, g_addr_ptr=torch.int64, m_addr_ptr=torch.int64,
                             v_addr_ptr=torch.int64, numel_ptr=torch.int64, block_tensor_ptr=torch.int32,
                             block_start_ptr=torch.int64, **scalars, P_DTYPE=tl_dtype, ALIGNED=aligned,
                             BLOCK=BLOCK_SIZE), num_warps=NUM_WARPS,
                        label=f"{str(dtype).removeprefix('torch.')} {'aligned' if aligned else 'unaligned'}",
                        shape=f"{numel:.3g} params", bytes=_bytes_per_step(numel, dtype, torch.float32),
                        flops=FLOPS_PER_ELEMENT * numel,  # torch's fused AdamW keeps its state in the param dtype
                        torch=(_bytes_per_step(numel, dtype, dtype), FLOPS_PER_ELEMENT * numel, "fp32_tflops"))
            for dtype, tl_dtype in PARAM_DTYPES.items() for aligned in (True, False)]


# ----------------------------------------------------------------------------- benchmarks

def transformer_numels(d_model: int, n_layers: int = 12, vocab: int = 32000) -> list[int]:
    """Parameter sizes of a GPT-2-like decoder (biases, LayerNorms, 4x MLP, tied embedding)."""
    layer = [d_model, d_model, 3 * d_model * d_model, 3 * d_model, d_model * d_model, d_model,  # LN, attention
             d_model, d_model, 4 * d_model * d_model, 4 * d_model, 4 * d_model * d_model, d_model]  # LN, MLP
    return [vocab * d_model] + layer * n_layers + [d_model, d_model]


def _bytes_per_step(numel: int, param_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    # p and g read, p written in the param dtype; m and v each read and written in the state dtype.
    ps, ss = param_dtype.itemsize, state_dtype.itemsize
    return numel * (3 * ps + 4 * ss)


def _ours_step(params: list[Tensor]):
    """One kernel launch over every param, with fp32 moments and a step count, as FusedAdamW does."""
    grads = [p.grad for p in params]
    m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    count = [0]

    def step():
        count[0] += 1
        # check=False, as FusedAdamW steps (it validates when its buckets change). With the check, the
        # first H100 run took 0.51 ms at 18M params and 0.52 ms at 54M: bound by host time, and the
        # check of 147 tensors costs ~0.37 ms of CPU (measured on the course's CPU machine).
        fused_adamw_(params, grads, m, v, step=count[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=1e-2, check=False)
    return step


IMPLS = ("torch for-loop", "torch foreach", "torch fused", "dlo triton")


def bench_optimizer_step(numel_list: list[int], dtype: torch.dtype = torch.float32,
                         device: torch.device | str | None = None, impls: tuple[str, ...] = IMPLS,
                         reps: int = 15) -> list[dict]:
    """Time one AdamW step over tensors of `numel_list` for torch's for-loop, foreach and fused
    implementations and ours (ours only where the kernel is compiled: the interpreter is no benchmark).
    The implementations are timed interleaved (`dlo.measure.time_interleaved`: `reps` rounds, each
    calls every one once after 2 untimed rounds that allocate the state), so a slow phase of a shared
    machine hits all of them and their medians compare.

    Rows: {"impl", "ms", "ms (95%)", "GB/s", "% peak"}: "ms" the median, "ms (95%)" the median with its
    interval over the rounds (an Estimate); "% peak" is None where the device peak is unknown.
    """
    if reps < 3:
        raise ValueError(f"bench_optimizer_step: need reps >= 3 for an interval, got {reps}")
    if unknown := set(impls) - set(IMPLS):
        raise ValueError(f"unknown impls {sorted(unknown)}; choose from {IMPLS}")
    from dlo.hardware import peak
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype, generator=gen)) for n in numel_list]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen)
    steps = {f"torch {name}": torch.optim.AdamW(params, lr=1e-4, **kw).step
             for name, kw in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                              ("fused", dict(fused=True)))}
    if device.type == "cuda" and not interpreting():
        steps["dlo triton"] = _ours_step(params)
    hbm = (peak(device) or {}).get("hbm_gbs")
    from dlo.measure import time_interleaved
    timings = time_interleaved({k: v for k, v in steps.items() if k in impls}, device=device, reps=reps)
    rows = []
    for impl, timing in timings.items():
        est = timing.estimate(1e3)
        ms = est.value
        state_dtype = torch.float32 if impl.startswith("dlo") else dtype  # torch keeps state in the param dtype
        # Effective bandwidth: the bytes a one-pass update must move. Unfused versions move more, so
        # their figure says how far they are from what the step could cost, not what DRAM carried.
        moved = _bytes_per_step(sum(numel_list), dtype, state_dtype)
        gbs = moved / (ms * 1e-3) / 1e9
        rows.append({"impl": impl, "ms": ms, "ms (95%)": est, "GB/s": gbs, "% peak": 100 * gbs / hbm if hbm else None,
                     "work": (moved, FLOPS_PER_ELEMENT * sum(numel_list), "fp32_tflops")})
    from dlo.hardware import add_roofline
    return add_roofline(rows, (peak(device) or {}).get("name"))


def bench(sizes: tuple[int, ...] = (256, 512, 1024), dtype: torch.dtype = torch.float32) -> list[dict]:
    """GPU benchmark for `dlo bench fused_adamw`: for each width d_model in `sizes`, a 12-layer
    transformer's parameters (~18M, 54M, 184M), all implementations side by side in this process."""
    if not torch.cuda.is_available():
        raise RuntimeError("the fused AdamW benchmark needs a CUDA GPU")
    rows = []
    for d_model in sizes:
        numels = transformer_numels(d_model)
        for row in bench_optimizer_step(numels, dtype, "cuda"):
            rows.append({"op": "fused_adamw", "size": sum(numels), "tensors": len(numels),
                         "dtype": str(dtype).removeprefix("torch."), **row})
        torch.cuda.empty_cache()
    return rows
