"""Multi-tensor unscale + inf/nan check for dynamic loss scaling, in one Triton pass.

Loss scaling (Micikevicius et al. 2018, Sec. 3.2) multiplies the loss by S so that small fp16
gradients land inside the representable range; before the optimizer step every gradient must be
multiplied by 1/S, and if any element is inf or nan the step is skipped and S is lowered. Done
naively that is two reads of every gradient per tensor (an `isfinite().all()` and a `mul_`) and one
host sync per tensor. Here all gradients of one (device, dtype) go through a single launch that reads
each element once, writes g * (1/S), and raises a device flag `found_inf` (fp32, 0.0 or 1.0) when an
input element is not finite: the same contract as torch's `_amp_foreach_non_finite_check_and_unscale_`,
so no value ever needs to reach the host until the scaler decides whether to step.

The pointer table (data addresses, sizes, a per-program (tensor, offset) map) is the scheme of
fused_adamw.py, built by runtime.launch_tables. 1/S is read from a device tensor, not passed as a float,
so a new scale never costs a sync or a recompile.

Order: kernel, launcher, `amp_unscale_ref` (torch), benchmarks.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.kernels.aot import CompileCase
from dlo.kernels.fused_adamw import LLAMA_3B_PARAMS, transformer_numels
from dlo.kernels.runtime import FP32_MAX, interpreting, kernel_available, launch_tables, round_to_bf16, time_ms

BLOCK_SIZE = 1024  # elements per program: 4 KiB of fp32 per program, 8 per thread with 4 warps
MAX_TENSORS_PER_LAUNCH = 2048  # longer lists are split so the per-launch tables stay small
GRAD_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _amp_unscale_kernel(g_addr_ptr,  # (T,) int64 data addresses of the gradients
                        numel_ptr,  # (T,) int64 element count of each gradient
                        block_tensor_ptr, block_start_ptr,  # (n_programs,) which tensor, first element
                        found_inf_ptr, inv_scale_ptr,  # (1,) fp32 each, on the gradients' device
                        G_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_start_ptr + pid)
    n = tl.load(numel_ptr + t)
    g_ptr = tl.load(g_addr_ptr + t).to(tl.pointer_type(G_DTYPE))
    offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)  # int64: tensors may exceed 2^31 elements
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    inv_scale = tl.load(inv_scale_ptr)

    # The check is on the scaled input, as torch does: an overflow in the backward pass is what
    # must skip the step. Masked lanes hold 0.0, which is finite.
    n_bad = tl.sum(tl.where(tl.abs(g) <= FP32_MAX, 0, 1))
    if n_bad > 0:
        tl.store(found_inf_ptr, 1.0)  # every writer stores the same value: the race is harmless

    g = g * inv_scale
    if G_DTYPE == tl.bfloat16:
        g = round_to_bf16(g)  # the interpreter would truncate; inf and nan pass through unchanged
    tl.store(g_ptr + offs, g.to(G_DTYPE), mask=mask)


def _check_scalars(found_inf: Tensor, inv_scale: Tensor) -> None:
    for name, t in (("found_inf", found_inf), ("inv_scale", inv_scale)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"{name} must be a one-element fp32 tensor, got {t.dtype} with {t.numel()} elements")


def _check_inputs(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, need_contiguous: bool) -> None:
    _check_scalars(found_inf, inv_scale)
    for i, g in enumerate(grads):
        if g.dtype not in GRAD_DTYPES:
            raise TypeError(f"grads[{i}] has dtype {g.dtype}; supported: {list(GRAD_DTYPES)}")
        if g.is_sparse:
            raise RuntimeError(f"grads[{i}] is sparse; the unscale kernel needs dense gradients")
        if g.device != found_inf.device or g.device != inv_scale.device:
            raise ValueError(f"grads[{i}] is on {g.device} but found_inf / inv_scale are on "
                             f"{found_inf.device} / {inv_scale.device}; use one pair per device")
        if need_contiguous and not g.is_contiguous():
            raise ValueError(f"grads[{i}] must be contiguous for the kernel")


_DTYPE = operator.attrgetter("dtype")
_plans: dict[tuple, list[tuple]] = {}


def launch_plan(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> list[tuple]:
    """The host side of `amp_unscale_` without the launches: the input checks, the dtype groups and
    their tables, as [(G_DTYPE, n_programs, addrs, numels, block_tensor, block_start)], one per launch.

    DynamicLossScaler calls it once per step on the same gradients, or on new ones at the same
    addresses after zero_grad(set_to_none=True). So the plan is cached under everything the checks
    and tables read -- each gradient's address, size, dtype, device and contiguity, five C-level passes
    over the list -- and a list that differs in any of them is checked in full again: no list gets a
    plan without having passed the checks. (The first H100 run: 0.109 ms vs torch's 0.076 ms at 147
    tensors, host-bound, when every call checked and grouped tensor by tensor in Python.)"""
    _check_scalars(found_inf, inv_scale)
    try:
        addrs = tuple(map(Tensor.data_ptr, grads))
    except RuntimeError:  # a sparse gradient has no data pointer: the full check names it
        _check_inputs(grads, found_inf, inv_scale, need_contiguous=True)
        raise
    key = (BLOCK_SIZE, found_inf.device, inv_scale.device, addrs, tuple(map(Tensor.numel, grads)),
           tuple(map(_DTYPE, grads)), tuple(map(Tensor.get_device, grads)), tuple(map(Tensor.is_contiguous, grads)))
    plan = _plans.get(key)
    if plan is None:
        _check_inputs(grads, found_inf, inv_scale, need_contiguous=True)
        if len(_plans) >= 64:
            _plans.pop(next(iter(_plans)))
        plan = _plans[key] = _build_plan(grads, found_inf.device)
    return plan


def _build_plan(grads: list[Tensor], device: torch.device) -> list[tuple]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        if g.numel() > 0:
            groups.setdefault(g.dtype, []).append(g)
    plan = []
    for dtype, group in groups.items():
        for c in range(0, len(group), MAX_TENSORS_PER_LAUNCH):
            addrs, numels, block_tensor, block_start, _ = launch_tables([group[c:c + MAX_TENSORS_PER_LAUNCH]],
                                                                        device, BLOCK_SIZE)
            plan.append((GRAD_DTYPES[dtype], len(block_tensor), addrs[0], numels, block_tensor, block_start))
    return plan


@torch.no_grad()
def amp_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """grads *= inv_scale in place; found_inf = 1.0 if any input element is inf or nan (else unchanged).

    grads: fp32 / bf16 / fp16, contiguous, on one device with the one-element fp32 tensors found_inf
    and inv_scale. CUDA, or CPU under TRITON_INTERPRET=1. One launch per dtype group.
    """
    plan = launch_plan(grads, found_inf, inv_scale)
    device = found_inf.device
    if plan and not kernel_available(device):
        raise RuntimeError(f"the Triton kernel cannot run on {device} here: it needs CUDA tensors, or CPU "
                           f"tensors with TRITON_INTERPRET=1 (use amp_unscale_ref otherwise)")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for g_dtype, n_programs, addrs, numels, block_tensor, block_start in plan:
            _amp_unscale_kernel[(n_programs,)](addrs, numels, block_tensor, block_start, found_inf, inv_scale,
                                               G_DTYPE=g_dtype, BLOCK=BLOCK_SIZE)


@torch.no_grad()
def amp_unscale_ref(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """The reference in plain torch, same contract as `amp_unscale_`, no host sync either."""
    _check_inputs(grads, found_inf, inv_scale, need_contiguous=False)
    for g in grads:
        g32 = g.float()
        bad = (~torch.isfinite(g32)).any()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
        g.copy_(g32 * inv_scale)


def compile_cases(numel: int = LLAMA_3B_PARAMS) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot), per gradient dtype; the work over `numel`
    gradients: one read and one write of each, a compare and a multiply."""
    return [CompileCase(_amp_unscale_kernel,
                        dict(g_addr_ptr=torch.int64, numel_ptr=torch.int64, block_tensor_ptr=torch.int32,
                             block_start_ptr=torch.int64, found_inf_ptr=torch.float32, inv_scale_ptr=torch.float32,
                             G_DTYPE=tl_dtype, BLOCK=BLOCK_SIZE),
                        str(dtype).removeprefix("torch."), shape=f"{numel:.3g} grads",
                        bytes=2 * numel * dtype.itemsize, flops=2 * numel,
                        torch=(2 * numel * dtype.itemsize, 2 * numel, "fp32_tflops"))  # its foreach kernel
            for dtype, tl_dtype in GRAD_DTYPES.items()]


