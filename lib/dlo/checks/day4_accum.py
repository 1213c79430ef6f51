"""Autograder check for Day 4's exercise 4, gradient accumulation with no_sync, part of `dlo.checks.day4`.

The student's step runs on `world_size` fresh ranks around the library's `DataParallelBucket`, each rank
given only its own slices of the batches (`day4_train.ddp_parts`); the reference, one process on the whole
batch, is computed here. Beside the result, the worker records what accumulation is: a forward per
micro-batch, a backward per micro-batch with the gradient sync off for all but the last, each the backward of
one forward's output, one all-reduce round per step, and everything the ranks sent (`verify_wire`). The watches
read autograd's engine (the backward pass running, the node it runs) and the module call that ran a forward, so
that calling their hooks directly shows.
"""

from __future__ import annotations

import random
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from dlo.checks.day4_train import SMALL_CAP, checks_optimizer, compare_params, ddp_parts, param_list, single_process
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import ok
from dlo.measure import CommCounter


def _accum_case(seed: int):
    return random.Random(seed).choice([(7, 2), (9, 4), (11, 3), (7, 3), (9, 2)])  # never divisible: unequal chunks


# autograd's engine as it runs, taken at import: the backward pass running on this thread (-1: none) and the node
# it is executing; the code of a module call, which calls its forward hooks (`_call_impl`, and the function nested
# in it that runs the hooks)
_GRAPH_TASK, _CURRENT_NODE = torch._C._current_graph_task_id, torch._C._current_autograd_node
_MODULE_CALL = frozenset([nn.Module._call_impl.__code__, *(c for c in nn.Module._call_impl.__code__.co_consts
                                                             if isinstance(c, types.CodeType))])


def _accum_worker(mine: dict, fn, micro: int):
    """`mine`: this rank's part (`ddp_parts`). Per step: all-reduces issued, buckets, each forward of the wrapped
    module (`model(x)` and `model.module(x)` both reach it: its rows, whether a module call made it, the backward
    passes its output's gradient was computed in), the first layer's gradient accumulations (backward's last) made
    by autograd's engine with the sync flag at each, the watches' calls from anywhere else, largest |grad| left after
    the step, what `fn` returned; then the parameters and everything counted, for the sockets."""
    from dlo.distributed.ddp import DataParallelBucket

    with CommCounter() as rec:
        model = DataParallelBucket(mine["net"], bucket_cap_mb=SMALL_CAP)  # 2 buckets
    opt = checks_optimizer(model, mine["lr"])
    net, first_param = model.module, next(model.module.parameters())
    forwards_of = {type(m): type(m).forward for m in net.modules()}  # the classes' own, before the student's code
    forwards, accs, elsewhere = [], [], []

    def watch_forward(module, args, output):
        """A real forward: called by a module call of the model's module, its forwards as they were (no
        micro-batch output taken from a forward the watch did not see)."""
        real = (sys._getframe(1).f_code in _MODULE_CALL and module is net and all(
            "forward" not in vars(m) and type(m).forward is forwards_of.get(type(m)) for m in net.modules()))
        seen = {"rows": int(args[0].shape[0]) if args and isinstance(args[0], torch.Tensor) else -1, "real": real,
                "backward": []}
        forwards.append(seen)
        node = getattr(output, "grad_fn", None)
        if real and node is not None:  # the output's gradient: computed once, in the backward of that micro-batch
            output.register_hook(lambda _: seen["backward"].append(
                (_GRAPH_TASK(), _CURRENT_NODE() is node, bool(model.require_backward_grad_sync))))

    def watch_grad(p):
        node = _CURRENT_NODE()  # in backward: the AccumulateGrad node of this parameter, run by the engine
        if _GRAPH_TASK() != -1 and node is not None and getattr(node, "variable", None) is p:
            accs.append((_GRAPH_TASK(), bool(model.require_backward_grad_sync)))
        else:
            elsewhere.append("the first parameter's post-accumulate-grad hook")

    net.register_forward_hook(watch_forward)
    first_param.register_post_accumulate_grad_hook(watch_grad)
    steps_seen = []
    for x, y in mine["batches"]:
        xs, ys = list(x.tensor_split(micro)), list(y.tensor_split(micro))  # unequal sizes
        first = len(rec.calls)
        for kept in (forwards, accs, elsewhere):
            kept.clear()
        with rec:
            res = fn(model, opt, F.cross_entropy, xs, ys)
        left = max((float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None), default=0.0)
        real = [f for f in forwards if f["real"]]
        steps_seen.append({"all_reduces": sum(c.kind == "all_reduce" for c in rec.calls[first:]),
                           "buckets": len(model.buckets), "grad_left": left, "rows": [f["rows"] for f in real],
                           "syncs": [sync for _, sync in accs], "grad_tasks": [task for task, _ in accs],
                           "backward": [f["backward"] for f in real],
                           "elsewhere": sorted(set(elsewhere)) + (["the module's forward hook"] if len(real) <
                                                                   len(forwards) else []),
                           "micro_rows": [len(t) for t in xs],
                           "returned": None if res is None else f"{type(res).__name__}: {res!r}"[:100]})
    return {"steps": steps_seen, "params": param_list(model), "records": rec.records()}


def _accum_micro(st: dict, where: str) -> None:
    """Accumulation itself: one forward per micro-batch, of its rows, and as many backward passes, all but the
    last inside no_sync (the gradient hooks off), each the backward of one micro-batch's forward. One forward and
    backward of the concatenated batch gives the same weights and one all-reduce round too, but spends the
    activation memory accumulation exists to save. The watches count what autograd and module calls do: a hook of
    theirs called directly (a red team, 2026-12-02), or a forward's output left without its backward, fails."""
    want = st["micro_rows"]
    if st["elsewhere"]:
        raise AssertionError(f"accumulation_step: the grader's watches ({', '.join(st['elsewhere'])}) were called "
                             f"outside a forward of the model or outside autograd's backward (called directly, or the "
                             f"module's forward replaced); run each micro-batch through model(x) and call .backward() "
                             f"on its loss ({where})")
    if sorted(st["rows"]) != sorted(want):
        raise AssertionError(f"accumulation_step: forward passes of {st['rows']} rows; expected one per micro-batch, "
                             f"of {want} rows: run each (xs[j], ys[j]) through the model in turn, without "
                             f"concatenating them ({where})")
    if st["syncs"] != [False] * (len(want) - 1) + [True]:
        raise AssertionError(f"accumulation_step: {len(st['syncs'])} backward passes for {len(want)} micro-batches, "
                             f"gradient sync on at each: {st['syncs']}; expected one backward per micro-batch, all "
                             f"but the last inside model.no_sync() ({where})")
    passes = [[task for task, at_node, _ in b if at_node] for b in st["backward"]]
    tasks = [p[0] for p in passes if len(p) == 1]
    if len(tasks) < len(passes) or len(set(tasks)) < len(tasks) or set(tasks) != set(st["grad_tasks"]):
        raise AssertionError(f"accumulation_step: the forwards' outputs went through backward "
                             f"{[len(p) for p in passes]} times, in {len(set(tasks))} distinct backward passes of the "
                             f"{len(set(st['grad_tasks']))} that reached the first layer; expected each micro-batch's "
                             f"loss, from its own forward, backpropagated once, in a backward of its own ({where})")


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
