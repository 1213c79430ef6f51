"""Autograder checks for Day 4 (data parallelism): naive and bucketed DDP here; the ring all-reduce in
`day4_ring`, accumulation with no_sync in `day4_accum`, the sharding sampler and metric sync in `day4_data`,
what the training checks share in `day4_train`; all of them importable from here.

The student's functions run on `world_size` fresh ranks (`dlo.grading.api.on_ranks`, gloo) in workers that
only run the student's code and return what they observed: outputs, parameters after k steps, gradients, and
the collectives counted by `dlo.measure.CommCounter`. The case is drawn here (from a secret seed when
graded: `case_seed`) and each rank is given only its own part (`per_rank`): its own inputs, its own starting
weights, its own slice of each step's batch; never the seed nor the other ranks' parts. The references are
computed here, out of the student's reach: the sum of the ranks' inputs for the ring; for training, one
process on the full batch with the same optimizer (that torch's DistributedDataParallel computes the same is
pinned by tests/distributed/test_ddp.py, so no check pays for launching its ranks). Everything runs in
float64, where a correct implementation differs from the references only by summation order (~1e-15); the
tolerance (1e-10) leaves room for that and still catches a missing average or a dropped micro-batch. While
the student's code runs, the references that would solve the exercise are off limits (every collective in
the ring, DDP in the DDP exercises). A right result is not enough: what the ranks sent is counted beside the
student's code and held to what the exercise sends (a ring's messages, the gradients' bytes in all-reduces,
nothing after backward), and the ranks' own sockets must agree with the count (`verify_wire`), so a result
passed through a file, or dummy messages beside the real exchange, fails.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks.day4_accum import check_accumulation_step
from dlo.checks.day4_data import check_all_reduce_metrics, check_shard_indices
from dlo.checks.day4_ring import COLLECTIVES, POINT_TO_POINT, check_ring_all_reduce, one_neighbour
from dlo.checks.day4_train import (
    SMALL_CAP,
    buffer_list,
    checks_batch,
    checks_net,
    checks_optimizer,
    close_enough,
    compare_buffers,
    compare_params,
    ddp_parts,
    param_list,
    rows_per_rank,
    single_process,
)
from dlo.checks.torch_source import torch_defined
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import ok
from dlo.measure import CommCounter, tensor_bytes

# the autograd engine's graph task on this thread (-1 outside backward), taken at import (`dlo.measure.comm`'s own
# copy records each collective's): the step's backward is named by its first node, in the check's own hook
_GRAPH_TASK = torch._C._current_graph_task_id

_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
_HOOK_MODULES = ("default_hooks", "quantization_hooks", "powerSGD_hook", "mixed_precision_hooks",
                 "optimizer_overlap_hooks", "debugging_hooks", "post_localSGD_hook", "ddp_zero_hook")
# torch DDP's engine and start-up beside its Python class (a red team, 2026-12-02: torch's C++ Reducer with its
# bucket assignment did exercise 3, torch.distributed.utils._sync_module_states and the default comm hook's
# _allreduce_fut exercise 2): the Reducer, its bucketing and coalesced broadcast, DDP's start-up sync, its comm
# hooks (public and private) and the composable replicate() over DDP or FSDP
TORCH_DDP = ("torch.nn.parallel.DistributedDataParallel",) + tuple(
    f"torch.distributed.{n}" for n in ("Reducer", "_compute_bucket_assignment_by_size", "_broadcast_coalesced")
    if hasattr(dist, n)) + torch_defined("torch.distributed.utils", (
        "_sync_module_states", "_sync_params_and_buffers", "_verify_param_shape_across_processes"), star=False) + (
    f"{_HOOKS}.**",) + tuple(n for m in ("", *_HOOK_MODULES) for n in torch_defined(
        f"{_HOOKS}.{m}".rstrip("."), star=False, private=True)) + torch_defined(
    "torch.distributed.algorithms._comm_hooks.default_hooks", star=False, private=True) + (
    "torch.distributed.algorithms._comm_hooks.default_hooks.*",) + tuple(
    f"torch.distributed._composable.{m}.replicate" for m in ("replicate", "replicate_with_fsdp")
    if torch_defined(f"torch.distributed._composable.{m}", ("replicate",), star=False))
DDP = TORCH_DDP + ("dlo.distributed.ddp.*",)

__all__ = ["COLLECTIVES", "POINT_TO_POINT", "check_accumulation_step", "check_all_reduce_metrics", "check_bucket_ddp",
           "check_naive_ddp", "check_ring_all_reduce", "check_shard_indices", "one_neighbour"]


# ----------------------------------------------------------------------------- 2. naive DDP

def _naive_worker(mine: dict, broadcast_parameters, all_reduce_gradients):
    """`mine`: this rank's part (`ddp_parts`). What the student's two functions communicate is counted
    (`CommCounter`, phases "broadcast" and "step s": which call a record came from, by its place in the count, not by
    the counter's label, which the student's code can reach); the rank's sockets are compared with it after."""
    net = mine["net"]  # each rank starts from its own random weights
    with CommCounter() as rec:
        broadcast_parameters(net)
    spans = [("broadcast", 0, len(rec.calls))]
    start, buffers, grads = param_list(net), buffer_list(net), None
    opt = checks_optimizer(net, mine["lr"])
    for s, (x, y) in enumerate(mine["batches"]):
        F.cross_entropy(net(x), y).backward()
        first = len(rec.calls)
        with rec:
            all_reduce_gradients(net)
        spans.append((f"step {s}", first, len(rec.calls)))
        if s == 0:
            grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    records = rec.records()
    for phase, a, b in spans:
        for r in records[a:b]:
            r["phase"] = phase
    return {"start": start, "buffers": buffers, "grads": grads, "params": param_list(net), "records": records}


