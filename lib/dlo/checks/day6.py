"""Autograder checks for Day 6 (pipeline parallelism).

1. schedules: the student's GPipe and 1F1B action lists against the library's and against
   torch.distributed.pipelining's own (`get_schedule_ops`), replayed by the simulator (no deadlock),
   and GPipe's bubble with unequal stages (derived) against the student's own list replayed;
2. stage partition: contiguous, covering, non-empty, and as balanced as the best partition;
3. and 4. GPipe and 1F1B training steps on `world_size` ranks (`on_ranks`): the check cuts a
   float64 CoAtNet into stages at seeded places (a secret seed when graded: `case_seed`) and gives
   each rank only its own `Stage`, the micro-batches to the first and the targets to the last (no
   rank holds the model or the seed); a trusted worker runs the student's step there; the gradients
   come back and are compared here with one process on the whole batch (micro-batches of unequal
   size: each must weigh by its share of the batch). The schedule itself is read from each rank's
   messages (`dlo.checks.day6_order`): one per micro-batch each way, and at each activation sent the
   bytes saved for backward (`dlo.checks.saved.GuardedMeter`) must be the schedule's micro-batches alive
   (GPipe's k-th forward: k; 1F1B's on rank r: min(k, p - r)), measured here one micro-batch at a time, and
   the bytes saved since the step began k micro-batches' (the meter's `made`: no forward hidden). 1F1B must
   also keep at most p micro-batches of activations alive on the first stage, and, where the check launches
   the ranks, raise the first stage's memory as the kernel counts it (read outside the rank) by at most one
   micro-batch more than the course's 1F1B on a larger case (`dlo.checks.day6_count`), whose loss and gradients
   are checked too (a step that skipped it kept the reference's count). Saved-tensor hooks are
   off limits in both (a step's own would hide its activations from the meter);
5. the same model through torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B): losses
   and gradients equal to one process, hence to the student's own engines of 3 and 4, and the order
   of each rank's forward and backward chunks that of the asked schedule (torch's own lists), recorded
   only for torch's own stages holding the modules given, once each chunk ran, with what the module was
   given in each forward chunk compared with the grader's own micro-batch at that stage (a red team forged
   the record by calling the recording wrappers with a stand-in stage, beside a whole-batch pipeline).

The CoAtNet runs in eval mode: BatchNorm then uses its running statistics, so samples are
independent and a pipeline equals one process exactly; in training mode each micro-batch would be
normalised by its own statistics (as GPipe does), which is not the whole batch's.
A deadlock in a student's schedule ends at `timeout` seconds with each rank's last posted send or
receive (`dlo.distributed.pipeline_comms.P2PWatch`) in the message.

Checks 1 and 2 live in `dlo.checks.day6_schedules` (re-exported here), 3-5 in this module, what they
read of a schedule's order in `dlo.checks.day6_order`. Forbidden while the student's code runs: the
library's schedules (1, 5) and torch's order builders (1), partition (2) and engines (3-5), saved-tensor hooks
(3, 4).
torch's own schedules are kept out of exercises 3 and 4 by checking that the step did not import
torch.distributed.pipelining (nothing else in a check's rank does), rather than by a `forbid` entry:
resolving one would import that package on every rank of every check, seconds each.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks.day6_count import count_parts, count_worker, verify_count
from dlo.checks.day6_order import OrderWatch, torch_order, verify_order, verify_torch_order
from dlo.checks.day6_schedules import PIPE, SCHED, check_schedules, check_split_stages
from dlo.checks.rank_count import every_rank
from dlo.checks.saved import HOOKS, GuardedMeter
from dlo.distributed.pipeline import build_stages, make_stage_modules
from dlo.distributed.pipeline_comms import P2PWatch
from dlo.grading.api import case_seed, check, on_ranks, wire_sent
from dlo.grading.compare import DTYPE, assert_close, ok
from dlo.measure import SavedTensorMeter
from dlo.models.coatnet import coatnet

__all__ = ["check_gpipe_step", "check_one_f_one_b_step", "check_schedules", "check_split_stages",
           "check_torch_pipeline"]

TIMEOUT = 120.0  # seconds: a deadlocked schedule ends here (a step takes < 1 s alone, a minute on a loaded grader)
TORCH_PP = "torch.distributed.pipelining."
ENGINES = tuple(PIPE + n for n in ("gpipe_step", "one_f_one_b_step", "naive_step", "run_schedule", "_Runner",
                                   "Stage.comms")) + ("dlo.distributed.pipeline_comms.StageComms",
                                                      "dlo.experiments.day6.torch_pipeline_step")
IMAGE = 32  # CoAtNet "tiny" at 32 x 32: 15 blocks, S3 on a 2 x 2 grid, milliseconds per step in float64


# ----------------------------------------------------------------------------- 3.-5. training steps

def _case(seed: int, p: int, equal: bool, n_stages: int | None = None) -> dict:
    """The model, its cut, the batch and its micro-batches, all from the seed (the same on every rank)."""
    rng = random.Random(seed)
    torch.manual_seed(1000 + seed)
    model = coatnet("tiny", image_size=IMAGE).to(DTYPE).eval()  # eval: BatchNorm per sample, see above
    n, n_stages = len(model.blocks), n_stages or p
    bounds = [0] + sorted(rng.sample(range(1, n), n_stages - 1)) + [n]
    m = rng.choice([2 * p, 3 * p]) if equal else rng.choice([p + 1, 2 * p + 1])
    b = rng.choice([1, 2]) if equal else 0
    B = m * b if equal else rng.choice([2 * m + 1, 3 * m - 1])
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 3, IMAGE, IMAGE, generator=gen, dtype=DTYPE)
    y = torch.randint(0, model.cfg.num_classes, (B,), generator=gen)
    # each micro-batch its own storage (a view would share the batch's: saved once for all)
    return {"model": model, "bounds": bounds, "m": m, "x": x, "y": y, "xs": [t.clone() for t in x.tensor_split(m)],
            "ys": list(y.tensor_split(m)), "where": dict(p=p, m=m, batch=B, bounds=bounds, seed=seed)}


def _reference(c: dict) -> tuple[float, list[list[torch.Tensor]]]:
    """One process on the whole batch: the mean loss and each stage's parameter gradients."""
    model = c["model"]
    loss = F.cross_entropy(model(c["x"]), c["y"])
    loss.backward()
    stages = make_stage_modules(list(model.blocks), c["bounds"])
    return loss.item(), [[q.grad.detach().clone() for q in s.parameters()] for s in stages]


