"""Asynchronous tensor parallelism: the collective matmul, naive beside decomposed.

Sequence-parallel TP (Korthikanti et al. 2022) puts an all-gather of the sequence before each
column-parallel linear and a reduce-scatter after each row-parallel one. Done as one collective and
then one matmul, the GPU waits for the whole all-gather before it computes. The *collective matmul*
(Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models", ASPLOS; torchtitan's "async TP", seed 004's "Async Linear") cuts both into t steps
over a ring: at step s each rank multiplies the sequence chunk it already holds while it sends that
chunk to its next neighbour and receives the next one, so communication hides behind t - 1 of the t
matmuls. The bytes are the all-gather's, (t-1)/t of the gathered input per rank; only the order changes.

- `all_gather_matmul(x, w)`: Y = AllGather_seq(X) W^T from this rank's chunk X_r, the chunks arriving
  around the ring while the product of the previous one is computed.
- `matmul_reduce_scatter(x, w)`: ReduceScatter_seq(X W^T), partial sums (this rank's columns of W) of
  every chunk: at each step a rank adds its own contribution to the running sum of one chunk and
  passes it on; after t - 1 hops each chunk's sum lands on its owner.

Each is the other's backward (the gradient of an all-gather is a reduce-scatter), as autograd Functions.
On a CPU over gloo the overlap is not measurable (the ranks share the cores); the results, gradients and
bytes are, against the one-collective versions in `dlo.distributed.tp_comms`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dlo.distributed.tp_comms import tp_rank, tp_size


def _ring_step(send: Tensor, group) -> tuple[Tensor, list]:
    """Start sending `send` to the next rank and receiving the previous rank's tensor into a new buffer."""
    t, r = tp_size(group), tp_rank(group)
    nxt, prev = (r + 1) % t, (r - 1) % t
    recv = torch.empty_like(send)
    to = dist.get_global_rank(group, nxt) if group is not None else nxt
    frm = dist.get_global_rank(group, prev) if group is not None else prev
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to, group),
                                    dist.P2POp(dist.irecv, recv, frm, group)])
    return recv, works


def _all_gather_matmul(x: Tensor, w: Tensor, dim: int, group) -> tuple[Tensor, Tensor]:
    """(Y, the gathered X): chunk j of Y along `dim` is X_j W^T; X_r is this rank's chunk."""
    t, r = tp_size(group), tp_rank(group)
    chunks: list = [None] * t
    out: list = [None] * t
    held = x.contiguous()
    for s in range(t):
        j = (r - s) % t  # at step s this rank holds the chunk of rank r - s
        works = []
        if s < t - 1:
            nxt, works = _ring_step(held, group)  # in flight while the matmul below runs
        chunks[j], out[j] = held, held @ w.T
        for work in works:
            work.wait()
        if s < t - 1:
            held = nxt
    return torch.cat(out, dim), torch.cat(chunks, dim)


def _matmul_reduce_scatter(x: Tensor, w: Tensor, dim: int, group) -> Tensor:
    """This rank's chunk along `dim` of sum over ranks of X W^T (each rank: its columns of W)."""
    t, r = tp_size(group), tp_rank(group)
    parts = x.chunk(t, dim)
    # the running sum of chunk c starts on rank c + 1 and travels forwards, ending on rank c
    acc = (parts[(r - 1) % t] @ w.T).contiguous()
    for s in range(1, t):
        incoming, works = _ring_step(acc, group)
        c = (r - 1 - s) % t
        mine = parts[c] @ w.T  # computed while the running sum arrives
        for work in works:
            work.wait()
        acc = (incoming + mine).contiguous()
    return acc


class AllGatherMatmul(torch.autograd.Function):
    """Saves the gathered input (its chunks arrived anyway) for W's gradient: t times the memory of
    `tp_comms.AllGatherLinear`, which saves its shard and gathers again in backward."""

    @staticmethod
    def forward(ctx, x, w, dim, group):
        y, gathered = _all_gather_matmul(x, w, dim, group)
        ctx.save_for_backward(gathered, w)
        ctx.dim, ctx.group = dim, group
        return y

    @staticmethod
    def backward(ctx, grad_y):
        gathered, w = ctx.saved_tensors
        grad_x = _matmul_reduce_scatter(grad_y, w.T, ctx.dim, ctx.group)  # dX_r = RS(dY W)
        grad_w = grad_y.flatten(0, -2).T @ gathered.flatten(0, -2)  # this rank's rows of W
        return grad_x, grad_w, None, None


class MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, dim, group):
        ctx.save_for_backward(x, w)
        ctx.dim, ctx.group = dim, group
        return _matmul_reduce_scatter(x, w, dim, group)

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        grad_x, grad_full = _all_gather_matmul(grad_y, w.T, ctx.dim, ctx.group)  # dX = AG(dY_r) W
        grad_w = grad_full.flatten(0, -2).T @ x.flatten(0, -2)  # this rank's columns of W
        return grad_x, grad_w, None, None


def all_gather_matmul(x: Tensor, w: Tensor, dim: int = 1, group=None) -> Tensor:
    """AllGather_dim(x) @ w.T, decomposed over the ring (x: this rank's chunk; w: (out, in))."""
    if tp_size(group) == 1:
        return x @ w.T
    return AllGatherMatmul.apply(x, w, dim, group)


def matmul_reduce_scatter(x: Tensor, w: Tensor, dim: int = 1, group=None) -> Tensor:
    """ReduceScatter_dim(x @ w.T) summed over ranks, decomposed over the ring (x: full along `dim`,
    this rank's input columns; w: (out, in_local))."""
    t = tp_size(group)
    if t == 1:
        return x @ w.T
    if x.shape[dim] % t:
        raise ValueError(f"matmul_reduce_scatter: size {x.shape[dim]} along dim {dim} is not divisible by {t}")
    return MatmulReduceScatter.apply(x, w, dim, group)


__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