def _naive_comm(records: list, steps: int, psi_b: int, state_b: int, where: str) -> None:
    """The exercise's messages on one rank: broadcasts of at least the parameters' and buffers' bytes, then per
    step all-reduces of exactly the gradients' (Psi float64 values); nothing else. The right weights from a
    channel beside the process group (a file) would pass the comparisons alone."""
    sent = {}
    for rec in records:
        sent.setdefault(rec["phase"], {}).setdefault(rec["kind"], 0)
        sent[rec["phase"]][rec["kind"]] += rec["bytes"]
    bcast = sent.get("broadcast", {})
    if set(bcast) - {"broadcast"} or bcast.get("broadcast", 0) < state_b:
        raise AssertionError(f"broadcast_parameters: sent {bcast or 'nothing'} (bytes by kind); rank 0's parameters "
                             f"and buffers are {state_b:,} bytes: dist.broadcast each of them from rank 0 ({where})")
    for s in range(steps):
        step = sent.get(f"step {s}", {})
        if set(step) - {"all_reduce"} or step.get("all_reduce", 0) != psi_b:
            raise AssertionError(f"all_reduce_gradients: step {s + 1} sent {step or 'nothing'} (bytes by kind); the "
                                 f"gradients are {psi_b:,} bytes (Psi float64 values): dist.all_reduce each .grad "
                                 f"once, then divide ({where})")


