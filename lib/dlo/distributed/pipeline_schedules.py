"""Pipeline schedules as data: per-rank action lists, a simulator that turns them into a timeline,
the bubble they imply, and the partition of a model's blocks into balanced stages.

A schedule is `list[list[Action]]`: for each pipeline rank, the ordered actions it runs in one
training step. `Action(kind, stage, mb)`: kind "F" (forward of micro-batch mb on stage `stage`),
"B" (its backward; the input-gradient half only when the schedule also has "W"), "W" (the
weight-gradient half, Zero Bubble's split). With one stage per rank, stage == rank.

- `gpipe_schedule` (Huang et al. 2019, "GPipe"): all forwards, then all backwards ("AFAB");
  every rank keeps the activations of all m micro-batches until its first backward.
- `one_f_one_b_schedule` (Narayanan et al. 2019, PipeDream; its synchronous form PipeDream-Flush,
  Narayanan et al. 2021 "Memory-efficient pipeline-parallel DNN training", as DAPPLE): rank r runs
  p - r - 1 warm-up forwards, then alternates one forward and one backward, then drains; at most
  p - r micro-batches are alive on rank r. Same bubble as GPipe.
- `interleaved_schedule` (Narayanan et al. 2021, "Efficient large-scale language model training on
  GPU clusters using Megatron-LM", Sec. 2.2.2): v model chunks per rank (rank r holds stages
  r, r + p, ..., r + (v - 1) p), 1F1B over them depth first; the bubble shrinks by v, the messages
  grow by v; needs m to be a multiple of p.
- `zero_bubble_schedule` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3): the backward
  split into B (gradient w.r.t. the input: on the critical path) and W (w.r.t. the weights: can
  wait). ZB-H1 delays W to fill 1F1B's tail bubble at 1F1B's memory; `torch_schedule` reads
  torch's own lists (ZB-H2-like V-shaped `ZBVZeroBubble` among them) for the simulator.

`simulate(schedule, t_f, t_b, t_w, t_comm)` replays a schedule with given durations and returns the
events (rank, kind, stage, mb, start, end), the same records `dlo.distributed.pipeline.Timeline`
takes from real runs; `bubble_fraction(events)` is the idle share of the step.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str   # "F", "B" or "W"
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" if self.stage < 0 else f"{self.stage}{self.kind}{self.mb}"


def _check(p: int, m: int) -> None:
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ValueError(f"need p >= 1 pipeline ranks and m >= 1 micro-batches, got p={p!r}, m={m!r}")


# ----------------------------------------------------------------------------- the schedules

def gpipe_schedule(p: int, m: int) -> list[list[Action]]:
    """GPipe: on every rank F0..F(m-1), then B0..B(m-1) (torch's ScheduleGPipe order)."""
    _check(p, m)
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]


def one_f_one_b_schedule(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): rank r warms up with min(p - r - 1, m) forwards, then alternates
    F, B until the forwards run out, then drains the backwards."""
    _check(p, m)
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        for j in range(m - warmup):  # steady state: one forward, one backward
            acts += [Action("F", r, warmup + j), Action("B", r, j)]
        acts += [Action("B", r, j) for j in range(m - warmup, m)]  # cooldown
        out.append(acts)
    return out


def interleaved_schedule(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B with v chunks per rank (Megatron-LM's schedule): the k-th forward of a rank
    is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p, groups of p micro-batches per chunk;
    backwards walk the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards."""
    _check(p, m)
    if v < 1:
        raise ValueError(f"interleaving needs v >= 1 chunks per rank, got v={v}")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m a multiple of p (Narayanan et al. 2021): m={m}, p={p}")
    total = m * v

    def nth(k: int, backward: bool) -> tuple[int, int]:  # (chunk, micro-batch) of a rank's k-th F or B
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        F = [Action("F", c * p + r, i) for c, i in (nth(k, False) for k in range(total))]
        B = [Action("B", c * p + r, i) for c, i in (nth(k, True) for k in range(total))]
        acts = F[:warmup]
        for j in range(total - warmup):
            acts += [F[warmup + j], B[j]]
        out.append(acts + B[total - warmup:])
    return out


