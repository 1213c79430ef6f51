"""Autograder checks for Day 5 (sharded data parallelism: ZeRO-1/2/3 and FSDP2).

The ZeRO checks run the student's engine on `world_size` ranks through `on_ranks`: a trusted worker
below builds a small language model with a tied embedding and tensors of odd sizes (nothing divides by
the world size), gives each rank its slice of a global batch, trains, and records what it observes: the
parameters the modules hold during a forward, the collectives of each phase (`dlo.measure.CommCounter`:
calls, payload bytes, async, forward/backward/step; their total checked against what the ranks' TCP
sockets sent, read outside the ranks: `dlo.grading.api.verify_wire`), and the bytes of model state the engine
holds (`dlo.measure.held_bytes`) and the rank keeps (`dlo.measure.live_bytes`) after the step and during
backward or forward. The check compares,
outside the worker, with one process on the whole batch: after one step of plain SGD (the gradient
itself: a sum where a mean is due shows as a factor N) and after k AdamW steps; ZeRO-1/2's ranks with
each other after a step in which all but rank 0 had their parameters disturbed (`verify_in_sync`: the
all-gather of the updated shards makes them equal again, and each value carries its owner's disturbance:
`verify_owners`); with the ZeRO paper's byte counts (2 Psi sent
per step for ZeRO-1/2, 3 Psi for ZeRO-3, within 5%) and memory formulas
(`dlo.distributed.zero.memory_per_rank`, within the padding of the flat buffers and one parameter's
gradient). Everything is float64, where a correct engine agrees with one process to ~1e-15
(`assert_close`'s default tolerance, 1e-9, catches any slip).

Here: the accountant (1) and ZeRO-1/2/3 (2-4); their test bench is `dlo.checks.day5_zero` (the model, the
reference, the comparisons), `day5_worker` (the trusted worker), `day5_memory` (what a rank keeps, after the
step and during it), `day5_count` (ZeRO-2's memory as the kernel counts it, outside the rank) and `day5_sync`
(the disturbed step: ZeRO's owners against DDP); FSDP2 (5) is `dlo.checks.day5_fsdp`, re-exported here.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from dlo.checks.day5_count import count_part, count_worker, verify_count
from dlo.checks.day5_fsdp import check_fsdp2
from dlo.checks.day5_memory import (
    ALLOWED,
    memory_slack,
    verify_backward,
    verify_forward,
    verify_memory,
    verify_unit_backward,
)
from dlo.checks.day5_sync import verify_in_sync, verify_owners
from dlo.checks.day5_worker import build_engine, rank_part, zero_worker
from dlo.checks.day5_zero import (
    BYTES_TOL,
    STEP,
    batch,
    case,
    count_psi,
    expect_bytes,
    fmt_where,
    lm_loss,
    optimizer_for,
    padding_bytes,
    tied_lm,
    verify_every_byte,
    verify_training,
)
from dlo.checks.rank_count import every_rank
from dlo.distributed.zero import memory_per_rank
from dlo.grading.api import case_seed, check, on_ranks, verify_wire, wire_sent
from dlo.grading.compare import DTYPE, assert_number, ok
from dlo.measure import comm_bytes, held_bytes

__all__ = ["check_fsdp2", "check_memory_accountant", "check_zero1", "check_zero2", "check_zero3"]


Z = "dlo.distributed.zero."
# the methods first (a subclass of the library's engine would reach them), then the classes themselves
# (torch's own equivalents are forbidden where they are the exercise: importing them costs each rank a second)
ZERO_REFS = tuple(Z + n for n in ("ZeRO1.__init__", "ZeRO2.__init__", "ZeRO3.__init__", "ZeRO1.step", "ZeRO2.step",
                                  "ZeRO3.step", "ZeRO1", "ZeRO2", "ZeRO3"))


# ----------------------------------------------------------------------------- 1. the memory accountant

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LLAMA_3B = 3_212_749_824


# the accounting module's rule too: precision_of (copy_widths under it) is the mixed-precision rule, the
# exercise's second bullet, and training_bytes_per_param the per-parameter sum; OPTIMIZER_STATES stays open
# (a dict of three numbers the exercise's text gives), as do shard_numel (a ceil) and PRECISIONS (three rows
# that leave the dtype rule to the student)
ACCOUNTANT_REFS = (Z + "memory_per_rank", "dlo.plan.row") + tuple(
    "dlo.accounting." + n for n in ("model_state_bytes", "precision_of", "copy_widths", "training_bytes_per_param"))


@check(forbid=ACCOUNTANT_REFS)
def check_memory_accountant(fn, seed: int = 0, trials: int = 40) -> None:
    """`fn(n_params, world_size, stage, *, param_dtype, optimizer) -> {"params", "grads", "optimizer",
    "total"}`: bytes per rank, stage 0 (DDP) to 3, against the ZeRO paper's formulas (exact ints)
    on random sizes, dtypes and optimizers and on Llama 3.2 3B; then against what the library's
    ZeRO engines hold on a fake process group of 2 and 3 ranks."""
    name, rng = "memory_accountant", random.Random(case_seed(seed))
    cases = [(LLAMA_3B, 8, s, torch.bfloat16, "adamw") for s in range(4)]
    cases += [(rng.choice([1, 7, 1001, 10 ** 6 + 3, LLAMA_3B]), rng.choice([1, 2, 3, 8, 64]), rng.randrange(4),
               rng.choice(DTYPES), rng.choice(["adamw", "sgd", "sgd_momentum"])) for _ in range(trials)]
    for n_params, world_size, stage, dtype, opt in cases:
        where = dict(n_params=n_params, world_size=world_size, stage=stage, param_dtype=str(dtype), optimizer=opt)
        got = fn(n_params, world_size, stage, param_dtype=dtype, optimizer=opt)
        want = memory_per_rank(n_params, world_size, stage, param_dtype=dtype, optimizer=opt)
        if not isinstance(got, dict) or set(want) - set(got):
            raise AssertionError(f"{name}: return a dict with keys {sorted(want)}, got {got!r}")
        for key, w in want.items():
            g = assert_number(name, key, got[key], where)
            if g != w:
                sharded = stage >= {"params": 3, "grads": 2, "optimizer": 1}.get(key, 1)
                hint = (" (a shard is ceil(n_params / world_size) elements)" if sharded and n_params % world_size else
                        " (16-bit parameters mean mixed precision: an fp32 master copy and fp32 moments)"
                        if dtype in DTYPES[:2] and key in ("optimizer", "total") else "")
                raise AssertionError(f"{name}: {key} = {g:,.0f} bytes, expected {w:,}{hint} ({fmt_where(where)})")
    _engines_hold(name, fn, random.Random(seed).choice([5, 6, 7]))
    ok(name, f"{len(cases)} cases and the library's engines at 2 and 3 ranks, seed={seed}")


def _engines_hold(name: str, fn, seed: int) -> None:
    """The library's ZeRO engines, one AdamW step on a fake process group: held bytes vs fn."""
    from dlo.distributed.zero import ZeRO1, ZeRO2, ZeRO3
    from dlo.plan import fake_world

    if dist.is_initialized():  # under torchrun: no fake group in this process
        return
    c = case(seed)
    for world_size in (2, 3):
        with fake_world(world_size):
            for stage, cls in ((1, ZeRO1), (2, ZeRO2), (3, ZeRO3)):
                model = tied_lm(c, 0)
                extra = {"bucket_cap_mb": 1e-3} if stage == 2 else {}
                engine = build_engine(cls, stage, model, *optimizer_for(c, "adamw"), extra)
                lm_loss(engine, *batch(c, seed, 0, 2)).backward()
                engine.step()
                held = held_bytes(engine)
                got = fn(count_psi(c), world_size, stage, param_dtype=DTYPE, optimizer="adamw")["total"]
                if abs(held - got) > memory_slack(c, world_size, stage):
                    raise AssertionError(f"{name}: ZeRO-{stage} at {world_size} ranks holds {held:,} bytes after an "
                                         f"AdamW step in float64, your accountant says {got:,}")