@check(forbid=DDP)
def check_naive_ddp(broadcast_parameters, all_reduce_gradients, seed: int = 0, world_size: int = 2,
                    steps: int = 3) -> None:
    """`broadcast_parameters(module)` (rank 0's parameters and buffers everywhere) and
    `all_reduce_gradients(module)` (every .grad becomes the mean over ranks): trained on shards of a
    batch, the parameters must equal one process on the whole batch. The broadcasts carry the parameters
    and buffers, each step's all-reduces the gradients' bytes, and the sockets agree (`verify_wire`)."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank = rows_per_rank(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank"
    got = on_ranks(_naive_worker, world_size, broadcast_parameters, all_reduce_gradients,
                   per_rank=ddp_parts(secret, steps, per_rank, world_size))
    start, buffers = param_list(checks_net(secret + 1)), buffer_list(checks_net(secret + 1))
    first = checks_net(secret + 1)  # the gradient of step 1 on the whole batch
    x, y = checks_batch(secret, 0, n)
    F.cross_entropy(first(x), y).backward()
    ref = single_process(secret, steps, n)
    psi_b, state_b = tensor_bytes(start), tensor_bytes(start + buffers)
    for r, g in enumerate(got):
        for i, (p, want) in enumerate(zip(g["start"], start)):
            close_enough("broadcast_parameters", f"parameter {i} on rank {r} (must equal rank 0's)", p, want, where)
        compare_buffers("broadcast_parameters", g["buffers"], buffers, f"{where}, rank {r}")
        for i, (p, q) in enumerate(zip(g["grads"], first.parameters())):
            close_enough("all_reduce_gradients", f"grad of parameter {i} on rank {r} after step 1 (the mean over "
                   f"ranks, not the sum)", p, q.grad, where)
        compare_params("naive DDP", g["params"], ref, steps, where)
    for r, g in enumerate(got):  # the right numbers everywhere; then how they got there
        _naive_comm(g["records"], steps, psi_b, state_b, f"{where}, rank {r}")
    verify_wire("naive DDP", [g["records"] for g in got], world_size, where)
    ok("naive_ddp", f"{steps} steps on {world_size} ranks, seed={seed}")


# ----------------------------------------------------------------------------- 3. bucketed DDP


def _bucket_worker(mine: dict, cls, frozen: bool = False):
    """`mine`: this rank's part (`ddp_parts`). Per bucket cap: the buffers after construction, the
    all-reduces of each step as (async, during backward), and the parameters. With a frozen parameter,
    what the student's class raised is reported (to name the mistake), not raised."""
    out = []
    for cap_mb in (SMALL_CAP, 25.0):
        try:
            out.append(_bucket_run(mine, cls, cap_mb))
        except (RuntimeError, AttributeError, TypeError, KeyError) as e:
            if not frozen:
                raise
            out.append({"cap_mb": cap_mb, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def _bucket_run(mine: dict, cls, cap_mb: float) -> dict:
    """One model at one cap. Counted (`CommCounter`): the construction, and per step backward and
    finish_gradient_synchronization, as (kind, bytes, async, during backward); all of it is compared with the
    sockets. During backward: launched in the step's own backward pass (the graph task the engine runs when the loss's
    node starts it, the same for every hook of it); not a phase label, which the student's code can reach and set
    (a red team, 2026-12-02), nor another backward started in finish_gradient_synchronization."""
    with CommCounter() as rec:
        rec.phase = "construction"
        model = cls(copy.deepcopy(mine["net"]), bucket_cap_mb=cap_mb)
    buffers = buffer_list(model.module)  # the exercise's skeleton keeps the wrapped module there
    opt = checks_optimizer(model, mine["lr"])
    calls = []
    for x, y in mine["batches"]:
        loss, task = F.cross_entropy(model(x), y), []
        loss.grad_fn.register_prehook(lambda _, task=task: task.append(_GRAPH_TASK()))  # this backward's, at its start
        first = len(rec.calls)
        with rec:
            rec.phase = "backward"
            loss.backward()
            rec.phase = "after backward"
            model.finish_gradient_synchronization()
        during = task[0] if len(task) == 1 else None  # None: the loss's node never ran (or twice): no call counts
        calls.append([(c.kind, c.nbytes, c.async_op, c.graph_task == during) for c in rec.calls[first:]])
        opt.step()
        opt.zero_grad()
    return {"cap_mb": cap_mb, "buffers": buffers, "calls": calls, "params": param_list(model), "records": rec.records()}


def _bucket_comm(step_calls: list, cap_mb: float, n_params: int, psi_b: int, here: str) -> None:
    """One step's messages (`_bucket_run`): one async all-reduce per bucket, launched from the hooks during
    backward, carrying every gradient once (Psi float64 values: the buckets' buffers together); nothing else,
    and nothing after backward but waiting on the handles."""
    reduces = [(is_async, during) for kind, _, is_async, during in step_calls if kind == "all_reduce"]
    if not all(is_async and during for is_async, during in reduces):
        raise AssertionError(f"bucket DDP: every bucket's all-reduce must be launched with async_op=True "
                             f"from the gradient hooks, during loss.backward() (calls as (async, during "
                             f"backward): {reduces}; during backward is read from autograd's engine at the call) "
                             f"({here})")
    other = sorted({(kind, "during backward" if during else "after backward")
                    for kind, _, _, during in step_calls if kind != "all_reduce"})
    if other:
        raise AssertionError(f"bucket DDP: {', '.join(f'{k} {p}' for k, p in other)}: the gradients travel in the "
                             f"buckets' all-reduces only, and finish_gradient_synchronization() only waits on "
                             f"their handles and copies the averages back ({here})")
    if cap_mb == 25.0 and len(reduces) != 1:
        raise AssertionError(f"bucket DDP: {len(reduces)} all-reduce calls per step with "
                             f"bucket_cap_mb=25 (the whole model fits one bucket: expected 1) ({here})")
    if cap_mb < 1 and not 2 <= len(reduces) < n_params:
        raise AssertionError(f"bucket DDP: {len(reduces)} all-reduce calls per step for {n_params} "
                             f"parameters with a 50-element cap: expected several buckets, fewer than "
                             f"one per parameter ({here})")
    got = sum(nbytes for kind, nbytes, _, _ in step_calls)
    if got != psi_b:
        raise AssertionError(f"bucket DDP: the buckets' all-reduces carried {got:,} bytes in a step; the gradients "
                             f"are {psi_b:,} (Psi = {psi_b // 8} float64 values, frozen parameters left out): each "
                             f"bucket's buffer holds its parameters' gradients, all-reduced once ({here})")


@check(forbid=DDP)
def check_bucket_ddp(cls, seed: int = 0, world_size: int = 2, steps: int = 3, frozen: bool = False) -> None:
    """`cls(module, bucket_cap_mb)` with `finish_gradient_synchronization()`: rank 0's parameters and
    buffers broadcast; several buckets at a tiny cap and one at 25 MB, each launched async during
    backward, their buffers together the gradients' bytes, nothing else sent in a step (`_bucket_comm`), the
    sockets agreeing (`verify_wire`); parameters must equal one process on the whole batch. `frozen`: one
    parameter has requires_grad=False (no gradient: it must be left out of the buckets, as torch DDP does)."""
    secret = case_seed(seed)  # a secret seed when graded
    per_rank = rows_per_rank(secret)
    n, where = per_rank * world_size, f"world_size={world_size}, {per_rank} samples per rank"
    if frozen:
        where += ", the first layer's bias frozen (requires_grad=False)"
    got = on_ranks(_bucket_worker, world_size, cls, frozen,
                   per_rank=ddp_parts(secret, steps, per_rank, world_size, frozen))
    trainable = [p for p in checks_net(0, frozen).parameters() if p.requires_grad]
    n_params, psi_b = len(trainable), tensor_bytes(trainable)
    # the same for both caps
    ref, buffers = single_process(secret, steps, n, frozen), buffer_list(checks_net(secret + 1))
    for rank_runs in got:
        for run in rank_runs:
            cap_mb = run["cap_mb"]
            here = f"{where}, bucket_cap_mb={cap_mb:.3g}"
            if "error" in run:
                raise AssertionError(f"bucket DDP: {run['error']}; a parameter with requires_grad=False never gets "
                                     f"a gradient (and cannot take a hook): leave it out of the buckets ({here})")
            compare_buffers("bucket DDP", run["buffers"], buffers, here)
            for step_calls in run["calls"]:
                _bucket_comm(step_calls, cap_mb, n_params, psi_b, here)
            compare_params("bucket DDP", run["params"], ref, steps, here)
    verify_wire("bucket DDP", [[rec for run in rank_runs for rec in run["records"]] for rank_runs in got], world_size,
                where)
    ok("bucket_ddp", f"{steps} steps x 2 bucket sizes on {world_size} ranks, seed={seed}")
