"""Data for data parallelism: a sampler that gives each rank its own shard, and metric sync.

The shard of rank r is every N-th index of a seeded permutation starting at r: the shards are
disjoint and together cover the data set exactly once (no sample dropped, none duplicated, sizes
differ by at most one). torch's DistributedSampler instead pads with repeated samples so that every
rank gets the same count; that keeps the ranks' step counts equal but counts some samples twice in
an evaluation, which is why metrics below are reduced as sums and counts, not as per-rank means.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dlo.distributed.current import rank as _rank
from dlo.distributed.current import rank_device
from dlo.distributed.current import world_size as _world_size


def shard_indices(n: int, rank: int, world_size: int, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True) -> list[int]:
    """Indices of rank's shard of range(n): a stride-N slice of one permutation shared by all ranks.

    The permutation depends only on (seed, epoch), so every rank computes the same one without
    communicating; change epoch to reshuffle.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_indices: rank {rank} not in [0, {world_size})")
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    return order[rank::world_size].tolist()


class ShardSampler(Sampler):
    """Sampler yielding this rank's shard (see `shard_indices`); call set_epoch(e) before each epoch."""

    def __init__(self, n: int, rank: int | None = None, world_size: int | None = None, seed: int = 0,
                 shuffle: bool = True):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.rank = _rank() if rank is None else rank
        self.world_size = _world_size() if world_size is None else world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(shard_indices(self.n, self.rank, self.world_size, self.seed, self.epoch, self.shuffle))

    def __len__(self):
        return len(range(self.rank, self.n, self.world_size))


def all_reduce_metrics(loss_sum: float, correct: float, count: int) -> tuple[float, float]:
    """Global (mean loss, accuracy) from each rank's summed loss, correct predictions and sample count.

    Sums are all-reduced, then divided: averaging per-rank means would weight a small shard as
    much as a large one. Without a process group the local values are used.
    """
    stats = torch.tensor([float(loss_sum), float(correct), float(count)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        stats = stats.to(rank_device())  # NCCL reduces GPU tensors only
        dist.all_reduce(stats)
    loss_sum, correct, count = stats.tolist()
    if count <= 0:
        raise ValueError("all_reduce_metrics: no samples on any rank")
    return loss_sum / count, correct / count
