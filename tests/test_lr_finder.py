"""The LR range test: lr grid, bias-corrected smoothing, the stopping rules and the suggestions."""

import math

import numpy as np
import pytest
import torch

from dlo.lr_finder import LRFinderResult, lr_range_test, suggest_lrs


def _recording(losses_by_call):
    calls = []

    def step_fn(lr):
        calls.append(lr)
        return losses_by_call(len(calls) - 1)

    return step_fn, calls


def test_full_run_lrs_are_geometric_and_constant_loss_is_unbiased():
    step_fn, calls = _recording(lambda i: 2.5)
    res = lr_range_test(step_fn, min_lr=1e-5, max_lr=1.0, num_steps=11, beta=0.98)
    assert isinstance(res, LRFinderResult)
    assert res.lrs == pytest.approx([10.0 ** (-5 + k / 2) for k in range(11)], rel=1e-12)
    assert calls == res.lrs
    # Without bias correction the EMA of a constant would start near 0.05, not at 2.5.
    assert res.smoothed == pytest.approx([2.5] * 11, rel=1e-12)


def test_smoothing_is_bias_corrected_ema():
    values = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0]
    step_fn, _ = _recording(lambda i: values[i])
    res = lr_range_test(step_fn, num_steps=len(values), beta=0.5, diverge=100.0)
    # Closed form: weights beta^(i-j) (1 - beta) / (1 - beta^(i+1)) over the losses so far.
    for i, s in enumerate(res.smoothed):
        w = [(1 - 0.5) * 0.5 ** (i - j) for j in range(i + 1)]
        assert s == pytest.approx(sum(wj * v for wj, v in zip(w, values)) / sum(w), rel=1e-12)
    assert res.losses == values


def test_stops_at_divergence_without_keeping_that_point():
    values = [5.0, 4.0, 3.0, 2.0, 1.0, 1.5, 3.9, 4.1, 0.5, 0.5]
    step_fn, calls = _recording(lambda i: values[i])
    res = lr_range_test(step_fn, num_steps=len(values), beta=0.0, diverge=4.0)  # beta=0: smoothed == loss
    assert res.losses == values[:7]  # 4.1 > 4 * best (1.0) stops the test
    assert len(calls) == 8


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_stops_at_non_finite_loss(bad):
    step_fn, calls = _recording(lambda i: bad if i == 4 else 1.0)
    res = lr_range_test(step_fn, num_steps=20)
    assert len(res.lrs) == len(res.losses) == len(res.smoothed) == 4
    assert len(calls) == 5


def test_suggest_lrs_rules():
    lrs = list(np.geomspace(1e-4, 1.0, 9))
    smoothed = [5.0, 5.0, 4.0, 2.0, 1.5, 1.4, 1.3, 2.0, 3.0]
    lr_min, lr_max = suggest_lrs(lrs, smoothed)
    assert lr_max == pytest.approx(lrs[6] / 10)
    # np.gradient (central differences): index 2 falls by 3 over two cells, index 3 by 2.5: 2 is steepest.
    assert lr_min == lrs[2]
    assert suggest_lrs(lrs[:3], [1.0, 2.0, 3.0]) == (lrs[0], lrs[0] / 10)  # minimum at the first point
    with pytest.raises(ValueError, match="no finite loss"):
        suggest_lrs([], [])


def test_range_test_on_least_squares_brackets_the_stability_limit():
    # Gradient descent on 0.5 * ||A w - b||^2 / n diverges for lr > 2 / L, L the Hessian's largest eigenvalue.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(64, generator=gen, dtype=torch.float64)
    hessian_max = torch.linalg.eigvalsh(a.T @ a / 64).max().item()
    w = torch.zeros(8, dtype=torch.float64)

    def step_fn(lr):
        residual = a @ w - b
        w.sub_(lr * a.T @ residual / 64)
        return (0.5 * residual.pow(2).mean()).item()

    res = lr_range_test(step_fn, min_lr=1e-4, max_lr=100.0, num_steps=60, beta=0.9)
    assert len(res.lrs) < 60  # it diverged and stopped
    assert res.lrs[-1] > 1.0 / hessian_max
    assert res.lr_min < res.lr_max * 10 and res.lr_max < 2.0 / hessian_max


def test_rejects_bad_arguments():
    for kw in (dict(min_lr=1.0, max_lr=0.1), dict(num_steps=1), dict(beta=1.0)):
        with pytest.raises(ValueError):
            lr_range_test(lambda lr: 1.0, **kw)
    with pytest.raises(ValueError, match="no finite loss"):
        lr_range_test(lambda lr: math.nan, num_steps=5)


def test_reading_window_skips_the_unsettled_start_and_the_blow_up():
    lrs = list(np.geomspace(1e-4, 1.0, 12))
    # a noisy first point that looks like a steep fall, the real fall at 3-5, the minimum at 8, a dip in the blow-up
    smoothed = [9.0, 3.0, 3.0, 3.0, 2.5, 1.5, 1.3, 1.2, 1.1, 2.0, 0.5, 4.0]
    assert suggest_lrs(lrs, smoothed) == (lrs[0], lrs[10] / 10)  # every point: the noise decides both
    lr_min, lr_max = suggest_lrs(lrs, smoothed, skip_start=1, skip_end=3)
    assert lr_min == lrs[4] and lr_max == pytest.approx(lrs[8] / 10)  # central differences: 3.0 -> 1.5 around 4
    assert suggest_lrs(lrs[:4], smoothed[:4], skip_start=1, skip_end=3) == suggest_lrs(lrs[:4], smoothed[:4])
    with pytest.raises(ValueError, match="skip_start"):
        suggest_lrs(lrs, smoothed, skip_start=-1)
