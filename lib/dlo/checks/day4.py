"""Autograder checks for Day 4 (data parallelism: ring all-reduce, naive and bucketed DDP, accumulation with
no_sync; the sharding sampler and metric sync are in `day4_data`).

The student's functions run on `world_size` fresh ranks (`dlo.grading.api.on_ranks`, gloo) in workers that
only run the student's code and return what they observed: outputs, parameters after k steps, gradients, and
the collectives counted by `dlo.measure.CommCounter`. The case is drawn here (from a secret seed when
graded: `case_seed`) and each rank is given only its own part (`per_rank`): its own inputs, its own starting
weights, its own slice of each step's batch; never the seed nor the other ranks' parts. The references are
computed here, out of the student's reach: the sum of the ranks' inputs for the ring; for training, one
process on the full batch with the same optimizer (that torch's DistributedDataParallel computes the same is
pinned by tests/distributed/test_ddp.py, so no check pays for launching its ranks). Everything runs in
float64, where a correct implementation differs from the references only by summation order (~1e-15); the
tolerance (1e-10) leaves room for that and still catches a missing average or a dropped micro-batch. While
the student's code runs, the references that would solve the exercise are off limits (every collective in
the ring, DDP in the DDP exercises).
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.checks.day4_data import check_all_reduce_metrics, check_shard_indices
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import DTYPE, assert_close, ok
from dlo.measure import CommCounter

TOL = 1e-10  # float64: correct code agrees to ~1e-15, a slip is off by >= 1e-3
POINT_TO_POINT = "build the all-reduce from dist.send/dist.recv or dist.isend/dist.irecv (point-to-point) only"
COLLECTIVES = tuple(f"torch.distributed.{n}" for n in (
    "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "reduce",
    "broadcast", "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list", "scatter",
    "gather", "gather_object", "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced")) + tuple(
    f"torch.distributed._functional_collectives.{n}" for n in (
        "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce_coalesced",
        "broadcast")) + tuple(  # torch >= 2.10's names for the single-tensor all-gather and reduce-scatter
    f"torch.distributed.{n}" for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n)) + (
    "dlo.distributed.collectives.ring_all_reduce", "dlo.distributed.collectives._exchange") + tuple(
    # the same collectives at dispatch, whatever reached them (a ProcessGroup's own methods, torch.ops.c10d):
    # every c10d collective but point-to-point and barriers, every functional one
    f"c10d::{op}*" for op in ("allreduce", "allgather", "_allgather_base", "reduce_scatter", "_reduce_scatter_base",
                              "reduce_", "broadcast", "alltoall", "gather", "scatter")) + tuple(
    f"_c10d_functional::{op}*" for op in ("all_", "reduce_scatter", "broadcast")) + (
    "_c10d_functional_autograd::*",)
DDP = ("torch.nn.parallel.DistributedDataParallel", "dlo.distributed.ddp.*")

__all__ = ["check_accumulation_step", "check_all_reduce_metrics", "check_bucket_ddp", "check_naive_ddp",
           "check_ring_all_reduce", "check_shard_indices"]


def _close(name: str, what: str, got, want, where: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: {what} is {type(got).__name__}, expected a tensor ({where})")
    assert_close(name, what, got, want, where, rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------- 1. ring all-reduce

def _ring_case(seed: int, trials: int, w: int):
    """Per trial: the shape, and every rank's input (rank r draws from its own generator)."""
    rng, gens = random.Random(seed), [torch.Generator().manual_seed(seed * 100 + r) for r in range(w)]
    sizes = [1, w - 1 or 1, w + 1, 17, 1001] + [rng.choice([5, 33, 257]) for _ in range(trials - 5)]
    shapes = [(n,) if t % 2 == 0 else (1, n) for t, n in enumerate(sizes)]
    return [(shape, [torch.randn(shape, generator=g, dtype=DTYPE) for g in gens]) for shape in shapes]


