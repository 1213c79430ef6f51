"""Autograder checks for Day 10 (context and expert parallelism).

Each `check_<exercise>(fn, ..., seed=0, trials=...)` draws odd shapes from `seed` (`case_seed`: a
secret one under `dlo grade`), calls the student's function (a plain call: tensors in, plain data
back; exercise 3's ring runs on ranks: `dlo.checks.day10_ring`; exercise 6, the layout search, is in
`dlo.checks.day10_layout`) and compares with the library's
reference (`dlo.distributed.context_parallel`, `dlo.models.moe`), which is off limits while the
student's code runs. A mismatch is named: the
check computes the usual slips on its own side (no rescale, a contiguous split, a capacity rounded
down, ...) and says which one the answer matches, else where it differs.
"""

from __future__ import annotations

import math
import random

import torch

from dlo.checks.day10_layout import check_layout_search  # noqa: F401 (exercise 6: the notebook calls it here)
from dlo.checks.day10_moe import check_dispatch_combine, check_route  # noqa: F401 (the notebook calls them here)
from dlo.checks.day10_ring import TORCH_CP, check_ring_forward  # noqa: F401 (exercise 3: the notebook calls it here)
from dlo.distributed import context_parallel as cp
from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_close, fmt, name_slip, need_dtype, ok, same

# torch's own context parallelism (TORCH_CP) merges partial results (_SDPAMerger) and cuts the head-tail split
# (_HeadTailLoadBalancer): a red team's merge and zig-zag called them
MERGE = ("dlo.distributed.context_parallel.merge_partials", "dlo.distributed.context_parallel.ring_forward",
         "dlo.distributed.context_parallel.ring_attention", "dlo.distributed.context_parallel.RingAttention") + TORCH_CP
ZIGZAG = ("dlo.distributed.context_parallel.zigzag_split", "dlo.distributed.context_parallel.zigzag_unsplit",
          "dlo.distributed.context_parallel.zigzag_positions", "dlo.distributed.context_parallel.rank_positions") \
    + TORCH_CP


# ----------------------------------------------------------------------------- exercise 1: the merge

def _merge_case(rng: random.Random, gen: torch.Generator, t: int) -> tuple[list[torch.Tensor], dict]:
    """Two partial results (o, lse) of odd shapes; trial 1 has huge log-sum-exps (exp overflows), trial 2
    float32 ones past exp's range (88), both with rows far apart in one tensor (+shift and -shift on alternate
    rows: only each row's own maximum keeps every row's exponents in range), trial 3 rows that saw no key on one
    side and on both."""
    B, H, T, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([5, 7, 9]), rng.choice([3, 4, 5])
    dtype = torch.float32 if t == 2 else torch.float64
    o1, o2 = (torch.randn(B, H, T, D, generator=gen, dtype=dtype) for _ in range(2))
    big = {1: 800.0, 2: 120.0}.get(t, 0.0)
    shift = torch.full((T,), big, dtype=dtype)
    shift[1::2] = -big
    lse1, lse2 = (torch.randn(B, H, T, generator=gen, dtype=dtype) * 3 + shift for _ in range(2))
    if t == 3:
        lse1[..., 0], o1[..., 0, :] = -math.inf, 0.0  # row 0 saw no key in block 1
        lse1[..., 1], o1[..., 1, :] = -math.inf, 0.0  # row 1 saw none in either block
        lse2[..., 1], o2[..., 1, :] = -math.inf, 0.0
    return [o1, lse1, o2, lse2], dict(shape=(B, H, T, D), dtype=str(dtype).removeprefix("torch."),
                                      lse_rows=f"+{big:g} and -{big:g}" if big else "near 0", empty_rows=t == 3)


