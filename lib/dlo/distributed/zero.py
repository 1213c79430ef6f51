"""ZeRO-DP from scratch: the three stages side by side (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020), and the memory accountant.

Data parallelism keeps on every rank the whole *model state*: parameters, gradients and the
optimizer state, 2 + 2 + K bytes per parameter under mixed-precision Adam (K = 12: an fp32 master
copy and two fp32 moments; Sec. 3.1). ZeRO-DP removes the redundancy by partitioning it over the
N ranks (Sec. 5), while every rank still runs the whole model on its own micro-batch:

- `ZeRO1` (P_os, Sec. 5.1): each rank keeps, and updates, only its 1/N of the optimizer state.
  After backward the gradients are reduce-scattered (rank r receives the averaged slice r), each
  rank steps its slice, and an all-gather brings every rank the updated parameters. Memory
  (2 + 2) Psi + K Psi / N; communication Psi + Psi = 2 Psi, as DDP's all-reduce (Sec. 7.2.1). Here
  in its naive form: one blocking reduce-scatter after backward, full gradients held meanwhile.
- `ZeRO2` (P_os+g, Sec. 5.2): gradients are reduce-scattered in buckets *during* backward
  (bucketization, Sec. 5.2), asynchronously, and a bucket's full gradients are freed as soon as
  its reduce-scatter is done: only the 1/N gradient shard stays. Memory 2 Psi + (2 + K) Psi / N;
  still 2 Psi of communication.
- `ZeRO3` (P_os+g+p, Sec. 5.3): parameters are partitioned too. Each unit (a transformer block)
  all-gathers its parameters just before its forward and frees them after it; backward gathers
  them again before the unit's backward and reduce-scatters the gradients after it. Memory
  (2 + 2 + K) Psi / N, communication Psi (forward) + Psi (backward) + Psi (gradients) = 3 Psi, the
  1.5x of Sec. 7.2.2. `reshard_after_forward=False` keeps the gathered parameters from forward to
  backward (2 Psi of communication, more memory); `prefetch=True` starts the next unit's
  all-gather before the current unit runs (the overlap of Sec. 7.2.2 / FSDP's prefetching).

The engines are full precision (parameters, gradients and optimizer state in the model's dtype);
`memory_per_rank` accounts for the mixed-precision case as well. Usage, on every rank:

    engine = ZeRO3(model, torch.optim.AdamW, units=list(model.layers.values()), lr=1e-3)
    loss = loss_fn(engine(x), y); loss.backward(); engine.step(); engine.zero_grad()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dlo.accounting import model_state_bytes, precision_of
from dlo.distributed.ddp import grad_ready_hook
from dlo.distributed.zero_comms import FlatBuffer, all_gather, reduce_scatter

# ----------------------------------------------------------------------------- the memory accountant

def memory_per_rank(n_params: int, world_size: int, stage: int, *, param_dtype: torch.dtype = torch.bfloat16,
                    optimizer: str = "adamw") -> dict:
    """Bytes of model state per rank: {"params", "grads", "optimizer", "total"} (Sec. 3.1 and 5).

    stage 0 is DDP (everything replicated); stages 1/2/3 partition the optimizer state, then the
    gradients, then the parameters, each partition being S = ceil(n_params / world_size) elements.
    Parameters and gradients are stored in `param_dtype`. A 16-bit `param_dtype` means mixed
    precision: the optimizer also keeps an fp32 master copy, and its moments are fp32 (K = 4 + 4 m
    bytes, 12 for Adam); in 32- or 64-bit training there is no master copy and the moments have the
    parameters' dtype (K = m x its size). `dlo.accounting.model_state_bytes` at `precision_of(param_dtype)`.
    """
    return model_state_bytes(n_params, optimizer, precision_of(param_dtype), world_size=world_size, stage=stage)


# ----------------------------------------------------------------------------- shared machinery

class _Group:
    """Parameters partitioned together (ZeRO-1: all, ZeRO-2: a bucket, ZeRO-3: a unit): their flat
    buffer, this rank's shard of it as the optimizer's parameter, and the gradients arriving."""

    def __init__(self, params: list, rank: int, world_size: int, keep_full: bool = True):
        self.params = params
        self.slot = {p: i for i, p in enumerate(params)}  # tensors hash by identity
        self.flat = FlatBuffer(params, world_size)  # the parameters are views of flat.data from now on
        if keep_full:  # ZeRO-1/2: the optimizer steps a view of the replicated buffer, in place
            self.shard = nn.Parameter(self.flat.shard(rank))
        else:  # ZeRO-3: the shard is the only lasting copy; the flat buffer is freed until needed
            self.shard = nn.Parameter(self.flat.shard(rank).clone())
            self.flat.free()
        self.grads: FlatBuffer | None = None  # full gradients of this group, while they are reduced
        self.ready: set = set()
        self.gather_handle = None


class _Sharded(nn.Module):
    """The wrapper every stage shares: rank 0's weights everywhere, forward, zero_grad, and the
    reduce-scatter of a group's gradients once they are all there (one reduction in flight)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: no process group; run inside dlo.distributed.launch")
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in module.parameters() if p.requires_grad]  # a tied weight once
        if not self.params:
            raise ValueError(f"{type(self).__name__}: the module has no trainable parameters")
        with torch.no_grad():
            for t in [*self.params, *module.buffers()]:
                dist.broadcast(t.data, 0)  # all replicas start equal, as in DDP
        self.groups: list[_Group] = []
        self.group_of: dict = {}
        self.pending = None  # (group, reduced shard, handle) of the reduce-scatter in flight

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _hook_gradients(self) -> None:
        for p in self.params:
            p.register_post_accumulate_grad_hook(grad_ready_hook(self._grad_ready))  # held weakly: no leak

    def _grad_ready(self, p: nn.Parameter) -> None:
        """p.grad is final for this backward: copy it into its group's flat gradient and drop it."""
        group = self.group_of[p]
        if self.pending is not None and self.pending[0] is group:
            # the previous backward's reduce-scatter of this group is still in flight (gradient
            # accumulation: a second backward before step): land it before a new gradient arrives
            self._finish()
        if group.grads is None:
            group.grads = FlatBuffer(group.params, self.world_size, bind=False)
        group.grads.view(group.slot[p]).add_(p.grad)
        p.grad = None
        group.ready.add(p)
        if len(group.ready) == len(group.params):
            self._reduce(group)

    def _reduce(self, group: _Group) -> None:
        self._finish()  # at most one reduction in flight: two groups of full gradients at most
        out = torch.empty(group.flat.shard_numel, dtype=group.grads.data.dtype, device=group.grads.data.device)
        self.pending = (group, out, reduce_scatter(out, group.grads.data, async_op=True))

    def _finish(self) -> None:
        if self.pending is None:
            return
        group, out, handle = self.pending
        handle.wait()
        out.div_(self.world_size)  # the mean over ranks: one process on the whole batch
        group.shard.grad = out if group.shard.grad is None else group.shard.grad.add_(out)
        group.grads, group.ready, self.pending = None, set(), None
        self._after_reduce(group)

    def _after_reduce(self, group: _Group) -> None:
        """What a stage does once a group's gradient shard is ready (ZeRO-3 frees the parameters)."""

    def reduce_gradients(self) -> None:
        """Every group's gradient shard final (the mean over ranks) before `step`; `step` calls it."""
        self._flush()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that the norm of the *whole* gradient is at most `max_norm`, as
        torch.nn.utils.clip_grad_norm_ does in one process; returns that norm. No rank holds the whole
        gradient, so each sums the squares of its own shards and one all-reduce of a scalar adds them
        (the padding of the flat buffers is zero). Clipping each shard by its own norm would scale each
        rank's slice by a different factor: a different update from one process on the whole batch."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.reduce_gradients()
        shards = [g.shard.grad for g in self.groups if g.shard.grad is not None]
        sq = sum((s.double().pow(2).sum() for s in shards), torch.zeros((), dtype=torch.float64))
        dist.all_reduce(sq)  # one scalar: 8 bytes per rank, whatever the model's size
        norm = sq.sqrt()
        coef = min(1.0, max_norm / (float(norm) + 1e-6))  # torch's rule, eps included
        for s in shards:
            s.mul_(coef)
        return norm

    def _flush(self) -> None:
        """Before the step: reduce groups that only some parameters reached (unused ones: zeros)."""
        for group in self.groups:
            if group.ready and len(group.ready) < len(group.params):
                self._reduce(group)
        self._finish()


