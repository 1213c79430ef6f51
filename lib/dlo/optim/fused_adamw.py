"""FusedAdamW: torch.optim.AdamW's interface on top of the multi-tensor Triton kernel.

Where the update runs:
- CUDA tensors: the compiled Triton kernel, one launch per (param group, device, dtype, step count);
- CPU tensors with TRITON_INTERPRET=1: the same kernel in Triton's interpreter (how the tests run it);
- CPU tensors otherwise: `fused_adamw_ref`, the same math in plain torch (no Triton on CPU).

State per param: "step" (a Python int), "exp_avg" and "exp_avg_sq" in fp32 whatever the param
dtype ("fp32 optimizer state", as in mixed precision training; load_state_dict keeps them fp32).
This is the one intended difference from torch.optim.AdamW, which keeps bf16 state for bf16
params: with bf16 params the two drift apart, while for fp32 params they agree to float rounding.
"""

from __future__ import annotations

import torch

from dlo.kernels.fused_adamw import PARAM_DTYPES, fused_adamw_, fused_adamw_ref
from dlo.kernels.runtime import kernel_available
from dlo.optim.utils import check_adam_hyperparameters, run_closure


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019, Alg. 2) with a one-pass multi-tensor update."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        _check_supported(amsgrad, maximize)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))
        self.register_load_state_dict_pre_hook(_stash_fp32_state)
        self.register_load_state_dict_post_hook(_restore_fp32_state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            _check_supported(group.get("amsgrad", False), group.get("maximize", False))
            beta1, beta2 = group["betas"]
            for (use_kernel, step, _, _), quad in self._buckets(group).items():
                hyper = dict(step=step, lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"])
                if use_kernel:
                    fused_adamw_(*quad, **hyper, check=False)  # _buckets validated what the kernel relies on
                else:
                    fused_adamw_ref(*quad, **hyper)
        return loss

    def _buckets(self, group) -> dict[tuple, tuple[list, list, list, list]]:
        """Params with a grad, grouped so that one call shares path, step count, device and dtype
        (the bias corrections differ for a param that missed steps because its grad was None)."""
        buckets: dict[tuple, tuple[list, list, list, list]] = {}
        kernel_ok: dict[torch.device, bool] = {}
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("FusedAdamW does not support sparse gradients")
            if grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
                raise ValueError(f"grad of a param of shape {tuple(p.shape)} ({p.dtype}, {p.device}) has shape "
                                 f"{tuple(grad.shape)} ({grad.dtype}, {grad.device}); they must match")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            # A Python int: a CPU tensor increment per param would cost more than the whole kernel.
            state["step"] = int(state["step"]) + 1
            if p.device not in kernel_ok:
                kernel_ok[p.device] = kernel_available(p.device)
            # The kernel updates p in place through its address, so a strided p takes the torch path;
            # so does an unsupported dtype, where the reference raises a clear error.
            use_kernel = kernel_ok[p.device] and p.dtype in PARAM_DTYPES and p.is_contiguous()
            key = (use_kernel, state["step"], p.device, p.dtype)
            for lst, t in zip(buckets.setdefault(key, ([], [], [], [])),
                              (p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"])):
                lst.append(t)
        return buckets


def _stash_fp32_state(optimizer: FusedAdamW, state_dict: dict) -> None:
    # torch's load_state_dict casts every floating state tensor to its param's dtype, which would
    # turn the fp32 moments of bf16 params into bf16; keep the saved ones aside to put back after.
    saved = state_dict["state"]
    optimizer._fp32_state = [[{k: saved[i][k] for k in ("exp_avg", "exp_avg_sq") if k in saved.get(i, {})}
                              for i in group["params"]] for group in state_dict["param_groups"]]


def _restore_fp32_state(optimizer: FusedAdamW) -> None:
    for group, saved_group in zip(optimizer.param_groups, optimizer.__dict__.pop("_fp32_state")):
        for p, saved in zip(group["params"], saved_group):
            state = optimizer.state[p]
            for k, v in saved.items():
                if v.shape != p.shape:  # the kernel trusts state sizes, so refuse a mismatched checkpoint
                    raise ValueError(f"loaded {k} has shape {tuple(v.shape)} but its param has {tuple(p.shape)}")
                state[k] = v.to(p.device, torch.float32, memory_format=torch.contiguous_format)
            if "step" in state:
                state["step"] = int(state["step"])  # also accepts the float tensor of a torch AdamW


def _check_supported(amsgrad: bool, maximize: bool) -> None:
    if amsgrad:
        raise ValueError("FusedAdamW supports amsgrad=False only (use torch.optim.AdamW(amsgrad=True))")
    if maximize:
        raise ValueError("FusedAdamW supports maximize=False only (negate the loss instead)")
