"""Autograder check for Day 4's exercise 4, gradient accumulation with no_sync, part of `dlo.checks.day4`.

The student's step runs on `world_size` fresh ranks around the library's `DataParallelBucket`, each rank
given only its own slices of the batches (`day4_train.ddp_parts`); the reference, one process on the whole
batch, is computed here. Beside the result, the worker records what accumulation is: a forward per
micro-batch, a backward per micro-batch with the gradient sync off for all but the last, one all-reduce
round per step, and everything the ranks sent (`verify_wire`).
"""

from __future__ import annotations

import random

import torch.nn.functional as F

from dlo.checks.day4_train import SMALL_CAP, checks_optimizer, compare_params, ddp_parts, param_list, single_process
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import ok
from dlo.measure import CommCounter


def _accum_case(seed: int):
    return random.Random(seed).choice([(7, 2), (9, 4), (11, 3), (7, 3), (9, 2)])  # never divisible: unequal chunks


def _accum_worker(mine: dict, fn, micro: int):
    """`mine`: this rank's part (`ddp_parts`). Per step: all-reduces issued, buckets, the rows of each forward of
    the wrapped module (`model(x)` and `model.module(x)` both reach it), the sync flag at each backward (read
    when the first layer's gradient, backward's last, is accumulated), largest |grad| left after the step, what
    `fn` returned; then the parameters and everything counted, for the sockets."""
    from dlo.distributed.ddp import DataParallelBucket

    with CommCounter() as rec:
        model = DataParallelBucket(mine["net"], bucket_cap_mb=SMALL_CAP)  # 2 buckets
    opt = checks_optimizer(model, mine["lr"])
    rows, syncs = [], []
    model.module.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].shape[0])))
    next(model.module.parameters()).register_post_accumulate_grad_hook(
        lambda _: syncs.append(bool(model.require_backward_grad_sync)))
    steps_seen = []
    for x, y in mine["batches"]:
        xs, ys = list(x.tensor_split(micro)), list(y.tensor_split(micro))  # unequal sizes
        first = len(rec.calls)
        rows.clear()
        syncs.clear()
        with rec:
            res = fn(model, opt, F.cross_entropy, xs, ys)
        left = max((float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None), default=0.0)
        steps_seen.append({"all_reduces": sum(c.kind == "all_reduce" for c in rec.calls[first:]),
                           "buckets": len(model.buckets), "grad_left": left, "rows": list(rows),
                           "syncs": list(syncs), "micro_rows": [len(t) for t in xs],
                           "returned": None if res is None else f"{type(res).__name__}: {res!r}"[:100]})
    return {"steps": steps_seen, "params": param_list(model), "records": rec.records()}


def _accum_micro(st: dict, where: str) -> None:
    """Accumulation itself: one forward per micro-batch, of its rows, and as many backward passes, all but the
    last inside no_sync (the gradient hooks off). One forward and backward of the concatenated batch gives the
    same weights and one all-reduce round too, but spends the activation memory accumulation exists to save."""
    want = st["micro_rows"]
    if sorted(st["rows"]) != sorted(want):
        raise AssertionError(f"accumulation_step: forward passes of {st['rows']} rows; expected one per micro-batch, "
                             f"of {want} rows: run each (xs[j], ys[j]) through the model in turn, without "
                             f"concatenating them ({where})")
    if st["syncs"] != [False] * (len(want) - 1) + [True]:
        raise AssertionError(f"accumulation_step: {len(st['syncs'])} backward passes for {len(want)} micro-batches, "
                             f"gradient sync on at each: {st['syncs']}; expected one backward per micro-batch, all "
                             f"but the last inside model.no_sync() ({where})")


@check(forbid=("torch.nn.parallel.DistributedDataParallel",))
def check_accumulation_step(fn, seed: int = 0, world_size: int = 2, steps: int = 2) -> None:
    """`fn(model, optimizer, loss_fn, xs, ys)`: one optimizer step of a DataParallelBucket model over
    micro-batches of unequal size, each its own forward and backward, all but the last in no_sync; one
    all-reduce round only (the sockets agreeing), parameters equal to one process on the whole batch."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank, micro = _accum_case(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank in {micro} micro-batches"
    got = on_ranks(_accum_worker, world_size, fn, micro, per_rank=ddp_parts(secret, steps, per_rank, world_size))
    ref = single_process(secret, steps, n)
    for g in got:
        for st in g["steps"]:
            if st["all_reduces"] != st["buckets"]:
                raise AssertionError(f"accumulation_step: {st['all_reduces']} all-reduce calls for {micro} "
                                     f"micro-batches; expected {st['buckets']} (one per bucket, only on the last "
                                     f"micro-batch: wrap the others in model.no_sync()) ({where})")
            _accum_micro(st, where)
            if st["returned"] is not None:
                raise AssertionError(f"accumulation_step: returns nothing (None), its work is on the model and the "
                                     f"optimizer; it returned {st['returned']} ({where})")
            if st["grad_left"] > 0:
                raise AssertionError(f"accumulation_step: gradients are not zero after the step; call "
                                     f"optimizer.zero_grad() after optimizer.step() ({where})")
        compare_params("accumulation_step", g["params"], ref, steps, where)
    verify_wire("accumulation_step", [g["records"] for g in got], world_size, where)
    ok("accumulation_step", f"{steps} steps on {world_size} ranks, seed={seed}")