# ----------------------------------------------------------------------------- benchmarks

def bench(sizes: tuple[int, ...] = (256, 512, 1024), dtype: torch.dtype = torch.float32) -> list[dict]:
    """GPU benchmark for `dlo bench amp_unscale`: the gradients of a 12-layer transformer of each
    width, unscaled by a per-tensor torch loop, torch's multi-tensor kernel and ours."""
    if not torch.cuda.is_available() or interpreting():
        raise RuntimeError("the amp_unscale benchmark needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from dlo.hardware import peak
    hbm = (peak("cuda") or {}).get("hbm_gbs")
    rows = []
    for d_model in sizes:
        numels = transformer_numels(d_model)
        grads = [torch.randn(n, device="cuda", dtype=dtype) for n in numels]
        found_inf = torch.zeros(1, device="cuda")
        inv_scale = torch.ones(1, device="cuda")  # 1.0 keeps the values stable over repetitions
        impls = {"torch for-loop": lambda: amp_unscale_ref(grads, found_inf, inv_scale),
                 "torch foreach": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                                                          inv_scale),
                 "dlo triton": lambda: amp_unscale_(grads, found_inf, inv_scale)}
        moved = 2 * sum(numels) * dtype.itemsize  # one read and one write of every gradient
        for impl, fn in impls.items():
            ms = time_ms(fn)
            gbs = moved / (ms * 1e-3) / 1e9
            rows.append({"op": "amp_unscale", "size": sum(numels), "tensors": len(numels),
                         "dtype": str(dtype).removeprefix("torch."), "impl": impl, "ms": ms, "GB/s": gbs,
                         "% peak": 100 * gbs / hbm if hbm else None,
                         "work": (moved, 2 * sum(numels), "fp32_tflops")})
        grads = impls = None  # free this width before the next one
        torch.cuda.empty_cache()
    from dlo.hardware import add_roofline
    return add_roofline(rows, (peak("cuda") or {}).get("name"))