# ----------------------------------------------------------------------------- 2-4. ZeRO-1, -2, -3

@check(forbid=ZERO_REFS + ("torch.distributed.optim.ZeroRedundancyOptimizer",))
def check_zero1(cls, seed: int = 0, world_size: int = 2, steps: int = 3) -> None:
    """`cls(module, optimizer_cls, **optimizer_kwargs)` with `step()` and `zero_grad()`: one
    reduce-scatter and one all-gather per step (2 Psi, no all-reduce), the optimizer state of
    1/N of the parameters per rank; parameters equal to one process after one SGD step and k AdamW steps."""
    name, secret = "zero1", case_seed(seed)  # the case's seed: secret when graded
    c = case(secret)
    res = on_ranks(zero_worker, world_size, cls, 1, steps, {},
                   per_rank=[rank_part(c, secret, r, world_size, steps) for r in range(world_size)])
    where = f"world_size={world_size}, seed={seed}"
    every_rank(name, res, world_size, where)
    verify_training(name, res, c, secret, steps, world_size, seed)
    verify_wire(name, [[rec for key in ("one_bucket_comm", "comm", "adamw_comm") for rec in got.get(key, ())]
                       for got in res], world_size, where)
    psi_b = 8 * count_psi(c)
    for r, got in enumerate(res):
        calls = got["comm"]
        if comm_bytes(calls, "all_reduce", STEP):
            raise AssertionError(f"{name}: rank {r} all-reduces the gradients: that is 2 Psi already, and the "
                                 f"all-gather of the parameters makes 3 Psi. Reduce-scatter them: each rank only "
                                 f"needs the averaged slice its optimizer updates ({where})")
        expect_bytes(name, "reduce-scatter of the gradients", comm_bytes(calls, "reduce_scatter", STEP), psi_b, 1,
                     "reduce-scatter the whole flat gradient once per step", where)
        expect_bytes(name, "all-gather of the updated parameters", comm_bytes(calls, "all_gather", STEP), psi_b, 1,
                     "all-gather the whole flat parameter buffer once per step", where)
    verify_every_byte(name, res, 1, psi_b, steps, where, padding_bytes(c, world_size))
    verify_in_sync(name, res, 1, where)
    m = verify_memory(name, res, c, 1, world_size, where)
    verify_owners(name, res, c, secret, world_size, 1, where)  # after the memory: a shard copied shows there first
    ok(name, f"{steps} steps on {world_size} ranks, 2 Psi = {2 * psi_b:,} bytes per step, {res[0]['held']:,} bytes "
             f"held (formula {m['want']:,} + {res[0]['held'] - m['want']:,} of the {m['slack']:,} allowed for "
             f"{ALLOWED[1]}), seed={seed}")


