"""Day 10's exercises 4 and 5 (the MoE router with a capacity, the dispatch/combine permutation), re-exported by
`dlo.checks.day10`, with the helpers that name a slip, which `dlo.checks.day10` shares.

Cases are drawn here (a secret seed under `dlo grade`): router logits with one popular expert (drops happen),
k = 1..3, capacities with and without rounding; the reference is `dlo.models.moe` (route, dispatch, combine)
with the identity as router weight, off limits while the student's code runs.
"""

from __future__ import annotations

import math
import random

import torch

from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_close, fmt, name_slip, need_dtype, ok, same
from dlo.models import moe

ROUTE = ("dlo.models.moe.*", "dlo.distributed.expert_parallel.*")
# the slips' helpers do the exercises' work with one thing changed (the capacity rule in any order; a stable sort by
# expert; a gated index_add), and every checks module is loaded where the student's code runs (reachable through gc)
OWN = "dlo.checks.day10_moe."
ROUTE_SLIPS = (OWN + "_kept_with", OWN + "_route_slips")
DISPATCH_SLIPS = (OWN + "_dispatch_slips", OWN + "_combine_slips")


def _reference_route(logits: torch.Tensor, top_k: int, factor: float) -> tuple[torch.Tensor, ...]:
    """(experts (S, k), gates (S, k), kept (S, k)) of the library's router with the identity as weight."""
    S, E = logits.shape
    cap = moe.expert_capacity(S, E, top_k, factor)
    r = moe.route(logits, torch.eye(E, dtype=logits.dtype), top_k, cap)
    gates, experts = r.probs.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    kept = torch.zeros(S, top_k, dtype=torch.bool)
    for tok, e in zip(r.token.tolist(), r.expert.tolist()):
        kept[tok, (experts[tok] == e).nonzero()[0, 0]] = True
    return experts, gates, kept


def _kept_with(experts: torch.Tensor, E: int, cap: int, order: list[tuple[int, int]]) -> torch.Tensor:
    """Which assignments fit `cap` per expert when taken in `order` ((token, choice) pairs)."""
    used, kept = [0] * E, torch.zeros(experts.shape, dtype=torch.bool)
    for s, j in order:
        e = int(experts[s, j])
        if used[e] < cap:
            used[e], kept[s, j] = used[e] + 1, True
    return kept


def _route_slips(logits, experts, gates, top_k, factor) -> dict:
    S, E = logits.shape
    cap = math.ceil(top_k * S * factor / E)
    choice_major = [(s, j) for j in range(top_k) for s in range(S)]
    by_score = sorted(choice_major, key=lambda sj: -float(gates[sj]))
    return {
        f"the capacity is rounded down (floor(k S f / E) = {math.floor(top_k * S * factor / E)}): it is "
        f"ceil(k S f / E) = {cap}": _kept_with(experts, E, math.floor(top_k * S * factor / E), choice_major),
        f"one assignment too many per expert (C + 1 = {cap + 1}): an expert keeps at most C = ceil(k S f / E)":
            _kept_with(experts, E, cap + 1, choice_major),
        "priority by score: the rule is by position, every token's first choice before any second choice, "
        "in token order": _kept_with(experts, E, cap, by_score),
        "priority token by token (token 0's choices, then token 1's): every first choice comes before any second "
        "choice": _kept_with(experts, E, cap, [(s, j) for s in range(S) for j in range(top_k)]),
    }


def integer_factor(rng, E: int, top_k: int) -> tuple[float, int]:
    """(f, S) with k S f / E an integer C in float64 whichever order it is multiplied in: E C / (k S) rounds,
    and for some (E, k, S) k S f / E is then C + 4e-16, whose ceiling is C + 1 (E 7, k 3, S 17, C 2), which
    would fail a student who wrote the product in another order for the rounding, not for the rule."""
    for S, C in rng.sample([(S, C) for S in (7, 9, 13, 17) for C in (2, 3)], 8):
        f = E / (top_k * S) * C
        if all(v == C for v in (top_k * S * f / E, S * f * top_k / E, top_k * S / E * f, f * top_k * S / E,
                                top_k * f * S / E, f * S * top_k / E)):
            return f, S
    raise AssertionError(f"no exact capacity factor for E={E}, k={top_k}")  # not reached for E 3..7, k 1..3


