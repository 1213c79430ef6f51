"""Synchronized batch norm that also runs on CPU with gloo (torch.nn.SyncBatchNorm is CUDA-only).

Batch norm (Ioffe & Szegedy, "Batch Normalization", ICML 2015, Alg. 1) normalizes each channel
with the mean and variance of the current mini-batch. Under data parallelism every rank only sees
its own shard, so plain nn.BatchNorm uses per-rank statistics: at a small per-rank batch they are
noisy and accuracy drops (Wu & He, "Group Normalization", ECCV 2018, Fig. 1). Peng et al.,
"MegDet", CVPR 2018, Sec. 3.2 introduced cross-GPU batch norm: the statistics are reduced over all
ranks, so the layer computes exactly what one process would on the concatenated global batch.

Forward all-reduces one packed (3, C) tensor [sum x, sum x^2, count]; backward all-reduces one
packed (2, C) tensor [sum dy, sum dy * xhat]. Per-rank batch sizes may differ. In eval mode, and
without a process group of more than one rank, the layer is exactly nn.BatchNorm.
Usage: `model = convert_sync_batchnorm(model)` before wrapping it for data parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))  # every dim but the channel dim 1 of (N, C, *)


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))  # (C,) -> (1, C, 1, ...) to broadcast against x


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = weight * xhat + bias, xhat = (x - mean) * invstd, with mean/invstd global over the ranks.

    Backward (Ioffe & Szegedy 2015, Sec. 3, with the batch sums taken over all M global samples):
        dx = weight * invstd * (dy - sum_all(dy) / M - xhat * sum_all(dy * xhat) / M)
    x_i enters every rank's output through the shared mean and variance, so its gradient needs the
    dy of all ranks: the two sums are all-reduced. This is the gradient of the SUM of the per-rank
    losses. dweight = sum(dy * xhat) and dbias = sum(dy) stay local, like the gradient of any other
    parameter: the data-parallel wrapper then averages all parameter gradients (and those that
    flowed back through dx) over the R ranks, which gives the gradient of (1/R) sum_r loss_r, the
    global mean loss when the per-rank batches are equal. torch's SyncBatchNorm + DDP do the same.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group = count, group
        y = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight, x)
        return y + _per_channel(bias, x) if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(x)
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)  # recomputed: saves one (N, C, *) buffer
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)  # (C,) each, local
        dx = None
        if ctx.needs_input_grad[0]:
            packed = torch.stack([sum_dy, sum_dy_xhat])  # (2, C), a copy: the local sums stay intact
            dist.all_reduce(packed, group=ctx.group)
            mean_dy, mean_dy_xhat = packed / ctx.count
            scale = invstd if weight is None else weight * invstd
            dx = _per_channel(scale, x) * (dy - _per_channel(mean_dy, x) - xhat * _per_channel(mean_dy_xhat, x))
        dweight = sum_dy_xhat if ctx.needs_input_grad[1] else None  # False for a None weight or bias
        dbias = sum_dy if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over the samples of all ranks of `process_group` (default: the world) for (N, C, *).

    Same attributes and hyper-parameters as nn.BatchNorm1d/2d/3d. The running statistics are
    updated like torch does, from the global mean and the unbiased global variance (count M / (M - 1)),
    so they stay identical on every rank.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None, *, bias=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, *), got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized()
        if not (self.training and distributed and dist.get_world_size(self.process_group) > 1):
            return super().forward(x)  # eval mode or a single rank: exactly nn.BatchNorm
        self._check_input_dim(x)
        # Variance as E[x^2] - E[x]^2 from plain sums: the only form one all-reduce can combine
        # (Chan et al.'s exact merge of per-rank (mean, M2) needs every rank's mean, an all-gather,
        # which is what torch does). The subtraction cancels about log10((mean/std)^2) digits; in
        # float32 (7 digits) an activation with |mean| = 1000 std would keep none, so the sums are
        # accumulated in float64 (16 digits), which costs a float64 copy of x but only C numbers of traffic.
        xd = x.detach().double()
        dims = _reduce_dims(x)
        n_local = x.numel() // x.shape[1]
        packed = torch.stack([xd.sum(dims), xd.square().sum(dims), xd.new_full((x.shape[1],), n_local)])
        dist.all_reduce(packed, group=self.process_group)  # (3, C): one message for all statistics
        total, total_sq, counts = packed
        count = counts[0].item()
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all ranks, got {count:g}")
        mean = total / count
        var = (total_sq / count - mean * mean).clamp_min(0)  # biased: what the batch is normalized with
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum None is torch's cumulative average: factor 1/t at the t-th batch
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                unbiased = var * count / (count - 1)
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, mean.to(x.dtype), invstd.to(x.dtype),
                                            count, self.process_group)


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d in `module` (itself included) by a SyncBatchNorm.

    Like torch.nn.SyncBatchNorm.convert_sync_batchnorm: the new layers share the old parameters and
    buffers (an optimizer built before the conversion still steps them), keep the hyper-parameters
    and the train/eval mode. Returns the converted module (a new object if `module` is a BN layer).
    """
    out = module
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, bias=module.bias is not None)
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out
