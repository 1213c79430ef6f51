"""simulate's message time t_comm against a hand-drawn timeline, and its fit to a recorded one
(`dlo.distributed.pipeline_fit`) on synthetic timelines with a planted t_comm (no process group)."""

import random

import pytest

from dlo.distributed import pipeline_schedules as S
from dlo.distributed.pipeline_fit import fit_timeline, makespan, message_gaps, residuals, simulate_fitted


def hand_gpipe_p2_m2(c: float) -> list[tuple]:
    """GPipe, p = 2, m = 2, t_f = 1, t_b = 2, a message c: (rank, kind, mb, start, end), drawn by hand.
    Rank 1 waits c for each activation, rank 0 c for each gradient: the step is 9 + 2c."""
    return [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 1 + c, 2 + c), (1, "F", 1, 2 + c, 3 + c),
            (1, "B", 0, 3 + c, 5 + c), (1, "B", 1, 5 + c, 7 + c), (0, "B", 0, 5 + 2 * c, 7 + 2 * c),
            (0, "B", 1, 7 + 2 * c, 9 + 2 * c)]


def as_tuples(events):
    return sorted((e["rank"], e["kind"], e["mb"], e["start"], e["end"]) for e in events)


@pytest.mark.parametrize("c", [0.0, 0.25])
def test_simulate_with_t_comm_is_the_hand_drawn_gpipe_timeline(c):
    events = S.simulate(S.gpipe_schedule(2, 2), 1.0, 2.0, t_comm=c)
    assert as_tuples(events) == sorted(hand_gpipe_p2_m2(c))
    assert makespan(events) == 9 + 2 * c


def test_t_comm_zero_is_the_simulator_without_messages():
    for sched in (S.one_f_one_b_schedule(4, 8), S.interleaved_schedule(2, 4, 2), S.zero_bubble_schedule(3, 6)):
        assert S.simulate(sched, 0.3, 0.7, 0.2) == S.simulate(sched, 0.3, 0.7, 0.2, t_comm=0.0)


def planted(schedule, t_comm, jitter=0.0, late=0, seed=0):
    """simulate's timeline with unequal stages and a planted t_comm; each action then shifted by up to
    `jitter` (a clock's noise) and `late` of them by a whole forward (a rank that waited for a core)."""
    rng = random.Random(seed)
    n = max(a.stage for acts in schedule for a in acts) + 1
    events = S.simulate(schedule, [1.0 + 0.1 * s for s in range(n)], [2.0 - 0.1 * s for s in range(n)], t_comm=t_comm)
    late_ones = set(rng.sample(range(len(events)), late))
    for k, e in enumerate(events):
        shift = rng.uniform(0, jitter) + (1.0 if k in late_ones else 0.0)
        e["start"] += shift
        e["end"] += shift
    return events


def test_the_fit_recovers_a_planted_message_time_exactly_without_noise():
    sched = S.one_f_one_b_schedule(4, 8)
    fit = fit_timeline(planted(sched, 0.3), sched)
    assert fit["t_comm"] == pytest.approx(0.3, abs=1e-12)
    assert fit["t_f"] == pytest.approx([1.0, 1.1, 1.2, 1.3]) and fit["t_b"] == pytest.approx([2.0, 1.9, 1.8, 1.7])
    assert max(abs(r["residual"]) for r in residuals(planted(sched, 0.3), simulate_fitted(planted(sched, 0.3),
                                                                                          sched))) < 1e-12


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_the_fit_recovers_a_planted_message_time_within_the_noise(name):
    """Jitter of 0.02 (2% of a forward) on every action and 3 late actions: the median gap stays within
    0.03 of the planted 0.3 (the mean of the gaps is pulled away by the late ones)."""
    sched = {"gpipe": S.gpipe_schedule(4, 8), "1f1b": S.one_f_one_b_schedule(4, 8),
             "interleaved": S.interleaved_schedule(4, 8, 2)}[name]
    events = planted(sched, 0.3, jitter=0.02, late=3, seed=1)
    fit = fit_timeline(events, sched)
    assert len(fit["gaps"]) >= 5  # GPipe with slower later stages: few idle waits
    assert fit["t_comm"] == pytest.approx(0.3, abs=0.03)


def test_no_cross_rank_wait_fits_zero_and_a_foreign_timeline_is_refused():
    sched = S.gpipe_schedule(1, 3)
    assert message_gaps(S.simulate(sched), sched) == [] and fit_timeline(S.simulate(sched), sched)["t_comm"] == 0.0
    with pytest.raises(ValueError, match="not one step of this schedule"):
        fit_timeline(S.simulate(S.gpipe_schedule(2, 2)), S.gpipe_schedule(2, 3))
