"""What the ZeRO engines (`dlo.distributed.zero`) share: flat padded buffers and their two collectives.

ZeRO partitions the model states of data parallelism into N equal contiguous parts, one per rank
(Rajbhandari et al. 2020, Sec. 5). A `FlatBuffer` lays a list of tensors end to end in one buffer
padded to a multiple of N, so that rank r owns the slice [r S, (r+1) S) with S = ceil(numel / N):
sizes that do not divide by N are padded, never dropped. Two collectives move such buffers:

- `reduce_scatter(shard, full)`: every rank contributes a full buffer, rank r receives the sum of
  slice r (the gradient step of ZeRO-1/2/3: Psi elements in, Psi/N out);
- `all_gather(full, shard)`: every rank contributes its slice, every rank receives the whole
  buffer (parameters after ZeRO-1/2's step, and before each use in ZeRO-3).

An all-reduce is exactly a reduce-scatter followed by an all-gather (Day 4), which is why ZeRO-1/2
communicate as much as DDP: 2 Psi (Sec. 7.2.1). Both helpers call torch's single-tensor
collectives, named `reduce_scatter_single` / `all_gather_single` from torch 2.13 on
(`reduce_scatter_tensor` / `all_gather_into_tensor` before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlo.accounting import shard_numel  # the accountant's partition: the buffers hold what it counts
from dlo.distributed.collectives import all_gather_single, reduce_scatter_single


def all_gather(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """full (N*S,) <- the ranks' shards (S,) in rank order; a Work handle when async_op."""
    return all_gather_single(full, shard, group=group, async_op=async_op)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """shard (S,) <- slice r of the sum over ranks of full (N*S,); a Work handle when async_op."""
    return reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class FlatBuffer:
    """Tensors laid end to end in one flat buffer of N*S elements (zero padding at the end).

    With `bind=True` the tensors' data become views of the buffer (`p.data = view`): writing the
    buffer updates the module, which is how an all-gather of parameters lands in the model. With
    `bind=False` it is a zeroed buffer of the same layout (gradients). `free()` drops the storage
    (the views stay, pointing at zero bytes) and `alloc()` brings it back, as FSDP1 does with its
    flat parameters; tensors saved for backward are views too and see the data again once it is
    gathered back.
    """

    def __init__(self, tensors, world_size: int, *, bind: bool = True, dtype=None):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("FlatBuffer: no tensors")
        self.tensors, self.world_size = tensors, world_size
        self.numel = sum(t.numel() for t in tensors)
        self.shard_numel = shard_numel(self.numel, world_size)
        first = tensors[0]
        self.data = torch.zeros(world_size * self.shard_numel, dtype=dtype or first.dtype,
                                device=first.device)  # (N*S,)
        self.offsets, offset = [], 0
        for t in tensors:
            self.offsets.append(offset)
            offset += t.numel()
        if bind:
            with torch.no_grad():
                for i, t in enumerate(tensors):
                    view = self.view(i)
                    view.copy_(t.detach())
                    t.data = view

    def view(self, i: int) -> torch.Tensor:
        """The slot of tensor i, shaped like it."""
        t, start = self.tensors[i], self.offsets[i]
        return self.data[start:start + t.numel()].view_as(t)

    def shard(self, rank: int) -> torch.Tensor:
        """Rank's contiguous 1/N slice (S,), a view."""
        return self.data[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    @property
    def allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0

    def free(self) -> None:
        self.data.untyped_storage().resize_(0)

    def alloc(self) -> None:
        if not self.allocated:
            self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())


__all__ = ["FlatBuffer", "all_gather", "reduce_scatter", "shard_numel"]