def _ring_worker(mine: list, fn):
    """`mine`: this rank's own input of each trial. Per trial: the sum, and what this rank sent to whom
    (`CommCounter`, beside the student's code; its total is checked against the rank's sockets)."""
    out = []
    for t in mine:
        got = t.clone()
        with CommCounter() as counter:
            res = fn(got)
        out.append({"sum": res if isinstance(res, torch.Tensor) else got, "to": counter.sent_by_peer(),
                    "sent": sum(counter.by_kind("sent").values()), "records": counter.records()})
    return out


@check(forbid=COLLECTIVES, hint=POINT_TO_POINT)
def check_ring_all_reduce(fn, seed: int = 0, world_size: int = 2, trials: int = 6) -> None:
    """`fn(tensor)` sums tensor over the ranks (in place, or returns the sum) with point-to-point
    messages only; compared with the sum of the ranks' inputs on random float64 tensors of odd sizes,
    some smaller than the world size. A ring: each rank sends to one neighbour only, 2(N-1) chunks of
    ceil(n/N) elements at most (`ring_sent`)."""
    trials, n = max(trials, 5), world_size
    case = _ring_case(case_seed(seed), trials, n)  # a secret seed when graded
    got = on_ranks(_ring_worker, n, fn, per_rank=[[inputs[r] for _, inputs in case] for r in range(n)])
    for t, (shape, inputs) in enumerate(case):
        want = torch.stack(inputs).sum(0)
        for r in range(n):
            _close("ring_all_reduce", f"the result on rank {r}", got[r][t]["sum"], want,
                   f"world_size={n}, shape={shape}; sum over ranks, in place or returned")
            ring_sent("ring_all_reduce", got[r][t], r, n, want.numel(), f"world_size={n}, shape={shape}")
    verify_wire("ring_all_reduce", [[rec for trial in got[r] for rec in trial["records"]] for r in range(n)], n,
                f"world_size={n}")
    ok("ring_all_reduce", f"{trials} sizes on {n} ranks, each rank sending to one neighbour, seed={seed}")


def one_neighbour(to: dict, r: int, n: int) -> bool:
    """Whether rank r of a ring of n sent (`to`: {peer: bytes}, `CommCounter.sent_by_peer`) to one neighbour
    only: (r + 1) % n, or (r - 1) % n for a ring run the other way."""
    return len(to) <= 1 and set(to) <= {(r + 1) % n, (r - 1) % n}


