"""Autograder check for Day 4's exercise 1, the ring all-reduce, part of `dlo.checks.day4`.

`fn(tensor)` runs on `world_size` fresh ranks (`dlo.grading.api.on_ranks`, gloo), each given only its own
inputs; the reference, the sum of the ranks' inputs, is computed here. What each rank sends, and to whom, is
counted beside the student's code (`dlo.measure.CommCounter`) and held to a ring's bounds from above (one
neighbour, 2(N-1) chunks of ceil(n/N)) and from below (2(N-1) messages, whole chunks, 2(N-1) n values over
the ranks); the ranks' sockets confirm the count (`verify_wire`). Counts and sizes do not see contents: what each
message carries is copied as it is sent (`_Messages`) and must be what a ring's carries, a chunk summed over the
ranks it has passed (`ring_contents`). While the student's code runs, every collective is off limits:
point-to-point messages only.
"""

from __future__ import annotations

import itertools
import random

import torch
import torch.distributed as dist

from dlo.checks.day4_train import close_enough
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import DTYPE, ok
from dlo.measure import CommCounter, collective_kind, tensors_in

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

# the library's other rings and point-to-point machinery (a red team, 2026-12-02: Day 7's collective matmul,
# async_tp.matmul_reduce_scatter then all_gather_matmul with a 1x1 identity, passed the chunks round the ring)
LIBRARY_RINGS = tuple(f"dlo.distributed.{m}.*" for m in (
    "collectives", "async_tp", "context_parallel", "tp_comms", "ulysses", "expert_parallel", "pipeline",
    "pipeline_comms"))


def _ring_case(seed: int, trials: int, w: int):
    """Per trial: the shape, and every rank's input (rank r draws from its own generator)."""
    rng, gens = random.Random(seed), [torch.Generator().manual_seed(seed * 100 + r) for r in range(w)]
    sizes = [1, w - 1 or 1, w + 1, 17, 1001] + [rng.choice([5, 33, 257]) for _ in range(trials - 5)]
    shapes = [(n,) if t % 2 == 0 else (1, n) for t, n in enumerate(sizes)]
    return [(shape, [torch.randn(shape, generator=g, dtype=DTYPE) for g in gens]) for shape in shapes]


class _Messages(CommCounter):
    """`CommCounter` that also keeps a flat copy of what each send carries, in the order sent: a message of the
    right size filled with zeros passes every count, and the sum can travel beside the process group."""

    def __init__(self):
        super().__init__()
        self.payloads: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if collective_kind(func) == "send":  # copied before the send: what an isend reads at the call
            parts = [t.detach().reshape(-1) for t in tensors_in(args[0])]
            self.payloads.append(torch.cat(parts) if parts else torch.zeros(0, dtype=DTYPE))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _ring_worker(mine: list, fn):
    """`mine`: this rank's own input of each trial. Per trial: the sum, and what this rank sent to whom
    (`CommCounter`, beside the student's code; its total is checked against the rank's sockets) and in
    each message."""
    out = []
    for t in mine:
        got = t.clone()
        with _Messages() as counter:
            res = fn(got)
        out.append({"sum": res if isinstance(res, torch.Tensor) else got, "to": counter.sent_by_peer(),
                    "sent": sum(counter.by_kind("sent").values()), "records": counter.records(),
                    "messages": counter.payloads})
    return out