# ----------------------------------------------------------------------------- ZeRO-1

class ZeRO1(_Sharded):
    """Optimizer-state partitioning, naive: full gradients until one reduce-scatter after backward
    (Sec. 5.1). `step()` reduce-scatters, steps this rank's 1/N, all-gathers the parameters."""

    def __init__(self, module: nn.Module, optimizer_cls=torch.optim.AdamW, **optimizer_kwargs):
        super().__init__(module)
        group = _Group(self.params, self.rank, self.world_size)
        self.groups = [group]
        self.grads = FlatBuffer(self.params, self.world_size, bind=False)  # (N*S,) full gradients
        for i, p in enumerate(self.params):
            p.grad = self.grads.view(i)  # backward accumulates in place into the flat buffer
        self.optimizer = optimizer_cls([group.shard], **optimizer_kwargs)

    def reduce_gradients(self) -> None:
        group = self.groups[0]
        if group.shard.grad is not None:  # already reduced this step (clip_grad_norm_ before step)
            return
        out = torch.empty_like(group.shard)
        reduce_scatter(out, self.grads.data)  # Psi in, the summed slice r out
        own = self.grads.shard(self.rank)
        own.copy_(out.div_(self.world_size))  # the mean, kept in this rank's slice of the gradient buffer
        group.shard.grad = own

    def step(self) -> None:
        group = self.groups[0]
        self.reduce_gradients()
        self.optimizer.step()
        all_gather(group.flat.data, group.shard.detach().clone())  # Psi: every rank the new weights

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.data.zero_()  # in place: the parameters' .grad are views of it
        self.groups[0].shard.grad = None