def _merge_slips(o1, lse1, o2, lse2, lse_ref) -> tuple[dict, dict]:
    """The usual wrong outputs and log-sum-exps, with what each message says."""
    with torch.no_grad():
        naive = torch.exp(lse1) + torch.exp(lse2)
        w1, w2 = (torch.exp(x).unsqueeze(-1) / naive.unsqueeze(-1) for x in (lse1, lse2))
        outs = {"the outputs are added without rescaling: weight O1 by exp(L1 - L) and O2 by exp(L2 - L)": o1 + o2,
                "the outputs are averaged: each weight is exp(L_i - L), the share of its block's softmax mass, not 1/2":
                    (o1 + o2) / 2,
                "exp(L1) / (exp(L1) + exp(L2)) overflows (inf / inf = nan) for large log-sum-exps: subtract the "
                "maximum first (exp(L_i - L) with L from torch.logaddexp, or L = m + log(exp(L1-m) + exp(L2-m)))":
                    w1 * o1 + w2 * o2}
        lses = {"lse is max(L1, L2): the merged log-sum-exp is log(exp(L1) + exp(L2)) (torch.logaddexp)":
                    torch.maximum(lse1, lse2),
                "lse is L1 + L2: log-sum-exps add as log(exp(L1) + exp(L2)), not as numbers": lse1 + lse2,
                "lse is computed as log(exp(L1) + exp(L2)) directly, which overflows to inf: subtract the maximum "
                "(or use torch.logaddexp)": torch.log(naive)}
        both = torch.cat([lse1.flatten(), lse2.flatten()])
        if torch.isfinite(both).any():  # one maximum for the whole tensor: rows far below it underflow
            m = both[torch.isfinite(both)].max()
            lses["lse is -inf where a row lies far below the tensor's largest log-sum-exp: subtract each row's own "
                 "maximum, max(L1, L2), not one maximum over the whole tensor"] = \
                m + torch.log(torch.exp(lse1 - m) + torch.exp(lse2 - m))
    lses = {k: v for k, v in lses.items() if not same(v, lse_ref)}
    return outs, lses


# _merge_slips: its overflowing slips are the merge itself on shifted log-sum-exps, and every checks module is loaded
# where the student's code runs (the runner imports dlo.checks; reachable through gc): off limits there
@check(forbid=MERGE + ("dlo.checks.day10._merge_slips",),
       hint="merge with torch.logaddexp and the weights exp(L_i - L) yourself")
