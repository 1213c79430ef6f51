"""Counting before measuring: the parameters a token's matmuls use, and the bytes of training state.

Two numbers every plan of Days 5-7 starts from (with `dlo.measure.transformer_flops_per_token` and
`dlo.measure.mfu`):

- `matmul_params(model)`: the N of "6N FLOPs per token" (Kaplan et al. 2020, Sec. 2.1): every weight
  matrix a token is multiplied by, the output head included; embedding tables that are only looked
  up are left out, a table tied to the head counts once (as the head); vectors (biases, norms) are
  left out, their FLOPs are a rounding error and FlopCounterMode does not count them either.
- `training_bytes_per_param(param_dtype, optimizer, master_dtype=None)`: weights + gradients + master
  copy + optimizer state, per parameter, derived from the dtypes (`copy_widths`). Mixed-precision Adam
  costs 2 + 2 + 4 + 4 + 4 = 16 bytes (ZeRO, Rajbhandari et al. 2020, Sec. 3.1), the same as fp32 Adam's
  4 + 4 + 8: mixed precision saves activations and time, not model-state memory ("16 bytes per
  parameter", Lippe 2024).

The one accountant of model state: `model_state_bytes` (per rank, replicated or partitioned by ZeRO's
stages; `dlo.distributed.zero.memory_per_rank` is it for a parameter dtype) and `optimizer_bytes` (the
state beside full-precision parameters, what `dlo plan`'s rows count), both from `OPTIMIZER_STATES`,
whose names every caller uses: "sgd", "sgd_momentum", "adamw", "lamb".
"""

from __future__ import annotations

import math

import torch
from torch import nn

PRECISIONS = {
    # precision -> (bytes per weight, per gradient, per fp32 master weight, per optimizer state value)
    "fp32": (4, 4, 0, 4),    # everything fp32 (also torch.autocast: the fp32 parameters are the master)
    "mixed": (2, 2, 4, 4),   # bf16/fp16 weights and gradients, fp32 master weights and optimizer state
    "bf16": (2, 2, 0, 2),    # pure bf16: no master copy, bf16 optimizer state (cheaper, less accurate)
}
# state values kept per parameter: none, a momentum buffer, two moments (AdamW's; LAMB keeps Adam's two)
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adamw": 2, "lamb": 2}


def matmul_params(model: nn.Module) -> int:
    """Parameters a token's matmuls multiply through: the weights with >= 2 dimensions, except
    embedding tables that are only looked up; a table tied to a Linear (the LM head) counts once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() for p in model.parameters()  # parameters(): a shared tensor appears once
               if p.dim() >= 2 and (id(p) not in embeddings or id(p) in linears))


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank of a flat partition: ceil(numel / world_size) (the last ranks hold padding)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return math.ceil(numel / world_size)


def precision_of(param_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """`PRECISIONS`' widths of training with parameters and gradients in `param_dtype`: a 16-bit dtype
    means mixed precision (an fp32 master copy, fp32 optimizer state); a 32- or 64-bit one keeps
    everything at its own width, without a master copy."""
    b = torch.empty((), dtype=param_dtype).element_size()
    return copy_widths(param_dtype, torch.float32 if b < 4 else None)


def _state_values(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def optimizer_bytes(optimizer: str, param_bytes: int) -> int:
    """Bytes of `optimizer`'s state beside full-precision parameters of `param_bytes` bytes (each state
    value as wide as a parameter); mixed precision: `model_state_bytes`."""
    return _state_values(optimizer) * param_bytes


def model_state_bytes(n_params: int, optimizer: str, widths: tuple[int, int, int, int] = PRECISIONS["fp32"], *,
                      world_size: int = 1, stage: int = 0) -> dict:
    """Bytes of model state per rank: {"params", "grads", "optimizer", "total"} (ZeRO, Sec. 3.1 and 5).
    `widths`: (weight, gradient, master copy, state value) bytes, a `PRECISIONS` entry or
    `precision_of(dtype)`. Stage 0 replicates everything (DDP); stages 1/2/3 partition over `world_size`
    ranks the optimizer state (the master copy with it), then the gradients, then the parameters, each
    partition `shard_numel(n_params, world_size)` elements."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage}")
    weight, grad, master, state = widths
    k = master + _state_values(optimizer) * state  # ZeRO's K: optimizer-side bytes per parameter
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    s = shard_numel(n_params, world_size)
    params = weight * (s if stage >= 3 else n_params)
    grads = grad * (s if stage >= 2 else n_params)
    opt = k * (s if stage >= 1 else n_params)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def copy_widths(param_dtype: torch.dtype, master_dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """(weight, gradient, master copy, state value) bytes, derived from the dtypes: a gradient has its
    parameter's dtype; the optimizer steps the master copy when there is one (else the parameters) and
    torch keeps its state in the dtype of the tensor it steps. `PRECISIONS`' rows are three of these:
    fp32 = (float32, None), mixed = (bfloat16, float32), bf16 = (bfloat16, None)."""
    for what, dt in (("param_dtype", param_dtype), ("master_dtype", master_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(f"{what} must be a floating torch.dtype (e.g. torch.bfloat16), got {dt!r}")
    if param_dtype is None:
        raise ValueError("param_dtype must be a floating torch.dtype (e.g. torch.bfloat16), got None")
    p = torch.finfo(param_dtype).bits // 8
    m = 0 if master_dtype is None else torch.finfo(master_dtype).bits // 8
    return p, p, m, m or p


def training_bytes_per_param(param_dtype: torch.dtype, optimizer: str, master_dtype: torch.dtype | None = None) -> int:
    """Bytes of model state per parameter while training with weights of `param_dtype` (and an optional master
    copy of `master_dtype`): weights, gradients, master copy and the optimizer's state (`OPTIMIZER_STATES`
    values), each at the width `copy_widths` derives."""
    return model_state_bytes(1, optimizer, copy_widths(param_dtype, master_dtype))["total"]


def held_after_step(model: nn.Module, optimizer: torch.optim.Optimizer, step, device) -> float:
    """Model-state bytes per parameter that a real training step leaves held, *measured*: the
    parameters' storages plus every byte allocated during `step()` and still held after it (the
    gradients; the optimizer's state, which torch's optimizer creates on its first step). Read from
    the CUDA allocator on a GPU (`memory_allocated` after minus before) and elsewhere from
    `dlo.measure.AllocationMeter` (every tensor a torch operator makes, while it lives): neither knows
    the 4 + 4 + 8 of the formula, so a step that kept one more copy (a master, AMSGrad's third moment)
    would show it. One untimed `step()` first warms the kernels up (cuBLAS keeps its workspace in the
    allocator); its gradients and `optimizer`'s state are then dropped, so the measured step creates
    them afresh."""
    from dlo.measure import AllocationMeter, sync

    device = torch.device(device)
    params = list(model.parameters())
    step()
    for p in params:
        p.grad = None
    optimizer.state.clear()
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        held = torch.cuda.memory_allocated(device) - before
    else:
        with AllocationMeter() as meter:
            step()
        held = meter.bytes
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}  # a tied one once
    return (sum(storages.values()) + held) / sum(p.numel() for p in params)
