"""What Day 4's training checks share (naive and bucketed DDP in `dlo.checks.day4`, accumulation in
`dlo.checks.day4_accum`): the checks' MLP and batches, each rank's part of the case (`ddp_parts`), the
reference (one process on the whole batch) and the comparisons.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from dlo.grading.compare import DTYPE, assert_close

TOL = 1e-10  # float64: correct code agrees to ~1e-15, a slip is off by >= 1e-3
SMALL_CAP = 50 * 8 / 2 ** 20  # 50 doubles, in MB: a few buckets for the checks' MLP


def close_enough(name: str, what: str, got, want, where: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: {what} is {type(got).__name__}, expected a tensor ({where})")
    assert_close(name, what, got, want, where, rtol=TOL, atol=TOL)


def checks_net(seed: int, frozen: bool = False) -> nn.Module:
    """The checks' MLP, with a buffer (as BatchNorm's running statistics: DDP broadcasts buffers too) and, when
    `frozen`, its first bias frozen (requires_grad=False: no gradient, never bucketed)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)
    net.register_buffer("running_stat", torch.randn(4, dtype=DTYPE))
    net[0].bias.requires_grad_(not frozen)
    return net


def checks_batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(n, 7, generator=g, dtype=DTYPE), torch.randint(0, 3, (n,), generator=g)


def checks_lr(seed: int) -> float:
    return 0.2 + 0.05 * (seed % 3)


def checks_optimizer(model, lr: float):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def param_list(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def buffer_list(model) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def compare_buffers(name: str, got: list, want: list, where: str) -> None:
    for i, (b, wnt) in enumerate(zip(got, want)):
        if not torch.equal(b, wnt):
            raise AssertionError(f"{name}: buffer {i} differs from rank 0's: broadcast the buffers too "
                                 f"(module.buffers(), e.g. BatchNorm's running statistics), as DDP does at "
                                 f"construction ({where})")


def single_process(seed, steps, n, frozen=False):
    """The target: one process, the whole global batch, mean loss, same optimizer, rank 0's start."""
    net = checks_net(seed + 1, frozen)
    opt = checks_optimizer(net, checks_lr(seed))
    for s in range(steps):
        x, y = checks_batch(seed, s, n)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return param_list(net)


def compare_params(name, got, want, steps, where):
    """The student's parameters against one process on the full batch (in float64 that is what torch's
    DDP computes too: tests/distributed/test_ddp.py holds the three against each other, so no check
    pays for launching torch DDP ranks)."""
    for i, (g, wnt) in enumerate(zip(got, want)):
        close_enough(name, f"parameter {i} after {steps} steps vs one process on the full batch", g, wnt, where)


def rows_per_rank(seed: int) -> int:
    return random.Random(seed).choice([3, 5, 7])


def ddp_parts(seed: int, steps: int, per_rank: int, w: int, frozen: bool = False) -> list[dict]:
    """What rank r is given, built here on the grader's side: its own random starting weights and buffers
    (the broadcast must replace them with rank 0's), the learning rate and its own slice of each step's
    global batch; never the global batch nor the seed."""
    batches = [checks_batch(seed, s, per_rank * w) for s in range(steps)]
    return [{"net": checks_net(seed + 1 + r, frozen), "lr": checks_lr(seed),
             "batches": [(x[r::w].clone(), y[r::w].clone()) for x, y in batches]} for r in range(w)]

