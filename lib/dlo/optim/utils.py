"""Gradient utilities of the training loop: global-norm clipping and gradient accumulation."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn


def _grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def grad_norm(parameters: Tensor | Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The global norm of all gradients taken as one vector (what `clip_grad_norm` clips)."""
    return _total_norm(_grads(parameters), float(norm_type))


def _total_norm(grads: list[Tensor], norm_type: float) -> Tensor:
    if not grads:
        return torch.tensor(0.0)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max() for g in grads]).max()
    # The norm of the per-tensor norms equals the norm of the concatenation, without the copy.
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]),
                                    norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale all gradients in place so their global norm is at most `max_norm` (Pascanu et al. 2013).

    Same result as torch.nn.utils.clip_grad_norm_: coef = min(1, max_norm / (total + 1e-6)), and the
    total norm *before* clipping is returned (log it: spikes show instability).
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    grads = _grads(parameters)
    total = _total_norm(grads, float(norm_type))
    # The 1e-6 keeps the division finite when all gradients are zero.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def accumulate_gradients(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor,
                         micro_batches: int) -> Tensor:
    """Backward over `micro_batches` chunks of (x, y) so that .grad equals one whole-batch backward.

    `loss_fn` must return the mean loss of its chunk. Each chunk's mean is weighted by its share of
    samples (n_k / B), so unequal chunks (B not divisible) still sum to the whole-batch mean. Only
    one chunk's activations are alive at a time: that is the memory saving. BatchNorm statistics
    are per chunk, so models with BatchNorm in train mode give (slightly) different gradients.
    Returns the whole-batch mean loss, detached.
    """
    batch = x.shape[0]
    if y.shape[0] != batch:
        raise ValueError(f"x has {batch} samples but y has {y.shape[0]}")
    if not 1 <= micro_batches <= batch:
        raise ValueError(f"micro_batches must be between 1 and the batch size {batch}, got {micro_batches}")
    model.zero_grad(set_to_none=True)
    total = None
    for xc, yc in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches)):
        loss = loss_fn(model(xc), yc) * (xc.shape[0] / batch)
        loss.backward()  # .grad accumulates (adds) across the chunks
        total = loss.detach() if total is None else total + loss.detach()
    return total


def check_adam_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The argument checks torch's Adam family makes, shared by LAMB and FusedAdamW."""
    if lr < 0:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
    if eps < 0:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if weight_decay < 0:
        raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")


def run_closure(closure: Callable[[], Tensor] | None) -> Tensor | None:
    """torch.optim's `step(closure)` protocol: the loss of `closure()`, run with grad enabled (step
    itself runs under no_grad), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
