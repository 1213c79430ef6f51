"""Day 6 experiments: the bubble measured, the memory counted, CoAtNet's stages balanced, torch's
pipelining and data parallelism beside ours. `run_all(P, log_dir)` runs inside
`dlo.distributed.launch` on `P.world_size` ranks (one launch for everything); rank 0's dict is read.

- `bubble`: per schedule (GPipe, 1F1B, interleaved 1F1B with v = 2) and number of micro-batches m,
  the step time and the idle share measured from each rank's recorded timeline (`Timeline`),
  beside (p - 1)/(v m + p - 1); and from the first (warm-up) step, every rank's peak memory: the
  bytes autograd saves (exact on the CPU) or `max_memory_allocated` (GPU). The model is a stack of
  identical CoAtNet transformer blocks, so that the stages are equal as the formula assumes, sized
  so that a stage's compute (milliseconds) dominates a message (tens of microseconds on one host);
- `splits`: CoAtNet's blocks cut into p stages balancing parameters, FLOPs, saved bytes or measured
  forward time, and the 1F1B step time of each cut;
- `torch`: the same steps with torch.distributed.pipelining (`PipelineStage`, `ScheduleGPipe`,
  `Schedule1F1B`, `ScheduleInterleaved1F1B`): step time, and the gradients' distance to ours;
- `ddp`: the same CoAtNet and global batch under torch DDP on the same ranks: throughput and peak memory.

The tables, claims and pictures, and `plan(P, gpus=, gpu_mem_gb=)` (the full profile on the meta
device, `dlo plan day6_pipeline`), are in `dlo.experiments.day6_report`. (About 310 lines: the four
experiments of the one launch and the timed step they share; each is a short function.)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.distributed.current import heartbeat, rank_device
from dlo.distributed.pipeline import ENGINES, Timeline, build_stages, make_stage_modules, run_schedule
from dlo.distributed.pipeline_schedules import (
    bubble_formula,
    bubble_fraction,
    interleaved_schedule,
    split_stages,
    stage_bounds,
)
from dlo.measure import SavedTensorMeter, peak_memory
from dlo.models.coatnet import CoAtNet, CoAtNetConfig, TransformerBlock, block_costs
from dlo.progress import tqdm

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
COSTS = ("params", "flops", "saved_bytes", "time")


# ----------------------------------------------------------------------------- models and data

def stack(P, device) -> list[nn.Module]:
    """P.stack_blocks identical CoAtNet transformer blocks (width P.stack_width on a P.stack_grid^2
    grid of tokens), seeded: the same on every rank."""
    torch.manual_seed(0)
    return [TransformerBlock(P.stack_width, P.stack_width, 1, P.head_dim, 4, P.stack_grid, "S3").to(device)
            for _ in range(P.stack_blocks)]


def stack_batch(P, m: int, device):
    """m micro-batches of P.micro_batch token grids (B, C, g, g), and regression targets."""
    g = torch.Generator().manual_seed(m)
    shape = (P.micro_batch, P.stack_width, P.stack_grid, P.stack_grid)
    xs = [torch.randn(shape, generator=g).to(device) for _ in range(m)]
    return xs, [torch.randn(shape, generator=g).to(device) for _ in range(m)]


def model_config(P) -> CoAtNetConfig:
    return CoAtNetConfig.from_name(P.model, image_size=P.image_size)


def image_batch(P, m: int, device):
    """m micro-batches of P.micro_batch synthetic images and labels."""
    g = torch.Generator().manual_seed(m)
    cfg = model_config(P)
    xs = [torch.randn(P.micro_batch, 3, cfg.image_size, cfg.image_size, generator=g).to(device) for _ in range(m)]
    return xs, [torch.randint(0, cfg.num_classes, (P.micro_batch,), generator=g).to(device) for _ in range(m)]


def mse(out, target):
    return F.mse_loss(out, target)


# ----------------------------------------------------------------------------- one timed step

def pipeline_step(stages, schedule: str, xs, ys, loss_fn, timeline=None):
    """One step of `schedule` ("gpipe", "1f1b", "interleaved") on this rank's stages; zeroes grads first."""
    for s in stages:
        s.module.zero_grad(set_to_none=True)
    if schedule == "interleaved":
        p, v = stages[0].p, len(stages)
        return run_schedule(stages, interleaved_schedule(p, len(xs), v)[stages[0].rank], xs, ys, loss_fn, timeline)
    return ENGINES[schedule](stages[0], xs, ys, loss_fn, timeline)


def peak_step(stages, schedule: str, xs, ys, loss_fn, device) -> list[int]:
    """Every rank's peak bytes over one step (all-gathered): the bytes autograd saves (exact) on the
    CPU, CUDA's max_memory_allocated (weights, gradients and workspace included) on a GPU."""
    held = [t for s in stages for t in (*s.module.parameters(), *s.module.buffers())]
    with peak_memory(device, exclude=held) as peak:
        pipeline_step(stages, schedule, xs, ys, loss_fn)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak.bytes)
    return gathered