def _step_parts(c: dict, p: int) -> list[dict]:
    """What each rank is given, built here on the grader's side: its own `Stage` (its blocks only, not
    the model), the micro-batches on the first stage and the targets on the last; never the seed."""
    mods = make_stage_modules(list(c["model"].blocks), c["bounds"])
    sizes = [len(t) for t in c["ys"]]
    parts = []
    for r in range(p):
        stage = build_stages(mods, p, sizes, (3, IMAGE, IMAGE), dtype=DTYPE, rank=r)[0]
        parts.append({"stage": stage, "m": c["m"], "xs": c["xs"] if stage.is_first else None,
                      "ys": c["ys"] if stage.is_last else None})
    return parts


def _step_worker(mine: dict, fn, label: str):
    """`mine`: this rank's part (`_step_parts`). The step's sends and receives are watched, the bytes
    saved for backward counted."""
    import sys

    r, p, stage = dist.get_rank(), dist.get_world_size(), mine["stage"]
    held = [*stage.module.parameters(), *stage.module.buffers()]
    with GuardedMeter(exclude=held) as meter, OrderWatch(f"rank {r}, your {label} step (p={p}, m={mine['m']})",
                                                      meter) as watch:
        loss = fn(stage, mine["xs"], mine["ys"], F.cross_entropy)
    if any(name.startswith(TORCH_PP.rstrip(".")) for name in sys.modules):
        raise AssertionError(f"{label} step: your step imported torch.distributed.pipelining; this exercise asks for "
                             f"your own schedule from point-to-point messages (exercise 5 is torch's)")
    loss = loss.item() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else loss
    return {"loss": loss if stage.is_last else None, "grads": [q.grad for q in stage.module.parameters()],
            "peak": meter.peak, "made": meter.made, "events": watch.events}