# ----------------------------------------------------------------------------- ZeRO-2

class ZeRO2(_Sharded):
    """Optimizer state and gradients partitioned; gradients reduce-scattered bucket by bucket from
    gradient hooks during backward, asynchronously (Sec. 5.2). Buckets of about `bucket_cap_mb`
    MiB are filled in reverse parameter order, the order backward produces gradients in."""

    def __init__(self, module: nn.Module, optimizer_cls=torch.optim.AdamW, *, bucket_cap_mb: float = 25.0,
                 **optimizer_kwargs):
        super().__init__(module)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        cap, current, size = bucket_cap_mb * 2 ** 20, [], 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:  # torch DDP's rule: a bucket is full once it reaches the cap
                self.groups.append(_Group(current, self.rank, self.world_size))
                current, size = [], 0
        if current:
            self.groups.append(_Group(current, self.rank, self.world_size))
        self.group_of = {p: g for g in self.groups for p in g.params}
        self._hook_gradients()
        self.optimizer = optimizer_cls([g.shard for g in self.groups], **optimizer_kwargs)

    def step(self) -> None:
        self.reduce_gradients()
        self.optimizer.step()
        handles = [all_gather(g.flat.data, g.shard.detach().clone(), async_op=True) for g in self.groups]
        for h in handles:
            h.wait()


# ----------------------------------------------------------------------------- ZeRO-3

class ZeRO3(_Sharded):
    """Everything partitioned (Sec. 5.3). `units` are submodules (transformer blocks), each
    gathered just before it runs and freed after; parameters outside every unit, and weights
    shared by two units (a tied embedding), form the root unit, gathered for the whole forward
    and again for the whole backward."""

    def __init__(self, module: nn.Module, optimizer_cls=torch.optim.AdamW, *, units=(),
                 reshard_after_forward: bool = True, prefetch: bool = False, **optimizer_kwargs):
        super().__init__(module)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        units = list(units)
        seen: dict = {}
        for u in units:
            for p in u.parameters():
                seen.setdefault(p, []).append(u)
        owned = {u: [p for p in self.params if seen.get(p) == [u]] for u in units}
        rest = [p for p in self.params if len(seen.get(p, [])) != 1]  # outside units, or shared
        self.units = [(u, _Group(owned[u], self.rank, self.world_size, keep_full=False)) for u in units if owned[u]]
        if rest:
            self.units.insert(0, (module, _Group(rest, self.rank, self.world_size, keep_full=False)))
        self.groups = [g for _, g in self.units]
        self.group_of = {p: g for g in self.groups for p in g.params}
        self.order: list[_Group] = []  # units in forward order, learnt in the first forward (prefetch)
        for u, g in self.units:
            u.register_forward_pre_hook(lambda m, args, g=g: self._pre_forward(g))
            u.register_forward_hook(lambda m, args, out, g=g: self._post_forward(g, out))
        self._hook_gradients()
        self.optimizer = optimizer_cls([g.shard for g in self.groups], **optimizer_kwargs)

    def _gather(self, group: _Group, async_op: bool = False) -> None:
        """Start the all-gather of a unit's parameters into its flat buffer (no-op if there)."""
        if group.flat.allocated:
            return
        group.flat.alloc()
        group.gather_handle = all_gather(group.flat.data, group.shard.detach(), async_op=True)
        if not async_op:
            self._wait(group)

    def _wait(self, group: _Group) -> None:
        if group.gather_handle is not None:
            group.gather_handle.wait()
            group.gather_handle = None

    def _neighbour(self, group: _Group, step: int) -> _Group | None:
        if group not in self.order:
            return None
        i = self.order.index(group) + step
        return self.order[i] if 0 <= i < len(self.order) and self.order[i] is not self.groups[0] else None

    def _pre_forward(self, group: _Group) -> None:
        if torch.is_grad_enabled() and group not in self.order:
            self.order.append(group)
        self._gather(group)
        self._wait(group)
        nxt = self._neighbour(group, +1) if self.prefetch else None
        if nxt is not None:
            self._gather(nxt, async_op=True)

    def _post_forward(self, group: _Group, out) -> None:
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard_after_forward or not tensors:
            group.flat.free()  # 1/N stays: the parameters' views now point at zero bytes
        if tensors:  # backward reaches this unit when the gradient of its output is computed
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(group),
                                                          mode="any")

    def _pre_backward(self, group: _Group) -> None:
        self._gather(group)
        self._wait(group)
        prev = self._neighbour(group, -1) if self.prefetch else None
        if prev is not None:
            self._gather(prev, async_op=True)

    def _after_reduce(self, group: _Group) -> None:
        self._wait(group)
        group.flat.free()  # its gradients are reduced: backward needs these parameters no more

    def step(self) -> None:
        self.reduce_gradients()
        self.optimizer.step()  # on the shards only: the next forward gathers the new values


__all__ = ["memory_per_rank", "ZeRO1", "ZeRO2", "ZeRO3"]
