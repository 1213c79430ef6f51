"""A Day 4 DDP step as a notebook cell writes it, run by slurm/torchrun.sbatch on two nodes:
`python ddp_step.py OUT.pt [WORLD]`. Each rank trains DataParallelBucket on its half of every batch;
rank 0 saves every rank's (node, parameters) for the test to compare with one process on the full batch
(reference(), the same steps without distribution)."""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH = 3, 12


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)).double()


def data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 7, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def reference():
    """One process, the full batch, the same optimizer."""
    model = net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for s in range(STEPS):
        x, y = data(s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def ddp_step():
    import torch.distributed as dist

    from dlo.distributed.ddp import DataParallelBucket

    r, w = dist.get_rank(), dist.get_world_size()
    model = DataParallelBucket(net(r))  # ranks start different: the wrapper broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for s in range(STEPS):
        x, y = data(s)
        F.cross_entropy(model(x[r::w]), y[r::w]).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return os.environ.get("SLURMD_NODENAME", "?"), [p.detach() for p in model.parameters()]


if __name__ == "__main__":
    from dlo.distributed import is_main, launch

    out = launch(ddp_step, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    if is_main():
        torch.save(out, sys.argv[1])
    # a rank that dies after this line died at exit (the process group closed by launch's atexit), not in a step
    print(f"rank {os.environ.get('RANK')}: done", flush=True)
