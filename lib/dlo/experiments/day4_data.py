"""Day 4's models and synthetic batches (the MLP of the comparisons and the BatchNorm experiment,
ResNet-18 on images at full scale): every rank draws its own batch of each step from (step, rank),
so a run needs no data loader and no data files; and the training step of every data-parallel
wrapper (`ddp_step`). `dlo.experiments.day4` trains on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlo.distributed.current import heartbeat
from dlo.models.resnet import resnet18
from dlo.models.small import MLP


def mlp(P, device, norm: bool = False, seed: int = 0) -> nn.Module:
    """d_in -> (hidden [BatchNorm] ReLU) x layers -> 10, the same weights on every call (seeded)."""
    torch.manual_seed(seed)
    return MLP(P.d_in, P.hidden, 10, depth=P.layers + 1, norm=norm).to(device)


def feature_batch(P, step: int, rank: int, device, n: int | None = None):
    """A learnable synthetic batch, different on every rank and step: 10 Gaussian clusters around
    fixed centres, each feature with its own offset and scale (so that normalization matters)."""
    centres = torch.randn(10, P.d_in, generator=torch.Generator().manual_seed(12345))  # (10, d_in)
    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, 10, (n or P.batch_per_rank,), generator=g)  # (B,)
    x = 0.3 * centres[y] + torch.randn(len(y), P.d_in, generator=g)  # (B, d_in)
    shift = torch.linspace(-3, 3, P.d_in)
    scale = torch.linspace(0.5, 4, P.d_in).roll(P.d_in // 3)
    return (x * scale + shift).to(device), y.to(device)


def image_batch(P, step: int, rank: int, device):
    """Synthetic images (B, 3, S, S) for the ResNet: 10 classes, each with its own mean pattern."""
    centres = torch.randn(10, 3, P.image_size, P.image_size, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, 10, (P.batch_per_rank,), generator=g)  # (B,)
    x = 0.5 * centres[y] + torch.randn(len(y), 3, P.image_size, P.image_size, generator=g)  # (B, 3, S, S)
    return x.to(device), y.to(device)


def model(P, device) -> nn.Module:
    """The model of the DDP comparisons: P.model is "mlp" (tiny) or "resnet18" (full, He et al. 2016)."""
    if P.model == "resnet18":
        torch.manual_seed(0)
        return resnet18(num_classes=10, width=P.width).to(device)
    if P.model == "mlp":
        return mlp(P, device)
    raise ValueError(f"Day4Preset.model must be 'mlp' or 'resnet18', got {P.model!r}")


def batch(P, step: int, rank: int, device):
    """A batch for `model(P, device)`."""
    return (image_batch if P.model == "resnet18" else feature_batch)(P, step, rank, device)


def batches(P, rank: int, device, n: int | None = None, features: bool = False, first: int = 0):
    """The endless stream of batches first, first + 1, ... of this rank (for `dlo.train.train`; another
    `first` for another seed's data)."""
    step = first
    while True:
        yield feature_batch(P, step, rank, device, n) if features else batch(P, step, rank, device)
        step += 1


def ddp_step(label: str = ""):
    """A `dlo.train.train` step for any of the data-parallel wrappers: cross-entropy, backward, our
    wrappers' explicit synchronization (torch DDP syncs inside backward), SGD step. Says `label`
    and the step count through the launcher's heartbeat."""
    count = [0]

    def step(net, opt, b) -> dict:
        if count[0] % 10 == 0:  # a file write: rare enough to leave a median step time alone
            heartbeat(f"{label}: step {count[0]}")
        count[0] += 1
        loss = F.cross_entropy(net(b[0]), b[1])
        loss.backward()
        if hasattr(net, "finish_gradient_synchronization"):  # ours; torch DDP syncs inside backward
            net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        return {"loss": loss}
    return step
