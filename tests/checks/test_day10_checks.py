"""The Day 10 checks accept correct solutions and reject stubs, plausible mistakes (each failing with the
message that names it) and the library's own references (off limits while a check runs).

The correct versions below are written out as a student writes them; each wrong version is one of
them with one slip."""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import types

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger  # the red team's
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

from dlo.checks import day10
from dlo.distributed import context_parallel as cp
from dlo.grading.forbid import ForbiddenCall
from dlo.grading.targets import forbidden_targets
from dlo.models import moe
from tests.checks import cases
from tests.checks.day10_students import (
    attend,
    merge_no_rescale,
    merge_ok,
    ring_all_gather,
    ring_always_causal,
    ring_hop_short,
    ring_local_mask,
    ring_no_rescale,
    ring_ok,
    ring_sends_twice,
    ring_stub,
    ring_to_everyone,
    ring_wrong_owner,
)

# the ring answers below run on ranks: they reach them by value, as a notebook's do (importing this module there
# would read the checks, which are sealed where student code runs)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- exercise 1: the merge

def merge_overflow(o1, lse1, o2, lse2):
    s = torch.exp(lse1) + torch.exp(lse2)
    return (torch.exp(lse1) / s)[..., None] * o1 + (torch.exp(lse2) / s)[..., None] * o2, torch.logaddexp(lse1, lse2)


def merge_lse_max(o1, lse1, o2, lse2):
    return merge_ok(o1, lse1, o2, lse2)[0], torch.maximum(lse1, lse2)


def merge_nan_on_empty(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse)[..., None] * o1 + torch.exp(lse2 - lse)[..., None] * o2, lse


def merge_one_max(o1, lse1, o2, lse2):
    """The red team's: one maximum for the whole tensor, right while all rows' log-sum-exps lie together."""
    both = torch.cat([lse1.flatten(), lse2.flatten()])
    m = both[torch.isfinite(both)].max() if torch.isfinite(both).any() else lse1.new_zeros(())
    e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    s = e1 + e2
    return (e1[..., None] * o1 + e2[..., None] * o2) / torch.where(s > 0, s, 1.0)[..., None], torch.log(s) + m


def merge_lse_float32(o1, lse1, o2, lse2):
    o, lse = merge_ok(o1, lse1, o2, lse2)
    return o, lse.float()


# ----------------------------------------------------------------------------- exercise 2: the zig-zag split

def split_ok(x, n, rank):
    if x.shape[2] % (2 * n):
        raise ValueError(f"{x.shape[2]} positions do not split into {2 * n} equal chunks")
    c = x.shape[2] // (2 * n)
    return torch.cat([x[:, :, rank * c:(rank + 1) * c], x[:, :, (2 * n - 1 - rank) * c:(2 * n - rank) * c]], 2)


