"""The Day 4 checks accept the dlo references and reject stubs and plausible mistakes.

Each multi-process check costs one launch (~2 s), so every exercise gets its reference plus the
two or three slips students really make, not an exhaustive list.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from dlo.checks import day4
from dlo.distributed import collectives, data, ddp


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- ring all-reduce

def ring_via_all_reduce(t):
    dist.all_reduce(t)


def ring_reduce_scatter_only(t):
    """Stops after the reduce-scatter phase: each rank holds one summed chunk, the rest partial."""
    w, r = dist.get_world_size(), dist.get_rank()
    flat = t.view(-1)
    chunks = list(flat.tensor_split(w))
    for s in range(w - 1):
        send, recv = chunks[(r - s) % w], torch.empty_like(chunks[(r - s - 1) % w])
        ops = [dist.isend(send.contiguous(), (r + 1) % w), dist.irecv(recv, (r - 1) % w)]
        for op in ops:
            op.wait()
        chunks[(r - s - 1) % w] += recv


def ring_drops_remainder(t):
    """Chunks of numel // world: the tail elements are never summed."""
    n = t.numel() - t.numel() % dist.get_world_size()
    if n:
        collectives.ring_all_reduce(t.view(-1)[:n])


@pytest.mark.parametrize("world", [3])
def test_ring_accepts_reference(world):
    day4.check_ring_all_reduce(collectives.ring_all_reduce, seed=1, world_size=world)


@pytest.mark.parametrize("fn,match", [(stub, "NotImplementedError"), (ring_via_all_reduce, "not allowed"),
                                      (ring_reduce_scatter_only, "differs"), (ring_drops_remainder, "differs")])
def test_ring_rejects(fn, match):
    with pytest.raises(AssertionError, match=match):
        day4.check_ring_all_reduce(fn)


# ----------------------------------------------------------------------------- naive DDP

def all_reduce_sum(module):
    for p in module.parameters():
        dist.all_reduce(p.grad)


def no_broadcast(module):
    pass


def test_naive_accepts_reference():
    day4.check_naive_ddp(ddp.broadcast_parameters, ddp.all_reduce_gradients, seed=2)


@pytest.mark.parametrize("bcast,reduce,match", [(ddp.broadcast_parameters, all_reduce_sum, "mean over ranks"),
                                                (no_broadcast, ddp.all_reduce_gradients, "rank 0")])
def test_naive_rejects(bcast, reduce, match):
    with pytest.raises(AssertionError, match=match):
        day4.check_naive_ddp(bcast, reduce)


# ----------------------------------------------------------------------------- bucketed DDP

class SyncAfterBackward(ddp.DataParallelNaive):
    """Right numbers, but blocking per-parameter all-reduces after backward: no buckets, no overlap."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module)


class AsyncPerParameter(ddp.DataParallelNaive):
    """Overlaps, but one async all-reduce per parameter (bucket_cap ignored)."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module)
        self.handles = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: self.handles.append((p, dist.all_reduce(p.grad, async_op=True))))

    def finish_gradient_synchronization(self):
        for p, h in self.handles:
            h.wait()
            p.grad.div_(dist.get_world_size())
        self.handles = []


def test_bucket_accepts_reference():
    day4.check_bucket_ddp(ddp.DataParallelBucket, seed=1)


@pytest.mark.parametrize("cls,match", [(SyncAfterBackward, "async_op=True"), (AsyncPerParameter, "fewer than one per")])
def test_bucket_rejects(cls, match):
    with pytest.raises(AssertionError, match=match):
        day4.check_bucket_ddp(cls)


# ----------------------------------------------------------------------------- accumulation

def accumulation_step(model, optimizer, loss_fn, xs, ys):
    total = sum(len(y) for y in ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        ctx = model.no_sync() if i < len(xs) - 1 else contextlib.nullcontext()
        with ctx:
            (loss_fn(model(x), y) * len(y) / total).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()


def accumulation_without_no_sync(model, optimizer, loss_fn, xs, ys):
    total = sum(len(y) for y in ys)
    for x, y in zip(xs, ys):
        (loss_fn(model(x), y) * len(y) / total).backward()
        model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()


def accumulation_divides_by_k(model, optimizer, loss_fn, xs, ys):
    for i, (x, y) in enumerate(zip(xs, ys)):
        ctx = model.no_sync() if i < len(xs) - 1 else contextlib.nullcontext()
        with ctx:
            (loss_fn(model(x), y) / len(xs)).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()


def test_accumulation_accepts_reference():
    day4.check_accumulation_step(accumulation_step, seed=1)


@pytest.mark.parametrize("fn,match", [(accumulation_without_no_sync, "no_sync"),
                                      (accumulation_divides_by_k, "differs")])
def test_accumulation_rejects(fn, match):
    with pytest.raises(AssertionError, match=match):
        day4.check_accumulation_step(fn)


# ----------------------------------------------------------------------------- sampler and metrics

def shard_contiguous(n, rank, world_size, seed=0, epoch=0):
    size = n // world_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[rank * size:(rank + 1) * size].tolist()


def shard_padded(n, rank, world_size, seed=0, epoch=0):
    """DistributedSampler's default: pad with repeats so every rank has ceil(n / N)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per = -(-n // world_size)
    perm += perm[:per * world_size - n]
    return perm[rank::world_size]


def shard_unshuffled(n, rank, world_size, seed=0, epoch=0):
    return list(range(rank, n, world_size))


def shard_seed_per_rank(n, rank, world_size, seed=0, epoch=0):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch + rank))
    return perm[rank::world_size].tolist()


def test_shard_accepts_reference():
    for seed in range(3):
        day4.check_shard_indices(data.shard_indices, seed=seed, trials=10)


@pytest.mark.parametrize("fn,match", [(stub, None), (shard_contiguous, "cover"), (shard_padded, "two shards"),
                                      (shard_unshuffled, "epoch"), (shard_seed_per_rank, None)])
def test_shard_rejects(fn, match):
    with pytest.raises((AssertionError, NotImplementedError), match=match):
        day4.check_shard_indices(fn, trials=10)


def mean_of_means(loss_sum, correct, count):
    t = torch.tensor([loss_sum / count, correct / count], dtype=torch.float64)
    dist.all_reduce(t)
    return tuple((t / dist.get_world_size()).tolist())


def test_metrics():
    day4.check_all_reduce_metrics(data.all_reduce_metrics, seed=1, world_size=3)
    with pytest.raises(AssertionError, match="mean of per-rank means"):
        day4.check_all_reduce_metrics(mean_of_means)