def timed_steps(stages, schedule: str, xs, ys, loss_fn, reps: int, device, label: str, warmup: int = 1) -> dict:
    """One step measuring the peak memory (it also warms up), `warmup` - 1 more untimed steps, then
    `reps` timed ones, each after a barrier: per step the wall time and, from every rank's timeline
    (all-gathered), the bubble fraction; the last step's events of all ranks. The ranks leave the
    barrier up to a few ms apart (a loaded CPU), so each rank's times are moved to the earliest rank's
    origin: `perf_counter` is one clock for all processes of a host, as `launch`'s ranks are."""
    heartbeat(f"{label}: the memory step")
    out = {"peak_bytes": peak_step(stages, schedule, xs, ys, loss_fn, device), "times_s": [], "bubbles": [],
           "events": []}
    for rep in range(2 - max(warmup, 1), reps + 1):
        heartbeat(f"{label}: step {rep} of {reps}")
        dist.barrier()
        tl = Timeline(dist.get_rank(), device)
        pipeline_step(stages, schedule, xs, ys, loss_fn, tl)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - tl.t0
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tl.events, wall, tl.t0))
        if rep <= 0:
            continue  # warm-up: allocations, first-call overheads
        origin = min(t0 for _, _, t0 in gathered)
        out["events"] = [{**e, "start": e["start"] + t0 - origin, "end": e["end"] + t0 - origin}
                         for evs, _, t0 in gathered for e in evs]
        out["times_s"].append(max(w + t0 - origin for _, w, t0 in gathered))
        out["bubbles"].append(bubble_fraction(out["events"]))
    return out


# ----------------------------------------------------------------------------- the experiments

def configs(P, p: int, desc: str):
    """(schedule, v, stage bounds of the stack, m) of the sweeps, with a progress bar on rank 0;
    interleaving (v = 2) only where m is a multiple of p, as the schedule needs."""
    out = []
    for schedule in SCHEDULE_NAMES:
        v = 2 if schedule == "interleaved" else 1
        bounds = [round(k * P.stack_blocks / (v * p)) for k in range(v * p + 1)]
        out += [(schedule, v, bounds, m) for m in P.m_values if v == 1 or m % p == 0]
    return tqdm(out, desc=desc, disable=dist.get_rank() != 0)


def bubble(P, device) -> dict:
    """Per schedule and m on the stack of identical blocks: the measured bubble fraction and step
    time of the timed steps, and every rank's peak memory of the first step."""
    p, rows, gantt = dist.get_world_size(), [], {}
    sample = (P.stack_width, P.stack_grid, P.stack_grid)
    for schedule, v, bounds, m in configs(P, p, "bubble and memory sweep"):
        modules = make_stage_modules(stack(P, device), bounds)
        stages = build_stages(modules, p, [P.micro_batch] * m, sample, device=device)
        xs, ys = stack_batch(P, m, device)
        r = timed_steps(stages, schedule, xs, ys, mse, P.reps, device, f"bubble: {schedule}, m={m}", P.warmup)
        rows.append({"schedule": schedule, "p": p, "v": v, "m": m, "bubbles": r["bubbles"], "times_s": r["times_s"],
                     "formula": bubble_formula(p, m, v), "peak_bytes": r["peak_bytes"]})
        if m == P.gantt_m:
            gantt[schedule] = r["events"]
    return {"rows": rows, "gantt": gantt, "one_microbatch": _one_microbatch_bytes(P, device, p),
            "memory_kind": "saved-tensor peak" if device.type != "cuda" else "cuda max_memory_allocated"}


def _one_microbatch_bytes(P, device, p) -> int:
    """Saved bytes of one micro-batch through one stage (1/p of the stack)."""
    block = stack(P, device)[: P.stack_blocks // p]
    x, _ = stack_batch(P, 1, device)
    seq = nn.Sequential(*block)
    with SavedTensorMeter(exclude=[*seq.parameters(), *seq.buffers()]) as meter:
        seq(x[0])
    return meter.peak


def block_times(P, device, reps: int = 3) -> list[float]:
    """Median forward seconds of each CoAtNet block on one micro-batch (the cost a split should balance)."""
    torch.manual_seed(0)
    model = CoAtNet(model_config(P)).to(device)
    x = image_batch(P, 1, device)[0][0]
    out = []
    for block in model.blocks:
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            y = block(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts[1:]))
        x = y.detach()
    return out


