"""Learning-rate schedules as pure functions of the step: `lr = schedule(step, ...)`.

A pure function is easier to plot, test and reason about than a stateful torch LRScheduler; the
training loop sets the lr of every param group from it before each step (see `dlo.train`).
`step` is 0-based and the returned lr is the one used *for* that step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


def warmup_cosine(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                  start_factor: float = 0.01) -> float:
    """Linear warmup then cosine decay (Goyal et al. 2017 warmup; Loshchilov & Hutter 2017 SGDR cosine).

    Warmup: base_lr * (start_factor + (1 - start_factor) * step / warmup_steps) for step < warmup.
    Decay:  min_lr + (base_lr - min_lr) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2,
    held at min_lr after total_steps. Same values as torch's SequentialLR(LinearLR, CosineAnnealingLR).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
                         f"total_steps={total_steps}")
    if step < warmup_steps:
        return base_lr * (start_factor + (1.0 - start_factor) * step / warmup_steps)
    progress = min(step - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0


def one_cycle(step: int, *, max_lr: float, total_steps: int, pct_start: float = 0.3, div_factor: float = 25.0,
              final_div_factor: float = 1e4) -> float:
    """The 1cycle policy (Smith & Topin 2017, "Super-Convergence"), cosine annealing, two phases.

    Rises from max_lr / div_factor to max_lr over the first pct_start of the steps, then falls to
    max_lr / div_factor / final_div_factor at step total_steps - 1. Same values as torch's OneCycleLR.
    """
    if not 0 <= step <= total_steps:
        raise ValueError(f"step must be in [0, total_steps={total_steps}], got {step}")
    if not 0 < pct_start < 1:
        raise ValueError(f"pct_start must be in (0, 1), got {pct_start}")
    initial_lr = max_lr / div_factor
    final_lr = initial_lr / final_div_factor
    # torch's phase boundaries: the peak is reached at step pct_start * total - 1, the end at total - 1.
    peak_step = float(pct_start * total_steps) - 1
    end_step = float(total_steps - 1)
    if peak_step <= 0:
        raise ValueError(f"pct_start * total_steps must be > 1 (got {pct_start} * {total_steps}): no room to warm up")
    if step <= peak_step:
        return _cos_anneal(initial_lr, max_lr, step / peak_step)
    return _cos_anneal(max_lr, final_lr, (step - peak_step) / (end_step - peak_step))


def _cos_anneal(start: float, end: float, pct: float) -> float:
    """Half a cosine from `start` (pct = 0) to `end` (pct = 1)."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


def lr_at_steps(schedule_fn: Callable[..., float], steps: int | Iterable[int], **kw) -> list[float]:
    """The schedule at each step (`steps` an int means range(steps)), e.g. for a plot."""
    if isinstance(steps, int):
        steps = range(steps)
    return [float(schedule_fn(s, **kw)) for s in steps]


def torch_scheduler_lrs(make_scheduler: Callable, base_lr: float, steps: int) -> list[float]:
    """The lr a torch LRScheduler uses for steps 0..steps-1: the reference these functions match.

    `make_scheduler(optimizer)` builds the scheduler; the lr is read before each optimizer.step(),
    then scheduler.step() is called, the order torch prescribes.
    """
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs
