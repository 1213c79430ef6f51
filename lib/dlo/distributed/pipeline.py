"""Pipeline parallelism: a model cut into stages, one (or v) per rank, micro-batches streamed through.

Engines, side by side in picotron's manner (one training step each, gradients accumulated in the
stage's parameters; the optimizer step is the caller's):

- `naive_step`: model parallelism without micro-batches: one rank busy at a time (GPipe, m = 1);
- `gpipe_step` (Huang et al. 2019, "GPipe: efficient training of giant neural networks using
  pipeline parallelism"): all forwards, then all backwards ("AFAB"); m micro-batches of
  activations alive on every rank at the turn;
- `one_f_one_b_step` (Narayanan et al. 2019, "PipeDream: generalized pipeline parallelism for DNN
  training"; its flushed, synchronous form PipeDream-Flush, Narayanan et al. 2021): warm-up
  forwards, one forward one backward, drain; at most p - r micro-batches alive on rank r;
- `run_schedule`: any action list of `dlo.distributed.pipeline_schedules` on the stages this rank
  holds, interleaved 1F1B with v chunks per rank included (Narayanan et al. 2021, Megatron-LM).

Each step takes the whole batch as a list of m micro-batches (`microbatches` on the first stage,
`targets` on the last; the other ranks pass lists of the same length, or None) and a per-micro-batch
`loss_fn(output, target)` (a mean over the micro-batch); each micro-batch's loss is weighted by its
share of the batch, len(target_i) / sum_j len(target_j), so that the gradients equal one process's
on the whole batch also when the micro-batches are unequal. The last stage returns the batch's mean
loss, the others None. A `Timeline` records when each action ran; the schedules' simulator draws
the same picture from assumed durations.

Bad input fails before any message: a split leaving a stage empty, more stages than blocks (see
`build_stages`), m not a multiple of p for interleaving (the schedule's own error).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dlo.distributed.pipeline_comms import StageComms, TorchWire, Wire, pipeline_channels, sample_shapes
from dlo.distributed.pipeline_schedules import (
    Action,
    bubble_formula,
    bubble_fraction,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    simulate,
    split_stages,
    zero_bubble_schedule,
)
from dlo.measure import sync


@dataclass
class Stage:
    """What a rank holds of stage `index` (of `n_stages`, placed round-robin on `p` ranks): its
    blocks, and the shape of the activation it receives (`in_shapes[i]`) and sends (`out_shapes[i]`)
    for each micro-batch i. `wire`: how its messages travel, None for torch.distributed (`TorchWire`);
    `dlo.distributed.pipeline_order` sets a recording one, the same on all the stages of a rank."""

    module: nn.Module
    index: int
    n_stages: int
    p: int
    in_shapes: list[tuple]
    out_shapes: list[tuple]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    wire: Wire | None = None

    @property
    def rank(self) -> int:
        return self.index % self.p

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def comms(self, wire: Wire) -> StageComms:
        return StageComms(self.index, self.n_stages, None if self.is_first else (self.index - 1) % self.p,
                          None if self.is_last else (self.index + 1) % self.p, self.in_shapes, self.out_shapes,
                          self.dtype, self.device, wire)


def make_stage_modules(blocks, bounds: list[int]) -> list[nn.Sequential]:
    """Blocks cut at `bounds` (0 = b_0 < ... < b_S = len(blocks)) into S sequentials."""
    n = len(blocks)
    if len(bounds) - 1 > n:
        raise ValueError(f"more stages than blocks: {len(bounds) - 1} stages for {n} blocks")
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"stage bounds {bounds} must start at 0 and end at {n} (every block in one stage)")
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b <= a:
            raise ValueError(f"stage {s} of the split {bounds} is empty (blocks {a}:{b})")
    return [nn.Sequential(*blocks[a:b]) for a, b in zip(bounds, bounds[1:])]


def build_stages(modules: list[nn.Module], p: int, sizes: list[int], sample_shape: tuple[int, ...], *,
                 dtype=torch.float32, device="cpu", rank: int | None = None) -> list[Stage]:
    """The `Stage`s rank `rank` (default: this process's) holds when the stage modules `modules` are
    placed round-robin on p ranks (stage s on rank s % p: one per rank when len(modules) == p, v
    chunks per rank when it is v p), for micro-batches of `sizes` samples of `sample_shape`."""
    n = len(modules)
    if p < 1 or n % p:
        raise ValueError(f"{n} stages cannot be placed on p={p} ranks (need a multiple of p)")
    rank = dist.get_rank() if rank is None else rank
    shapes = [tuple(sample_shape)] + sample_shapes(modules, tuple(sample_shape), dtype)
    return [Stage(modules[s].to(device), s, n, p, [(b, *shapes[s]) for b in sizes],
                  [(b, *shapes[s + 1]) for b in sizes], dtype, torch.device(device)) for s in range(rank, n, p)]


# ----------------------------------------------------------------------------- the timeline recorder

class Timeline:
    """Start and end of every action of this rank, in seconds since `t0` (take it after a barrier so
    that ranks share the origin: one host's perf_counter is one clock). On CUDA an action starts and
    ends with a `synchronize`, so that waiting for a message is not counted as work (the
    synchronisations cost some overlap: the timeline is a measurement, not the fastest run)."""

    def __init__(self, rank: int = 0, device=None):
        self.rank, self.device, self.events = rank, torch.device(device or "cpu"), []
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def span(self, kind: str, stage: int, mb: int):
        sync(self.device)  # the span is of the work, not of launching it
        start = time.perf_counter()
        yield
        sync(self.device)
        self.events.append({"rank": self.rank, "kind": kind, "stage": stage, "mb": mb,
                            "start": start - self.t0, "end": time.perf_counter() - self.t0})


def _span(timeline, kind, stage, mb):
    return timeline.span(kind, stage, mb) if timeline is not None else contextlib.nullcontext()


# ----------------------------------------------------------------------------- one stage's F and B

class _Runner:
    """Forward and backward of micro-batches on one stage, keeping what backward needs."""

    def __init__(self, stage: Stage, wire: Wire, microbatches, targets, loss_fn, timeline=None):
        self.stage, self.comms, self.timeline = stage, stage.comms(wire), timeline
        self.microbatches, self.targets, self.loss_fn = microbatches, targets, loss_fn
        self.inputs: dict[int, Tensor] = {}
        self.outputs: dict[int, Tensor] = {}
        self.loss = 0.0
        if stage.is_last:
            self.total = sum(len(t) for t in targets)

    def forward(self, i: int) -> None:
        s = self.stage
        x = self.microbatches[i] if s.is_first else self.comms.recv_forward(i)
        with _span(self.timeline, "F", s.index, i):
            y = s.module(x)
            if s.is_last:  # the micro-batch's share of the whole batch's mean loss
                y = self.loss_fn(y, self.targets[i]) * (len(self.targets[i]) / self.total)
                self.loss += y.item()
        if not s.is_last:
            self.comms.send_forward(y, i)
        self.inputs[i], self.outputs[i] = x, y

    def backward(self, i: int) -> None:
        s = self.stage
        grad = None if s.is_last else self.comms.recv_backward(i)
        with _span(self.timeline, "B", s.index, i):
            torch.autograd.backward(self.outputs.pop(i), grad)  # frees the graph: the activations go
        x = self.inputs.pop(i)
        if not s.is_first:
            self.comms.send_backward(x.grad, i)

    def finish(self):
        self.comms.wait()
        return self.loss if self.stage.is_last else None


# ----------------------------------------------------------------------------- the engines

def gpipe_step(stage: Stage, microbatches, targets, loss_fn, timeline: Timeline | None = None):
    """GPipe (all forwards, all backwards) on this rank's stage; the batch's mean loss on the last stage.
    The order is `gpipe_schedule`'s list for the stage."""
    actions = gpipe_schedule(stage.n_stages, len(stage.in_shapes))[stage.index]
    return run_schedule([stage], actions, microbatches, targets, loss_fn, timeline)


def naive_step(stage: Stage, x, y, loss_fn, timeline: Timeline | None = None):
    """Model parallelism without micro-batches: GPipe with m = 1 (one rank busy at a time)."""
    return gpipe_step(stage, [x], [y], loss_fn, timeline)


def one_f_one_b_step(stage: Stage, microbatches, targets, loss_fn, timeline: Timeline | None = None):
    """1F1B (PipeDream-Flush) on this rank's stage; the batch's mean loss on the last stage. The order
    (warm-up forwards, one forward one backward, drain) is `one_f_one_b_schedule`'s list for the stage."""
    actions = one_f_one_b_schedule(stage.n_stages, len(stage.in_shapes))[stage.index]
    return run_schedule([stage], actions, microbatches, targets, loss_fn, timeline)


def run_schedule(stages: list[Stage], actions: list[Action], microbatches, targets, loss_fn,
                 timeline: Timeline | None = None):
    """Run this rank's `actions` (F and B of `dlo.distributed.pipeline_schedules`) on the stages it
    holds, e.g. `interleaved_schedule(p, m, v)[rank]` with v stages per rank; the mean loss if this
    rank holds the last stage, else None. Every rank of the pipeline calls it at each step: the first
    step makes the pipeline's process groups (`dlo.distributed.pipeline_comms.channel_groups`)."""
    first = stages[0]  # its wire serves all the stages of this rank (one order of messages per rank)
    wire = first.wire if first.wire is not None else TorchWire(pipeline_channels(first.p, first.n_stages))
    runners = {s.index: _Runner(s, wire, microbatches, targets, loss_fn, timeline) for s in stages}
    for a in actions:
        if a.stage not in runners or a.kind not in ("F", "B"):
            raise ValueError(f"this rank holds stages {sorted(runners)} and runs F/B only; got {a}")
        (runners[a.stage].forward if a.kind == "F" else runners[a.stage].backward)(a.mb)
    losses = [r.finish() for r in runners.values()]
    return next((x for x in losses if x is not None), None)


ENGINES = {"gpipe": gpipe_step, "1f1b": one_f_one_b_step}


__all__ = ["Stage", "make_stage_modules", "build_stages", "Timeline", "naive_step", "gpipe_step", "one_f_one_b_step",
           "run_schedule", "ENGINES", "Action", "gpipe_schedule", "one_f_one_b_schedule", "interleaved_schedule",
           "zero_bubble_schedule", "simulate", "bubble_fraction", "bubble_formula", "split_stages"]
