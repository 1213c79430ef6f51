"""The simulator's parameters fitted to a recorded pipeline timeline, and what the fit leaves unexplained.

`fit_timeline(events, schedule)` reads a timeline (`dlo.distributed.pipeline.Timeline`'s records, one
step, every rank on one clock) of `schedule` and returns what `simulate` needs to redraw it:

- per stage, the median duration of its F, B (and W) actions: a stage's work, whatever rank runs it;
- t_comm, the time of one stage-to-stage message: the **median gap** between the end of an action on
  one rank and the start of the action on another rank that waits for it (`dependencies`), over the
  pairs where the waiting rank had finished its previous action by then (it was idle: under the
  simulator's rule, start = max(rank free, dependency end + t_comm), such a start is dependency end +
  t_comm exactly). A median, not least squares: the rule is a max (the model is not linear in t_comm,
  and a busy rank hides the message), and on a shared CPU a rank waiting for a core adds long one-sided
  delays that pull a mean up while the median of the gaps stays at the typical message.

The recorded spans are the compute only (the engine receives before a span and sends after it), so
a gap holds the send, the receive and the engine's Python between them; what the fit cannot hold
(a rank's own overhead between two actions, a late core) shows in `residuals`: recorded start minus
simulated start of each action, both from their step's first start.
"""

from __future__ import annotations

import statistics

from dlo.distributed.pipeline_schedules import Action, dependencies, simulate


def _key(e: dict) -> Action:
    return Action(e["kind"], e["stage"], e["mb"])


def _check(events: list[dict], schedule: list[list[Action]]) -> dict[Action, dict]:
    by_action = {_key(e): e for e in events}
    wanted = {a for acts in schedule for a in acts}
    if set(by_action) != wanted or len(by_action) != len(events):
        missing, extra = sorted(map(str, wanted - set(by_action))), sorted(map(str, set(by_action) - wanted))
        raise ValueError(f"the timeline is not one step of this schedule: missing {missing[:4]}, not in it "
                         f"{extra[:4]}, {len(events) - len(by_action)} repeated")
    return by_action


def message_gaps(events: list[dict], schedule: list[list[Action]]) -> list[float]:
    """Dependency end to dependent start, across ranks, where the dependent's rank was idle (module
    docstring): each an observation of t_comm."""
    by_action = _check(events, schedule)
    n_stages = max(a.stage for a in by_action) + 1
    rank_of = {a: r for r, acts in enumerate(schedule) for a in acts}
    gaps = []
    for acts in schedule:
        for prev, a in zip([None] + acts[:-1], acts):
            e = by_action[a]
            free = by_action[prev]["end"] if prev is not None else float("-inf")
            for d in dependencies(a, n_stages):
                if rank_of[d] != rank_of[a] and by_action[d]["end"] >= free:
                    gaps.append(e["start"] - by_action[d]["end"])
    return gaps


def fit_timeline(events: list[dict], schedule: list[list[Action]]) -> dict:
    """`simulate`'s arguments for a recorded step: t_f, t_b, t_w (per-stage medians; t_w 0 without W)
    and t_comm (median message gap, >= 0; 0 with no cross-rank wait), with the gaps it rests on."""
    by_action = _check(events, schedule)
    n_stages = max(a.stage for a in by_action) + 1

    def per_stage(kind):
        out = []
        for s in range(n_stages):
            d = [e["end"] - e["start"] for a, e in by_action.items() if a.kind == kind and a.stage == s]
            out.append(statistics.median(d) if d else 0.0)
        return out

    gaps = message_gaps(events, schedule)
    has_w = any(a.kind == "W" for a in by_action)
    return {"t_f": per_stage("F"), "t_b": per_stage("B"), "t_w": per_stage("W") if has_w else 0.0,
            "t_comm": max(0.0, statistics.median(gaps)) if gaps else 0.0, "gaps": gaps}


def simulate_fitted(events: list[dict], schedule: list[list[Action]], t_comm: float | None = None) -> list[dict]:
    """`simulate(schedule)` with the fitted durations and the fitted t_comm (or the one given)."""
    fit = fit_timeline(events, schedule)
    return simulate(schedule, fit["t_f"], fit["t_b"], fit["t_w"], fit["t_comm"] if t_comm is None else t_comm)


def residuals(recorded: list[dict], simulated: list[dict]) -> list[dict]:
    """Per action, recorded start minus simulated start (each from its own step's first start)."""
    r0, s0 = min(e["start"] for e in recorded), min(e["start"] for e in simulated)
    sim = {_key(e): e["start"] - s0 for e in simulated}
    return [{**{k: e[k] for k in ("rank", "kind", "stage", "mb")}, "residual": e["start"] - r0 - sim[_key(e)]}
            for e in sorted(recorded, key=lambda e: e["start"])]


def makespan(events: list[dict]) -> float:
    return max(e["end"] for e in events) - min(e["start"] for e in events)


__all__ = ["fit_timeline", "makespan", "message_gaps", "residuals", "simulate_fitted"]
