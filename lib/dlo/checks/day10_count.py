"""The kernel's count of a ring-attention rank (Day 10's exercise 3), read outside the rank.

Ring attention's point is memory: a rank holds its own queries, the K/V block it is attending to and the
one arriving, never the whole sequence's keys and values (Liu et al. 2023). The forward check sees
what each hop carries and to whom, which a rank that passes every block on correctly, keeps them all and
attends once at the end also satisfies. Here the process that launched the ranks reads each rank's memory from
/proc (`dlo.checks.rank_count`) on a case where the K/V blocks dominate (`count_parts`: N = 6 ranks, float64,
H of 3-5, T/N of 96-160 and D of 640-2048 drawn from the check's seed so that each rank's K/V block is 7-10 MiB and the
scores stay small): the course's ring (`reference_ring`, before any student object exists) first, then the
student's function on the same shards. The student's peak above the mark may exceed the reference's by two K/V
blocks (`slack`: a stacked copy and a receive buffer more, merge temporaries of the output's size). A rank that
keeps all blocks holds N - 1 = 5 received ones against the reference's one: four blocks more, two over the
allowance.

Measured (2026-12-02, 2 cores, seeds 0-2, then D = 1024 and T/N = 128), in K/V blocks above the mark on rank 0:
the course's ring 4.5 (its stacked block, the one arriving, the output and the merge's temporaries), the solution
4.7, a double-buffered ring sending K and V apart 4.6, one cloning every block it sends 4.7; a ring keeping every
block and attending one by one after the last hop 8.6, attending once over their concatenation 12.1. The count
costs a launch of 6 ranks: 2-3 s a check on 2 cores.

The count backs the memory rule only if the counted call does the work: a red team's ring recognised the counted
case (then always 6 ranks and D = 1024) and returned its queries at once there, its output never compared, while
the checked cases kept every block and attended once over the whole sequence (2026-12-02). So the counted call is
checked like the others (`verify_count`): each rank returns its output as a digest (`digest`: a random projection
and the squared norm per batch row and head; the output itself sent back would count against the rank) and its
log-sum-exp, compared here with one process on the whole sequence; and each rank's sockets, read by the launcher,
must have sent the ring's K/V blocks twice (N - 1 hops of the reference's ring, N - 1 of the student's).
"""

from __future__ import annotations

import gc
import random

import torch

from dlo.checks.rank_count import counted_peaks, every_rank
from dlo.grading.api import wire_sent
from dlo.grading.compare import assert_close

RANKS, B = 6, 1  # keys and values dominate: D >> T/N keeps the scores small
WIRE_SHARE = 0.99  # of the ring's K/V bytes each rank's sockets must have sent (gloo adds headers only)


def count_shape(seed: int) -> dict:
    """The counted case's heads H, positions per rank T/N and head size D, drawn from `seed` (the check's secret
    one under `dlo grade`): a K/V block of 7-10 MiB, never one shape a rank can wait for."""
    rng = random.Random(f"day10-count-{seed}")
    H, t = rng.choice([3, 4, 5]), rng.randrange(96, 161, 8)
    D = rng.uniform(7, 10) * 2 ** 20 / (2 * B * H * t * 8)
    return {"H": H, "T_RANK": t, "D": max(640, min(2048, int(D)))}


def count_case(seed: int) -> dict:
    """The whole counted case (float64, not causal: every block is attended): q, k, v, the shape, the digest's
    seed."""
    shape = count_shape(seed)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, shape["H"], RANKS * shape["T_RANK"], shape["D"], generator=gen, dtype=torch.float64)
               for _ in range(3))
    probe = int(torch.randint(0, 2 ** 40, (1,), generator=gen))
    return {"q": q, "k": k, "v": v, "probe": probe, **shape}


def count_parts(seed_or_case) -> list[dict]:
    """Each rank's contiguous shard of q, k, v and the digest's seed (a case of `count_case`, or its seed)."""
    c = count_case(seed_or_case) if isinstance(seed_or_case, int) else seed_or_case
    t = c["T_RANK"]
    return [{**{x: c[x][:, :, r * t:(r + 1) * t].clone() for x in ("q", "k", "v")}, "probe": c["probe"]}
            for r in range(RANKS)]


def block_bytes(case: dict | None = None) -> int:
    """One rank's K and V block: what a ring passes at each hop (of `case`; the former fixed shape without)."""
    H, t, D = (case["H"], case["T_RANK"], case["D"]) if case else (4, 128, 1024)
    return 2 * B * H * t * D * 8


def reference_ring(part: dict) -> bool:
    """On each rank, before the student's objects exist (`dlo.grading.ranks.run_on_rank`): the course's ring
    forward on the counted shards, then let go of (`steady_malloc` is set: the rank's memory falls back)."""
    from dlo.distributed.context_parallel import ring_forward

    out = ring_forward(part["q"], part["k"], part["v"], False, False)
    del out
    gc.collect()
    return True


