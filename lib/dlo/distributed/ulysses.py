"""DeepSpeed-Ulysses (Jacobs et al. 2023, Sec. 3.1, Fig. 2): context parallelism by all-to-all.

Each rank holds T/N positions of all H heads. One all-to-all per tensor turns that into all T positions
of H/N heads (sequence-sharded -> head-sharded); attention is then local, every head seeing the whole
sequence; a last all-to-all turns the output back (head-sharded -> sequence-sharded). Backward runs the
same all-to-alls the other way (`SeqToHead` and `HeadToSeq` are each other's gradient).

Bytes per rank: each all-to-all sends (N-1)/N of a rank's tensor, B H T/N D elements; four per pass
(q, k, v, o), so 4 (N-1)/N^2 B H T D, which falls with N, where ring attention's 2 (N-1)/N B H_kv T D
does not (`ulysses_bytes_per_rank`, `dlo.distributed.context_parallel.ring_bytes_per_rank`). The price:
H must be divisible by N (the degree is capped by the heads; by the K/V heads under GQA, unless they
are repeated), and each rank holds T x T scores per head pair in a plain local attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dlo.distributed.context_parallel import block_attention, rank_positions
from dlo.distributed.tp_comms import tp_size
from dlo.errors import BadInput

__all__ = ["seq_to_head", "head_to_seq", "SeqToHead", "HeadToSeq", "ulysses_attention", "ulysses_bytes_per_rank"]


def _all_to_all(x: Tensor, group) -> Tensor:
    """Block j of dim 0 goes to rank j; block j of the result came from rank j."""
    x = x.contiguous()  # before empty_like: it would copy a view's permuted strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_head(x: Tensor, group=None) -> Tensor:
    """(B, H, T/N, D) sequence shard -> (B, H/N, T, D) head shard, the sequence in rank-block order."""
    n = tp_size(group)
    B, H, t, D = x.shape
    send = x.reshape(B, n, H // n, t, D).movedim(1, 0)  # (N, B, H/N, T/N, D): head group j to rank j
    recv = _all_to_all(send, group)  # (N, B, H/N, T/N, D): sequence block j from rank j
    return recv.movedim(0, 2).reshape(B, H // n, n * t, D)


def head_to_seq(x: Tensor, group=None) -> Tensor:
    """(B, H/N, T, D) head shard -> (B, H, T/N, D) sequence shard (the inverse of `seq_to_head`)."""
    n = tp_size(group)
    B, h, T, D = x.shape
    send = x.reshape(B, h, n, T // n, D).movedim(2, 0)  # (N, B, H/N, T/N, D): sequence block j to rank j
    recv = _all_to_all(send, group)  # (N, B, H/N, T/N, D): head group j from rank j
    return recv.movedim(0, 1).reshape(B, n * h, T // n, D)


class SeqToHead(torch.autograd.Function):
    """all-to-all sequence -> heads forward, heads -> sequence backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq(grad, ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """all-to-all heads -> sequence forward, sequence -> heads backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head(grad, ctx.group), None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, zigzag: bool = False,
                      group=None) -> Tensor:
    """This rank's attention output (B, H, T/N, D): q, k, v all-to-all'd to head shards, attended over
    the whole sequence (positions of each rank's block: contiguous, or zig-zag), all-to-all'd back."""
    n = tp_size(group)
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise BadInput(f"q, k, v must be (B, H, T/N, D) of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                       f"{tuple(v.shape)}")
    if q.shape[1] % n:
        raise BadInput(f"Ulysses splits the heads over the ranks: {q.shape[1]} heads over {n} ranks do not "
                       "divide; use ring attention, or a degree that divides the heads")
    T = q.shape[-2] * n
    pos = torch.cat([rank_positions(T, n, j, zigzag) for j in range(n)]).to(q.device)  # rank-block order
    qh, kh, vh = (SeqToHead.apply(x, group) if n > 1 else x for x in (q, k, v))  # (B, H/N, T, D)
    o = block_attention(qh, kh, vh, pos, pos, causal)[0]
    return HeadToSeq.apply(o, group) if n > 1 else o


def ulysses_bytes_per_rank(B: int, H: int, T: int, D: int, n: int, itemsize: int, H_kv: int | None = None,
                           backward: bool = False) -> float:
    """Bytes one rank sends: all-to-alls of q, k, v and o forward ((N-1)/N of each T/N shard), of dq, dk,
    dv and do backward; H_kv K/V heads under GQA (default H)."""
    H_kv = H if H_kv is None else H_kv
    per_pass = (n - 1) / n * B * (T // n) * D * itemsize * (2 * H + 2 * H_kv)
    return per_pass * (2 if backward else 1)
