"""DataParallelNaive / DataParallelBucket vs one process on the full batch and vs torch DDP, the
shard sampler and metric sync. One launch of 2 ranks runs every multi-process comparison."""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.distributed import launch
from dlo.distributed.data import ShardSampler, all_reduce_metrics, shard_indices
from dlo.distributed.ddp import DataParallelBucket, DataParallelNaive
from dlo.measure import CommCounter

STEPS, BATCH, MICRO = 3, 10, 2  # 10 samples split 5 + 5 over two ranks


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3)).double()


class _Mixed(nn.Module):
    """Two dtypes (float64 body, float32 head: one bucket each) and a layer that forward never calls."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.body, self.unused, self.head = nn.Linear(7, 13).double(), nn.Linear(13, 13).double(), nn.Linear(13, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).float())  # (B, 3) float32


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 7, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def _reference(net):
    """One process, full batch (mean over all samples), same optimizer."""
    opt = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    for s in range(STEPS):
        x, y = _data(s)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _train(model, rec, micro=1, set_to_none=True):
    r, w = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    calls_during_no_sync = 0
    for s in range(STEPS):
        x, y = _data(s)
        xs, ys = x[r::w].chunk(micro), y[r::w].chunk(micro)  # this rank's shard, in micro-batches
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == micro - 1
            before = rec.count("all_reduce")
            with (model.no_sync() if not last else torch.enable_grad()):
                # weight each micro-batch mean by its share of the shard (chunks of 5 are 3 + 2)
                (F.cross_entropy(model(xm), ym) * len(ym) / len(x[r::w])).backward()
            if not last:
                calls_during_no_sync += rec.count("all_reduce") - before
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return [p.detach().clone() for p in model.parameters()], calls_during_no_sync


def _worker():
    r = dist.get_rank()
    want = _reference(_net(0))
    out = {}
    # bucket_kept: zero_grad(set_to_none=False) keeps .grad as views of the buckets, so backward
    # accumulates straight into them (the no-copy path)
    for name, micro in (("naive", 1), ("bucket", 1), ("torch", 1), ("bucket_accum", MICRO), ("bucket_kept", MICRO)):
        net = _net(r)  # different init per rank: the wrappers must broadcast rank 0's weights
        if name == "naive":
            model = DataParallelNaive(net)
        elif name == "torch":
            model = nn.parallel.DistributedDataParallel(net)
        else:
            model = DataParallelBucket(net, bucket_cap_mb=10 * 8 / 2 ** 20)  # 10 doubles: several buckets
        with CommCounter() as rec:
            got, in_no_sync = _train(model, rec, micro, set_to_none=name != "bucket_kept")
        out[name] = (max((g - w).abs().max().item() for g, w in zip(got, want)), in_no_sync, rec.count("all_reduce"))
    out["n_buckets"] = len(DataParallelBucket(_net(0), bucket_cap_mb=10 * 8 / 2 ** 20).buckets)
    # overlap=False (Day 4's no-overlap baseline): the same buckets, every all-reduce after backward
    after = DataParallelBucket(_net(r), bucket_cap_mb=10 * 8 / 2 ** 20, overlap=False)
    with CommCounter() as rec:
        got, _ = _train(after, rec)
    x, y = _data(STEPS)
    with CommCounter() as in_backward:
        F.cross_entropy(after(x[r::2]), y[r::2]).backward()
    with CommCounter() as in_finish:
        after.finish_gradient_synchronization()
    out["after"] = (max((g - w).abs().max().item() for g, w in zip(got, want)), in_backward.count("all_reduce"),
                    in_finish.count("all_reduce"))
    # the unused layer shares the float64 bucket: finish_gradient_synchronization must send zeros for
    # it (every rank launches every bucket), while the used parameters get the mean
    mixed = DataParallelBucket(_Mixed(r))  # the default 25 MB cap: the buckets split by dtype only
    with CommCounter() as rec:
        got, _ = _train(mixed, rec)
    want = _reference(_Mixed(0))
    x, y = _data(STEPS)
    F.cross_entropy(mixed(x[r::2]), y[r::2]).backward()
    mixed.finish_gradient_synchronization()
    out["mixed"] = (max((g - w).abs().max().item() for g, w in zip(got, want)), rec.count("all_reduce"),
                    [b.buffer.dtype for b in mixed.buckets], mixed.module.unused.weight.grad.abs().max().item())
    # rank 0 holds 3 samples, rank 1 holds 4: the global mean weights by count
    out["metrics"] = all_reduce_metrics(*([6.0, 2, 3] if r == 0 else [4.0, 4, 4]))
    return out


def test_ddp_versions_match_single_process_and_torch_ddp():
    for out in launch(_worker, 2, timeout=120):
        for name in ("naive", "bucket", "torch", "bucket_accum", "bucket_kept"):
            err, in_no_sync, _ = out[name]
            # float64, same data, only the summation order differs: agreement to ~1e-15
            assert err < 1e-12, f"{name}: parameters differ from the single-process run by {err}"
            assert in_no_sync == 0, f"{name}: {in_no_sync} all-reduces inside no_sync"
        assert out["n_buckets"] >= 3
        # the bucketed version sends one message per bucket, the naive one per parameter (6 tensors)
        assert out["bucket"][2] == STEPS * out["n_buckets"] and out["naive"][2] == STEPS * 6
        assert out["bucket_accum"][2] == out["bucket_kept"][2] == STEPS * out["n_buckets"]
        err, in_backward, in_finish = out["after"]
        assert err < 1e-12 and in_backward == 0 and in_finish == out["n_buckets"]
        # torch's reducer issues its all-reduces from C++: CommCounter sees them at the dispatcher
        assert out["torch"][2] >= STEPS
        assert out["metrics"] == pytest.approx((10.0 / 7, 6 / 7))
        err, calls, dtypes, unused_grad = out["mixed"]
        assert err < 1e-6, f"mixed dtypes / unused layer: parameters differ by {err}"  # float32 head
        assert dtypes == [torch.float32, torch.float64] and calls == STEPS * 2
        assert unused_grad == 0.0


@pytest.mark.parametrize("n,world_size", [(10, 3), (7, 4), (2, 3), (100, 1)])
def test_shards_cover_without_overlap(n, world_size):
    shards = [shard_indices(n, r, world_size, seed=5, epoch=1) for r in range(world_size)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [len(ShardSampler(n, r, world_size)) for r in range(world_size)] == list(map(len, shards))


def test_sampler_reshuffles_per_epoch_and_validates_rank():
    s = ShardSampler(50, rank=1, world_size=2, seed=3)
    first = list(s)
    assert sorted(first) != first  # epoch 0 is shuffled too, not only the later epochs
    s.set_epoch(1)
    assert list(s) != first and list(ShardSampler(50, 1, 2, shuffle=False)) == list(range(1, 50, 2))
    with pytest.raises(ValueError, match="rank 2"):
        shard_indices(5, 2, 2)


def test_metrics_without_process_group():
    assert all_reduce_metrics(3.0, 1, 4) == (0.75, 0.25)
