"""Day 4's controls: evidence about the course's own engines that does not come from those engines.

A row that times dlo's naive or bucketed DDP, or trains with dlo's SyncBatchNorm, holds only if these
compute what torch's do; their own unit tests are the course's code checked by the course (issue 34).
Here torch is the measured side:

- `update_gap`: after the throughput rounds (the same initial weights, batch and optimizer steps for
  every version), each version's parameters against torch DDP's: the largest difference over the
  largest weight (float rounding only, if the gradients are averaged the same way).
- `sync_bn_gap`: dlo's SyncBatchNorm on every rank's shard against torch's nn.BatchNorm1d in one process
  on all ranks' samples concatenated, which is the layer's definition (Peng et al. 2018, Sec. 3.2):
  outputs, input gradients (of the sum of the ranks' losses) and running statistics, each as the
  largest difference over the largest reference value.

`update_claims` and `sync_bn_claim` make them claims rows: torch's result is the measured side.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from dlo import claims as C
from dlo import estimates as E
from dlo.distributed.sync_bn import convert_sync_batchnorm

CONTROL_DDP = "this notebook's control (torch DDP's weights): the throughput rows compare the same work"


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (float64)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def update_gap(nets: dict[str, nn.Module], ref: str = "torch DDP") -> dict[str, float]:
    """Per version but `ref`: max |w - w_ref| / max |w_ref| over the wrapped module's parameters."""
    want = torch.cat([p.detach().flatten() for p in nets[ref].module.parameters()])
    return {name: _gap(torch.cat([p.detach().flatten() for p in net.module.parameters()]), want)
            for name, net in nets.items() if name != ref}


def sync_bn_gap(features: int, per_rank: int, device) -> dict[str, float]:
    """dlo's SyncBatchNorm (train mode) on this rank's `per_rank` samples against nn.BatchNorm1d on every
    rank's samples at once: {"output", "input grad", "running mean", "running var": relative gap}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(4242)  # the same layer, inputs and upstream gradients on every rank
    bn = nn.BatchNorm1d(features)
    with torch.no_grad():
        bn.weight.copy_(1 + 0.5 * torch.randn(features, generator=g))
        bn.bias.copy_(torch.randn(features, generator=g))
    x_all = (3 * torch.randn(world * per_rank, features, generator=g) + 1).to(device)
    dy_all = torch.randn(world * per_rank, features, generator=g).to(device)
    ref = copy.deepcopy(bn).to(device)
    synced = convert_sync_batchnorm(nn.Sequential(copy.deepcopy(bn))).to(device)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    x_ref, x = x_all.clone().requires_grad_(), x_all[mine].clone().requires_grad_()
    y_ref, y = ref(x_ref), synced(x)
    (y_ref * dy_all).sum().backward()  # the sum of every rank's loss (y * dy) in one process
    (y * dy_all[mine]).sum().backward()
    layer = synced[0]
    return {"output": _gap(y, y_ref[mine]), "input grad": _gap(x.grad, x_ref.grad[mine]),
            "running mean": _gap(layer.running_mean, ref.running_mean),
            "running var": _gap(layer.running_var, ref.running_var)}


def update_claims(tp: dict) -> list[C.Claim]:
    """dlo's DDP engines against torch DDP's weights after the same steps (`day4_controls.update_gap`): the
    throughput rows compare the same work only if the gradients are averaged the same way."""
    return [C.Claim(f"{name} makes torch DDP's updates (the weights after the throughput rounds' steps)",
                    CONTROL_DDP, "the same weights", C.at_most(1e-3, "<= 1e-3 of the largest weight"),
                    E.exact(v["update gap"], "max |w - w_torch DDP| / max |w_torch DDP|, the same initial weights, "
                                             "batch and SGD steps"))
            for name, v in tp.items() if "update gap" in v]


def sync_bn_claim(gaps: dict, world_size: int, per_rank: int) -> C.Claim:
    """dlo's SyncBatchNorm against torch's nn.BatchNorm1d on the global batch in one process
    (`day4_controls.sync_bn_gap`): the largest of the four relative gaps, each named."""
    detail = ", ".join(f"{k} {E.format_number(v)}" for k, v in gaps.items())
    return C.Claim(f"dlo's SyncBatchNorm computes BatchNorm over the global batch ({world_size} ranks x {per_rank} "
                   f"samples)", "Peng et al. 2018, Sec. 3.2 (the definition); torch's nn.BatchNorm1d as the control",
                   "the same outputs, gradients, statistics", C.at_most(1e-4, "<= 1e-4 relative"),
                   E.exact(max(gaps.values()), f"max |dlo - torch BatchNorm on all ranks' samples| / max |torch|: "
                                               f"{detail}"))


__all__ = ["sync_bn_claim", "sync_bn_gap", "update_claims", "update_gap"]