def zero_bubble_schedule(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, Sec. 3.1), the backward split into B (input gradient) and W (weights):
    1F1B's order of F and B; rank r postpones its weight passes by r micro-batches, so that the r
    W's left at the end fill the time the upstream ranks spend on the last B's. Bubble
    (p - 1)(t_F + t_B - t_W) instead of 1F1B's (p - 1)(t_F + t_B + t_W); at most p micro-batches
    alive on every rank, 1F1B's peak. (ZB-H2 and the V-shaped schedules reach ~0 with more memory:
    torch's ScheduleZBVZeroBubble, replayed by `simulate` through `torch_schedule`.)"""
    out = []
    for r, plain in enumerate(one_f_one_b_schedule(p, m)):
        acts = []
        for a in plain:
            acts.append(a)
            if a.kind == "B" and a.mb >= r:  # the W of the micro-batch r backwards ago
                acts.append(Action("W", r, a.mb - r))
        out.append(acts + [Action("W", r, j) for j in range(max(0, m - r), m)])
    return out


def torch_schedule(name: str, p: int, m: int, v: int | None = None) -> list[list[Action]]:
    """torch.distributed.pipelining's own action lists (`get_schedule_ops`, no process group needed)
    for schedule `name` ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", ...), as Actions
    (FULL_BACKWARD and BACKWARD_INPUT -> "B", BACKWARD_WEIGHT -> "W"; idle slots and gradient
    reductions dropped)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    ops = get_schedule_ops(name, p, m, num_stages_per_rank=v)
    return [[Action(kinds[a.computation_type.name], a.stage_index, a.microbatch_index) for a in rank
             if a is not None and a.computation_type.name in kinds] for rank in ops]



# ----------------------------------------------------------------------------- formulas

def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step for GPipe and 1F1B (v = 1) and interleaved 1F1B (v chunks):
    (p - 1) / (v m + p - 1), i.e. the bubble t_pb = (p - 1)(t_f + t_b) / v over the step time
    m (t_f + t_b) + t_pb (Narayanan et al. 2021, Sec. 2.2)."""
    _check(p, m)
    return (p - 1) / (v * m + p - 1)


def bubble_over_ideal(p: int, m: int, v: int = 1) -> float:
    """The same bubble relative to the ideal time m (t_f + t_b): (p - 1) / (v m) (the seminar's PBS)."""
    _check(p, m)
    return (p - 1) / (v * m)


# ----------------------------------------------------------------------------- the simulator

def _duration(t, stage: int) -> float:
    return float(t[stage]) if isinstance(t, (list, tuple)) else float(t)


def dependencies(a: Action, n_stages: int) -> list[Action]:
    """The actions `a` waits for: F(s, i) on F(s - 1, i); B(s, i) on F(s, i) and B(s + 1, i); W(s, i)
    on B(s, i)."""
    deps = []
    if a.kind == "F" and a.stage > 0:
        deps.append(Action("F", a.stage - 1, a.mb))
    if a.kind == "B":
        deps.append(Action("F", a.stage, a.mb))
        if a.stage < n_stages - 1:
            deps.append(Action("B", a.stage + 1, a.mb))
    if a.kind == "W":
        deps.append(Action("B", a.stage, a.mb))
    return deps


