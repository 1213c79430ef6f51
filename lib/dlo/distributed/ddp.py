"""Data parallelism from scratch, two versions side by side (after picotron's data_parallel.py).

Both follow Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020: every rank holds a full replica, starts from the same weights (a broadcast from rank 0,
Sec. 3.1), runs forward and backward on its own shard of the global batch, and the gradients are
averaged by all-reduce before the (identical) optimizer step, so the replicas never drift apart.

- `DataParallelNaive`: one blocking all-reduce per parameter after backward. Correct, but many
  small messages (each pays the latency alpha) and no overlap: the network idles during backward
  and the GPU idles during communication.
- `DataParallelBucket`: gradients are copied into ~25 MB buckets (Sec. 3.2.3, the default chosen
  empirically in the paper) filled in reverse parameter order, roughly the order backward produces
  them; as soon as a bucket is full its all-reduce is launched asynchronously, so communication
  overlaps the rest of backward (Sec. 3.2.3, Fig. 2). `finish_gradient_synchronization()` waits
  for the outstanding handles before the optimizer step. Afterwards every .grad is a view of its
  bucket (torch's gradient_as_bucket_view), which saves the copy back and, with
  zero_grad(set_to_none=False), the copy in as well. `overlap=False` keeps the buckets but launches
  them all after backward: the baseline that measures what the overlap hides (Day 4's exposed time).

Both offer `no_sync()` (Sec. 3.2.4): inside it backward only accumulates local gradients, and the
first backward outside it all-reduces the sum, so k micro-batches cost one all-reduce.
Usage: `model = DataParallelBucket(net); loss.backward(); model.finish_gradient_synchronization();
opt.step()`.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn


def grad_ready_hook(method):
    """`method` (an engine's bound method) as a post-accumulate-grad hook that holds the engine weakly.
    A parameter keeps such hooks on torch's C++ side, where Python's collector does not look: a hook bound
    to the engine that holds the parameter is a cycle the collector never breaks, and the engine (its
    buckets, flat buffers, optimizer state) would live as long as the process - on a GPU, one more model
    state per engine an experiment builds. Once the engine is gone the hook does nothing."""
    engine = weakref.WeakMethod(method)

    def hook(p):
        bound = engine()
        if bound is not None:
            bound(p)
    return hook


def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy rank src's parameters and buffers to every rank, so that all replicas start equal."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src)


def all_reduce_gradients(module: nn.Module) -> None:
    """Replace every .grad by its mean over the ranks: one blocking all-reduce per tensor."""
    world_size = dist.get_world_size()
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


class _DataParallel(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: no process group; run inside dlo.distributed.launch")
        self.module = module
        self.require_backward_grad_sync = True  # torch DDP's name for the flag no_sync clears
        broadcast_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients (gradient accumulation)."""
        prev, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = prev


class DataParallelNaive(_DataParallel):
    """All-reduce every gradient, one blocking call per parameter, after backward (Li et al. 2020, Sec. 3.1)."""

    def finish_gradient_synchronization(self) -> None:
        if self.require_backward_grad_sync:
            all_reduce_gradients(self.module)


class _Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they are copied into."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets, total = {}, 0
        for p in params:
            self.offsets[p] = total
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)  # (numel,)
        self.ready: set = set()
        self.handle = None

    def view(self, p: nn.Parameter) -> torch.Tensor:
        return self.buffer[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)


class DataParallelBucket(_DataParallel):
    """Bucketed gradients with async all-reduce overlapping backward (Li et al. 2020, Sec. 3.2.3)."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True):
        super().__init__(module)
        self.overlap = overlap  # False: the same buckets, all launched after backward (the no-overlap baseline)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.world_size = dist.get_world_size()
        cap = bucket_cap_mb * 2 ** 20
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, current, size = [], [], 0
        for p in reversed(params):  # backward meets the last layers first
            if current and p.dtype != current[0].dtype:  # one flat buffer holds one dtype
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:  # torch's Reducer rule: a bucket is full once it reaches the cap
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in params:
            p.register_post_accumulate_grad_hook(grad_ready_hook(self._grad_ready))

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Runs when p.grad is complete in this backward: copy it in, launch the bucket when full."""
        if not self.require_backward_grad_sync:
            return
        bucket = self.bucket_of[p]
        view = bucket.view(p)
        if p.grad.data_ptr() != view.data_ptr():  # after the first step .grad already is the view
            view.copy_(p.grad)
        bucket.ready.add(p)
        if self.overlap and len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.div_(self.world_size)  # average = sum of (g / N): pre-divide, as torch DDP does
        bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back to .grad."""
        if not self.require_backward_grad_sync:
            return
        for bucket in self.buckets:  # overlap=False: every bucket starts here, after backward
            if bucket.handle is None:  # some parameter got no gradient: send zeros for it, in order
                for p in bucket.params:
                    if p not in bucket.ready:
                        bucket.view(p).zero_()
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            for p in bucket.params:
                # .grad becomes a view of the bucket (torch DDP's gradient_as_bucket_view): no copy
                # back now, and with zero_grad(set_to_none=False) backward accumulates straight
                # into the bucket, so the copy in the hook disappears too
                p.grad = bucket.view(p)
            bucket.handle, bucket.ready = None, set()