@check(forbid=ROUTE + ROUTE_SLIPS, hint="softmax, topk and a count per expert in plain torch")
def check_route(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(logits (S, E), top_k, capacity_factor) -> (experts (S, k) int64, gates (S, k), kept (S, k) bool)`."""
    name, rng = "route", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(case_seed(seed))
    for t in range(trials):
        E = rng.choice([3, 4, 5, 7])
        top_k = 1 if t % 3 == 0 else rng.choice([2, min(3, E)])
        S = rng.choice([7, 9, 13, 17])
        if t % 3 == 1:  # k S f / E an integer: a capacity of C + 1 shows
            factor, S = integer_factor(rng, E, top_k)
        else:  # a fractional k S f / E: the ceiling matters
            factor = rng.choice([0.5, 0.75, 1.0, 1.25])
        skew = torch.zeros(E, dtype=torch.float64)
        skew[rng.randrange(E)] = 1.5  # one popular expert: drops happen
        logits = torch.randn(S, E, generator=gen, dtype=torch.float64) + skew
        hp = dict(S=S, E=E, top_k=top_k, capacity_factor=round(factor, 4),
                  capacity=math.ceil(top_k * S * factor / E))
        experts, gates, kept = _reference_route(logits, top_k, factor)
        got = fn(logits.clone(), top_k, factor)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise AssertionError(f"{name}: return (experts, gates, kept), got {type(got).__name__} ({fmt(hp)})")
        g_experts, g_gates, g_kept = got
        need_dtype(name, "experts", g_experts, torch.int64, hp)
        assert_close(name, "experts (the top-k, most probable first)", g_experts, experts, hp)
        if not same(g_gates, gates):
            probs, raw = torch.softmax(logits, -1).topk(top_k, -1)[0], logits.topk(top_k, -1)[0]
            name_slip(name, g_gates, {"the top-k gates are not renormalised: with k > 1 they are divided by their sum "
                                   "(GShard)": probs,
                                   "the gates are renormalised with k = 1: Switch keeps the router's probability":
                                       torch.ones_like(probs),
                                   "the gates are the logits: they are softmax probabilities": raw},
                   hp)
        need_dtype(name, "gates", g_gates, logits.dtype, hp, "the logits' ")
        assert_close(name, "gates", g_gates, gates, hp)  # float64: within 1e-9 relative (compare.RTOL)
        if not same(g_kept, kept):
            name_slip(name, g_kept, _route_slips(logits, experts, gates, top_k, factor), hp)
        need_dtype(name, "kept", g_kept, torch.bool, hp)
        assert_close(name, "kept", g_kept.to(torch.float64), kept.to(torch.float64), hp)
    ok(name, f"{trials} routings, k = 1..3, capacities with and without rounding, seed={seed}")


# ----------------------------------------------------------------------------- exercise 5: dispatch and combine

def _dispatch_slips(x, experts, kept, E) -> dict:
    """The usual wrong row orders and counts, from the same assignments."""
    S, k = experts.shape
    pairs = [(s, j) for j in range(k) for s in range(S) if kept[s, j]]  # priority order
    by_token = sorted(pairs, key=lambda sj: (int(experts[sj]), sj[0]))
    everything = sorted([(s, j) for j in range(k) for s in range(S)], key=lambda sj: int(experts[sj]))
    return {"within an expert the rows are in token order: they are in priority order (every first choice, "
            "tokens in order, before any second choice)": x[[s for s, _ in by_token]],
            "dropped assignments are dispatched: only the kept ones go to their expert": x[[s for s, _ in everything]],
            "the rows are in priority order, not grouped by expert (expert 0's rows first, then expert 1's, ...)":
                x[[s for s, _ in pairs]]}


def _combine_slips(y, experts, gates, kept, routing, S) -> dict:
    order = [(s, j) for j in range(experts.shape[1]) for s in range(S) if kept[s, j]]  # priority order
    tokens = torch.tensor([s for s, _ in order], dtype=torch.long)
    g = torch.stack([gates[sj] for sj in order]) if order else y.new_zeros(0)
    wrong_order = y.new_zeros((S, y.shape[1])).index_add(0, tokens, g.unsqueeze(-1) * y)
    return {"the gates are not applied: out[s] = sum over kept j of g[s, j] y[row of (s, j)]":
                y.new_zeros((S, y.shape[1])).index_add(0, routing.token, y),
            "combine reads y in priority order: y's rows are in dispatch's order (grouped by expert), undo that "
            "permutation": wrong_order}


@check(forbid=ROUTE + DISPATCH_SLIPS,
       hint="index with the kept assignments and a stable sort by expert (torch.argsort(stable=True))")
def check_dispatch_combine(dispatch_fn, combine_fn, seed: int = 0, trials: int = 6) -> None:
    """`dispatch_fn(x, experts, kept, n_experts) -> (rows (A, dim), counts (E,))`; `combine_fn(y, experts, gates,
    kept, n_tokens) -> out (S, dim)`. Against `dlo.models.moe.dispatch` / `combine` on the same routing."""
    name, rng = "dispatch_combine", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(case_seed(seed))
    for t in range(trials):
        E, top_k = rng.choice([3, 5, 7]), 1 + t % 3
        S = rng.choice([4, 5, 9, 13]) if t % 2 else rng.choice([2, 3])  # few tokens: an idle expert
        top_k = min(top_k, E)
        factor = rng.choice([0.5, 1.0, 1.25])
        skew = torch.zeros(E, dtype=torch.float64)
        skew[rng.randrange(E)] = 1.5
        logits = torch.randn(S, E, generator=gen, dtype=torch.float64) + skew
        x = torch.randn(S, rng.choice([3, 5]), generator=gen, dtype=torch.float64)
        experts, gates, kept = _reference_route(logits, top_k, factor)
        routing = moe.route(logits, torch.eye(E, dtype=logits.dtype), top_k, moe.expert_capacity(S, E, top_k, factor))
        hp = dict(S=S, E=E, top_k=top_k, capacity=routing.capacity, kept=int(kept.sum()))
        got = dispatch_fn(x.clone(), experts.clone(), kept.clone(), E)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"{name}: dispatch returns (rows, counts), got {type(got).__name__} ({fmt(hp)})")
        rows, counts = got
        counts_t = torch.as_tensor(counts)
        if counts_t.numel() != E:
            raise AssertionError(f"{name}: counts has {counts_t.numel()} entries: one per expert, {E}, zeros for idle "
                                 f"experts included (torch.bincount(..., minlength=E)) ({fmt(hp)})")
        need_dtype(name, "counts", counts, torch.int64, hp)
        assert_close(name, "counts (rows per expert)", counts, routing.kept, hp)
        want_rows = moe.dispatch(x, routing)
        if not same(rows, want_rows):
            name_slip(name, rows, _dispatch_slips(x, experts, kept, E), hp, want_rows)
        need_dtype(name, "dispatched rows", rows, x.dtype, hp, "x's ")
        assert_close(name, "dispatched rows", rows, want_rows, hp)
        y = torch.randn(want_rows.shape[0], x.shape[1] + 1, generator=gen, dtype=torch.float64)  # an expert's output
        out = combine_fn(y.clone(), experts.clone(), gates.clone(), kept.clone(), S)
        want = moe.combine(y, routing, S)
        if not same(out, want):
            name_slip(name, out, _combine_slips(y, experts, gates, kept, routing, S), hp, want)
        need_dtype(name, "combined output", out, y.dtype, hp, "y's ")
        assert_close(name, "combined output", out, want, hp)  # float64: within 1e-9 relative (compare.RTOL)
    ok(name, f"{trials} routings (k = 1..3, drops, idle experts), seed={seed}")
