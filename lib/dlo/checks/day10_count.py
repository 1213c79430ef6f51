"""The kernel's count of a ring-attention rank (Day 10's exercise 3), read outside the rank.

Ring attention's point is memory: a rank holds its own queries, the K/V block it is attending to and the
one arriving, never the whole sequence's keys and values (Liu et al. 2023). The forward check sees
what each hop carries and to whom, which a rank that passes every block on correctly, keeps them all and
attends once at the end also satisfies. Here the process that launched the ranks reads each rank's memory from
/proc (`dlo.checks.rank_count`) on a case where the K/V blocks dominate (`count_parts`: N = 6 ranks, float64,
D = 1024 and T/N = 128: 8 MiB of K and V per rank, 0.5 MiB of scores): the course's ring (`reference_ring`, before
any student object exists) first, then the student's function on the same shards. The student's peak above
the mark may exceed the reference's by two K/V blocks (`slack`: a stacked copy and a receive buffer more, merge
temporaries of the output's size). A rank that keeps all blocks holds N - 1 = 5 received ones against the
reference's one: four blocks more, two over the allowance.

Measured (2026-12-02, 2 cores, seeds 0-2), in K/V blocks above the mark on rank 0: the course's ring 4.5 (its
stacked block, the one arriving, the output and the merge's temporaries), the solution 4.7, a double-buffered ring
sending K and V apart 4.6, one cloning every block it sends 4.7; a ring keeping every block and attending one by one
after the last hop 8.6, attending once over their concatenation 12.1. The count costs a launch of 6 ranks: 2-3 s a
check on 2 cores.
"""

from __future__ import annotations

import gc

import torch

from dlo.checks.rank_count import counted_peaks

RANKS, B, H, T_RANK, D = 6, 1, 4, 128, 1024  # keys and values dominate: D >> T/N keeps the scores small


def count_parts(seed: int) -> list[dict]:
    """Each rank's contiguous shard of q, k, v (float64) of a non-causal case: every block is attended."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, RANKS * T_RANK, D, generator=gen, dtype=torch.float64) for _ in range(3))
    return [{x: t[:, :, r * T_RANK:(r + 1) * T_RANK].clone() for x, t in (("q", q), ("k", k), ("v", v))}
            for r in range(RANKS)]


def block_bytes() -> int:
    """One rank's K and V block: what a ring passes at each hop."""
    return 2 * B * H * T_RANK * D * 8


def reference_ring(part: dict) -> bool:
    """On each rank, before the student's objects exist (`dlo.grading.ranks.run_on_rank`): the course's ring
    forward on the counted shards, then let go of (`steady_malloc` is set: the rank's memory falls back)."""
    from dlo.distributed.context_parallel import ring_forward

    out = ring_forward(part["q"], part["k"], part["v"], False, False)
    del out
    gc.collect()
    return True


def count_worker(part: dict, fn, *, counted: bool = False) -> bool:
    """The student's ring forward on the counted shards (only where the launcher counts: `counted`)."""
    if not counted:
        return False
    fn(part["q"], part["k"], part["v"], False)
    return True


count_worker.counted_prelude = reference_ring


def slack() -> int:
    """What the student's ring may reach beyond the reference's: two K/V blocks (a stacked copy of its own block
    and a receive buffer held at once, or the output-sized temporaries of another merge)."""
    return 2 * block_bytes()


def verify_count(name: str, where: str) -> str:
    """Every rank's peak in the last `on_ranks(count_worker, RANKS, ...)` against the reference's, and a line for
    the check's `ok`."""
    one = block_bytes()
    peaks = counted_peaks(name, where)
    for r, (ref, got) in enumerate(peaks):
        if got > ref + slack():
            raise AssertionError(f"{name}: on the large case ({RANKS} ranks, K/V blocks of {one / 2 ** 20:.0f} MiB, "
                                 f"not causal) rank {r}'s resident memory rose by {got / 2 ** 20:.0f} MiB during "
                                 f"your forward, as the kernel counts it outside your code: {(got - ref) / one:.1f} "
                                 f"K/V blocks more than the course's ring ({ref / 2 ** 20:.0f} MiB; two blocks more "
                                 f"allowed). A ring rank attends to each block as it arrives and lets it go once "
                                 f"passed on, holding one or two blocks, never all {RANKS} ({where})")
    ref, got = peaks[0]
    return f"rank 0 rose by {got / one:.1f} K/V blocks on the large case, the course's ring by {ref / one:.1f}"
