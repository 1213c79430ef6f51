"""Expert parallelism (Day 10): the E experts of an MoE layer spread over N ranks, E/N each; every rank
routes its own tokens, sends each kept assignment to the rank of its expert and gets the outputs back
(GShard, Lepikhin et al. 2020, Sec. 2.2-3; Switch, Fedus et al. 2021, Sec. 2.2 and Fig. 3).

One step on a rank (S tokens, A kept assignments, sorted by expert by `dlo.models.moe.route`, hence by
destination rank):

1. counts: all-to-all of the kept counts per expert (E,), so each rank learns how many rows each source
   sends to each of its experts (N, E/N): the split sizes of the next all-to-all (`exchange_counts`);
2. dispatch: all-to-all of the rows with those split sizes (`all_to_all_rows`, an autograd Function whose
   backward is the same all-to-all with the splits swapped); the rows arrive source-major;
3. regroup expert-major (`expert_major_order`), run the local experts, restore the arrival order;
4. combine: the all-to-all back (splits swapped), then gate x output summed per token
   (`dlo.models.moe.combine`).

Routing is per rank (GShard's groups: the capacity counts this rank's tokens), so each rank's output is
what the single-process `MoE` gives for that rank's tokens; the router is replicated (its gradient is a
data-parallel all-reduce, left to the caller: `sync_router_grad`); each expert's weight gradient comes
from every rank's tokens through the backward all-to-alls.

Bytes per rank (`ep_bytes_per_rank`): each all-to-all sends the rows bound to other ranks, (N-1)/N of
its k S rows under balanced routing; four per step (dispatch and combine, forward and backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dlo.distributed.tp_comms import tp_rank, tp_size
from dlo.errors import BadInput
from dlo.models.moe import MoE, MoEOutput, aux_loss, combine, dispatch, expert_capacity, route, run_experts

__all__ = ["AllToAllRows", "all_to_all_rows", "exchange_counts", "expert_major_order", "ExpertParallelMoE",
           "sync_router_grad", "ep_bytes_per_rank"]


class AllToAllRows(torch.autograd.Function):
    """Rows of x (sum(in_splits), dim) to the ranks, in_splits[j] to rank j; out_splits[j] rows come from
    rank j. Backward sends the gradients back the same way reversed (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: Tensor, out_splits: list[int], in_splits: list[int], group=None) -> Tensor:
    return AllToAllRows.apply(x, out_splits, in_splits, group)


def exchange_counts(kept: Tensor, group=None) -> Tensor:
    """(N, E/N): row j is how many rows rank j sends to each of this rank's experts (kept: (E,), this
    rank's kept assignments per expert, experts of rank j at j E/N .. (j+1) E/N - 1)."""
    n = tp_size(group)
    send = kept.to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # equal splits: E/N counts to each rank
    return recv.view(n, -1)


def expert_major_order(recv_counts: Tensor) -> Tensor:
    """The permutation that takes rows arrived source-major (source j's rows for local experts 0, 1, ..)
    to expert-major (expert 0's rows from sources 0, 1, .., then expert 1's): recv[perm]."""
    n, e_local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) run begins in the arrival order
    runs = [torch.arange(int(starts[j * e_local + e]), int(starts[j * e_local + e] + flat[j * e_local + e]))
            for e in range(e_local) for j in range(n)]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)


class ExpertParallelMoE(nn.Module):
    """This rank's part of `moe`: the router (replicated) and experts r E/N .. (r+1) E/N - 1 (copies of
    the full layer's weights), over the expert-parallel `group`."""

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        n, r = tp_size(group), tp_rank(group)
        if moe.n_experts % n:
            raise BadInput(f"{moe.n_experts} experts cannot be spread evenly over {n} ranks; use a degree that "
                           "divides the number of experts")
        self.group, self.n_experts, self.top_k = group, moe.n_experts, moe.top_k
        self.capacity_factor, self.renormalize, self.aux = moe.capacity_factor, moe.renormalize, moe.aux
        self.router = nn.Linear(moe.router.in_features, moe.n_experts, bias=False)
        self.router.weight = nn.Parameter(moe.router.weight.detach().clone())
        mine = slice(r * moe.n_experts // n, (r + 1) * moe.n_experts // n)
        self.w1, self.w3, self.w2 = (nn.Parameter(w.detach()[mine].clone()) for w in (moe.w1, moe.w3, moe.w2))

    def restore_order(self, y: Tensor, perm: Tensor) -> Tensor:
        """Expert-major outputs back to the arrival order, ready for the all-to-all home."""
        return y[torch.argsort(perm)]

    def forward(self, x: Tensor) -> MoEOutput:
        flat = x.reshape(-1, x.shape[-1])  # (S, dim), this rank's tokens
        cap = expert_capacity(flat.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        r = route(flat, self.router.weight, self.top_k, cap, self.renormalize)
        n = tp_size(self.group)
        recv_counts = exchange_counts(r.kept, self.group)  # (N, E/N)
        in_splits = r.kept.view(n, -1).sum(1).tolist()  # rows to each rank
        out_splits = recv_counts.sum(1).tolist()  # rows from each rank
        arrived = all_to_all_rows(dispatch(flat, r), out_splits, in_splits, self.group)  # source-major
        perm = expert_major_order(recv_counts)
        y = run_experts(arrived[perm], recv_counts.sum(0).tolist(), self.w1, self.w3, self.w2)
        home = all_to_all_rows(self.restore_order(y, perm), in_splits, out_splits, self.group)  # (A, dim)
        out = combine(home, r, flat.shape[0]).view_as(x)
        self.last_splits = {"in": in_splits, "out": out_splits}  # what the all-to-alls moved (for counting)
        return MoEOutput(out, aux_loss(r, self.aux), r.kept, r.routed, r.dropped, r.capacity)


def sync_router_grad(model: ExpertParallelMoE) -> None:
    """Sum the router's gradient over the group (it is replicated: each rank's holds its tokens' part)."""
    if model.router.weight.grad is not None and tp_size(model.group) > 1:
        dist.all_reduce(model.router.weight.grad, group=model.group)


def ep_bytes_per_rank(tokens: int, dim: int, top_k: int, n: int, itemsize: int, backward: bool = False) -> float:
    """Bytes one rank sends under balanced routing with nothing dropped: (N-1)/N of its k S rows in the
    dispatch and again in the combine (and both again backward)."""
    one = (n - 1) / n * top_k * tokens * dim * itemsize
    return (4 if backward else 2) * one
