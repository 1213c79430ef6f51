"""Day 6's exercises 1 and 2 (schedule construction, stage partition): no ranks needed. Re-exported
by `dlo.checks.day6`, whose docstring describes every Day 6 check.
"""

from __future__ import annotations

import random

from dlo.distributed.pipeline_schedules import (
    Action,
    bubble_formula,
    bubble_fraction,
    gpipe_schedule,
    one_f_one_b_schedule,
    simulate,
    split_stages,
    torch_schedule,
)
from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_close, assert_number, fmt, ok
from dlo.models.coatnet import coatnet

PIPE, SCHED = "dlo.distributed.pipeline.", "dlo.distributed.pipeline_schedules."
TORCH_PP = "torch.distributed.pipelining."
SCHEDULES = tuple(SCHED + n for n in ("gpipe_schedule", "one_f_one_b_schedule", "interleaved_schedule",
                                      "zero_bubble_schedule", "torch_schedule", "bubble_formula", "bubble_over_ideal",
                                      "simulate", "bubble_fraction")) + tuple(
    PIPE + n for n in ("gpipe_schedule", "one_f_one_b_schedule", "interleaved_schedule", "zero_bubble_schedule",
                       "simulate", "bubble_fraction", "bubble_formula")) + (
    TORCH_PP + "_schedule_visualizer.get_schedule_ops", TORCH_PP + "schedules.ScheduleGPipe._get_pipeline_order",
    TORCH_PP + "schedules.Schedule1F1B._get_pipeline_order") + tuple(
    # torch's private order builders: a red team's lists came from _get_1f1b_rank_ops (2026-12-02)
    TORCH_PP + "schedules." + n for n in ("_get_1f1b_rank_ops", "_get_warmup_ops") + tuple(
        f"{cls}._calculate_single_rank_operations" for cls in (
            "ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV")) + ("ScheduleInterleavedZeroBubble._add_bubbles_to_actions",))


# ----------------------------------------------------------------------------- 1. schedules

def _as_actions(name: str, got, p: int, m: int) -> list[list[Action]]:
    """The student's [[("F", 0), ("F", 1), ...], ...] as Actions of stage r, or AssertionError."""
    where = dict(p=p, m=m)
    if not isinstance(got, (list, tuple)) or len(got) != p:
        raise AssertionError(f"{name}: return one list of actions per rank ({p} lists), got {type(got).__name__} "
                             f"of length {len(got) if hasattr(got, '__len__') else '?'} ({where})")
    out = []
    for r, acts in enumerate(got):
        rank = []
        for a in acts:
            if not (isinstance(a, (tuple, list)) and len(a) == 2 and a[0] in ("F", "B") and isinstance(a[1], int)):
                raise AssertionError(f"{name}: rank {r}'s action {a!r} is not a pair (\"F\" or \"B\", micro-batch) "
                                     f"({where})")
            rank.append(Action(a[0], r, a[1]))
        out.append(rank)
    return out


def _same(name: str, what: str, got: list[list[Action]], want: list[list[Action]], where) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        if g != w:
            i = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            show = lambda acts: " ".join(f"{a.kind}{a.mb}" for a in acts)  # noqa: E731
            raise AssertionError(f"{name}: rank {r}'s actions differ from {what} at position {i}:\n"
                                 f"  expected {show(w)}\n  got      {show(g)}\n({where})")


def _bubble_slip(got: float, t_f: list, t_b: list, m: int) -> str:
    """The usual wrong model, when the student's number is its value."""
    p = len(t_f)
    slow = max(f + b for f, b in zip(t_f, t_b))
    wrongs = {"the equal-stage formula (p-1)/(m+p-1): with unequal stages the slowest one sets the pace":
              (p - 1) / (m + p - 1),
              "(m+p-1) slots of the slowest stage's t_f + t_b: GPipe's forwards and backwards are two phases, each "
              "paced by its own slowest stage": 1 - m * sum(t_f + t_b) / p / ((m + p - 1) * slow)}
    return next((f" ({text}?)" for text, w in wrongs.items() if abs(got - w) < 1e-9), "")


def _check_bubble(bubble_fn, g: list[list[Action]], p: int, m: int, rng: random.Random, where: dict) -> None:
    """`bubble_fn` at equal stages against (p-1)/(m+p-1), then at unequal ones against the simulated
    timeline of the student's own GPipe list `g` (the schedule they wrote, replayed)."""
    equal = ([1.0] * p, [2.0] * p)
    unequal = ([rng.choice([0.5, 1.0, 3.0]) * rng.uniform(0.5, 1.5) for _ in range(p)],
               [rng.choice([1.0, 2.0, 6.0]) * rng.uniform(0.5, 1.5) for _ in range(p)])
    for t_f, t_b in (equal, unequal):
        here = {**where, "t_f": [round(x, 3) for x in t_f], "t_b": [round(x, 3) for x in t_b]}
        got = assert_number("gpipe_bubble", f"bubble_fn(t_f, t_b, {m})", bubble_fn(list(t_f), list(t_b), m), here)
        want = bubble_fraction(simulate(g, t_f, t_b))
        if t_f is equal[0]:
            assert_close("gpipe_bubble", "the idle share at equal stages against (p - 1)/(m + p - 1)", got,
                         bubble_formula(p, m), here)
        if abs(got - want) > 1e-9:
            raise AssertionError(f"gpipe_bubble: the idle share of your GPipe list, replayed with these durations, is "
                                 f"{want:.6f}; you predict {got:.6f}{_bubble_slip(got, t_f, t_b, m)} ({fmt(here)})")