@check(forbid=COLLECTIVES + LIBRARY_RINGS, hint=POINT_TO_POINT)
def check_ring_all_reduce(fn, seed: int = 0, world_size: int = 2, trials: int = 6) -> None:
    """`fn(tensor)` sums tensor over the ranks (in place, or returns the sum) with point-to-point
    messages only; compared with the sum of the ranks' inputs on random float64 tensors of odd sizes,
    some smaller than the world size. A ring: each rank sends 2(N-1) messages to one neighbour, the same
    way round on every rank, chunks of ceil(n/N) elements at most and together the 2(N-1) n values a ring
    moves (`ring_sent`, `ring_total`), each message a chunk summed over the ranks it has passed
    (`ring_contents`); the sockets carry what the messages count (`verify_wire`)."""
    trials, n = max(trials, 5), world_size
    case = _ring_case(case_seed(seed), trials, n)  # a secret seed when graded
    got = on_ranks(_ring_worker, n, fn, per_rank=[[inputs[r] for _, inputs in case] for r in range(n)])
    for t, (shape, inputs) in enumerate(case):  # the sums, and no more than a ring sends
        want, where = torch.stack(inputs).sum(0), f"world_size={n}, shape={shape}"
        for r in range(n):
            close_enough("ring_all_reduce", f"the result on rank {r}", got[r][t]["sum"], want,
                   f"{where}; sum over ranks, in place or returned")
            ring_sent("ring_all_reduce", got[r][t], r, n, want.numel(), where)
    for t, (shape, inputs) in enumerate(case):  # then no less: the sums crossed the ring as messages
        numel, where = got[0][t]["sum"].numel(), f"world_size={n}, shape={shape}"
        for r in range(n):
            ring_messages("ring_all_reduce", got[r][t], r, n, numel, where)
        ring_total("ring_all_reduce", [got[r][t] for r in range(n)], numel, where)
        sums = partial_sums(inputs)
        for r in range(n):
            ring_contents("ring_all_reduce", got[r][t]["messages"], sums, r, n, numel, where)
    verify_wire("ring_all_reduce", [[rec for trial in got[r] for rec in trial["records"]] for r in range(n)], n,
                f"world_size={n}")
    ok("ring_all_reduce", f"{trials} sizes on {n} ranks, each rank sending to one neighbour, seed={seed}")


def one_neighbour(to: dict, r: int, n: int) -> bool:
    """Whether rank r of a ring of n sent (`to`: {peer: bytes}, `CommCounter.sent_by_peer`) to one neighbour
    only: (r + 1) % n, or (r - 1) % n for a ring run the other way."""
    return len(to) <= 1 and set(to) <= {(r + 1) % n, (r - 1) % n}