@check(forbid=ZERO_REFS)
def check_zero2(cls, seed: int = 0, world_size: int = 2, steps: int = 3) -> None:
    """`cls(module, optimizer_cls, bucket_cap_mb=25.0, **optimizer_kwargs)`: gradients
    reduce-scattered bucket by bucket (async, from gradient hooks, during backward), only the 1/N
    gradient shard kept (also during backward, wherever the rank keeps it: at most a couple of buckets of full
    gradients);
    parameters equal to one process. Run at a tiny bucket cap (several buckets) and at 25 MiB (one)."""
    name, secret = "zero2", case_seed(seed)  # the case's seed: secret when graded
    c = case(secret)
    cap = 60 * 8 / 2 ** 20  # 60 float64 elements: several buckets, whichever side of the cap a bucket closes on
    res = on_ranks(zero_worker, world_size, cls, 2, steps, {"bucket_cap_mb": cap}, {"bucket_cap_mb": 25.0},
                   per_rank=[rank_part(c, secret, r, world_size, steps) for r in range(world_size)])
    where = f"world_size={world_size}, seed={seed}"
    every_rank(name, res, world_size, where)
    verify_training(name, res, c, secret, steps, world_size, seed)
    verify_wire(name, [[rec for key in ("one_bucket_comm", "comm", "adamw_comm") for rec in got.get(key, ())]
                       for got in res], world_size, where)
    psi_b = 8 * count_psi(c)
    for r, got in enumerate(res):
        rs = [x for x in got["comm"] if x["kind"] == "reduce_scatter" and x["phase"] in STEP]
        if len(rs) < 2 or not all(x["async"] and x["phase"] == "backward" for x in rs):
            raise AssertionError(f"{name}: rank {r} issued {len(rs)} reduce-scatter(s) with bucket_cap_mb={cap:.2g}; "
                                 f"expected several buckets, each launched with async_op=True from a gradient hook "
                                 f"during backward (calls as (async, phase): "
                                 f"{[(x['async'], x['phase']) for x in rs]}) ({where})")
        n_big = got["one_bucket"]
        if n_big != 1:
            raise AssertionError(f"{name}: {n_big} reduce-scatters per step with bucket_cap_mb=25: the whole model "
                                 f"fits one bucket ({where})")
        calls = got["comm"]
        expect_bytes(name, "reduce-scatter of the gradients", comm_bytes(calls, "reduce_scatter", STEP), psi_b, 1,
                     "every gradient goes through one reduce-scatter", where)
        expect_bytes(name, "all-gather of the updated parameters", comm_bytes(calls, "all_gather", STEP), psi_b, 1,
                     "all-gather every bucket's parameters after the step", where)
        if comm_bytes(calls, "all_reduce", STEP):
            raise AssertionError(f"{name}: an all-reduce of the gradients leaves every rank the full gradient; "
                                 f"reduce-scatter ({where})")
    verify_every_byte(name, res, 2, psi_b, steps, where, padding_bytes(c, world_size))
    verify_in_sync(name, res, 2, where)
    m = verify_memory(name, res, c, 2, world_size, where)
    verify_owners(name, res, c, secret, world_size, 2, where)
    verify_backward(name, res, c, m, cap, where)
    counted = ""
    if wire_sent() is not None:  # ranks the launcher reads (not the tests' reused ones): the kernel's count too
        big = count_part(secret, world_size)
        counted = on_ranks(count_worker, world_size, cls, per_rank=big["parts"])
        counted = f"; {verify_count(name, big, counted, world_size, where)}"
    ok(name, f"{steps} steps on {world_size} ranks, buckets reduce-scattered during backward, peak "
             f"{max(res[0]['samples']['backward']):,} bytes{counted}, seed={seed}")


