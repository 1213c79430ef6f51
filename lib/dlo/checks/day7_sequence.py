"""Day 7's exercises 4 and 5 (sequence parallelism around the norm, vocabulary-parallel
cross-entropy), re-exported by `dlo.checks.day7`.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from dlo.checks.day7_comms import CommTap, expect_blocks, expect_sum, recorded, verified
from dlo.checks.day7_shared import (
    COMMS,
    DTENSOR,
    F_G,
    LAYERS,
    SWIGLU_SPLIT,
    SwiGLU,
    assert_block_close,
    expect_comms,
    fwd_bwd,
    only_blocks,
    param_grad,
    reference,
    seeded_gen,
)
from dlo.checks.saved import HOOKS, GuardedMeter
from dlo.checks.torch_source import torch_defined
from dlo.grading.api import case_seed, check, on_ranks
from dlo.grading.compare import DTYPE, assert_close, ok
from dlo.measure import CommCounter, SavedTensorMeter

SP = tuple(COMMS + n for n in ("gather_from_sp", "reduce_scatter_to_sp", "all_gather", "reduce_scatter",
                               "all_gather_linear", "GatherFromSequenceParallel.apply",
                               "ReduceScatterToSequenceParallel.apply", "AllGatherLinear.apply"))
# other holders of gather_fn's and scatter_fn's work, each an all-gather with a reduce-scatter as its backward or the
# reverse (a red-team audit of 2026-12-02: each passed the check): torch's autograd-aware collectives
# (`torch.cat(torch.distributed.nn.functional.all_gather(x), 1)`, funcol's `all_gather_tensor_autograd(x, 1, group)`
# and their operators) and Day 7's collective matmuls with an identity weight (`async_tp.matmul_reduce_scatter`)
SP += torch_defined("torch.distributed.nn.functional", (
    "_Broadcast", "_Gather", "_Scatter", "_Reduce", "_Reduce_Scatter", "_AllGather", "_AllGatherBase", "_AlltoAll",
    "_AlltoAllSingle", "_AllReduce", "_all_gather_base")) + torch_defined("torch.distributed._functional_collectives", (
        "all_gather_single_autograd", "reduce_scatter_single_autograd", "all_gather_tensor_autograd",
        "reduce_scatter_tensor_autograd"), star=False) + ("_c10d_functional_autograd::*", "dlo.distributed.async_tp.*")
# torch's vocabulary-parallel cross-entropy (what loss_parallel switches on): its log-softmax over the shards, its
# masked target logit and its fused backward, called on the rank's logits, passed exercise 5 (the same audit)
VOCAB_CE = torch_defined("torch.distributed.tensor.parallel.loss", (
    "_log_softmax", "_log_softmax_handler", "_log_softmax_backward_handler", "_nll_loss_forward",
    "_nll_loss_forward_handler", "_nll_loss_and_log_softmax_backward", "_nll_loss_backward_handler",
    "_enable_custom_loss_ops"))


# ----------------------------------------------------------------------------- 4. sequence parallelism

def _sp_case(seed: int, t: int) -> dict:
    rng, gen = random.Random(seed), seeded_gen(seed, 4)
    B, dim, hidden = rng.choice([1, 3]), rng.choice([7, 9, 11]) * 2, t * rng.choice([1, 3])
    T = t * rng.choice([3, 5])
    norm = nn.RMSNorm(dim, eps=1e-5, dtype=DTYPE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, dtype=DTYPE))
    c = {"norm": norm, "ffn": SwiGLU(dim, hidden, gen), "x": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
         "up": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
         "where": dict(B=B, T=T, dim=dim, hidden=hidden, world_size=t, seed=seed)}
    # each rank's own full-length tensors: gather_fn's output gradient, scatter_fn's input
    c["g_up"] = [torch.randn(B, T, dim, generator=gen, dtype=DTYPE) for _ in range(t)]
    c["s_in"] = [torch.randn(B, T, dim, generator=gen, dtype=DTYPE) for _ in range(t)]
    return c


def _sp_parts(c: dict, t: int) -> list[dict]:
    """Rank r's part, drawn here: its block of the sequence and of the output gradient, its own
    full-length tensors for gather_fn's backward and scatter_fn's forward, the norm (replicated) and
    its own blocks of the MLP (`only_blocks`); what the other ranks hold has to come through a
    collective."""
    return [{"x": c["x"].chunk(t, 1)[r].clone(), "up": c["up"].chunk(t, 1)[r].clone(), "g_up": c["g_up"][r],
             "s_in": c["s_in"][r], "norm": c["norm"], "ffn": only_blocks(c["ffn"], t, r, SWIGLU_SPLIT)}
            for r in range(t)]


@recorded
def _sp_worker(mine, gather_fn, scatter_fn, cls):
    out = {"gather": fwd_bwd(lambda x: gather_fn(x), mine["x"], mine["g_up"]),
           "scatter": fwd_bwd(lambda x: scatter_fn(x), mine["s_in"], mine["up"])}
    block = cls(mine["norm"], mine["ffn"], None)
    x = mine["x"].detach().clone().requires_grad_(True)
    params = list(block.parameters()) + list(mine["norm"].parameters()) + list(mine["ffn"].parameters())
    with CommTap() as fwd, GuardedMeter(exclude=params) as meter:  # the student's own hook pair is forbidden
        y = block(x)
    with CommCounter() as bwd:
        (y * mine["up"]).sum().backward()
    out["block"] = {"y": y.detach(), "dx": x.grad, "fwd": fwd.by_kind("calls"), "bwd": bwd.by_kind("calls"),
                    "saved": meter.peak, "fwd_in": {c.kind: v for c, v in zip(fwd.calls, fwd.inputs)}}
    out["block"].update({w: param_grad(block, f"{w}.weight", "the sequence-parallel block")
                         for w in ("norm", "w1", "w2")})
    # a second backward before zero_grad (gradient accumulation): the norm's gradient must come to twice the
    # whole one; reducing the accumulated .grad (a post-accumulate hook) reduces the first backward's part again
    x2 = mine["x"].detach().clone().requires_grad_(True)
    (block(x2) * mine["up"]).sum().backward()
    out["block"]["norm_accumulated"] = param_grad(block, "norm.weight", "the sequence-parallel block")
    return out


def _saved(fn, x, params) -> int:
    with SavedTensorMeter(exclude=params) as meter:
        fn(x.detach().clone().requires_grad_(True))
        return meter.peak


@check(forbid=LAYERS + F_G + SP + HOOKS + DTENSOR)
def check_sequence_parallel(gather_fn, scatter_fn, cls, seed: int = 0, world_size: int = 2) -> None:
    """`gather_fn(x, group=None)`: all-gather along the sequence (dim 1) forward, reduce-scatter
    backward; `scatter_fn(x, group=None)`: reduce-scatter along dim 1 forward, all-gather backward;
    `cls(norm, ffn, group=None)`: x + ffn(norm(x)) on a (B, T/t, C) sequence shard, the norm on the
    shard, the MLP tensor-parallel between an all-gather and a reduce-scatter (each rank is given only
    its blocks of it: the others are NaN on its rank), the norm's weight gradient whole on every rank.
    Values, gradients, collectives, and the bytes saved for backward."""
    name, t = "sequence_parallel", world_size
    c = _sp_case(case_seed(seed), t)  # a secret seed when graded
    where = {**c["where"], "seed": seed}
    got = verified(name, on_ranks(_sp_worker, world_size, gather_fn, scatter_fn, cls, per_rank=_sp_parts(c, t)),
                   t, where)
    g_up_sum, s_in_sum = sum(c["g_up"]), sum(c["s_in"])
    y, dx = reference(lambda x: x + c["ffn"](c["norm"](x)), c["x"], c["up"])
    for r, res in enumerate(got):
        here = {**where, "rank": r}
        g_res, s_res, b_res = res["gather"], res["scatter"], res["block"]
        assert_close(name, "gather_fn output (every rank's shard, in rank order along dim 1)", g_res["y"], c["x"], here)
        assert_close(name, "gather_fn input gradient (reduce-scatter: the sum over ranks of this rank's block)",
                     g_res["dx"], g_up_sum.chunk(t, 1)[r], here)
        expect_comms(name, "gather_fn", {**g_res["fwd"], **{f"{k} (backward)": v for k, v in g_res["bwd"].items()}},
                     {"all_gather": 1, "reduce_scatter (backward)": 1}, "all-gather forward, reduce-scatter "
                     "backward", here)
        assert_close(name, "scatter_fn output (this rank's block of the sum over ranks)", s_res["y"],
                     s_in_sum.chunk(t, 1)[r], here)
        assert_close(name, "scatter_fn input gradient (all-gather of the shards' gradients)", s_res["dx"], c["up"],
                     here)
        assert_block_close(name, "block output (this rank's block of the sequence)", b_res["y"], y.chunk(t, 1)[r], here)
        assert_block_close(name, "block input gradient", b_res["dx"], dx.chunk(t, 1)[r], here)
        assert_block_close(name, "w1 gradient", b_res["w1"], c["ffn"].w1.weight.grad.chunk(t, 0)[r], here)
        assert_block_close(name, "w2 gradient", b_res["w2"], c["ffn"].w2.weight.grad.chunk(t, 1)[r], here)
        assert_block_close(name, "norm weight gradient (each rank's norm saw 1/t of the tokens: all-reduce each "
                           "backward's gradient, e.g. in a hook on norm.weight)", b_res["norm"], c["norm"].weight.grad,
                           here)
        assert_block_close(name, "norm weight gradient after a second backward without zero_grad (gradient "
                           "accumulation: twice the whole gradient; all-reduce each backward's gradient before it is "
                           "accumulated, `norm.weight.register_hook`, not the accumulated .grad, whose earlier part "
                           "is already whole)", b_res["norm_accumulated"], 2 * c["norm"].weight.grad, here)
        fwd = b_res["fwd"]
        if fwd.get("all_reduce") or fwd.get("all_gather") != 1 or fwd.get("reduce_scatter") != 1:
            raise AssertionError(f"{name}: the block's forward issued {fwd}: expected one all-gather of the normed "
                                 f"shard (shared by w1 and w3) and one reduce-scatter after w2, no all-reduce ({here})")
    _sp_payloads(name, c, [res["block"]["fwd_in"] for res in got], t, where)
    # Bytes saved for backward on one rank: the norm on T/t tokens, plus the MLP's own (its input, all
    # T tokens, and hidden/t units), measured here on one process with the same modules.
    B, T, dim, hidden = (where[k] for k in ("B", "T", "dim", "hidden"))
    params = list(c["norm"].parameters()) + list(c["ffn"].parameters())
    norm_full = _saved(c["norm"], c["x"], params)
    norm_shard = _saved(c["norm"], c["x"].chunk(t, 1)[0], params)
    local = SwiGLU(dim, hidden // t, seeded_gen(0, 5))  # its weights do not change the bytes saved
    mlp_local = _saved(local, c["x"], list(local.parameters()))
    budget = norm_shard + mlp_local + (norm_full - norm_shard) // 2
    for r, res in enumerate(got):
        saved = res["block"]["saved"]
        if saved > budget:
            raise AssertionError(f"{name}: rank {r} saved {saved} bytes for backward; with the norm on its sequence "
                                 f"shard about {norm_shard + mlp_local} are needed ({norm_shard} for the norm on "
                                 f"{T // t} tokens, {mlp_local} for the MLP), {norm_full + mlp_local} with the norm "
                                 f"on all {T} tokens: run the norm on the shard and all-gather after it ({where})")
    ok(name, f"all-gather/reduce-scatter, values and saved bytes on {world_size} ranks, seed={seed}")


def _sp_payloads(name: str, c: dict, sent: list[dict], t: int, where) -> None:
    """What the block's forward collectives carried: each rank's all-gather its normed shard (the norm ran on
    T/t tokens, computed here from the shard: gathering the raw input and norming all T tokens fails), the
    reduce-scatter's inputs w2's partial products, summing to the MLP's output on all T tokens (the residual
    added after the reduce-scatter, or before)."""
    with torch.no_grad():
        normed = [c["norm"](x) for x in c["x"].chunk(t, 1)]
        mlp = c["ffn"](torch.cat(normed, 1))
    expect_blocks(name, "the forward all-gather", [s["all_gather"] for s in sent], normed,
                  "norm(x) of its sequence shard", "run the norm on the shard, then all-gather its output (not the "
                  "raw input: the norm would run on all T tokens on every rank)", where)
    expect_sum(name, "the forward reduce-scatter", [s["reduce_scatter"] for s in sent], [mlp, mlp + c["x"]],
               "the MLP's output on all T tokens", "reduce-scatter w2's partial products (B, T, C), nothing else",
               where)


# ----------------------------------------------------------------------------- 5. vocabulary-parallel cross-entropy

def _ce_case(seed: int, t: int, trial: int) -> dict:
    rng, gen = random.Random(seed * 10 + trial), seeded_gen(seed, 50 + trial)
    N, V = rng.choice([1, 7, 13]), t * rng.choice([3, 5, 11])
    shift = 800.0 if trial == 1 else 0.0  # exp(800) overflows float64: subtract the max first
    logits = torch.randn(N, V, generator=gen, dtype=DTYPE) * rng.choice([0.5, 3.0]) + shift
    return {"logits": logits, "target": torch.randint(0, V, (N,), generator=gen),
            "where": dict(N=N, V=V, shift=shift, world_size=t, seed=seed)}


@recorded
def _ce_worker(mine, fn):
    """`mine`: this rank's part of each trial (its slice of the logits, the targets), drawn on the
    grader's side: no rank holds the whole logits, nor the seed they came from."""
    out = []
    for part in mine:
        logits = part["logits"].clone().requires_grad_(True)
        with CommCounter() as comm:
            loss = fn(logits, part["target"].clone(), None)
            torch.as_tensor(loss).backward()
        out.append({"loss": torch.as_tensor(loss).detach(), "grad": logits.grad,
                    "calls": [(call.kind, call.nbytes) for call in comm.calls]})
    return out


