"""The learning-rate range test (Smith 2017, "Cyclical Learning Rates for Training Neural Networks", 3.3).

Train for a short while with the lr growing geometrically from tiny to huge, record the loss, and
read a good lr range off the curve: the loss starts to fall fast (lr_min), bottoms out, then blows up.
The caller owns the model: `step_fn(lr)` runs one training step at that lr and returns the loss.

Reading the curve needs care at small scale. Its first points average only one or two noisy losses
(the EMA has not settled) and its last ones are the blow-up, so a slope read there is noise: fastai's
`lr_find` reads its suggestions on the recorded points `[num_it // 10 : -5]` only
(fastai/callback/schedule.py). `skip_start` / `skip_end` do the same here; 0 keeps every point.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class LRFinderResult:
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    lr_max: float
    lr_min: float


def suggest_lrs(lrs: list[float], smoothed: list[float], *, skip_start: int = 0,
                skip_end: int = 0) -> tuple[float, float]:
    """(lr_min, lr_max) from a range-test curve.

    lr_max: one decade below the lr of the lowest smoothed loss (past the minimum, training is
    already unstable). lr_min: the lr where the smoothed loss falls fastest per decade, i.e. the
    argmin of d(loss)/d(log10 lr) before the minimum (lrs[0] if the minimum is the first point).
    Both are read on the points [skip_start : len - skip_end] (fastai's trimming, module docstring),
    or on all of them when fewer than 3 would be left.
    """
    if len(lrs) != len(smoothed):
        raise ValueError(f"lrs and smoothed differ in length: {len(lrs)} vs {len(smoothed)}")
    if not lrs:
        raise ValueError("the range test recorded no finite loss: lower min_lr or check the model")
    if skip_start < 0 or skip_end < 0:
        raise ValueError(f"skip_start and skip_end must be >= 0, got {skip_start}, {skip_end}")
    if len(lrs) - skip_start - skip_end >= 3:
        lrs, smoothed = lrs[skip_start: len(lrs) - skip_end], smoothed[skip_start: len(smoothed) - skip_end]
    best = int(np.argmin(smoothed))
    lr_max = lrs[best] / 10.0
    if best == 0:
        return lrs[0], lr_max
    slope = np.gradient(np.asarray(smoothed, dtype=float), np.log10(np.asarray(lrs, dtype=float)))
    lr_min = lrs[int(np.argmin(slope[:best]))]
    return lr_min, lr_max


def lr_range_test(step_fn: Callable[[float], float], *, min_lr: float = 1e-7, max_lr: float = 10.0,
                  num_steps: int = 100, beta: float = 0.98, diverge: float = 4.0, skip_start: int = 0,
                  skip_end: int = 0) -> LRFinderResult:
    """Run `step_fn(lr)` at lr_i = min_lr * (max_lr / min_lr) ** (i / (num_steps - 1)) until divergence.

    The loss is smoothed by a bias-corrected EMA (as Adam corrects its moments) so that noise does not
    trigger the stop. Stops, without keeping the point, when the loss is not finite or the smoothed
    loss exceeds `diverge` times the best smoothed loss so far. The suggestions skip the first
    `skip_start` and last `skip_end` kept points (`suggest_lrs`).
    """
    if not 0 < min_lr < max_lr:
        raise ValueError(f"need 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}")
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2, got {num_steps}")
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    lrs, losses, smoothed = [], [], []
    avg, best = 0.0, math.inf
    for i in range(num_steps):
        lr = min_lr * (max_lr / min_lr) ** (i / (num_steps - 1))
        loss = float(step_fn(lr))
        if not math.isfinite(loss):
            break
        avg = beta * avg + (1 - beta) * loss
        smooth = avg / (1 - beta ** (i + 1))
        if smooth > diverge * best:
            break
        best = min(best, smooth)
        lrs.append(lr)
        losses.append(loss)
        smoothed.append(smooth)
    lr_min, lr_max = suggest_lrs(lrs, smoothed, skip_start=skip_start, skip_end=skip_end)
    return LRFinderResult(lrs=lrs, losses=losses, smoothed=smoothed, lr_max=lr_max, lr_min=lr_min)