def digest(o: torch.Tensor, seed: int) -> list:
    """[w . o[b, h], o[b, h] . o[b, h]] for each batch row b and head h, w drawn from `seed` (one head's worth
    at a time, float64): what a rank returns of its output; an output the ring got wrong moves w . o."""
    out = []
    with torch.no_grad():
        rows = o.detach().to(torch.float64).reshape(o.shape[0] * o.shape[1], -1)
        for i, row in enumerate(rows):
            w = torch.randn(row.numel(), generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
            out.append([float(row @ w), float(row @ row)])
    return out


def count_worker(part: dict, fn, *, counted: bool = False):
    """The student's ring forward on the counted shards (only where the launcher counts: `counted`; else False):
    its output as a digest and its log-sum-exp, or what was wrong with what it returned."""
    if not counted:
        return False
    q = part["q"]
    got = fn(q, part["k"], part["v"], False)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return {"error": f"returned {type(got).__name__}, expected a pair (o, lse)"}
    o, lse = got
    for what, x, shape in (("o", o, q.shape), ("lse", lse, q.shape[:-1])):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
            have = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return {"error": f"returned {what} of {have}, expected a tensor of shape {tuple(shape)}"}
    return {"o": digest(o, part["probe"]), "lse": lse.detach().to(torch.float64).tolist()}


count_worker.counted_prelude = reference_ring


def slack(case: dict | None = None) -> int:
    """What the student's ring may reach beyond the reference's: two K/V blocks (a stacked copy of its own block
    and a receive buffer held at once, or the output-sized temporaries of another merge)."""
    return 2 * block_bytes(case)


def _large(case: dict | None) -> str:
    one = block_bytes(case)
    return f"the large case ({RANKS} ranks, K/V blocks of {one / 2 ** 20:.1f} MiB, not causal)"


def verify_count(name: str, where: str, res: list | None = None, case: dict | None = None) -> str:
    """Every rank's peak in the last `on_ranks(count_worker, RANKS, ...)` against the reference's, and a line for
    the check's `ok`; with `res` (the ranks' replies) and `case` (`count_case`: the check passes both) also the
    counted call's output against one process on the whole sequence and each rank's bytes sent (`wire_sent`, read
    by the launcher)."""
    one = block_bytes(case)
    peaks = counted_peaks(name, where)
    if res is not None and case is not None:
        _verify_result(name, case, every_rank(name, res, RANKS, where), where)
    for r, (ref, got) in enumerate(peaks):
        if got > ref + slack(case):
            raise AssertionError(f"{name}: on {_large(case)} rank {r}'s resident memory rose by "
                                 f"{got / 2 ** 20:.0f} MiB during your forward, as the kernel counts it outside your "
                                 f"code: {(got - ref) / one:.1f} K/V blocks more than the course's ring "
                                 f"({ref / 2 ** 20:.0f} MiB; two blocks more allowed). A ring rank attends to each "
                                 f"block as it arrives and lets it go once passed on, holding one or two blocks, "
                                 f"never all {RANKS} ({where})")
    ref, got = peaks[0]
    return f"rank 0 rose by {got / one:.1f} K/V blocks on the large case, the course's ring by {ref / one:.1f}"


def _float64(values):
    """A reply's list of numbers as a float64 tensor (torch would make float32 of it, rounding at 1e-7), or the
    reply itself where it is none (`assert_close` names what it is)."""
    try:
        return torch.tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return values


def _verify_result(name: str, case: dict, res: list[dict], where: str) -> None:
    """The counted call did the forward: every rank's output and log-sum-exp those of one process on the whole
    sequence, and its sockets sent the ring's blocks."""
    from dlo.distributed.context_parallel import block_attention

    large, t = _large(case), case["T_RANK"]
    everything = torch.arange(RANKS * t)
    o_all, lse_all = block_attention(case["q"], case["k"], case["v"], everything, everything, False)
    for r, got in enumerate(res):
        if "error" in got:
            raise AssertionError(f"{name}: on {large} rank {r} {got['error']}: the large case is checked like the "
                                 f"small ones, whatever its size ({where})")
        mine = slice(r * t, (r + 1) * t)
        assert_close(name, f"rank {r}'s output o on {large} (its projection on a random vector and its squared "
                           f"norm per head; one process on the whole sequence as reference)", _float64(got.get("o")),
                     torch.tensor(digest(o_all[:, :, mine], case["probe"]), dtype=torch.float64), where, atol=1e-9)
        assert_close(name, f"rank {r}'s log-sum-exp on {large}", _float64(got.get("lse")), lse_all[:, :, mine],
                     where)
    sent = wire_sent()
    if sent is None:
        return
    need = 2 * (RANKS - 1) * block_bytes(case)  # the reference's ring, then the student's
    for r in range(RANKS):
        if sent[r] < WIRE_SHARE * need:
            raise AssertionError(f"{name}: on {large} rank {r}'s sockets sent {sent[r] / 2 ** 20:.1f} MiB, as the "
                                 f"kernel counts them outside your code; the course's ring and yours together send "
                                 f"{need / 2 ** 20:.1f} MiB: each rank passes its K/V block on N - 1 = {RANKS - 1} "
                                 f"times ({where})")
