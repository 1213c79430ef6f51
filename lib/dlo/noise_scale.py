"""The gradient noise scale and the critical batch size (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training").

The gradient of the mean loss over a batch of B samples is the true gradient G plus noise of
covariance Sigma / B, so E|G_B|^2 = |G|^2 + tr(Sigma) / B. The *simple noise scale*

    B_simple = tr(Sigma) / |G|^2

is the batch at which the noise and the signal of a gradient are equal; McCandlish et al. find the
critical batch size B_crit ~ B_simple: below it, doubling the batch halves the steps to a given loss
(perfect scaling); above it, returns diminish (steps S = S_min (1 + B_noise / B), samples
E = E_min (1 + B / B_noise)). Their Appendix A.1 estimates both terms without per-example gradients,
from squared gradient norms at two batch sizes:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

each unbiased; the norms are averaged over several steps *before* the ratio is taken (a ratio of
noisy estimates is biased and may be negative).

- `noise_scale(small_sq, big_sq, b_small, b_big)`: the estimator, from lists of squared norms.
- `grad_sq_norms(model, loss_fn, x, y, b_small)`: the squared norms of one big batch and of its
  b_small-sized chunks, and their mean loss (the data-parallel setting of A.1: each worker's gradient and their mean),
  with autograd.grad, leaving .grad and the buffers (BatchNorm statistics) as they were.
- `steps_ratio`, `samples_ratio`: what the model predicts for going from one batch to another.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class NoiseScale:
    """The A.1 estimates: `g2` (|G|^2), `tr_sigma` (tr(Sigma), per sample) and `b_simple` (their ratio,
    nan when the |G|^2 estimate is not positive: the noise hides the signal at these batch sizes)."""

    g2: float
    tr_sigma: float
    b_simple: float


def noise_scale(small_sq, big_sq, b_small: int, b_big: int) -> NoiseScale:
    """B_simple from squared gradient norms measured at two batch sizes (McCandlish et al. 2018, A.1):
    `small_sq` are |G_small|^2 of batches of b_small samples, `big_sq` |G_big|^2 of batches of b_big;
    each list is averaged first, then the unbiased |G|^2 and tr(Sigma) estimates are formed."""
    small_sq, big_sq = [float(v) for v in small_sq], [float(v) for v in big_sq]
    if not small_sq or not big_sq:
        raise ValueError("noise_scale: need at least one squared norm at each batch size")
    if not 1 <= b_small < b_big:
        raise ValueError(f"noise_scale: need 1 <= b_small < b_big, got {b_small}, {b_big}")
    s, b = statistics.fmean(small_sq), statistics.fmean(big_sq)
    g2 = (b_big * b - b_small * s) / (b_big - b_small)
    tr_sigma = (s - b) / (1 / b_small - 1 / b_big)
    return NoiseScale(g2, tr_sigma, tr_sigma / g2 if g2 > 0 else float("nan"))


def _sq_norm(grads) -> float:
    return float(sum(g.double().pow(2).sum() for g in grads))


@dataclass(frozen=True)
class GradNorms:
    """What `grad_sq_norms` measured on one big batch: `small` (|G_small|^2 per chunk), `big`
    (|G_big|^2 of their mean) and `loss` (the mean of the chunks' losses)."""

    small: list[float]
    big: float
    loss: float


def grad_sq_norms(model: nn.Module, loss_fn, x: Tensor, y: Tensor, b_small: int) -> GradNorms:
    """Squared gradient norms of each b_small chunk of (x, y) and of their mean, G the gradient of
    `loss_fn(model(x_chunk), y_chunk)` (a mean over the chunk) with respect to the trainable
    parameters. The big batch is len(x) = k * b_small samples seen as k workers of b_small each
    (BatchNorm normalises per chunk, as in data parallelism without SyncBatchNorm). The model's
    .grad and buffers are left as they were."""
    if b_small < 1 or len(x) % b_small or len(x) // b_small < 2:
        raise ValueError(f"grad_sq_norms: {len(x)} samples must be k >= 2 chunks of b_small={b_small}")
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [t.clone() for t in model.buffers()]
    small, losses, total = [], [], None
    for xc, yc in zip(x.split(b_small), y.split(b_small)):
        loss = loss_fn(model(xc), yc)
        grads = torch.autograd.grad(loss, params)
        small.append(_sq_norm(grads))
        losses.append(loss.detach().item())
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    with torch.no_grad():
        for t, saved in zip(model.buffers(), buffers):
            t.copy_(saved)  # the measurement's forwards must not move BatchNorm's running statistics
    return GradNorms(small, _sq_norm(t / len(small) for t in total), statistics.fmean(losses))


def steps_ratio(b_noise: float, b_from: int, b_to: int) -> float:
    """S(b_from) / S(b_to) with S(B) = S_min (1 + B_noise / B): how many times fewer steps b_to needs
    to reach the same loss (b_to / b_from under perfect scaling, 1 far above B_noise)."""
    return (1 + b_noise / b_from) / (1 + b_noise / b_to)


def samples_ratio(b_noise: float, b_from: int, b_to: int) -> float:
    """E(b_to) / E(b_from) with E(B) = E_min (1 + B / B_noise): how many times the samples (epochs)
    b_to needs for the loss b_from reaches (1 under perfect scaling, b_to / b_from far above B_noise)."""
    return (1 + b_to / b_noise) / (1 + b_from / b_noise)