def check_merge_partials(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(o1, lse1, o2, lse2) -> (o, lse)`: two partial attention results over disjoint key sets merged
    (o (B, H, T, D), lse (B, H, T), x's dtype; rows with no key: o = 0, lse = -inf)."""
    name, rng = "merge_partials", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(case_seed(seed))
    for t in range(trials):
        args, hp = _merge_case(rng, gen, t % 4)
        o_ref, lse_ref = cp.merge_partials(*args)
        got = fn(*(a.clone() for a in args))
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"{name}: return a pair (o, lse), got {type(got).__name__} ({fmt(hp)})")
        o, lse = got
        outs, lses = _merge_slips(*args, lse_ref)
        name_slip(name, lse, lses, hp, lse_ref)
        if hp["empty_rows"] and isinstance(lse, torch.Tensor) and lse.shape == lse_ref.shape \
                and torch.isnan(lse[..., 1]).any():
            raise AssertionError(f"{name}: a row that saw no key in either block must keep lse = -inf, got nan "
                                 f"({fmt(hp)})")
        tol = dict(rtol=1e-5, atol=1e-6) if t % 4 == 2 else dict(rtol=1e-9, atol=1e-12)
        need_dtype(name, "lse", lse, lse_ref.dtype, hp, "the inputs' ")
        assert_close(name, "lse", lse, lse_ref, hp, rtol=tol["rtol"])
        if hp["empty_rows"] and isinstance(o, torch.Tensor) and o.shape == o_ref.shape and torch.isnan(o).any():
            raise AssertionError(f"{name}: nan in the output: a row with lse = -inf on both sides must give o = 0; "
                                 f"exp(-inf - (-inf)) is nan, so use 0 as L where L = -inf ({fmt(hp)})")
        name_slip(name, o, outs, hp, o_ref)
        need_dtype(name, "o", o, o_ref.dtype, hp, "the inputs' ")
        assert_close(name, "o", o, o_ref, hp, **tol)
    ok(name, f"{trials} trials (large log-sum-exps, float32, empty rows), seed={seed}")


# ----------------------------------------------------------------------------- exercise 2: the zig-zag split

def _contiguous(x, n, r):
    return x.chunk(n, 2)[r]


def _zigzag_slips(x, n, r) -> dict:
    c = x.chunk(2 * n, 2)
    slips = {"a contiguous split: rank r gets chunks r and 2N-1-r of 2N equal chunks (head and tail)":
             _contiguous(x, n, r),
             "head and tail swapped: the head chunk r comes first, then the tail chunk 2N-1-r": torch.cat(
                 [c[2 * n - 1 - r], c[r]], 2)}
    slips["the tail is chunk 2N-r: it is chunk 2N-1-r (chunks are numbered 0..2N-1)"] = torch.cat(
        [c[r], c[(2 * n - r) % (2 * n)]], 2)  # rank 0's "chunk 2N" wraps to chunk 0
    return {k: v for k, v in slips.items() if not same(v, cp.zigzag_split(x, n, r))}


@check(forbid=ZIGZAG, hint="chunk the sequence into 2N pieces yourself (torch.chunk / slicing)")
def check_zigzag(split_fn, unsplit_fn, seed: int = 0, trials: int = 4) -> None:
    """`split_fn(x, n, rank)`: rank r's zig-zag shard of x (B, H, T, D) along dim 2; `unsplit_fn(shards)`:
    the full x from the N shards in rank order; a ValueError when 2N does not divide T."""
    name, rng = "zigzag", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(case_seed(seed))
    for t in range(trials):
        n = (2, 3, 4, 5)[t % 4] if t < 4 else rng.choice([2, 3, 4, 5])
        chunk = rng.choice([1, 3, 5])
        B, H, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([2, 3])
        x = torch.randn(B, H, 2 * n * chunk, D, generator=gen, dtype=torch.float64)
        hp = dict(n=n, T=x.shape[2], shape=tuple(x.shape))
        for r in range(n):
            got = split_fn(x.clone(), n, r)
            want = cp.zigzag_split(x, n, r)
            if not same(got, want):
                name_slip(name, got, _zigzag_slips(x, n, r), {**hp, "rank": r})
            need_dtype(name, f"rank {r}'s shard", got, x.dtype, {**hp, "rank": r}, "x's ")
            assert_close(name, f"rank {r}'s shard", got, want, {**hp, "rank": r})
        # unsplit on the shards of another sequence, cut here by the reference: none that split_fn has seen
        y = torch.randn(rng.choice([1, 2]), rng.choice([1, 3]), 2 * n * rng.choice([1, 3, 5]), rng.choice([2, 3]),
                        generator=gen, dtype=torch.float64)
        shards, hp = [cp.zigzag_split(y, n, r) for r in range(n)], dict(n=n, T=y.shape[2], shape=tuple(y.shape))
        full = unsplit_fn([s.clone() for s in shards])
        if not same(full, y):
            tails_in_order = torch.cat([*(s.chunk(2, 2)[0] for s in shards), *(s.chunk(2, 2)[1] for s in shards)], 2)
            name_slip(name, full, {"unsplit puts the tails in rank order: they come back in reverse, rank N-1's tail "
                                "first (chunk 2N-1-r is rank r's)": tails_in_order,
                                "unsplit concatenates the shards as they are: each shard is a head and a tail, "
                                "which go to the two ends": torch.cat(shards, 2)}, hp)
        need_dtype(name, "unsplit(shards)", full, y.dtype, hp, "the shards' ")
        assert_close(name, "unsplit(shards) (shards of a sequence split_fn never saw)", full, y, hp)
        bad_T = 2 * n * chunk + rng.choice([1, n]) if n > 1 else 3
        bad = torch.randn(1, 1, bad_T, 2, generator=gen, dtype=torch.float64)
        for r in range(n):
            try:
                split_fn(bad.clone(), n, r)
            except ValueError:
                continue
            raise AssertionError(f"{name}: a sequence of {bad_T} positions cannot be cut into 2N = {2 * n} equal "
                                 f"chunks; split_fn must raise ValueError on every rank, not return unequal shards "
                                 f"(rank {r} returned one)")
    ok(name, f"{trials} sequences, N = 2..5, odd chunks, lengths not divisible by 2N refused, seed={seed}")
