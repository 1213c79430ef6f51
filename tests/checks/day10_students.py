"""Day 10's exercise answers as students write them, correct and with one slip each, in a module of their own:
the ranks of a check import the module of the function they run, and this one touches no check (the grader's
modules are sealed on the ranks)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def merge_ok(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse1 - ref)[..., None] * o1 + torch.exp(lse2 - ref)[..., None] * o2, lse


def merge_no_rescale(o1, lse1, o2, lse2):
    return o1 + o2, torch.logaddexp(lse1, lse2)



def attend(q, kv, q_pos, k_pos, causal):
    """One block's (o_j, lse_j): the queries against the keys and values kv = stack([k, v])."""
    scores = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    l_j = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isinf(l_j), torch.zeros_like(l_j), l_j)[..., None])
    return p @ kv[1], l_j


def _ring(q, k, v, causal, *, local_mask=False, hops=None, owner_sign=-1, merge=merge_ok):
    """Rank r's (o, lse): K/V around the ring with isend/irecv, one block per step, merged as it comes."""
    n, r = dist.get_world_size(), dist.get_rank()
    B, H, t, D = q.shape
    q_pos = torch.arange(t) if local_mask else torch.arange(r * t, (r + 1) * t)
    o, lse = torch.zeros_like(q), torch.full((B, H, t), float("-inf"), dtype=q.dtype)
    kv = torch.stack([k, v])
    steps = n if hops is None else hops
    for s in range(steps):
        j = (r + owner_sign * s) % n
        k_pos = torch.arange(t) if local_mask else torch.arange(j * t, (j + 1) * t)
        o, lse = merge(o, lse, *attend(q, kv, q_pos, k_pos, causal))
        if s < n - 1:
            recv = torch.empty_like(kv)
            for op in [dist.isend(kv, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]:
                op.wait()
            kv = recv
    return o, lse


def ring_ok(q, k, v, causal):
    return _ring(q, k, v, causal)


def ring_local_mask(q, k, v, causal):
    return _ring(q, k, v, causal, local_mask=True)


def ring_hop_short(q, k, v, causal):
    return _ring(q, k, v, causal, hops=dist.get_world_size() - 1)


def ring_wrong_owner(q, k, v, causal):
    return _ring(q, k, v, causal, owner_sign=+1)


def ring_no_rescale(q, k, v, causal):
    return _ring(q, k, v, causal, merge=merge_no_rescale)


def ring_all_gather(q, k, v, causal):
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return merge_ok(*ring_ok(q, k, v, causal), *ring_ok(q, k, v, causal))


def ring_sends_twice(q, k, v, causal):
    out = _ring(q, k, v, causal)
    n, r = dist.get_world_size(), dist.get_rank()
    extra = torch.empty_like(k)
    for op in [dist.isend(k.contiguous(), (r + 1) % n), dist.irecv(extra, (r - 1) % n)]:
        op.wait()
    return out




def ring_always_causal(q, k, v, causal):
    """Masks whatever `causal` says: right on every causal case, wrong on the others."""
    return _ring(q, k, v, True)


def ring_to_everyone(q, k, v, causal):
    """Each rank sends its own K/V block to every other rank (the ring's bytes, all N blocks held at once)."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = q.shape[2]
    blocks = [torch.stack([k, v]) if j == r else torch.empty_like(torch.stack([k, v])) for j in range(n)]
    ops = [op for j in range(n) if j != r
           for op in (dist.isend(blocks[r], j), dist.irecv(blocks[j], j))]
    for op in ops:
        op.wait()
    o, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for j in range(n):
        o, lse = merge_ok(o, lse, *attend(q, blocks[j], torch.arange(r * t, (r + 1) * t),
                                           torch.arange(j * t, (j + 1) * t), causal))
    return o, lse


def ring_stub(q, k, v, causal):
    raise NotImplementedError()
