"""The trusted worker of the Day 5 ZeRO checks: it runs a student's engine on each rank and records what it
observes - the parameters the modules hold during a forward, the collectives of each phase
(`dlo.measure.CommCounter`: calls, payload bytes, async, forward/backward/step, and the graph task of the SGD
step's own backward: `backward_task`), and the bytes the engine
holds (`dlo.measure.held_bytes`) and the rank keeps (`dlo.measure.live_bytes`) after the step and during
backward or forward. A module-level function of a checks module (the sandboxed grader loads it by reference);
it returns plain data only. The model, the data and the comparisons are `dlo.checks.day5_zero`'s.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch import nn

from dlo.checks.day5_memory import backward_in_flight
from dlo.checks.day5_sync import disturbance, disturbed_step
from dlo.checks.day5_zero import TiedLM, batch, lm_loss, optimizer_for, seen_parameters, settled_growth, tied_lm
from dlo.grading.compare import DTYPE
from dlo.measure import CommCounter, held_bytes, live_bytes
from dlo.measure.comm import graph_task


def build_engine(cls, stage: int, model, opt_cls, kw, extra: dict):
    if stage == 3:
        return cls(model, opt_cls, units=list(model.blocks), **kw)
    return cls(model, opt_cls, **extra, **kw)


def rank_part(c: dict, seed: int, r: int, n: int, steps: int) -> dict:
    """What rank r of n is given, drawn here on the grader's side: the case's sizes and
    hyper-parameters, its own initial weights, its own slice of each step's batch, the one
    sequence every rank probes the parameters with and its own disturbance (`day5_sync`); never the
    global batch, the seed nor another rank's disturbance."""
    batches = [batch(c, seed, s, n * c["per_rank"]) for s in range(steps)]
    return {"c": c, "init": {k: v.detach().clone() for k, v in tied_lm(c, seed + 1 + r).state_dict().items()},
            "batches": [(x[r::n].clone(), y[r::n].clone()) for x, y in batches], "probe": batches[0][0][:1].clone(),
            "disturb": disturbance(c, seed, r)}


def rank_model(mine: dict) -> TiedLM:
    c = mine["c"]
    model = TiedLM(c["vocab"], c["dim"], c["hidden"], c["n_blocks"]).to(DTYPE)
    model.load_state_dict(mine["init"])
    return model


def zero_worker(mine: dict, cls, stage: int, steps: int, extra: dict, one_bucket: dict | None = None, *,
                live_before: int | None = None):
    """`mine`: this rank's part of the case (`rank_part`). Every collective and point-to-point
    message of the rank is counted, from each engine's construction to the last forward (phases
    "init", "start", "forward", "backward", "step", "after", "drift", "adamw"): a byte sent outside the step's
    own collectives shows. The AdamW run, whose memory is measured, comes first: the rank's growth is
    counted from before the student's objects were unpickled (`live_before`, given by
    `dlo.grading.ranks.run_on_rank`; else from here), so no engine of an earlier phase can hold state
    for it, and nothing an earlier engine leaves behind counts against it (an engine hooked to its own
    parameters is never collected: `dlo.distributed.ddp.grad_ready_hook`)."""
    before = live_bytes() if live_before is None else live_before
    out = adamw_phase(mine, cls, stage, steps, extra, before)
    c, probe, batches = mine["c"], mine["probe"], mine["batches"]
    if one_bucket is not None:  # ZeRO-2 at the default cap: count the reduce-scatters of one step
        with CommCounter() as comm:
            comm.phase = "init"
            engine = build_engine(cls, stage, rank_model(mine), *optimizer_for(c, "sgd"), one_bucket)
            comm.phase = "step"
            lm_loss(engine, *batches[0]).backward()
            engine.step()
        out["one_bucket"] = comm.count("reduce_scatter")
        out["one_bucket_comm"] = comm.records()
    with CommCounter() as comm:
        comm.phase = "init"
        model = rank_model(mine)  # every rank its own weights: the engine must start from rank 0's
        engine = build_engine(cls, stage, model, *optimizer_for(c, "sgd"), extra)
        comm.phase = "start"
        out["start"] = seen_parameters(model, lambda: engine(probe))
        comm.phase = "forward"
        loss, task = lm_loss(engine, *batches[0]), []
        loss.grad_fn.register_prehook(lambda _: task.append(graph_task()))  # this backward's, at its start
        comm.phase = "backward"
        loss.backward()
        out["backward_task"] = task[0] if len(task) == 1 else None  # None: the loss's node never ran (or twice)
        comm.phase = "step"
        engine.step()
        comm.phase = "after"
        engine.zero_grad()
        out["sgd"] = seen_parameters(model, lambda: engine(probe))
        if stage < 3:  # ZeRO-1/2: every rank's copy of the parameters is the owners' after a step
            comm.phase = "drift"
            disturbed_step(engine, model, batches[0], mine["disturb"])
            out["drift"] = seen_parameters(model, lambda: engine(probe))
    out["comm"] = comm.records()
    return out


