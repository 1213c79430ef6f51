"""dlo.noise_scale: McCandlish et al.'s A.1 estimator on a problem whose tr(Sigma) and |G|^2 are known."""

import math

import pytest
import torch
from torch import nn

from dlo.noise_scale import grad_sq_norms, noise_scale, samples_ratio, steps_ratio


def linear_regression_norms(n: int, b_small: int, b_big: int, *, d: int = 8, sigma: float = 1.0, seed: int = 0):
    """Squared gradient norms of 0.5 (x.w - y)^2 at w = w* + delta, x ~ N(0, I_d), y = x.w* + N(0, sigma^2):
    per-example g = x (x.delta - eps), so G = delta and Sigma = (|delta|^2 + sigma^2) I + delta delta^T
    (Gaussian fourth moments): tr(Sigma) = d (|delta|^2 + sigma^2) + |delta|^2, |G|^2 = |delta|^2 = 1."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.zeros(d, dtype=torch.float64)
    delta[0] = 1.0
    X = torch.randn(n, b_big, d, generator=g, dtype=torch.float64)
    eps = sigma * torch.randn(n, b_big, generator=g, dtype=torch.float64)
    per_example = X * (X @ delta - eps)[..., None]  # (n, b_big, d)
    small = per_example.view(n, b_big // b_small, b_small, d).mean(2).pow(2).sum(-1).flatten()
    big = per_example.mean(1).pow(2).sum(-1)
    return small.tolist(), big.tolist(), d * (1 + sigma**2) + 1


@pytest.mark.parametrize("seed,b_small,b_big", [(0, 4, 64), (1, 8, 32), (2, 2, 128)])
def test_recovers_known_noise_scale(seed, b_small, b_big):
    # 2000 big batches: the estimates' spread over seeds is ~1-2% (measured); tolerances 4% / 6% / 8%
    small, big, tr_sigma = linear_regression_norms(2000, b_small, b_big, seed=seed)
    est = noise_scale(small, big, b_small, b_big)
    assert est.tr_sigma == pytest.approx(tr_sigma, rel=0.04)
    assert est.g2 == pytest.approx(1.0, rel=0.06 if b_small > 2 else 0.08)
    assert est.b_simple == pytest.approx(tr_sigma, rel=0.08)


def test_only_noise_gives_nan_not_a_negative_batch():
    # |G|^2 = 0: the estimate of it is noise around 0; a negative one gives no B_simple
    est = noise_scale([1.0, 1.1], [0.13, 0.12], 4, 32)
    assert est.g2 < 0 and math.isnan(est.b_simple) and est.tr_sigma > 0


@pytest.mark.parametrize("b_small,b_big", [(8, 8), (0, 8), (16, 8)])
def test_bad_batch_sizes_refused(b_small, b_big):
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_scale([1.0], [0.5], b_small, b_big)


def test_grad_sq_norms_are_the_chunks_and_their_mean_and_touch_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    loss_fn = nn.functional.cross_entropy
    before = [t.clone() for t in model.buffers()]
    m = grad_sq_norms(model, loss_fn, x, y, 4)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    grads, losses = [], []
    for i in range(3):
        model.zero_grad()
        losses.append(loss_fn(model(x[4 * i: 4 * i + 4]), y[4 * i: 4 * i + 4]))
        losses[-1].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert m.small == pytest.approx([float(g.pow(2).sum()) for g in grads], rel=1e-5)
    assert m.big == pytest.approx(float(torch.stack(grads).mean(0).pow(2).sum()), rel=1e-5)
    assert m.loss == pytest.approx(sum(loss.item() for loss in losses) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="chunks"):
        grad_sq_norms(model, loss_fn, x, y, 5)


def test_scaling_ratios():
    assert steps_ratio(1e9, 32, 256) == pytest.approx(8, rel=1e-6)  # far below B_noise: perfect scaling
    assert samples_ratio(1e-9, 32, 256) == pytest.approx(8, rel=1e-6)  # far above: 8x the samples
    assert steps_ratio(64, 32, 256) == pytest.approx(3 / 1.25) and samples_ratio(64, 32, 256) == pytest.approx(5 / 1.5)