def ring_sent(name: str, got: dict, r: int, n: int, numel: int, where: str) -> None:
    """What a ring all-reduce sends at most (Patarasuk & Yuan 2009): rank r only to one neighbour ((r + 1) % N,
    or (r - 1) % N for a ring run the other way), N-1 chunks in the reduce-scatter and N-1 in the all-gather,
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


def ring_messages(name: str, got: dict, r: int, n: int, numel: int, where: str) -> None:
    """What a ring all-reduce sends at least: 2(N-1) messages from rank r to its neighbour, each a whole chunk
    of at least floor(n / N) values. A sum that crosses no message (each rank's tensor in a file, summed by
    every rank) is as right as the ring's, and sends nothing. `got`: as `ring_sent`'s."""
    msgs = sum(rec["kind"] == "send" for rec in got["records"])
    if not got["to"]:
        raise AssertionError(f"{name}: rank {r} sent no message through the process group: a ring passes "
                             f"2(N-1) = {2 * (n - 1)} chunks to its neighbour with dist.isend/dist.send (a file or "
                             f"any channel beside torch.distributed is not the exercise) ({where})")
    if msgs != 2 * (n - 1):
        raise AssertionError(f"{name}: rank {r} sent {msgs} messages per call; a ring sends 2(N-1) = {2 * (n - 1)}: "
                             f"N-1 chunks in the reduce-scatter, N-1 in the all-gather, one message each ({where})")
    least = 2 * (n - 1) * (numel // n) * torch.finfo(DTYPE).bits // 8
    if got["sent"] < least:
        raise AssertionError(f"{name}: rank {r} sent {got['sent']:,.0f} bytes for {numel} float64 values; a ring "
                             f"sends 2(N-1) = {2 * (n - 1)} chunks of at least floor(n/N) = {numel // n} values, "
                             f"{least:,} bytes: each message carries a whole chunk of the tensor ({where})")


def ring_total(name: str, got: list, numel: int, where: str) -> None:
    """Over the ranks of one call: every rank sends the same way round (all to rank + 1, or all to rank - 1:
    otherwise some rank receives from two), and together at least 2(N-1) n values: in the reduce-scatter
    each rank sends all chunks but one, in the all-gather all but another, N(2n) - 2n whatever the split."""
    n = len(got)
    ways = {(peer - r) % n for r, g in enumerate(got) for peer in g["to"]}
    if n > 2 and len(ways) > 1:
        raise AssertionError(f"{name}: the ranks send to {[sorted(g['to']) for g in got]}: a ring runs one way "
                             f"round, every rank sending to (rank + 1) % N (or every one to (rank - 1) % N) "
                             f"({where})")
    least = 2 * (n - 1) * numel * torch.finfo(DTYPE).bits // 8
    sent = sum(g["sent"] for g in got)
    if sent < least:
        raise AssertionError(f"{name}: the ranks sent {sent:,.0f} bytes together for {numel} float64 values; a "
                             f"ring's messages carry 2(N-1) n values in all, {least:,} bytes: every chunk of the "
                             f"reduce-scatter and of the all-gather travels as a message ({where})")


# what a message of the ring carries, float64 sums of at most N values in any order: exact to ~1e-15
TOLERANCE = 1e-9


def partial_sums(inputs: list[torch.Tensor]) -> dict[frozenset, torch.Tensor]:
    """{set of ranks: the sum of their flat inputs, sorted}: what a ring's message may carry, each of its
    values an element of one of them (sorted: a message's values are looked up, whatever the chunking)."""
    flat = [t.reshape(-1).to(DTYPE) for t in inputs]
    return {frozenset(s): torch.stack([flat[q] for q in s]).sum(0).sort().values
            for k in range(1, len(flat) + 1) for s in itertools.combinations(range(len(flat)), k)}


def _carries(message: torch.Tensor, values: torch.Tensor, pad: int) -> bool:
    """Whether `message` is a chunk of `values` (sorted): its values distinct elements of them, in any order
    and any split (contiguous, strided), and the rest zeros up to the padding of a padded copy."""
    y = message.reshape(-1).to(DTYPE)
    if y.numel() == 0:
        return True
    hi = torch.searchsorted(values, y).clamp(max=len(values) - 1)  # the nearest value: below or above y
    lo = (hi - 1).clamp(min=0)
    j = torch.where((y - values[lo]).abs() < (y - values[hi]).abs(), lo, hi)
    found = (y - values[j]).abs() <= TOLERANCE * (1 + values[j].abs())
    rest = y[~found]
    return (len(set(j[found].tolist())) == int(found.sum()) and rest.numel() <= pad
            and bool((rest.abs() <= TOLERANCE).all()))


def ring_contents(name: str, messages: list, sums: dict, r: int, n: int, numel: int, where: str) -> None:
    """What rank r's 2(N-1) messages carry (Patarasuk & Yuan 2009): at reduce-scatter step s (from 0), a chunk
    summed over s + 1 ranks, r among them (its own chunk, then what it received plus its own); in the
    all-gather, a chunk summed over all N. Either way round, any chunking, padded or not; a message of the
    right size filled with anything else (zeros, noise) fails, wherever the sum itself travelled.
    `sums`: `partial_sums` of the ranks' inputs."""
    pad = n * -(-numel // n) - numel
    for k, message in enumerate(messages):
        size = min(k + 1, n)
        if any(_carries(message, sums[s], pad) for s in sums if len(s) == size and r in s):
            continue
        what = ("a chunk of its own input" if size == 1 else "a chunk summed over all N ranks" if size == n else
                f"a chunk summed over {size} ranks (its own and the {size - 1} before it on the ring)")
        raise AssertionError(f"{name}: message {k + 1} of {len(messages)} that rank {r} sent does not carry {what}: "
                             f"in a ring each message is a chunk of the tensors being summed (reduce-scatter step s: "
                             f"the sum over s + 1 ranks; all-gather: the finished sums), not stand-in values of the "
                             f"right size ({where})")