def _ce_records(name: str, records: list[list[dict]], cases: list[dict]) -> None:
    """The per-trial rule below on every collective the rank's worker issued (`recorded`'s count, which
    `verified` holds to the rank's sockets): the per-trial lists come from counters of their own, which an empty
    reply would leave with nothing to judge."""
    allowed = sum(4 * c["where"]["N"] * c["logits"].element_size() for c in cases)
    for r, recs in enumerate(records):
        other = sorted({x["kind"] for x in recs if x["kind"] != "all_reduce"})
        total = sum(x["bytes"] for x in recs if x["kind"] == "all_reduce")
        if other or total > allowed:
            raise AssertionError(f"{name}: rank {r} issued {other or 'all-reduces'} of {total:,} bytes in all over the "
                                 f"{len(cases)} trials, {allowed:,} allowed: only all-reduces of per-token numbers "
                                 f"(max, sum of exponentials, target logit) are needed; gathering the logits is what "
                                 f"the exercise avoids")


@check(forbid=LAYERS + ("torch.distributed.tensor.parallel.loss_parallel",) + VOCAB_CE + DTENSOR)
def check_vocab_parallel_cross_entropy(fn, seed: int = 0, world_size: int = 2, trials: int = 3) -> None:
    """`fn(logits, target, group=None)`: the mean cross-entropy of (N, V/t) logits split by
    vocabulary (rank r holds classes [r V/t, (r+1) V/t)) against global targets (N,), differentiable,
    communicating only per-token numbers (never the logits). Loss and logits gradient against
    F.cross_entropy on the whole logits; one trial has logits near 800 (subtract the max)."""
    name = "vocab_parallel_cross_entropy"
    t = world_size
    cases = [_ce_case(case_seed(seed), t, trial) for trial in range(trials)]  # a secret seed when graded
    for c in cases:
        c["where"]["seed"] = seed
    per_rank = [[{"logits": c["logits"].chunk(t, -1)[r].clone(), "target": c["target"]} for c in cases]
                for r in range(t)]
    raw = on_ranks(_ce_worker, world_size, fn, per_rank=per_rank)
    got = verified(name, raw, t, cases[0]["where"])
    for trial, c in enumerate(cases):
        logits = c["logits"].clone().requires_grad_(True)
        loss = F.cross_entropy(logits, c["target"])
        loss.backward()
        N = c["where"]["N"]
        for r, rank_out in enumerate(got):
            if not isinstance(rank_out, list) or len(rank_out) != len(cases):
                raise AssertionError(f"{name}: rank {r} returned {len(rank_out) if isinstance(rank_out, list) else 0} "
                                     f"of {len(cases)} trials: the grader got no result to check for the rest")
            res, here = rank_out[trial], {**c["where"], "rank": r}
            big = [(k, n) for k, n in res["calls"] if k != "all_reduce" or n > 4 * N * 8]
            if big:
                raise AssertionError(f"{name}: collectives {big} (kind, bytes): only all-reduces of per-token numbers "
                                     f"(max, sum of exponentials, target logit: {N * 8} bytes each) are needed; "
                                     f"gathering the logits is what the exercise avoids ({here})")
            # bounded in all, not per call: many small all-reduces of a few columns each gather the logits too
            reduces = [n for k, n in res["calls"] if k == "all_reduce"]
            total, calls = sum(reduces), len(reduces)
            if total > 4 * N * c["logits"].element_size():
                raise AssertionError(f"{name}: {calls} all-reduces of {total:,} bytes in all on rank {r}: the loss "
                                     f"needs 3 numbers per token from the other ranks (max, sum of exponentials, "
                                     f"target logit: {3 * N * 8:,} bytes); moving the logits through all-reduces "
                                     f"is gathering them, which the exercise avoids ({here})")
            assert_close(name, "loss", res["loss"], loss.detach(), here)
            assert_close(name, "logits gradient (this rank's classes)", res["grad"], logits.grad.chunk(t, -1)[r], here)
    _ce_records(name, [res["records"] for res in raw], cases)
    ok(name, f"{trials} trials on {world_size} ranks, seed={seed}")