@check(forbid=SCHEDULES)
def check_schedules(gpipe_fn, one_f_one_b_fn, bubble_fn, seed: int = 0, trials: int = 4) -> None:
    """`gpipe_fn(p, m)` and `one_f_one_b_fn(p, m)`: per rank, the ordered list of ("F", i) / ("B", i)
    actions of one training step (GPipe: backwards in the forwards' order, as torch's ScheduleGPipe);
    `bubble_fn(t_f, t_b, m)`: the idle share of a GPipe step (mean over ranks of 1 - busy / step) when
    stage s's forward takes t_f[s] and its backward t_b[s] for every micro-batch, no message time: a
    derivation (the text gives the equal-stage case only). Lists compared with the library's and
    torch.distributed.pipelining's, replayed by the simulator; the bubble with the simulated timeline
    of the student's own GPipe list, at equal and at unequal stages."""
    rng = random.Random(case_seed(seed))
    cases = [(2, 4), (3, 3)] + [(rng.choice([2, 3, 4, 5]), rng.choice([1, 2, 3, 5, 6, 8])) for _ in range(trials)]
    for p, m in cases:
        where = dict(p=p, m=m, seed=seed)
        g = _as_actions("gpipe", gpipe_fn(p, m), p, m)
        _same("gpipe", "GPipe's (all forwards, then all backwards in the same order)", g, gpipe_schedule(p, m), where)
        _same("gpipe", "torch's ScheduleGPipe", g, torch_schedule("GPipe", p, m), where)
        o = _as_actions("1f1b", one_f_one_b_fn(p, m), p, m)
        _same("1f1b", "1F1B's (rank r: min(p - r - 1, m) warm-up forwards, then F/B pairs, then the remaining B)",
              o, one_f_one_b_schedule(p, m), where)
        if m >= p:  # torch refuses m < p; its list numbers the last rank's forwards from 1 (torch 2.13): ranks < p-1
            t = torch_schedule("1F1B", p, m)
            _same("1f1b", "torch's Schedule1F1B", o[:-1], t[:-1], where)
        for name, sched in (("gpipe", g), ("1f1b", o)):
            try:
                simulate(sched, 1.0, 2.0)
            except ValueError as e:
                raise AssertionError(f"{name}: {e} ({where})") from None
        _check_bubble(bubble_fn, g, p, m, rng, where)
    ok("schedules", f"GPipe, 1F1B and GPipe's bubble at equal and unequal stages for {len(cases)} (p, m), also "
                    f"against torch's lists, seed={seed}")


# ----------------------------------------------------------------------------- 2. stage partition

def _coatnet_costs() -> dict[str, list[float]]:
    from dlo.models.coatnet import block_costs

    rows = block_costs(coatnet("tiny"))
    return {k: [float(r[k]) for r in rows] for k in ("params", "flops", "saved_bytes")}


@check(forbid=(SCHED + "split_stages", PIPE + "split_stages"))
def check_split_stages(fn, seed: int = 0, trials: int = 8) -> None:
    """`fn(costs, p)`: p contiguous, non-empty stages (lists of block indices, in order, covering every
    block once) whose largest total cost is as small as any partition's; ValueError when p > len(costs).
    Random costs (zeros, odd counts) and CoAtNet's per-block parameters, FLOPs and saved bytes."""
    name, rng = "split_stages", random.Random(case_seed(seed))
    cases = [(costs, p) for costs in _coatnet_costs().values() for p in (2, 4)]
    for _ in range(trials):
        n = rng.choice([1, 3, 7, 11, 16])
        cases.append(([rng.choice([0.0, 1.0, 2.5, rng.uniform(0, 10)]) for _ in range(n)], rng.randint(1, n)))
    for costs, p in cases:
        where = dict(n=len(costs), p=p, seed=seed)
        got = fn(list(costs), p)
        if not isinstance(got, (list, tuple)) or len(got) != p:
            raise AssertionError(f"{name}: return p={p} lists of block indices, got {got!r} ({where})")
        flat = [i for stage in got for i in stage]
        if any(len(stage) == 0 for stage in got):
            raise AssertionError(f"{name}: a stage is empty in {got}: every stage needs at least one block ({where})")
        if flat != list(range(len(costs))):
            raise AssertionError(f"{name}: the stages {got} must be contiguous runs of blocks, in order, covering "
                                 f"0..{len(costs) - 1} exactly once ({where})")
        worst = max(sum(costs[i] for i in stage) for stage in got)
        best = max(sum(costs[i] for i in stage) for stage in split_stages(costs, p))
        if worst > best * (1 + 1e-9) + 1e-12:
            raise AssertionError(f"{name}: the largest stage costs {worst:.6g}, but a partition with largest stage "
                                 f"{best:.6g} exists: the pipeline runs at the pace of its slowest stage ({where})")
    try:
        fn([1.0, 2.0], 3)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{name}: fn([1.0, 2.0], 3) must raise ValueError (more stages than blocks)")
    ok(name, f"{len(cases)} partitions optimal, contiguous and covering, seed={seed}")