def unsplit_ok(shards):
    heads = [s[:, :, :s.shape[2] // 2] for s in shards]
    tails = [s[:, :, s.shape[2] // 2:] for s in shards]
    return torch.cat(heads + tails[::-1], 2)


def split_contiguous(x, n, rank):
    split_ok(x, n, rank)
    return x.chunk(n, 2)[rank]


def split_swapped(x, n, rank):
    s = split_ok(x, n, rank)
    return torch.cat(s.chunk(2, 2)[::-1], 2)


def split_no_check(x, n, rank):
    c = x.chunk(2 * n, 2)
    return torch.cat([c[rank], c[2 * n - 1 - rank]], 2)


def split_tail_off_by_one(x, n, rank):
    split_ok(x, n, rank)
    c = x.chunk(2 * n, 2)
    return torch.cat([c[rank], c[(2 * n - rank) % (2 * n)]], 2)


def unsplit_tails_in_order(shards):
    return torch.cat([s.chunk(2, 2)[0] for s in shards] + [s.chunk(2, 2)[1] for s in shards], 2)


STASH = "_dlo_test_zigzag_stash"  # a module both functions reach by reference (the grader pickles each by value)


def split_stash(x, n, rank):
    """The red team's: keeps the full x, which its unsplit returns without looking at the shards."""
    sys.modules.setdefault(STASH, types.ModuleType(STASH)).x = x.clone()
    return split_ok(x, n, rank)


def unsplit_stash(shards):
    return sys.modules[STASH].x.clone()


def split_refuses_on_rank_0_only(x, n, rank):
    return split_ok(x, n, rank) if rank == 0 else split_no_check(x, n, rank)


# ----------------------------------------------------------------------------- exercise 3: the router

def _route(logits, top_k, capacity_factor, *, cap_fn=math.ceil, extra=0, order="choice", renorm=True):
    S, E = logits.shape
    probs = torch.softmax(logits, -1)
    gates, experts = probs.topk(top_k, -1)
    if top_k > 1 and renorm:
        gates = gates / gates.sum(-1, keepdim=True)
    cap = cap_fn(top_k * S * capacity_factor / E) + extra
    pairs = {"choice": [(s, j) for j in range(top_k) for s in range(S)],
             "token": [(s, j) for s in range(S) for j in range(top_k)]}.get(order)
    if order == "score":
        pairs = sorted([(s, j) for j in range(top_k) for s in range(S)], key=lambda sj: -float(gates[sj]))
    used, kept = [0] * E, torch.zeros(S, top_k, dtype=torch.bool)
    for s, j in pairs:
        e = int(experts[s, j])
        if used[e] < cap:
            used[e] += 1
            kept[s, j] = True
    return experts, gates, kept


def route_ok(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor)


def route_other_order(logits, top_k, capacity_factor):
    """The same rule with the capacity's product written S f k / E."""
    return _route(logits, top_k, capacity_factor, cap_fn=lambda _: math.ceil(
        logits.shape[0] * capacity_factor * top_k / logits.shape[1]))


def route_floor(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor, cap_fn=math.floor)


def route_plus_one(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor, extra=1)


def route_by_score(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor, order="score")


def route_token_major(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor, order="token")


def route_not_renormalised(logits, top_k, capacity_factor):
    return _route(logits, top_k, capacity_factor, renorm=False)


def route_float_experts(logits, top_k, capacity_factor):
    experts, gates, kept = route_ok(logits, top_k, capacity_factor)
    return experts.float(), gates, kept


def route_float32_gates(logits, top_k, capacity_factor):
    experts, gates, kept = route_ok(logits, top_k, capacity_factor)
    return experts, gates.float(), kept


# ----------------------------------------------------------------------------- exercise 5: dispatch and combine

def _priority(experts, kept):
    """(token, choice) of the kept assignments, every first choice before any second, grouped by expert."""
    S, k = experts.shape
    pairs = [(s, j) for j in range(k) for s in range(S) if kept[s, j]]
    return sorted(pairs, key=lambda sj: int(experts[sj]))  # sorted() is stable: priority order within an expert


def dispatch_ok(x, experts, kept, n_experts):
    pairs = _priority(experts, kept)
    counts = torch.bincount(experts[kept], minlength=n_experts)
    return x[[s for s, _ in pairs]], counts


def combine_ok(y, experts, gates, kept, n_tokens):
    pairs = _priority(experts, kept)
    out = y.new_zeros((n_tokens, y.shape[1]))
    for row, (s, j) in enumerate(pairs):
        out[s] += gates[s, j] * y[row]
    return out


def dispatch_token_order(x, experts, kept, n_experts):
    pairs = sorted(_priority(experts, kept), key=lambda sj: (int(experts[sj]), sj[0]))
    return x[[s for s, _ in pairs]], torch.bincount(experts[kept], minlength=n_experts)


def dispatch_not_grouped(x, experts, kept, n_experts):
    S, k = experts.shape
    return x[[s for j in range(k) for s in range(S) if kept[s, j]]], torch.bincount(experts[kept], minlength=n_experts)


def dispatch_no_minlength(x, experts, kept, n_experts):
    return dispatch_ok(x, experts, kept, n_experts)[0], torch.bincount(experts[kept])


def dispatch_float_counts(x, experts, kept, n_experts):
    rows, counts = dispatch_ok(x, experts, kept, n_experts)
    return rows, counts.float()


def dispatch_float32_rows(x, experts, kept, n_experts):
    rows, counts = dispatch_ok(x, experts, kept, n_experts)
    return rows.float(), counts


def combine_float32(y, experts, gates, kept, n_tokens):
    return combine_ok(y, experts, gates, kept, n_tokens).float()


def combine_no_gates(y, experts, gates, kept, n_tokens):
    return combine_ok(y, experts, torch.ones_like(gates), kept, n_tokens)


def combine_priority_order(y, experts, gates, kept, n_tokens):
    S, k = experts.shape
    pairs = [(s, j) for j in range(k) for s in range(S) if kept[s, j]]
    out = y.new_zeros((n_tokens, y.shape[1]))
    for row, (s, j) in enumerate(pairs):
        out[s] += gates[s, j] * y[row]
    return out


CASES = [
    (day10.check_merge_partials, (merge_ok,), [
        ((merge_no_rescale,), "without rescaling"), ((merge_overflow,), "overflows"),
        ((merge_lse_max,), "max(L1, L2)"), ((merge_nan_on_empty,), "nan in the output"),
        ((merge_one_max,), "not one maximum over the whole tensor"),
        ((merge_lse_float32,), "lse is float32, expected the inputs' float64"), ((stub,), "")]),
    (day10.check_zigzag, (split_ok, unsplit_ok), [
        ((split_contiguous, unsplit_ok), "a contiguous split"), ((split_swapped, unsplit_ok), "head and tail swapped"),
        ((split_tail_off_by_one, unsplit_ok), "chunk 2N-r"), ((split_no_check, unsplit_ok), "must raise ValueError"),
        ((split_ok, unsplit_tails_in_order), "tails in rank order"),
        ((split_stash, unsplit_stash), "unsplit(shards) (shards of a sequence split_fn never saw)"),
        ((split_refuses_on_rank_0_only, unsplit_ok), "must raise ValueError on every rank"), ((stub, unsplit_ok), "")]),
    (day10.check_route, (route_ok,), [
        ((route_floor,), "rounded down"), ((route_plus_one,), "one assignment too many"),
        ((route_by_score,), "priority by score"), ((route_token_major,), "token by token"),
        ((route_not_renormalised,), "not renormalised"), ((route_float_experts,), "experts is float32, expected int64"),
        ((route_float32_gates,), "gates is float32, expected the logits' float64"), ((stub,), "")]),
    (day10.check_dispatch_combine, (dispatch_ok, combine_ok), [
        ((dispatch_token_order, combine_ok), "token order"), ((dispatch_not_grouped, combine_ok), "not grouped"),
        ((dispatch_no_minlength, combine_ok), "minlength"), ((dispatch_ok, combine_no_gates), "gates are not applied"),
        ((dispatch_ok, combine_priority_order), "reads y in priority order"),
        ((dispatch_float_counts, combine_ok), "counts is float32, expected int64"),
        ((dispatch_float32_rows, combine_ok), "dispatched rows is float32, expected x's float64"),
        ((dispatch_ok, combine_float32), "combined output is float32, expected y's float64"),
        ((dispatch_ok, stub), "")]),
]
LIBRARY = [(lambda *a: cp.merge_partials(*a),), (lambda x, n, r: cp.zigzag_split(x, n, r), unsplit_ok),
           (lambda lg, k, f: moe.route(lg, torch.eye(lg.shape[1], dtype=lg.dtype), k, 3),),
           (lambda x, e, kept, n: moe.dispatch(x, None), combine_ok)]


test_reference_passes = cases.reference_passes(CASES)
test_wrong_versions_fail_and_are_named = cases.wrong_versions_fail(CASES)
test_library_is_refused = cases.library_refused([(c, lib) for (c, _, _), lib in zip(CASES, LIBRARY)],
                                                ids=[c.__name__ for c, _, _ in CASES])
test_reference_passes_sandboxed = cases.reference_passes_sandboxed(CASES)
test_wrong_fails_sandboxed = cases.wrong_fails_sandboxed(
    [(day10.check_merge_partials, merge_overflow), (day10.check_route, route_by_score),
     (day10.check_merge_partials, merge_one_max), (day10.check_zigzag, (split_stash, unsplit_stash))],
    ids=["merge", "route", "merge-one-max", "zigzag-stash"])

RED_TEAM = [(day10.check_merge_partials, (merge_one_max,), "not one maximum over the whole tensor"),
            (day10.check_zigzag, (split_stash, unsplit_stash), "unsplit(shards)"),
            (day10.check_zigzag, (split_refuses_on_rank_0_only, unsplit_ok), "must raise ValueError on every rank"),
            (day10.check_route, (route_float_experts,), "experts is float32, expected int64"),
            (day10.check_dispatch_combine, (dispatch_float_counts, combine_ok), "counts is float32, expected int64")]


def test_route_capacity_in_any_order_of_the_product():
    """The integer-capacity trial draws factors for which k S f / E is exactly C in float64 whatever order it is
    multiplied in: E C / (k S) could round so that k S f / E = C + 4e-16 (E 7, k 3, S 17), whose ceiling C + 1
    failed a student who wrote S f k / E as rounding down (16 seeds of 0..399, 100, 102 and 153 among them)."""
    for seed in [*range(10), 100, 102, 153]:
        day10.check_route(route_other_order, seed=seed)


@pytest.mark.parametrize("check,bad,says", RED_TEAM, ids=[cases.named(b) for _, b, _ in RED_TEAM])
def test_red_team_answers_fail_at_every_seed(check, bad, says):
    """Answers that passed without doing the exercise (a global maximum, a stashed x, a refusal on rank 0 only,
    float indices) fail at every seed, not only at seed 0."""
    for seed in range(6):
        with pytest.raises(AssertionError, match=re.escape(says)):
            check(*bad, seed=seed)


@pytest.mark.parametrize("world_size,seed", [(2, 0), (3, 1)])
def test_ring_forward_accepts_correct(ranks, one_thread, world_size, seed, capsys):
    day10.check_ring_forward(ring_ok, seed=seed, world_size=world_size)
    assert ": ok (" in capsys.readouterr().out


SLOW = pytest.mark.slow  # a check on 3 ranks each: the first two run in make test, the rest with -m slow


@pytest.mark.parametrize("bad,slip", [(ring_local_mask, "local positions"), (ring_all_gather, "off limits"),
                                      pytest.param(ring_hop_short, "a block is missing", marks=SLOW),
                                      pytest.param(ring_wrong_owner, "the wrong way round", marks=SLOW),
                                      pytest.param(ring_no_rescale, "without rescaling", marks=SLOW),
                                      pytest.param(ring_sends_twice, "bytes; passing its K and V", marks=SLOW),
                                      (ring_to_everyone, "rank 0 sent to ranks [1, 2]: in a ring"),
                                      (ring_always_causal, "causal=False"),
                                      pytest.param(ring_stub, "NotImplementedError", marks=SLOW)])
def test_ring_forward_names_the_slip(ranks, one_thread, bad, slip):
    with pytest.raises(AssertionError, match=re.escape(slip)):
        day10.check_ring_forward(bad, seed=1, world_size=3)


# ----------------------------------------------------------------------------- the red team's, 2026-12: Day 10

def merge_torch_merger(o1, lse1, o2, lse2):
    """torch's ring-attention merger does the rescale (cheat01's merge)."""
    m = _SDPAMerger(False, 2)
    m.step(o1, lse1, False)
    m.step(o2, lse2, False)
    o, lse = m.results()
    a, b = torch.isneginf(lse1), torch.isneginf(lse2)  # its formula gives nan where a side saw no key
    o = torch.where(a.unsqueeze(-1), o2, torch.where(b.unsqueeze(-1), o1, o))
    return o.to(o1.dtype), torch.where(a, lse2, torch.where(b, lse1, lse)).to(lse1.dtype)


def split_torch_balancer(x, n, rank):
    """torch's head-tail load balancer cuts the zig-zag split (cheat01's)."""
    if x.shape[2] % (2 * n):
        raise ValueError("T")
    return x.index_select(2, _HeadTailLoadBalancer(x.shape[2], n, "cpu")._generate_indices().reshape(n, -1)[rank])


def unsplit_torch_balancer(shards):
    n, T = len(shards), sum(s.shape[2] for s in shards)
    back = _HeadTailLoadBalancer(T, n, "cpu")._generate_indices(restore=True).reshape(-1)
    return torch.cat(shards, 2).index_select(2, back)


@pytest.mark.parametrize("check,bad", [(day10.check_merge_partials, (merge_torch_merger,)),
                                       (day10.check_zigzag, (split_torch_balancer, unsplit_torch_balancer)),
                                       (day10.check_zigzag, (split_ok, unsplit_torch_balancer))],
                         ids=["merge-SDPAMerger", "zigzag-HeadTailLoadBalancer", "unsplit-HeadTailLoadBalancer"])
def test_torch_context_parallel_is_refused(check, bad):
    """torch's own merger and load balancer (private classes, which "package.**" does not cover) are off limits:
    with them the red team's merge and zig-zag passed."""
    with pytest.raises(ForbiddenCall, match="off limits"):
        check(*bad, seed=0)


def test_torch_context_parallel_names_resolve():
    """Every name of torch's context parallelism in the forbid lists stands for something in this torch (a name
    that does not resolve stops the check), the private classes the red team called among them."""
    names = " ".join(day10.TORCH_CP)
    assert "_SDPAMerger" in names and "_HeadTailLoadBalancer" in names and "_templated_ring_attention" in names
    for path in day10.TORCH_CP:
        assert forbidden_targets(path), path
    for check in (day10.check_merge_partials, day10.check_zigzag, day10.check_ring_forward):
        assert set(day10.TORCH_CP) <= set(check.forbid), check.__name__


def _kv_file(r: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"dlo-test-day10-kv-{os.getuid()}-{r}.pt")


def _save_kv(r: int, k, v) -> None:
    """Rank r's K/V into its file, replaced whole: the check calls the ring twice (causal, then not), and a slower
    rank may still be reading the first call's file when this rank writes the second's (an EOFError, seen once)."""
    part = f"{_kv_file(r)}.{os.getpid()}"
    torch.save(torch.stack([k, v]), part)
    os.replace(part, _kv_file(r))


def _attend_from_files(q, n, r, causal):
    """This rank's queries over every rank's K/V, read from the files the ranks wrote (not from the wire)."""
    t = q.shape[2]
    whole = torch.cat([torch.load(_kv_file(j)) for j in range(n)], 3)
    return attend(q, whole, torch.arange(r * t, (r + 1) * t), torch.arange(n * t), causal)


def ring_through_files(q, k, v, causal):
    """cheat02: K/V through files, zeros of the right size on the wire, one attention over everything."""
    n, r = dist.get_world_size(), dist.get_rank()
    _save_kv(r, k, v)
    kv = torch.zeros_like(torch.stack([k, v]))
    for _ in range(n - 1):
        recv = torch.empty_like(kv)
        for op in [dist.isend(kv, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]:
            op.wait()
        kv = recv  # every rank wrote its file before its first send: all are there after the ring
    return _attend_from_files(q, n, r, causal)


def ring_own_block_every_hop(q, k, v, causal):
    """Sends its own block at every hop (the right bytes, to the right rank) and reads the others from files."""
    n, r = dist.get_world_size(), dist.get_rank()
    _save_kv(r, k, v)
    for _ in range(n - 1):
        recv = torch.empty_like(torch.stack([k, v]))
        for op in [dist.isend(torch.stack([k, v]), (r + 1) % n), dist.irecv(recv, (r - 1) % n)]:
            op.wait()
    return _attend_from_files(q, n, r, causal)


def ring_kv_apart(q, k, v, causal):
    """A right ring whose hops carry K and V as two messages, V transposed and K concatenated with nothing."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = q.shape[2]
    o, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for s in range(n):
        j = (r - s) % n
        o, lse = merge_ok(o, lse, *attend(q, torch.stack([k, v]), torch.arange(r * t, (r + 1) * t),
                                           torch.arange(j * t, (j + 1) * t), causal))
        if s < n - 1:
            nk, nvt = torch.empty_like(k), torch.empty_like(v.transpose(-1, -2).contiguous())
            for op in [dist.isend(k.contiguous(), (r + 1) % n), dist.irecv(nk, (r - 1) % n),
                       dist.isend(v.transpose(-1, -2).contiguous(), (r + 1) % n), dist.irecv(nvt, (r - 1) % n)]:
                op.wait()
            k, v = nk, nvt.transpose(-1, -2)
    return o, lse


def test_ring_forward_accepts_any_layout_of_the_blocks(ranks, one_thread, capsys):
    day10.check_ring_forward(ring_kv_apart, seed=1, world_size=3)
    assert ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("bad,says", [(ring_through_files, "rank 0's hop 1 of 2 to rank 1 carried zeros, expected "
                                                           "the K and V blocks of rank 0 (its own)"),
                                      (ring_own_block_every_hop, "rank 0's hop 2 of 2 to rank 1 carried the K and V "
                                                                 "blocks of rank 0, expected the K and V blocks of "
                                                                 "rank 2 (received at hop 1)")])
def test_ring_forward_checks_what_the_hops_carry(ranks, one_thread, bad, says):
    """Right outputs, the ring's bytes to the right neighbour, and the blocks beside the messages (cheat02): each
    hop must carry the block the rank holds."""
    try:
        with pytest.raises(AssertionError, match=re.escape(says)):
            day10.check_ring_forward(bad, seed=1, world_size=3)
    finally:
        for r in range(3):
            if os.path.exists(_kv_file(r)):
                os.unlink(_kv_file(r))
