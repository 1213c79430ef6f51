"""Autograder checks for Day 4 (data parallelism: ring all-reduce, naive and bucketed DDP,
accumulation with no_sync, sharding sampler, metric sync).

The student's functions are shipped to `world_size` fresh ranks with `dlo.distributed.launch` (one
launch per check: starting ranks costs seconds) and compared there with torch itself: dist.all_reduce
for the ring, and for training both one process on the full batch and
torch.nn.parallel.DistributedDataParallel. Everything runs in float64, where a correct
implementation differs from the references only by summation order (~1e-15); the tolerances below
(1e-10) leave room for that and still catch a missing average or a dropped micro-batch. A failing
rank's message (or a deadlock's timeout) comes back as an AssertionError naming what to fix.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.distributed.collectives import count_calls
from dlo.distributed.launch import RankError, launch

DTYPE = torch.float64
TOL = 1e-10  # float64: correct code agrees to ~1e-15, a slip is off by >= 1e-3
TIMEOUT = 120.0  # seconds: a deadlocked ring ends here instead of hanging the notebook
POINT_TO_POINT = "build the all-reduce from dist.send/dist.recv or dist.isend/dist.irecv (point-to-point) only"
FORBIDDEN = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
             "reduce", "broadcast", "all_to_all", "all_to_all_single")


def _launch(name: str, worker, world_size: int, *args):
    try:
        return launch(worker, world_size, *args, backend="gloo", timeout=TIMEOUT)  # float64 CPU tensors
    except RankError as e:  # the rank's own message (assertion or exception) is the useful part
        raise AssertionError(f"{name}: {e}") from None
    except TimeoutError as e:
        raise AssertionError(f"{name}: the ranks did not finish ({e}). A deadlock? Every send needs a matching "
                             f"recv on the peer; blocking send/recv on all ranks at once waits forever: use "
                             f"dist.isend/dist.irecv and wait on both") from None


def _ok(name: str, what: str, seed: int) -> None:
    print(f"{name}: ok ({what}, seed={seed})")


def _close(name: str, what: str, got, want, where: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: {what} is {type(got).__name__}, expected a tensor ({where})")
    if got.shape != want.shape:
        raise AssertionError(f"{name}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} ({where})")
    err = (got.detach().to(DTYPE) - want.to(DTYPE)).abs().nan_to_num(float("inf")).max().item()
    if err > TOL * (1 + want.abs().max().item()):
        raise AssertionError(f"{name}: {what} differs from the reference by {err:.3g} ({where})")


# ----------------------------------------------------------------------------- 1. ring all-reduce

def _ring_worker(fn, seed, trials):
    r, w = dist.get_rank(), dist.get_world_size()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed * 100 + r)
    sizes = [1, w - 1 or 1, w + 1, 17, 1001] + [rng.choice([5, 33, 257]) for _ in range(trials - 5)]
    for t, n in enumerate(sizes):
        shape = (n,) if t % 2 == 0 else (1, n)
        x = torch.randn(shape, generator=gen, dtype=DTYPE)
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        with count_calls(*FORBIDDEN, forbid=POINT_TO_POINT):
            out = fn(got)
        _close("ring_all_reduce", f"the result on rank {r}", out if isinstance(out, torch.Tensor) else got, want,
               f"world_size={w}, shape={shape}; sum over ranks, in place or returned")
    return len(sizes)


def check_ring_all_reduce(fn, seed: int = 0, world_size: int = 2, trials: int = 6) -> None:
    """`fn(tensor)` sums tensor over the ranks (in place, or returns the sum) with point-to-point
    messages only; compared with dist.all_reduce on random float64 tensors of odd sizes, some smaller
    than the world size."""
    _launch("ring_all_reduce", _ring_worker, world_size, fn, seed, max(trials, 5))
    _ok("ring_all_reduce", f"{max(trials, 5)} sizes on {world_size} ranks", seed)


# ----------------------------------------------------------------------------- training helpers

def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)


def _batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(n, 7, generator=g, dtype=DTYPE), torch.randint(0, 3, (n,), generator=g)


def _optimizer(model, seed):
    return torch.optim.SGD(model.parameters(), lr=0.2 + 0.05 * (seed % 3), momentum=0.9)


def _single_process(seed, steps, n):
    """The target: one process, the whole global batch, mean loss, same optimizer, rank 0's start."""
    net = _net(seed + 1)
    opt = _optimizer(net, seed)
    for s in range(steps):
        x, y = _batch(seed, s, n)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _torch_ddp(seed, steps, n, micro=1):
    r, w = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(_net(seed + 1 + r))  # broadcasts rank 0's weights
    opt = _optimizer(model, seed)
    for s in range(steps):
        x, y = _batch(seed, s, n)
        xs, ys = x[r::w], y[r::w]
        for i, (xm, ym) in enumerate(zip(xs.tensor_split(micro), ys.tensor_split(micro))):
            ctx = model.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                (F.cross_entropy(model(xm), ym) * len(ym) / len(ys)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _references(seed, steps, n, micro=1) -> dict:
    """The parameters both references end with; collective (torch DDP), so every rank must call it."""
    return {"one process on the full batch": _single_process(seed, steps, n),
            "torch DistributedDataParallel": _torch_ddp(seed, steps, n, micro)}


def _compare_params(name, got, refs, steps, where):
    for label, want in refs.items():
        for i, (g, wnt) in enumerate(zip(got, want)):
            _close(name, f"parameter {i} after {steps} steps vs {label}", g, wnt, where)


# ----------------------------------------------------------------------------- 2. naive DDP

def _naive_worker(broadcast_parameters, all_reduce_gradients, seed, steps):
    r, w = dist.get_rank(), dist.get_world_size()
    per_rank = random.Random(seed).choice([3, 5, 7])
    n, where = per_rank * w, f"world_size={w}, {per_rank} samples per rank"
    net = _net(seed + 1 + r)  # each rank starts from its own random weights
    broadcast_parameters(net)
    start = [p.detach().clone() for p in _net(seed + 1).parameters()]
    for i, (p, want) in enumerate(zip(net.parameters(), start)):
        _close("broadcast_parameters", f"parameter {i} on rank {r} (must equal rank 0's)", p.detach(), want, where)
    opt = _optimizer(net, seed)
    for s in range(steps):
        x, y = _batch(seed, s, n)
        F.cross_entropy(net(x[r::w]), y[r::w]).backward()
        all_reduce_gradients(net)
        if s == 0:
            ref = _net(seed + 1)
            F.cross_entropy(ref(x), y).backward()
            for i, (p, q) in enumerate(zip(net.parameters(), ref.parameters())):
                _close("all_reduce_gradients", f"grad of parameter {i} on rank {r} after step 1 (the mean over "
                       f"ranks, not the sum)", p.grad, q.grad, where)
        opt.step()
        opt.zero_grad()
    _compare_params("naive DDP", [p.detach() for p in net.parameters()], _references(seed, steps, n), steps, where)


def check_naive_ddp(broadcast_parameters, all_reduce_gradients, seed: int = 0, world_size: int = 2,
                    steps: int = 3) -> None:
    """`broadcast_parameters(module)` (rank 0's weights everywhere) and `all_reduce_gradients(module)`
    (every .grad becomes the mean over ranks): trained on shards of a batch, the parameters must equal
    one process on the whole batch and torch DDP."""
    _launch("naive DDP", _naive_worker, world_size, broadcast_parameters, all_reduce_gradients, seed, steps)
    _ok("naive_ddp", f"{steps} steps on {world_size} ranks", seed)


# ----------------------------------------------------------------------------- 3. bucketed DDP

def _bucket_worker(cls, seed, steps):
    r, w = dist.get_rank(), dist.get_world_size()
    per_rank = random.Random(seed).choice([3, 5, 7])
    n, where = per_rank * w, f"world_size={w}, {per_rank} samples per rank"
    n_params = len(list(_net(0).parameters()))
    refs = _references(seed, steps, n)  # the same for both caps
    # 50 doubles: several buckets whether a bucket closes before exceeding the cap or once it reaches
    # it (torch's rule); then the 25 MB default, where the whole model is one bucket
    for cap_mb in (50 * 8 / 2 ** 20, 25.0):
        model = cls(_net(seed + 1 + r), bucket_cap_mb=cap_mb)
        opt = _optimizer(model, seed)
        here = f"{where}, bucket_cap_mb={cap_mb:.3g}"
        for s in range(steps):
            x, y = _batch(seed, s, n)
            loss = F.cross_entropy(model(x[r::w]), y[r::w])
            with count_calls("all_reduce") as rec:
                rec.phase = "backward"
                loss.backward()
                rec.phase = "after backward"
                model.finish_gradient_synchronization()
            calls = [(c.name, c.async_op, c.phase == "backward") for c in rec.calls]
            if not all(is_async and during for _, is_async, during in calls):
                raise AssertionError(f"bucket DDP: every bucket's all-reduce must be launched with async_op=True "
                                     f"from the gradient hooks, during backward (calls as (name, async, during "
                                     f"backward): {calls}) ({here})")
            if cap_mb == 25.0 and len(calls) != 1:
                raise AssertionError(f"bucket DDP: {len(calls)} all-reduce calls per step with bucket_cap_mb=25 "
                                     f"(the whole model fits one bucket: expected 1) ({here})")
            if cap_mb < 1 and not 2 <= len(calls) < n_params:
                raise AssertionError(f"bucket DDP: {len(calls)} all-reduce calls per step for {n_params} parameters "
                                     f"with a 50-element cap: expected several buckets, fewer than one per "
                                     f"parameter ({here})")
            opt.step()
            opt.zero_grad()
        _compare_params("bucket DDP", [p.detach() for p in model.parameters()], refs, steps, here)


def check_bucket_ddp(cls, seed: int = 0, world_size: int = 2, steps: int = 3) -> None:
    """`cls(module, bucket_cap_mb)` with `finish_gradient_synchronization()`: several buckets at a tiny
    cap and one at 25 MB, each launched async during backward; parameters must equal one process on
    the whole batch and torch DDP."""
    _launch("bucket DDP", _bucket_worker, world_size, cls, seed, steps)
    _ok("bucket_ddp", f"{steps} steps x 2 bucket sizes on {world_size} ranks", seed)


# ----------------------------------------------------------------------------- 4. accumulation

def _accum_worker(fn, seed, steps):
    from dlo.distributed.ddp import DataParallelBucket

    r, w = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    per_rank, micro = rng.choice([(7, 2), (9, 4), (11, 3), (7, 3), (9, 2)])  # never divisible: unequal chunks
    n, where = per_rank * w, f"world_size={w}, {per_rank} samples per rank in {micro} micro-batches"
    model = DataParallelBucket(_net(seed + 1 + r), bucket_cap_mb=50 * 8 / 2 ** 20)  # 2 buckets
    opt = _optimizer(model, seed)
    for s in range(steps):
        x, y = _batch(seed, s, n)
        xs, ys = list(x[r::w].tensor_split(micro)), list(y[r::w].tensor_split(micro))  # unequal sizes
        with count_calls("all_reduce") as rec:
            fn(model, opt, F.cross_entropy, xs, ys)
        if len(rec.calls) != len(model.buckets):
            raise AssertionError(f"accumulation_step: {len(rec.calls)} all-reduce calls for {micro} micro-batches; "
                                 f"expected {len(model.buckets)} (one per bucket, only on the last micro-batch: "
                                 f"wrap the others in model.no_sync()) ({where})")
        if any(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters()):
            raise AssertionError(f"accumulation_step: gradients are not zero after the step; call "
                                 f"optimizer.zero_grad() after optimizer.step() ({where})")
    _compare_params("accumulation_step", [p.detach() for p in model.parameters()], _references(seed, steps, n, micro),
                    steps, where)


def check_accumulation_step(fn, seed: int = 0, world_size: int = 2, steps: int = 2) -> None:
    """`fn(model, optimizer, loss_fn, xs, ys)`: one optimizer step of a DataParallelBucket model over
    micro-batches of unequal size; one all-reduce round only, parameters equal to one process on the
    whole batch and to torch DDP with no_sync."""
    _launch("accumulation_step", _accum_worker, world_size, fn, seed, steps)
    _ok("accumulation_step", f"{steps} steps on {world_size} ranks", seed)


# ----------------------------------------------------------------------------- 5. sampler and metrics

def check_shard_indices(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(n, rank, world_size, seed=0, epoch=0) -> list of indices`: shards disjoint, covering range(n)
    exactly once, sizes within one, the same on every call, reshuffled when the epoch changes. Runs
    in this process (it needs no communication)."""
    name, rng = "shard_indices", random.Random(seed)
    for t in range(trials):
        n, w = rng.choice([1, 2, 10, 17, 33, 100]), rng.choice([2, 3, 4, 5])
        s, e = rng.randrange(1000), rng.randrange(5)
        where = f"n={n}, world_size={w}, seed={s}, epoch={e}"
        shards = [list(fn(n, r, w, seed=s, epoch=e)) for r in range(w)]
        flat = sorted(int(i) for sh in shards for i in sh)
        if len(flat) != len(set(flat)):
            raise AssertionError(f"{name}: some index is in two shards (or twice in one): ranks must not overlap; "
                                 f"shard sizes {[len(x) for x in shards]} ({where})")
        if flat != list(range(n)):
            missing = sorted(set(range(n)) - set(flat))[:5]
            raise AssertionError(f"{name}: the shards do not cover range(n): missing e.g. {missing} ({where})")
        if max(map(len, shards)) - min(map(len, shards)) > 1:
            raise AssertionError(f"{name}: shard sizes {[len(x) for x in shards]} differ by more than one ({where})")
        if [list(fn(n, r, w, seed=s, epoch=e)) for r in range(w)] != shards:
            raise AssertionError(f"{name}: two calls with the same arguments gave different shards; draw the "
                                 f"permutation from a generator seeded with seed and epoch ({where})")
        if n >= 10 and list(fn(n, 0, w, seed=s, epoch=e + 1)) == shards[0]:
            raise AssertionError(f"{name}: epoch {e + 1} gives the same shard as epoch {e}: reshuffle per epoch "
                                 f"({where})")
    _ok(name, f"{trials} trials", seed)


def _metrics_worker(fn, seed):
    r, w = dist.get_rank(), dist.get_world_size()
    counts = [random.Random(seed * 31 + k).randint(1, 40) for k in range(w)]  # unequal shards
    losses = [random.Random(seed * 31 + k).uniform(0.5, 3.0) * counts[k] for k in range(w)]
    corrects = [random.Random(seed * 7 + k).randint(0, counts[k]) for k in range(w)]
    got = fn(losses[r], corrects[r], counts[r])
    want = (sum(losses) / sum(counts), sum(corrects) / sum(counts))
    where = f"world_size={w}, counts={counts}, rank {r}"
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"all_reduce_metrics: return (mean_loss, accuracy), got {got!r} ({where})")
    for label, g, wnt in zip(("mean loss", "accuracy"), got, want):
        g = float(g)
        if abs(g - wnt) > 1e-9 * (1 + abs(wnt)):
            raise AssertionError(f"all_reduce_metrics: {label} {g:.6g}, expected {wnt:.6g}: all-reduce the sums "
                                 f"and the counts, then divide (a mean of per-rank means weights small shards too "
                                 f"much) ({where})")


def check_all_reduce_metrics(fn, seed: int = 0, world_size: int = 2) -> None:
    """`fn(loss_sum, correct, count) -> (mean_loss, accuracy)` over all ranks, with unequal shard sizes."""
    _launch("all_reduce_metrics", _metrics_worker, world_size, fn, seed)
    _ok("all_reduce_metrics", f"{world_size} ranks", seed)