zero_worker.measures_growth = True  # dlo.grading.ranks.run_on_rank passes live_before


def adamw_phase(mine: dict, cls, stage: int, steps: int, extra: dict, before: int) -> dict:
    """`steps` AdamW steps of a fresh engine: its messages, the parameters after, and the bytes it holds
    (`held`: walked from the engine; `live`: the rank's growth since `before`, wherever it is kept;
    `samples`: held during the last step's forward and backward; for ZeRO-2/3, also what the rank keeps
    beyond the engine and the activations: `watched_step`)."""
    c, probe, batches = mine["c"], mine["probe"], mine["batches"]
    out = {}
    adamw = CommCounter()
    adamw.__enter__()
    adamw.phase = "init"
    model = rank_model(mine)
    engine = build_engine(cls, stage, model, *optimizer_for(c, "adamw"), extra)
    adamw.phase = "adamw"
    samples = {"backward": [], "forward": [], "outside": []}
    for s in range(steps):
        if s < steps - 1:
            lm_loss(engine, *batches[s]).backward()
        else:  # the last step is watched: memory during forward (per unit) and backward
            hooks = watched_step(engine, model, c, batches[s], stage, samples, before)
        engine.step()
        if s == steps - 1:
            out["held"] = held_bytes(engine)
            for h in hooks:
                h.remove()
            out["live"] = settled_growth(before, out["held"])  # wherever the engine keeps it (a global, a class)
        engine.zero_grad()
    out["adamw"] = seen_parameters(model, lambda: engine(probe))
    adamw.__exit__(None, None, None)
    out["adamw_comm"] = adamw.records()
    out["samples"] = samples
    return out


def watched_step(engine, model: nn.Module, c: dict, batch, stage: int, samples: dict, before: int) -> list:
    """The watched step's forward and backward: the bytes the engine holds after each block's forward and after
    each gradient, and what the rank keeps beyond the engine and the activations (`outside_sampler`): for ZeRO-2
    during backward, for ZeRO-3 after the last unit's forward, when every unit has been gathered (one sample: on
    a ZeRO-3 rank, which imported FSDP for its forbidden names, a walk of its objects costs ~0.17 s).
    Returns the hooks, for the caller to remove after the step."""
    hooks = [b.register_forward_hook(lambda *a: samples["forward"].append(held_bytes(engine))) for b in model.blocks]
    saved = Activations()  # what autograd saves, kept alive until backward ends and left out of the count
    sample = outside_sampler(engine, saved, before, backward_in_flight(c), samples["outside"]) if stage > 1 else None
    if stage == 3:
        hooks.append(model.blocks[-1].register_forward_hook(lambda *a: sample()))
    with (torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t) if stage > 1
          else contextlib.nullcontext()):
        loss = lm_loss(engine, *batch)
    watch = [lambda p: samples["backward"].append(held_bytes(engine))]
    if stage == 2:
        watch.append(every_quota(model, backward_in_flight(c), sample))
    hooks += [p.register_post_accumulate_grad_hook(w) for p in model.parameters() for w in watch]
    loss.backward()
    saved.clear()  # the hooks the caller removes after its count reach this list: the activations go now
    return hooks


class Activations(list):
    """The tensors autograd saved in the watched forward (a list that a weak reference can name)."""


def outside_sampler(engine, saved: Activations, before: int, quota: int, samples: list):
    """A function appending what the rank's live tensors hold beyond the engine and the activations (`live_bytes`
    since `before`, when no student object existed yet, against `held_bytes` of both): ZeRO-2's full gradients or
    ZeRO-3's gathered parameters kept where the walk from the engine does not go (a module global, a class
    attribute), made during backward or long before it. The activations, which backward frees as it goes, are
    kept alive by the caller until backward ends: else their release hides what was kept. A sample above
    `quota` is taken again for up to 0.5 s and the least kept, as `settled_growth` does: a finished
    collective's buffers go a moment after its wait(), kept tensors stay. The sampler names the activations by a
    weak reference: it is hooked to the engine's parameters, and the walk from the engine would count them."""
    activations = weakref.ref(saved)

    def outside() -> int:
        return max(0, live_bytes() - before - held_bytes(engine, activations()))

    def sample() -> None:
        least, deadline = outside(), time.monotonic() + 0.5
        while least > quota and time.monotonic() < deadline:
            time.sleep(0.02)
            least = min(least, outside())
        samples.append(least)
    return sample


def every_quota(model: nn.Module, quota: int, sample):
    """A gradient hook calling `sample` each time another `quota` bytes of gradients have arrived, and at the last
    gradient. A sample costs a walk of the rank's objects (~0.02-0.1 s): a rank keeping gradients out of sight and
    dropping them just before each sample keeps no more than the allowance."""
    left, since = len(list(model.parameters())), 0

    def hook(p):
        nonlocal left, since
        left, since = left - 1, since + p.numel() * p.element_size()
        if since >= quota or left == 0:
            since = 0
            sample()
    return hook
