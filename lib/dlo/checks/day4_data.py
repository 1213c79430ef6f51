"""Autograder checks for Day 4's exercise 5 (the sharding sampler and metric sync), part of `dlo.checks.day4`.

The sampler needs no communication and runs in the grading process; the metrics run on `world_size` fresh
ranks (`dlo.grading.api.on_ranks`, gloo), each given only its own sums. The exercise specifies one answer:
the strided slice perm[rank::world_size] of torch.randperm(n) seeded by seed + epoch, as Python ints; the
metrics as a tuple of two Python floats, from an all-reduce that took in each rank's own sums (copied as it ran,
`dlo.checks.day7_comms.CommTap`), the ranks' sockets agreeing (`verify_wire`).
"""

from __future__ import annotations

import random

import torch

from dlo.checks.day7_comms import CommTap
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import ok

SAMPLERS = ("dlo.distributed.data.shard_indices", "dlo.distributed.data.ShardSampler",
            "torch.utils.data.DistributedSampler")


@check(forbid=SAMPLERS)
def check_shard_indices(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(n, rank, world_size, seed=0, epoch=0) -> list of indices`: shards disjoint, covering range(n)
    exactly once, sizes within one, the same on every call, reshuffled when the epoch changes. Runs
    in one process (it needs no communication)."""
    name, rng = "shard_indices", random.Random(case_seed(seed))
    for _ in range(trials):
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
        if [_ints(fn(n, r, w, seed=s, epoch=e)) for r in range(w)] != [_ints(sh) for sh in shards]:
            raise AssertionError(f"{name}: two calls with the same arguments gave different shards; draw the "
                                 f"permutation from a generator seeded with seed and epoch ({where})")
        # every rank's shard at once (the whole permutation): rank 0's alone is the same in two epochs of a right
        # answer in ~1.5% of submissions (a false negative, 2026-12-02); the whole, once in n! >= 3.6M at n >= 10
        if n >= 10 and [_ints(fn(n, r, w, seed=s, epoch=e + 1)) for r in range(w)] == [_ints(sh) for sh in shards]:
            raise AssertionError(f"{name}: epoch {e + 1} gives the same shards as epoch {e} on every rank: reshuffle "
                                 f"per epoch (seed the generator with seed + epoch) ({where})")
        _same_shards(name, shards, n, w, s, e, where)
    ok(name, f"{trials} trials, seed={seed}")


def _ints(indices) -> list[int]:
    return [int(i) for i in indices]


def _same_shards(name: str, shards: list, n: int, w: int, seed: int, epoch: int, where: str) -> None:
    """The one right answer the exercise specifies: a list of Python ints, the strided slice perm[rank::w] of
    torch.randperm(n) drawn from torch.Generator().manual_seed(seed + epoch)."""
    bad = next((sh for sh in shards if type(sh) is not list or any(type(i) is not int for i in sh)), None)
    if bad is not None:
        kind = type(bad).__name__ if type(bad) is not list else f"a list holding {type(bad[0]).__name__}"
        raise AssertionError(f"{name}: return a list of Python ints (e.g. tensor.tolist()), got {kind} ({where})")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if shards == [perm[r::w] for r in range(w)]:
        return
    blocks = [i for sh in shards for i in sh] == perm  # contiguous blocks of the permutation, in rank order
    if blocks or sorted(map(sorted, shards)) == sorted(sorted(perm[r::w]) for r in range(w)):
        raise AssertionError(f"{name}: the shards are not the strided slices of the permutation: rank r takes "
                             f"perm[r::world_size] (every world_size-th index from position r), not a contiguous "
                             f"block nor another order ({where})")
    raise AssertionError(f"{name}: not the exercise's permutation: draw it as torch.randperm(n, generator="
                         f"torch.Generator().manual_seed(seed + epoch)) and take perm[rank::world_size] ({where})")


def _metrics_case(seed: int, w: int):
    counts = [random.Random(seed * 31 + k).randint(1, 40) for k in range(w)]  # unequal shards
    losses = [random.Random(seed * 31 + k).uniform(0.5, 3.0) * counts[k] for k in range(w)]
    corrects = [random.Random(seed * 7 + k).randint(0, counts[k]) for k in range(w)]
    return counts, losses, corrects


def _metrics_worker(mine: tuple, fn):
    """`mine`: this rank's own (loss_sum, correct, count). What the call sent is counted, and what it put into each
    collective copied as it ran (`CommTap`): the right floats from a channel beside the process group (files)
    reduce nothing."""
    with CommTap() as tap:
        got = fn(*mine)
    if not isinstance(got, tuple) or len(got) != 2 or any(type(g) is not float for g in got):
        kinds = ", ".join(type(g).__name__ for g in got) if isinstance(got, (tuple, list)) else ""
        return {"bad": f"{type(got).__name__}({kinds}): {got!r}"[:200]}
    return {"got": list(got), "records": tap.records(), "inputs": tap.inputs}


def _metrics_comm(res: dict, mine: tuple, where: str) -> None:
    """One rank's messages: all-reduces only, which between them took in this rank's three sums (a 1e-6 margin:
    float32 sums are named by the comparison before)."""
    kinds = sorted({rec["kind"] for rec in res["records"]})
    if kinds != ["all_reduce"]:
        raise AssertionError(f"all_reduce_metrics: the rank made {', '.join(kinds) or 'no collective'}; the sums "
                             f"travel in dist.all_reduce of one float64 tensor (loss_sum, correct, count), not beside "
                             f"torch.distributed (a file) nor in another collective ({where})")
    sent = torch.cat([t.reshape(-1).to(torch.float64) for t in res["inputs"]])
    missing = [label for label, v in zip(("loss_sum", "correct", "count"), mine)
               if not bool(((sent - float(v)).abs() <= 1e-6 * (1 + abs(float(v)))).any())]
    if missing:
        raise AssertionError(f"all_reduce_metrics: the all-reduce did not take in this rank's {', '.join(missing)} "
                             f"(it reduced {sent.tolist()[:6]}); all-reduce the rank's own sums, "
                             f"torch.tensor([loss_sum, correct, count], dtype=torch.float64), then divide ({where})")


@check(forbid=("dlo.distributed.data.all_reduce_metrics",))
def check_all_reduce_metrics(fn, seed: int = 0, world_size: int = 2) -> None:
    """`fn(loss_sum, correct, count) -> (mean_loss, accuracy)` over all ranks, with unequal shard sizes."""
    counts, losses, corrects = _metrics_case(case_seed(seed), world_size)  # a secret seed when graded
    got = on_ranks(_metrics_worker, world_size, fn, per_rank=list(zip(losses, corrects, counts)))
    want = (sum(losses) / sum(counts), sum(corrects) / sum(counts))
    for r, res in enumerate(got):
        where = f"world_size={world_size}, counts={counts}, rank {r}"
        if "bad" in res:
            raise AssertionError(f"all_reduce_metrics: return a tuple of two Python floats (mean_loss, accuracy) "
                                 f"(e.g. from tensor.tolist()), got {res['bad']} ({where})")
        for label, g, wnt in zip(("mean loss", "accuracy"), res["got"], want):
            if abs(g - wnt) > 1e-9 * (1 + abs(wnt)):
                if abs(g - wnt) <= 1e-6 * (1 + abs(wnt)):  # right sums, rounded to fp32 (torch.tensor's default)
                    raise AssertionError(f"all_reduce_metrics: {label} {g!r}, expected {wnt!r}: off by float32 "
                                         f"rounding; reduce the sums in a float64 tensor (torch.tensor(..., "
                                         f"dtype=torch.float64)), compared within 1e-9 ({where})")
                raise AssertionError(f"all_reduce_metrics: {label} {g:.6g}, expected {wnt:.6g}: all-reduce the sums "
                                     f"and the counts, then divide (a mean of per-rank means weights small shards "
                                     f"too much) ({where})")
    for r, (res, mine) in enumerate(zip(got, zip(losses, corrects, counts))):  # the right numbers; then how
        _metrics_comm(res, mine, f"world_size={world_size}, counts={counts}, rank {r}")
    verify_wire("all_reduce_metrics", [res["records"] for res in got], world_size, f"world_size={world_size}")
    ok("all_reduce_metrics", f"{world_size} ranks, seed={seed}")