def _check_step(name: str, fn, label: str, seed: int, world_size: int, equal: bool, timeout: float) -> tuple:
    c = _case(case_seed(seed), world_size, equal)  # a secret seed when graded
    c["where"]["seed"] = seed
    got = every_rank(name, on_ranks(_step_worker, world_size, fn, label, timeout=timeout,
                                    per_rank=_step_parts(c, world_size)), world_size, str(c["where"]))
    loss, grads = _reference(c)
    where = c["where"]
    last = got[-1]["loss"]
    if not isinstance(last, (int, float)) or isinstance(last, bool):
        raise AssertionError(f"{name}: the last stage must return the batch's mean loss (a float), got {last!r} "
                             f"({where})")
    assert_close(name, "the loss returned by the last stage (the mean over the whole batch: weigh each "
                 "micro-batch's mean loss by its share of the samples)", last, loss, where)
    for r, res in enumerate(got):
        if len(res["grads"]) != len(grads[r]):
            raise AssertionError(f"{name}: rank {r} has {len(res['grads'])} parameters, expected {len(grads[r])}")
        for k, (g, want) in enumerate(zip(res["grads"], grads[r])):
            assert_close(name, f"gradient of parameter {k} of stage {r} (one process on the whole batch as "
                         f"reference)", g, want, where)
    return got, c


@check(forbid=ENGINES + HOOKS)
def check_gpipe_step(fn, seed: int = 0, world_size: int = 2, timeout: float = TIMEOUT) -> None:
    """`fn(stage, microbatches, targets, loss_fn)` on every rank: one GPipe training step (all
    forwards, then all backwards) with point-to-point messages (dist.isend/irecv/send/recv);
    `microbatches` on the first stage, `targets` on the last, None elsewhere; returns the batch's mean
    loss on the last stage. Gradients against one process on the whole batch, micro-batches unequal."""
    got, c = _check_step("gpipe_step", fn, "GPipe", seed, world_size, False, timeout)
    verify_order("gpipe_step", "GPipe", got, c, c["where"])
    ok("gpipe_step", f"loss and gradients on {world_size} ranks equal one process, seed={seed}")


@check(forbid=ENGINES + HOOKS)
def check_one_f_one_b_step(fn, seed: int = 0, world_size: int = 2, timeout: float = TIMEOUT) -> None:
    """`fn(stage, microbatches, targets, loss_fn)`: one 1F1B step, as `check_gpipe_step`, and at
    most min(p, m) micro-batches of activations alive at once on the first stage (saved bytes counted
    on rank 0 against one micro-batch's, measured here)."""
    name = "one_f_one_b_step"
    got, c = _check_step(name, fn, "1F1B", seed, world_size, True, timeout)
    stage0 = make_stage_modules(list(c["model"].blocks), c["bounds"])[0]
    with SavedTensorMeter(exclude=[*stage0.parameters(), *stage0.buffers()]) as meter:
        stage0(c["xs"][0])
    one, p, m = meter.peak, world_size, c["m"]
    alive = got[0]["peak"] / one
    if got[0]["peak"] > min(p, m) * one:
        raise AssertionError(f"{name}: the first stage kept {alive:.1f} micro-batches of activations alive at once "
                             f"({got[0]['peak']} bytes saved for backward, {one} per micro-batch); 1F1B keeps at most "
                             f"p = {p}: warm up with p - r - 1 forwards, then one forward, one backward ({c['where']})")
    verify_order(name, "1F1B", got, c, c["where"])
    counted = ""
    if wire_sent() is not None:  # ranks the launcher reads (not the tests' reused ones): the kernel's count too
        case = count_parts(case_seed(seed), world_size)
        res = on_ranks(count_worker, world_size, fn, timeout=timeout, per_rank=case["parts"])
        counted = f"; {verify_count(name, case, world_size, c['where'], res)}"
    ok(name, f"loss and gradients equal one process, at most {alive:.0f} of {m} micro-batches alive on stage "
             f"0{counted}, {world_size} ranks, seed={seed}")


def _torch_parts(cases: dict, p: int) -> list[dict]:
    """Rank r's part of each schedule's case, built here: the stage modules it holds (stages r, r + p,
    ...), the batch if it holds the first stage, the targets if it holds the last."""
    parts = [{} for _ in range(p)]
    for name, c in cases.items():
        mods = make_stage_modules(list(c["model"].blocks), c["bounds"])
        for r in range(p):
            mine = list(range(r, len(mods), p))
            parts[r][name] = {"ids": mine, "mods": [mods[s] for s in mine], "n_stages": len(mods), "m": c["m"],
                              "x": c["x"] if 0 in mine else None, "y": c["y"] if len(mods) - 1 in mine else None}
    return parts


