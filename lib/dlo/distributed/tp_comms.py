"""The communication of tensor and sequence parallelism, as autograd Functions (picotron's
`tp_communications` manner: each collective beside its conjugate in backward).

Megatron-LM (Shoeybi et al. 2019, Sec. 3, Fig. 3) names two conjugate operators:

- **f** (`copy_to_tp`): identity forward, all-reduce backward. It sits where a replicated input
  enters column-parallel layers: every rank uses the whole input, so the input's gradient is the sum
  of every rank's partial gradient.
- **g** (`reduce_from_tp`): all-reduce forward, identity backward. It closes a row-parallel layer:
  each rank holds a partial sum of the output, and the replicated output's gradient is already whole.

Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 5) splits the all-reduce into its
two halves, so that the regions between the tensor-parallel blocks (norms, dropout, residuals) work
on a 1/t slice of the sequence:

- `gather_from_sp` (their g): all-gather along the sequence forward, reduce-scatter backward;
- `reduce_scatter_to_sp` (their g-bar): reduce-scatter along the sequence forward, all-gather backward.

The gathers and scatters of whole activations (`gather_from_tp`, `scatter_to_tp`) enter or leave a
parallel region from replicated data.
`AllGatherLinear` is Megatron's sequence-parallel column linear: it saves only this rank's sequence
shard and all-gathers it again in backward (one more all-gather, t times fewer saved bytes).

Every function takes `group` (None: the default process group); with one rank each is the identity.
Collectives need contiguous tensors and reduce in place, so they work on a contiguous copy: a tensor
that autograd saved for backward is never overwritten.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dlo.distributed.collectives import all_gather_single, reduce_scatter_single

# torch >= 2.13 names the single-tensor collectives *_single; older releases *_into_tensor / _tensor


def tp_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"{what} of size {size} cannot be split into {parts} equal shards")


# ----------------------------------------------------------------------------- plain collectives on a dimension

def all_reduce(x: Tensor, group=None) -> Tensor:
    """Sum of x over the group (a new tensor)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather(x: Tensor, dim: int, group=None) -> Tensor:
    """The ranks' x concatenated along `dim`, in rank order: (.., n, ..) -> (.., t*n, ..)."""
    t = tp_size(group)
    moved = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = moved.new_empty((t * moved.shape[0], *moved.shape[1:]))
    all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, group=None) -> Tensor:
    """Sum of x over the group, this rank's 1/t slice along `dim`: (.., t*n, ..) -> (.., n, ..)."""
    t = tp_size(group)
    _check_divisible(x.shape[dim], t, f"dimension {dim}")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // t, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def split(x: Tensor, dim: int, group=None) -> Tensor:
    """This rank's contiguous 1/t slice along `dim` (no communication)."""
    t = tp_size(group)
    _check_divisible(x.shape[dim], t, f"dimension {dim}")
    return x.chunk(t, dim)[tp_rank(group)].contiguous()


# ----------------------------------------------------------------------------- Megatron's f and g

class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Shoeybi et al. 2019, Eq. 3 and Fig. 3a)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new autograd node over the same values

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension forward (a column layer's full output), keep this rank's
    slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, -1, ctx.group), None


class ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward (a row layer fed a replicated input),
    all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, -1, ctx.group), None


# ----------------------------------------------------------------------------- sequence parallelism

class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (Korthikanti et al.'s g)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (Korthikanti et al.'s g-bar)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class AllGatherLinear(torch.autograd.Function):
    """y = all_gather(x, dim) @ W^T + b, saving only x (this rank's sequence shard): backward
    all-gathers x again for W's gradient and reduce-scatters the input gradient (Megatron-LM's
    sequence-parallel column linear, Korthikanti et al. 2022, Sec. 4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, group):
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        full = all_gather(x, dim, group)  # freed when forward returns: only the shard stays
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = all_gather(x, ctx.dim, ctx.group)  # the extra all-gather that buys the memory
        grad_x = reduce_scatter(grad @ weight, ctx.dim, ctx.group)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


# ----------------------------------------------------------------------------- the functional names

def copy_to_tp(x: Tensor, group=None) -> Tensor:
    """f: identity forward, all-reduce backward."""
    return CopyToTensorParallel.apply(x, group) if tp_size(group) > 1 else x


def reduce_from_tp(x: Tensor, group=None) -> Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallel.apply(x, group) if tp_size(group) > 1 else x


def gather_from_tp(x: Tensor, group=None) -> Tensor:
    return GatherFromTensorParallel.apply(x, group) if tp_size(group) > 1 else x


def scatter_to_tp(x: Tensor, group=None) -> Tensor:
    return ScatterToTensorParallel.apply(x, group) if tp_size(group) > 1 else x


def gather_from_sp(x: Tensor, dim: int = 1, group=None) -> Tensor:
    """All-gather the sequence (dim 1 of (B, T, C)) forward, reduce-scatter backward."""
    return GatherFromSequenceParallel.apply(x, dim, group) if tp_size(group) > 1 else x


def reduce_scatter_to_sp(x: Tensor, dim: int = 1, group=None) -> Tensor:
    """Reduce-scatter the sequence forward, all-gather backward."""
    return ReduceScatterToSequenceParallel.apply(x, dim, group) if tp_size(group) > 1 else x


def all_gather_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, dim: int = 1, group=None) -> Tensor:
    if tp_size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return AllGatherLinear.apply(x, weight, bias, dim, group)


__all__ = ["tp_size", "tp_rank", "all_reduce", "all_gather", "reduce_scatter", "split", "CopyToTensorParallel",
           "ReduceFromTensorParallel", "GatherFromTensorParallel", "ScatterToTensorParallel",
           "GatherFromSequenceParallel", "ReduceScatterToSequenceParallel", "AllGatherLinear", "copy_to_tp",
           "reduce_from_tp", "gather_from_tp",
           "scatter_to_tp", "gather_from_sp", "reduce_scatter_to_sp", "all_gather_linear"]
