"""LAMB as a torch.optim.Optimizer, one `lamb_step` per parameter tensor (per layer).

You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Alg. 2.
The trust ratio is computed per tensor, so each weight matrix and each bias is its own "layer".
"""

from __future__ import annotations

import torch

from dlo.optim.reference import lamb_step
from dlo.optim.utils import check_adam_hyperparameters, run_closure


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training; `state[p]["trust_ratio"]` keeps the last ratio."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["trust_ratio"] = lamb_step(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                    beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        return loss

    def trust_ratios(self) -> list[float]:
        """The last trust ratio of every parameter that has taken a step, in param-group order."""
        return [self.state[p]["trust_ratio"] for g in self.param_groups for p in g["params"]
                if "trust_ratio" in self.state[p]]