def _probe(t, seed: int = 6) -> float | None:
    """w . t for a tensor t, w drawn from `seed` (the same on both sides): what a rank returns of a chunk's input."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    with torch.no_grad():
        flat = t.detach().reshape(-1).to(DTYPE)
        return float(flat @ torch.randn(flat.numel(), generator=torch.Generator().manual_seed(seed), dtype=DTYPE))


def _torch_worker(mine: dict, fn):
    """Rank r's torch steps; each stage's forward and backward chunks recorded in the order they ran: only a
    chunk of a real torch stage (`_PipelineStageBase`) holding one of the given modules, recorded once it ran (a
    red team called the recording wrappers with a stand-in holding only `stage_index`, 2026-12-02), a forward
    with what the module was given in it (`_probe`, compared with the grader's own micro-batch there)."""
    from torch.distributed.pipelining import stage as pp_stage

    r, base = dist.get_rank(), pp_stage._PipelineStageBase
    order, running, given = [], [], {}  # given: stage id -> its module, for the case being run
    originals = {k: getattr(base, f"{k}ward_one_chunk") for k in ("for", "back")}

    def recorded(kind, original):
        def run(self, chunk, *args, **kwargs):
            s = getattr(self, "stage_index", None)
            real = isinstance(self, base) and isinstance(s, int) and given.get(s) is not None \
                and getattr(self, "submod", None) is given[s]
            if not real:
                return original(self, chunk, *args, **kwargs)
            running.append([kind, int(s), int(chunk), []])
            try:
                out = original(self, chunk, *args, **kwargs)
            finally:
                act = running.pop()
            seen = act.pop()
            order.append(act + [seen[0] if kind == "F" and len(seen) == 1 else None])
            return out
        return run

    def seen(module, args):  # the module's input, inside a forward chunk of its own stage
        if running and running[-1][0] == "F" and given.get(running[-1][1]) is module and args:
            running[-1][3].append(_probe(args[0]))

    base.forward_one_chunk, base.backward_one_chunk = recorded("F", originals["for"]), recorded("B", originals["back"])
    out, hooks = {}, []
    try:
        for name, part in mine.items():
            last = part["y"] is not None
            order.clear()
            given.clear()
            given.update(zip(part["ids"], part["mods"]))
            hooks = [mod.register_forward_pre_hook(seen) for mod in part["mods"]]
            with P2PWatch(f"rank {r}, your torch.distributed.pipelining {name} step"):
                losses = fn(part["mods"], part["ids"], part["n_stages"], part["x"], part["y"], F.cross_entropy,
                            part["m"], name)
            for h in hooks:
                h.remove()
            out[name] = {"losses": [float(torch.as_tensor(x).detach()) for x in losses] if last and losses is not None
                         else None,
                         "last": last, "grads": {s: [q.grad for q in m.parameters()]
                                                 for s, m in zip(part["ids"], part["mods"])},
                         "chunks": sum(1 for a in order if a[0] == "F"), "order": [list(a) for a in order]}
    finally:
        base.forward_one_chunk, base.backward_one_chunk = originals["for"], originals["back"]
    return out


def _chunk_inputs(c: dict) -> list[list[float]]:
    """Per stage, `_probe` of its input for each micro-batch (torch's split: tensor_split of the batch), here."""
    mods, out = make_stage_modules(list(c["model"].blocks), c["bounds"]), []
    with torch.no_grad():
        hs = list(c["x"].tensor_split(c["m"]))
        for mod in mods:
            out.append([_probe(h) for h in hs])
            hs = [mod(h) for h in hs]
    return out


def _verify_chunks(name: str, r: int, order: list, want: list[list[float]], where: dict) -> None:
    """Each forward chunk torch's stages ran on rank r was given that micro-batch's input at that stage."""
    for a in order:
        if not (isinstance(a, list) and len(a) == 4 and isinstance(a[1], int) and isinstance(a[2], int)):
            raise AssertionError(f"{name}: rank {r}'s record of torch's chunks holds {a!r}, not what the grader "
                                 f"records ([kind, stage, micro-batch, probe]) ({where})")
        if a[0] != "F":
            continue
        _, s, chunk, got = a
        if not (0 <= s < len(want) and 0 <= chunk < len(want[s])):
            raise AssertionError(f"{name}: torch's stage {s} on rank {r} ran micro-batch {chunk}, which the case does "
                                 f"not have ({where})")
        if got is None:
            raise AssertionError(f"{name}: in its forward of micro-batch {chunk}, torch's stage {s} on rank {r} did "
                                 f"not call its module once: the stage runs the module you gave it ({where})")
        assert_close(name, f"the input of stage {s}'s module in torch's forward of micro-batch {chunk} on rank {r} "
                     f"(its projection on a random vector): torch's stages run the micro-batches themselves", got,
                     want[s][chunk], where)


@check(forbid=ENGINES + (SCHED + "*",))
def check_torch_pipeline(fn, seed: int = 0, world_size: int = 2,
                         schedules: tuple = ("GPipe", "1F1B", "Interleaved1F1B"), timeout: float = 2 * TIMEOUT) -> None:
    """`fn(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule)`: build a
    torch.distributed.pipelining `PipelineStage` per module this rank holds and run one step of
    `schedule` ("GPipe", "1F1B", "Interleaved1F1B"); return the list of micro-batch losses on the
    rank with the last stage. Losses and gradients against one process (hence against your GPipe and
    1F1B, which equal it too); torch's stages must have run every micro-batch."""
    name, secret = "torch_pipeline", case_seed(seed)  # a secret seed when graded
    cases = {sched: _case(secret, world_size, True, (2 if sched == "Interleaved1F1B" else 1) * world_size)
             for sched in schedules}
    got = every_rank(name, on_ranks(_torch_worker, world_size, fn, timeout=timeout,
                                    per_rank=_torch_parts(cases, world_size)), world_size)
    orders = {sched: torch_order(sched, world_size, c["m"], 2 if sched == "Interleaved1F1B" else 1)
              for sched, c in cases.items()}
    inputs = {sched: _chunk_inputs(c) for sched, c in cases.items()}
    for sched, c in cases.items():
        v = 2 if sched == "Interleaved1F1B" else 1
        loss, grads = _reference(c)
        where = {**c["where"], "seed": seed, "schedule": sched}
        n_stages = v * world_size
        for r, rank_out in enumerate(got):
            res, ids = rank_out[sched], list(range(r, n_stages, world_size))  # the stages rank r holds
            if sorted(res["grads"]) != ids or any(len(res["grads"][s]) != len(grads[s]) for s in ids):
                raise AssertionError(f"{name}: rank {r} returned the gradients of stages {sorted(res['grads'])} "
                                     f"({[len(g) for g in res['grads'].values()]} parameters), it holds stages {ids} "
                                     f"({[len(grads[s]) for s in ids]}): the grader got no gradient to check for "
                                     f"the rest ({where})")
            if res["last"] != (n_stages - 1 in ids):
                raise AssertionError(f"{name}: rank {r} said it holds{'' if res['last'] else ' not'} the last stage; "
                                     f"it holds stages {ids} of {n_stages} ({where})")
            if res["chunks"] != c["m"] * v:
                raise AssertionError(f"{name}: torch's pipeline stages on rank {r} ran {res['chunks']} micro-batch "
                                     f"forwards, expected {c['m'] * v}: build PipelineStage(s) and call the "
                                     f"schedule's step ({where})")
            verify_torch_order(name, sched, r, res["order"], orders[sched][r], where)
            _verify_chunks(name, r, res["order"], inputs[sched], where)
            if res["last"]:
                if not res["losses"] or len(res["losses"]) != c["m"]:
                    raise AssertionError(f"{name}: return the {c['m']} micro-batch losses (schedule.step(..., "
                                         f"losses=losses)) on the last stage, got {res['losses']!r} ({where})")
                assert_close(name, "the mean of the micro-batch losses", sum(res["losses"]) / c["m"], loss, where)
            for s, gs in res["grads"].items():
                for k, (g, want) in enumerate(zip(gs, grads[s])):
                    assert_close(name, f"gradient of parameter {k} of stage {s} (rank {r})", g, want, where)
    ok(name, f"{', '.join(schedules)} on {world_size} ranks equal one process, seed={seed}")
