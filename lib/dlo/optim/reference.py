"""Functional, in-place reference steps for SGD with momentum, AdamW and LAMB.

One call updates one parameter tensor. The arithmetic follows torch.optim's single-tensor code path
operation by operation, so results agree with torch to float rounding; these are the ground truth
for the fused kernels and the hand-written notebook exercises.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _check_same_shape(param: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.shape != param.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but param has shape {tuple(param.shape)}")


@torch.no_grad()
def sgd_momentum_step(param: Tensor, grad: Tensor, buf: Tensor | None, *, lr: float, momentum: float = 0.9,
                      weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False) -> Tensor | None:
    """SGD with heavy-ball or Nesterov momentum (Sutskever et al. 2013, torch formulation).

    d = g + wd * w;  b = mu * b + (1 - dampening) * d  (b = d on the first step);
    w -= lr * (d + mu * b if nesterov else b). Returns the momentum buffer (None when momentum == 0).
    """
    _check_same_shape(param, grad=grad, buf=buf)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0 (as in torch.optim.SGD)")
    d_p = grad if weight_decay == 0 else grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if buf is None:
            # The first step has no history: torch starts the buffer at d (no dampening applied).
            buf = d_p.clone().detach()
        else:
            buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
    param.add_(d_p, alpha=-lr)
    return buf


@torch.no_grad()
def adamw_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """AdamW (Loshchilov & Hutter 2019, Alg. 2): Adam moments plus decoupled weight decay.

    w *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).  `step` is t, 1-based.
    """
    _check_same_shape(param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if step < 1:
        raise ValueError(f"step is the 1-based count after incrementing, got {step}")
    # Decay acts on the weights directly, not through the gradient, so Adam's scaling leaves it alone.
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


@torch.no_grad()
def lamb_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.01) -> float:
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Alg. 2), one layer.

    r = m_hat / (sqrt(v_hat) + eps);  u = r + wd * w;  trust = ||w|| / ||u|| (1 if either is 0);
    w -= lr * trust * u. The trust ratio makes the step size relative to the layer's weight norm,
    which is what lets very large batches use one global lr. Returns the trust ratio.
    """
    _check_same_shape(param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if step < 1:
        raise ValueError(f"step is the 1-based count after incrementing, got {step}")
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    update = m_hat / (v_hat.sqrt() + eps)  # r: the Adam direction
    if weight_decay != 0:
        update.add_(param, alpha=weight_decay)
    w_norm = param.norm().item()
    u_norm = update.norm().item()
    # A zero weight norm (e.g. a bias at init) would freeze the layer forever: fall back to plain Adam.
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    param.add_(update, alpha=-lr * trust)
    return trust