@check(forbid=ZERO_REFS + ("torch.distributed.fsdp.fully_shard",))
def check_zero3(cls, seed: int = 0, world_size: int = 2, steps: int = 3) -> None:
    """`cls(module, optimizer_cls, units=[blocks], **optimizer_kwargs)`: parameters sharded; each
    unit all-gathered just before its forward and freed after, gathered again for its backward,
    gradients reduce-scattered per unit during backward (3 Psi per step); 1/N of everything held between
    steps, little more during forward and backward; parameters equal to one process."""
    name, secret = "zero3", case_seed(seed)  # the case's seed: secret when graded
    c = case(secret)
    res = on_ranks(zero_worker, world_size, cls, 3, steps, {},
                   per_rank=[rank_part(c, secret, r, world_size, steps) for r in range(world_size)])
    where = f"world_size={world_size}, seed={seed}"
    every_rank(name, res, world_size, where)
    verify_training(name, res, c, secret, steps, world_size, seed)
    verify_wire(name, [[rec for key in ("one_bucket_comm", "comm", "adamw_comm") for rec in got.get(key, ())]
                       for got in res], world_size, where)
    psi_b = 8 * count_psi(c)
    for got in res:
        calls = got["comm"]
        regather = "free each unit after its forward and gather it again before its backward (the root too: its " \
                   "output's hook gathers it again): keeping the gathered weights until backward (or until the next " \
                   "step) is not ZeRO-3's memory"
        # backward first: a missing re-gather is the slip to name even when forward is off too
        expect_bytes(name, "all-gathers in backward", comm_bytes(calls, "all_gather", "backward"), psi_b, 1, regather,
                     where)
        expect_bytes(name, "all-gathers in forward", comm_bytes(calls, "all_gather", "forward"), psi_b, 1,
                     "gather every unit (and the root's parameters) once in forward", where)
        expect_bytes(name, "reduce-scatter of the gradients", comm_bytes(calls, "reduce_scatter", STEP), psi_b, 1,
                     "reduce-scatter each unit's gradients after its backward", where)
        gathers = [x for x in calls if x["kind"] == "all_gather" and x["phase"] == "forward"]
        if len(gathers) < c["n_blocks"]:
            raise AssertionError(f"{name}: {len(gathers)} all-gathers in forward for {c['n_blocks']} units: gather "
                                 f"each unit just before it runs, not the whole model at once ({where})")
        _reduced_in_backward(name, got, c, psi_b, padding_bytes(c, world_size), where)
    verify_every_byte(name, res, 3, psi_b, steps, where, padding_bytes(c, world_size))
    m = verify_memory(name, res, c, 3, world_size, where)
    verify_forward(name, res, c, m, where)
    verify_unit_backward(name, res, c, m, where)
    ok(name, f"{steps} steps on {world_size} ranks, 3 Psi = {3 * psi_b:,} bytes per step, {res[0]['held']:,} bytes "
             f"held (formula {m['want']:,}), seed={seed}")


def _reduced_in_backward(name: str, got: dict, c: dict, psi_b: int, pad_b: int, where: str) -> None:
    """ZeRO-3's reduce-scatters, one per unit (the blocks and the root), launched in the step's own backward pass (the
    graph task the loss's node started, read by the rank's counter at each call: not a phase label, which the
    student's code can set). A ZeRO-3 that kept every gradient and reduce-scattered them all in step() passed the
    step's byte total (a red team's, 2026-12-02)."""
    task = got.get("backward_task")
    rs = [x for x in got["comm"] if x["kind"] == "reduce_scatter" and task is not None and x["graph_task"] == task]
    reduced = sum(x["bytes"] for x in rs)
    units = c["n_blocks"] + 1
    if len(rs) < units or abs(reduced - psi_b) > BYTES_TOL * psi_b + pad_b:
        raise AssertionError(f"{name}: {len(rs)} reduce-scatter(s) carrying {reduced / psi_b:.3f} Psi were launched "
                             f"during backward, for {units} units (the blocks and the root) and Psi of gradients: "
                             f"reduce-scatter each unit's gradients from a gradient hook as soon as its last one "
                             f"arrives, in backward, not in step() ({where})")