def ring_sent(name: str, got: dict, r: int, n: int, numel: int, where: str) -> None:
    """What a ring all-reduce sends (Patarasuk & Yuan 2009): rank r only to one neighbour ((r + 1) % N, or
    (r - 1) % N for a ring run the other way), N-1 chunks in the reduce-scatter and N-1 in the all-gather,
    a chunk ceil(n / N) elements (the padded copy: tensor_split's chunks are no larger). An exchange with every
    rank, or the whole tensor passed around the ring, sums right but is not the ring the exercise builds.
    `got`: the worker's record of one call (`to`: bytes per peer; `sent`: all bytes, every kind)."""
    to = got["to"]
    if not one_neighbour(to, r, n):
        raise AssertionError(f"{name}: rank {r} sent to ranks {sorted(to)}: in a ring each rank sends to one "
                             f"neighbour only, (rank + 1) % N, and receives from (rank - 1) % N ({where})")
    limit = 2 * (n - 1) * -(-numel // n) * torch.finfo(DTYPE).bits // 8
    if got["sent"] > limit:
        raise AssertionError(f"{name}: rank {r} sent {got['sent']:,.0f} bytes for {numel} float64 values; a "
                             f"ring sends 2(N-1) = {2 * (n - 1)} chunks of ceil(n/N) = {-(-numel // n)} values, "
                             f"{limit:,} bytes: pass one chunk per step, not the whole tensor ({where})")


# ----------------------------------------------------------------------------- training helpers

def _net(seed: int, frozen: bool = False) -> nn.Module:
    """The checks' MLP, with a buffer (as BatchNorm's running statistics: DDP broadcasts buffers too) and, when
    `frozen`, its first bias frozen (requires_grad=False: no gradient, never bucketed)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)
    net.register_buffer("running_stat", torch.randn(4, dtype=DTYPE))
    net[0].bias.requires_grad_(not frozen)
    return net


def _batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(n, 7, generator=g, dtype=DTYPE), torch.randint(0, 3, (n,), generator=g)


def _lr(seed: int) -> float:
    return 0.2 + 0.05 * (seed % 3)


def _optimizer(model, lr: float):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _buffers(model) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def _compare_buffers(name: str, got: list, want: list, where: str) -> None:
    for i, (b, wnt) in enumerate(zip(got, want)):
        if not torch.equal(b, wnt):
            raise AssertionError(f"{name}: buffer {i} differs from rank 0's: broadcast the buffers too "
                                 f"(module.buffers(), e.g. BatchNorm's running statistics), as DDP does at "
                                 f"construction ({where})")


def _single_process(seed, steps, n, frozen=False):
    """The target: one process, the whole global batch, mean loss, same optimizer, rank 0's start."""
    net = _net(seed + 1, frozen)
    opt = _optimizer(net, _lr(seed))
    for s in range(steps):
        x, y = _batch(seed, s, n)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(net)


def _compare_params(name, got, want, steps, where):
    """The student's parameters against one process on the full batch (in float64 that is what torch's
    DDP computes too: tests/distributed/test_ddp.py holds the three against each other, so no check
    pays for launching torch DDP ranks)."""
    for i, (g, wnt) in enumerate(zip(got, want)):
        _close(name, f"parameter {i} after {steps} steps vs one process on the full batch", g, wnt, where)


def _per_rank(seed: int) -> int:
    return random.Random(seed).choice([3, 5, 7])


def ddp_parts(seed: int, steps: int, per_rank: int, w: int, frozen: bool = False) -> list[dict]:
    """What rank r is given, built here on the grader's side: its own random starting weights and buffers
    (the broadcast must replace them with rank 0's), the learning rate and its own slice of each step's
    global batch; never the global batch nor the seed."""
    batches = [_batch(seed, s, per_rank * w) for s in range(steps)]
    return [{"net": _net(seed + 1 + r, frozen), "lr": _lr(seed),
             "batches": [(x[r::w].clone(), y[r::w].clone()) for x, y in batches]} for r in range(w)]


# ----------------------------------------------------------------------------- 2. naive DDP

def _naive_worker(mine: dict, broadcast_parameters, all_reduce_gradients):
    """`mine`: this rank's part (`ddp_parts`)."""
    net = mine["net"]  # each rank starts from its own random weights
    broadcast_parameters(net)
    start, buffers, grads = _params(net), _buffers(net), None
    opt = _optimizer(net, mine["lr"])
    for s, (x, y) in enumerate(mine["batches"]):
        F.cross_entropy(net(x), y).backward()
        all_reduce_gradients(net)
        if s == 0:
            grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    return {"start": start, "buffers": buffers, "grads": grads, "params": _params(net)}


@check(forbid=DDP)
def check_naive_ddp(broadcast_parameters, all_reduce_gradients, seed: int = 0, world_size: int = 2,
                    steps: int = 3) -> None:
    """`broadcast_parameters(module)` (rank 0's parameters and buffers everywhere) and
    `all_reduce_gradients(module)` (every .grad becomes the mean over ranks): trained on shards of a
    batch, the parameters must equal one process on the whole batch."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank = _per_rank(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank"
    got = on_ranks(_naive_worker, world_size, broadcast_parameters, all_reduce_gradients,
                   per_rank=ddp_parts(secret, steps, per_rank, world_size))
    start, buffers = _params(_net(secret + 1)), _buffers(_net(secret + 1))
    first = _net(secret + 1)  # the gradient of step 1 on the whole batch
    x, y = _batch(secret, 0, n)
    F.cross_entropy(first(x), y).backward()
    ref = _single_process(secret, steps, n)
    for r, g in enumerate(got):
        for i, (p, want) in enumerate(zip(g["start"], start)):
            _close("broadcast_parameters", f"parameter {i} on rank {r} (must equal rank 0's)", p, want, where)
        _compare_buffers("broadcast_parameters", g["buffers"], buffers, f"{where}, rank {r}")
        for i, (p, q) in enumerate(zip(g["grads"], first.parameters())):
            _close("all_reduce_gradients", f"grad of parameter {i} on rank {r} after step 1 (the mean over "
                   f"ranks, not the sum)", p, q.grad, where)
        _compare_params("naive DDP", g["params"], ref, steps, where)
    ok("naive_ddp", f"{steps} steps on {world_size} ranks, seed={seed}")


# ----------------------------------------------------------------------------- 3. bucketed DDP

SMALL_CAP = 50 * 8 / 2 ** 20  # 50 doubles, in MB


def _bucket_worker(mine: dict, cls, frozen: bool = False):
    """`mine`: this rank's part (`ddp_parts`). Per bucket cap: the buffers after construction, the
    all-reduces of each step as (async, during backward), and the parameters. With a frozen parameter,
    what the student's class raised is reported (to name the mistake), not raised."""
    out = []
    for cap_mb in (SMALL_CAP, 25.0):
        try:
            out.append(_bucket_run(mine, cls, cap_mb))
        except (RuntimeError, AttributeError, TypeError, KeyError) as e:
            if not frozen:
                raise
            out.append({"cap_mb": cap_mb, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def _bucket_run(mine: dict, cls, cap_mb: float) -> dict:
    model = cls(copy.deepcopy(mine["net"]), bucket_cap_mb=cap_mb)
    buffers = _buffers(model.module)  # the exercise's skeleton keeps the wrapped module there
    opt = _optimizer(model, mine["lr"])
    calls = []
    for x, y in mine["batches"]:
        loss = F.cross_entropy(model(x), y)
        with CommCounter() as rec:
            rec.phase = "backward"
            loss.backward()
            rec.phase = "after backward"
            model.finish_gradient_synchronization()
        calls.append([(c.async_op, c.phase == "backward") for c in rec.calls if c.kind == "all_reduce"])
        opt.step()
        opt.zero_grad()
    return {"cap_mb": cap_mb, "buffers": buffers, "calls": calls, "params": _params(model)}


@check(forbid=DDP)
def check_bucket_ddp(cls, seed: int = 0, world_size: int = 2, steps: int = 3, frozen: bool = False) -> None:
    """`cls(module, bucket_cap_mb)` with `finish_gradient_synchronization()`: rank 0's parameters and
    buffers broadcast; several buckets at a tiny cap and one at 25 MB, each launched async during
    backward; parameters must equal one process on the whole batch. `frozen`: one parameter has
    requires_grad=False (no gradient: it must be left out of the buckets, as torch DDP does)."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank = _per_rank(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank"
    if frozen:
        where += ", the first layer's bias frozen (requires_grad=False)"
    got = on_ranks(_bucket_worker, world_size, cls, frozen,
                   per_rank=ddp_parts(secret, steps, per_rank, world_size, frozen))
    n_params = sum(p.requires_grad for p in _net(0, frozen).parameters())
    ref, buffers = _single_process(secret, steps, n, frozen), _buffers(_net(secret + 1))  # the same for both caps
    for rank_runs in got:
        for run in rank_runs:
            cap_mb = run["cap_mb"]
            here = f"{where}, bucket_cap_mb={cap_mb:.3g}"
            if "error" in run:
                raise AssertionError(f"bucket DDP: {run['error']}; a parameter with requires_grad=False never gets "
                                     f"a gradient (and cannot take a hook): leave it out of the buckets ({here})")
            _compare_buffers("bucket DDP", run["buffers"], buffers, here)
            for step_calls in run["calls"]:
                if not all(is_async and during for is_async, during in step_calls):
                    raise AssertionError(f"bucket DDP: every bucket's all-reduce must be launched with async_op=True "
                                         f"from the gradient hooks, during backward (calls as (async, during "
                                         f"backward): {step_calls}) ({here})")
                if cap_mb == 25.0 and len(step_calls) != 1:
                    raise AssertionError(f"bucket DDP: {len(step_calls)} all-reduce calls per step with "
                                         f"bucket_cap_mb=25 (the whole model fits one bucket: expected 1) ({here})")
                if cap_mb < 1 and not 2 <= len(step_calls) < n_params:
                    raise AssertionError(f"bucket DDP: {len(step_calls)} all-reduce calls per step for {n_params} "
                                         f"parameters with a 50-element cap: expected several buckets, fewer than "
                                         f"one per parameter ({here})")
            _compare_params("bucket DDP", run["params"], ref, steps, here)
    ok("bucket_ddp", f"{steps} steps x 2 bucket sizes on {world_size} ranks, seed={seed}")


# ----------------------------------------------------------------------------- 4. accumulation

def _accum_case(seed: int):
    return random.Random(seed).choice([(7, 2), (9, 4), (11, 3), (7, 3), (9, 2)])  # never divisible: unequal chunks


def _accum_worker(mine: dict, fn, micro: int):
    """`mine`: this rank's part (`ddp_parts`). Per step: all-reduces issued, buckets, largest |grad|
    left after the step; then the parameters."""
    from dlo.distributed.ddp import DataParallelBucket

    model = DataParallelBucket(mine["net"], bucket_cap_mb=SMALL_CAP)  # 2 buckets
    opt = _optimizer(model, mine["lr"])
    steps_seen = []
    for x, y in mine["batches"]:
        xs, ys = list(x.tensor_split(micro)), list(y.tensor_split(micro))  # unequal sizes
        with CommCounter() as rec:
            res = fn(model, opt, F.cross_entropy, xs, ys)
        left = max((float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None), default=0.0)
        steps_seen.append({"all_reduces": rec.count("all_reduce"), "buckets": len(model.buckets), "grad_left": left,
                           "returned": None if res is None else f"{type(res).__name__}: {res!r}"[:100]})
    return {"steps": steps_seen, "params": _params(model)}


@check(forbid=("torch.nn.parallel.DistributedDataParallel",))
def check_accumulation_step(fn, seed: int = 0, world_size: int = 2, steps: int = 2) -> None:
    """`fn(model, optimizer, loss_fn, xs, ys)`: one optimizer step of a DataParallelBucket model over
    micro-batches of unequal size; one all-reduce round only, parameters equal to one process on the
    whole batch."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank, micro = _accum_case(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank in {micro} micro-batches"
    got = on_ranks(_accum_worker, world_size, fn, micro, per_rank=ddp_parts(secret, steps, per_rank, world_size))
    ref = _single_process(secret, steps, n)
    for g in got:
        for st in g["steps"]:
            if st["all_reduces"] != st["buckets"]:
                raise AssertionError(f"accumulation_step: {st['all_reduces']} all-reduce calls for {micro} "
                                     f"micro-batches; expected {st['buckets']} (one per bucket, only on the last "
                                     f"micro-batch: wrap the others in model.no_sync()) ({where})")
            if st["returned"] is not None:
                raise AssertionError(f"accumulation_step: returns nothing (None), its work is on the model and the "
                                     f"optimizer; it returned {st['returned']} ({where})")
            if st["grad_left"] > 0:
                raise AssertionError(f"accumulation_step: gradients are not zero after the step; call "
                                     f"optimizer.zero_grad() after optimizer.step() ({where})")
        _compare_params("accumulation_step", g["params"], ref, steps, where)
    ok("accumulation_step", f"{steps} steps on {world_size} ranks, seed={seed}")