def splits(P, device) -> dict:
    """CoAtNet's per-block costs, its cut into p stages balancing each cost, and 1F1B's step time per cut."""
    p, cfg = dist.get_world_size(), model_config(P)
    rows = block_costs(meta_model(cfg), P.micro_batch)
    heartbeat("splits: timing each block")
    times = [block_times(P, device) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(times, 0)  # every rank cuts with rank 0's measurement
    for r, t in zip(rows, times[0]):
        r["time"] = t
    out = {"blocks": rows, "splits": {}}
    m = P.split_m
    for cost in tqdm(P.split_costs, desc="CoAtNet splits", disable=dist.get_rank() != 0):
        bounds = stage_bounds(split_stages([r[cost] for r in rows], p))
        same = next((v for v in out["splits"].values() if v["bounds"] == bounds), None)
        if same is not None:  # the same cut as another cost's: one timing serves both
            out["splits"][cost] = same
            continue
        torch.manual_seed(0)
        modules = make_stage_modules(list(CoAtNet(cfg).blocks), bounds)  # built here, each stage moved to its rank
        stages = build_stages(modules, p, [P.micro_batch] * m, (3, cfg.image_size, cfg.image_size), device=device)
        xs, ys = image_batch(P, m, device)
        r = timed_steps(stages, "1f1b", xs, ys, F.cross_entropy, P.reps, device, f"splits: by {cost}",
                        P.warmup)
        out["splits"][cost] = {"bounds": bounds, "times_s": r["times_s"], "bubbles": r["bubbles"]}
    return out


def meta_model(cfg):
    with torch.device("meta"):
        return CoAtNet(cfg)


def torch_pipeline_step(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule, device=None):
    """The library's torch.distributed.pipelining version of a step (the answer to exercise 5):
    one PipelineStage per module this rank holds, `schedule` in ("GPipe", "1F1B", "Interleaved1F1B");
    the micro-batch losses on the rank with the last stage, else None."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    device = torch.device(device or "cpu")
    stages = [PipelineStage(mod, s, n_stages, device) for mod, s in zip(stage_modules, stage_ids)]
    if schedule == "Interleaved1F1B":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    else:
        sched = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule](stages[0], n_microbatches, loss_fn=loss_fn)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    losses = [] if last else None
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    return losses


def torch_vs_ours(P, device) -> dict:
    """Step time of torch's schedules beside ours on the stack, m = P.gantt_m, alternating step by
    step (P.reps timed steps each: fewer than 3 give no interval), and the largest difference
    between torch's and our gradients (same weights, same batch)."""
    p, m, out = dist.get_world_size(), P.gantt_m, {}
    sample = (P.stack_width, P.stack_grid, P.stack_grid)
    xs, ys = stack_batch(P, m, device)
    x, y = torch.cat(xs), torch.cat(ys)
    for schedule, name in TORCH_NAMES.items():
        v = 2 if schedule == "interleaved" else 1
        bounds = [round(k * P.stack_blocks / (v * p)) for k in range(v * p + 1)]
        mine = list(range(dist.get_rank(), v * p, p))
        ours = build_stages(make_stage_modules(stack(P, device), bounds), p, [P.micro_batch] * m, sample, device=device)
        theirs = [make_stage_modules(stack(P, device), bounds)[s] for s in mine]
        times = {"ours": [], "torch": []}
        for rep in range(1 - P.warmup, P.reps + 1):
            heartbeat(f"torch vs ours: {name}, step {rep}")
            for who in ("ours", "torch"):
                dist.barrier()
                t0 = time.perf_counter()
                if who == "ours":
                    pipeline_step(ours, schedule, xs, ys, mse)
                else:
                    for mod in theirs:
                        mod.zero_grad(set_to_none=True)
                    first, last = 0 in mine, v * p - 1 in mine
                    torch_pipeline_step(theirs, mine, v * p, x if first else None, y if last else None, mse, m,
                                        name, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                if rep > 0:
                    times[who].append(time.perf_counter() - t0)
        diff = max(((a.grad - b.grad).abs().max().item() for s, mod in zip(ours, theirs)
                    for a, b in zip(s.module.parameters(), mod.parameters())), default=0.0)
        out[schedule] = {"times_s": times, "max_grad_diff": diff}
    return out


def ddp(P, device) -> dict:
    """torch DDP on the same ranks and global batch (m micro-batches' worth, split over the ranks):
    step times and peak memory, beside the pipeline's 1F1B at m = P.split_m (from `splits`)."""
    p, cfg = dist.get_world_size(), model_config(P)
    torch.manual_seed(0)
    net = CoAtNet(cfg).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    xs, ys = image_batch(P, P.split_m, device)
    x, y = torch.cat(xs).tensor_split(p)[dist.get_rank()], torch.cat(ys).tensor_split(p)[dist.get_rank()]
    times = []
    for rep in range(1 - P.warmup, P.reps + 1):
        heartbeat(f"ddp: step {rep}")
        dist.barrier()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep > 0:
            times.append(time.perf_counter() - t0)
    with peak_memory(device, exclude=[*net.parameters(), *net.buffers()]) as peak:
        F.cross_entropy(model(x), y).backward()
    return {"times_s": times, "peak_bytes": peak.bytes, "samples": P.split_m * P.micro_batch}


def run_all(P, log_dir=None) -> dict:
    """Every Day 6 measurement on this world (call it through dlo.distributed.launch)."""
    device = rank_device()
    out = {"world": dist.get_world_size(), "device": str(device), "bubble": bubble(P, device),
           "splits": splits(P, device)}
    out["ddp"] = ddp(P, device)
    out["torch"] = torch_vs_ours(P, device)
    return out