def simulate(schedule: list[list[Action]], t_f=1.0, t_b=2.0, t_w=0.0, t_comm=0.0) -> list[dict]:
    """Replay `schedule`: each rank runs its actions in order, each as soon as its inputs exist:
    F(s, i) after F(s - 1, i), B(s, i) after F(s, i) and B(s + 1, i), W(s, i) after B(s, i); a
    message between ranks takes t_comm. Durations are numbers or per-stage lists (B: the input
    gradient when the schedule has W actions, the whole backward otherwise). Returns the events;
    ValueError (naming what each rank waits on) if the schedule deadlocks or repeats an action.
    t_comm = 0 adds nothing (the timelines of a simulator without messages, bit for bit);
    `dlo.distributed.pipeline_fit.fit_timeline` fits it, and the durations, to a recorded timeline."""
    rank_of = {a.stage: r for r, acts in enumerate(schedule) for a in acts}
    n_stages = max(rank_of) + 1
    seen = set()
    for r, acts in enumerate(schedule):
        for a in acts:
            if a in seen:
                raise ValueError(f"rank {r} runs {a.kind}{a.mb} of stage {a.stage} twice")
            seen.add(a)
    done: dict[Action, float] = {}
    free, pos, events = [0.0] * len(schedule), [0] * len(schedule), []

    def ready(a: Action, r: int) -> float | None:
        t = 0.0
        for d in dependencies(a, n_stages):
            if d not in done:
                return None
            t = max(t, done[d] + (t_comm if rank_of.get(d.stage) != r else 0.0))
        return t

    while any(pos[r] < len(acts) for r, acts in enumerate(schedule)):
        progressed = False
        for r, acts in enumerate(schedule):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = ready(a, r)
                if t is None:
                    break
                start = max(t, free[r])
                dur = _duration({"F": t_f, "B": t_b, "W": t_w}[a.kind], a.stage)
                free[r] = done[a] = start + dur
                events.append({"rank": r, "kind": a.kind, "stage": a.stage, "mb": a.mb, "start": start,
                               "end": start + dur})
                pos[r] += 1
                progressed = True
        if not progressed:
            waiting = "; ".join(f"rank {r} at {acts[pos[r]]}" for r, acts in enumerate(schedule) if pos[r] < len(acts))
            raise ValueError(f"the schedule deadlocks: every rank waits on an action no rank can run ({waiting})")
    return events


def bubble_fraction(events: list[dict]) -> float:
    """Mean over ranks of the idle share of the step [first start, last end] (all ranks)."""
    t0, t1 = min(e["start"] for e in events), max(e["end"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    busy = {r: sum(e["end"] - e["start"] for e in events if e["rank"] == r) for r in ranks}
    return sum(1 - busy[r] / (t1 - t0) for r in ranks) / len(ranks)


def peak_in_flight(schedule: list[list[Action]]) -> list[int]:
    """Per rank, the most micro-batches whose activations are alive at once: from a forward until
    the backward (or, with split backwards, the W) that frees them."""
    out = []
    for acts in schedule:
        last = "W" if any(a.kind == "W" for a in acts) else "B"
        alive = peak = 0
        for a in acts:
            alive += (a.kind == "F") - (a.kind == last)
            peak = max(peak, alive)
        out.append(peak)
    return out


# ----------------------------------------------------------------------------- stage balancing

def split_stages(costs: list[float], p: int) -> list[list[int]]:
    """Cut blocks 0..n-1 into p contiguous, non-empty stages minimising the largest stage cost (the
    pipeline's bottleneck), by dynamic programming over (blocks, stages): O(p n^2). Returns the block
    indices of each stage."""
    n = len(costs)
    if p < 1:
        raise ValueError(f"need p >= 1 stages, got {p}")
    if p > n:
        raise ValueError(f"more stages than blocks: p={p} stages for {n} blocks (every stage needs one)")
    if any(c < 0 for c in costs):
        raise ValueError("block costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: the smallest bottleneck of the first j blocks in k stages; cut[k][j] where the last starts
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                b = max(best[k - 1][i], prefix[j] - prefix[i])
                if b < best[k][j]:
                    best[k][j], cut[k][j] = b, i
    bounds, j = [n], n
    for k in range(p, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.reverse()
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stage_bounds(stages: list[list[int]]) -> list[int]:
    """[[0, 1], [2, 3, 4]] -> [0, 2, 5]."""
    return [s[0] for s in stages] + [stages[-1][-1] + 1]


__all__ = ["Action", "gpipe_schedule", "one_f_one_b_schedule", "interleaved_schedule", "zero_bubble_schedule",
           "torch_schedule", "bubble_formula", "bubble_over_ideal", "dependencies", "simulate", "bubble_fraction",
           "peak_in_flight", "split_stages", "stage_bounds"]
