"""Grid, random, successive halving and ASHA on a synthetic objective whose best config and learning-curve
order are known (tests/tuning/toy.py): the right trials are promoted, the same best is found with fewer
training steps than grid search (counted), a resumed study skips finished jobs, bad spaces are refused."""

import json

import pytest

from dlo.errors import BadInput
from dlo.tuning.search import Asha, best, grid_search, promotable, random_search, rung_steps, successive_halving
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study
from tests.tuning.toy import curve_trial, q

SPACE = Space({"x": {"uniform": [0.0, 1.0]}})
GRID = SPACE.grid(27)


def test_rungs_and_promotion_rule():
    assert rung_steps(1, 27, 3) == [1, 3, 9, 27]
    assert rung_steps(2, 20, 3) == [2, 6, 18, 20]
    rung = [Result(f"t{i}", {}, 1, [v], 1, v) for i, v in enumerate([0.5, 0.1, 0.9, 0.3, 0.2, 0.7])]
    assert promotable(rung, 3, set()) == ["t1", "t4"]       # top floor(6/3) = 2, best first
    assert promotable(rung, 3, {"t1"}) == ["t4"]            # already promoted: not again
    assert promotable(rung[:2], 3, set()) == []             # floor(2/3) = 0: nothing yet


def test_successive_halving_promotes_the_best_third_of_each_rung_and_costs_fewer_steps_than_grid(tmp_path):
    halving = Study(tmp_path / "sh")
    found = successive_halving(halving, curve_trial, SPACE, min_steps=1, max_steps=27, eta=3, configs=GRID)
    by_q = sorted(range(27), key=lambda i: q(GRID[i]["x"]))
    results = halving.results()
    for steps, keep in ((3, 9), (9, 3), (27, 1)):
        reached = {r.trial for r in results if r.steps == steps}
        assert reached == {f"a{i:04d}" for i in by_q[:keep]}, f"rung {steps}"
    grid = Study(tmp_path / "grid")
    grid_best = best(grid_search(grid, curve_trial, SPACE, steps=27, points=27))
    assert found.config == grid_best.config == GRID[by_q[0]]
    assert grid.steps_run() == 27 * 27
    assert halving.steps_run() == 27 * 1 + 9 * (3 - 1) + 3 * (9 - 3) + 1 * (27 - 9)   # promotions resume


def test_sequential_asha_finds_the_grid_best_with_fewer_steps(tmp_path):
    study = Study(tmp_path / "asha")
    found = Asha(SPACE, min_steps=1, max_steps=27, eta=3, configs=GRID).run(study, curve_trial, width=1)
    assert found.steps == 27 and found.config == min(GRID, key=lambda c: q(c["x"]))
    assert study.steps_run() < 27 * 27


def test_a_resumed_study_skips_finished_jobs_and_reissues_killed_ones(tmp_path):
    asha = Asha(SPACE, min_steps=1, max_steps=9, eta=3, n_configs=9, seed=4)
    study = Study(tmp_path / "s")
    first = asha.next_jobs(study.results(), width=None)
    assert len(first) == 9 and all(j.steps == 1 for j in first)
    for job in first[:6]:                      # the array's last three tasks were killed
        study.run(curve_trial, job)
    again = asha.next_jobs(study.results(), width=None)
    assert [j.trial for j in again if j.steps == 1] == [j.trial for j in first[6:]]
    assert [j.config for j in again if j.steps == 1] == [j.config for j in first[6:]]  # same configs: seeded
    assert sum(j.steps == 3 for j in again) == 2                                          # floor(6/3) promoted
    calls = []
    study.run(lambda c, s, w: calls.append(1) or [0.0], first[0])
    assert calls == []                         # finished: its result file is read, the trial is not rerun


def test_random_search_is_deterministic_by_seed(tmp_path):
    a = random_search(Study(tmp_path / "a"), curve_trial, SPACE, steps=2, n=5, seed=3)
    b = random_search(Study(tmp_path / "b"), curve_trial, SPACE, steps=2, n=5, seed=3)
    assert [r.config for r in a] == [r.config for r in b] and [r.value for r in a] == [r.value for r in b]
    assert json.loads((tmp_path / "a" / "trials" / "r0000" / "config.json").read_text()) == a[0].config


@pytest.mark.parametrize("spec, says", [
    ({"lr": {"log_uniform": [0, 1]}}, "low > 0"),
    ({"lr": {"uniform": [2, 1]}}, "low < high"),
    ({"lr": {"normal": [0, 1]}}, "kind in"),
    ({}, "non-empty"),
])
def test_bad_spaces_are_refused_in_one_line(spec, says):
    with pytest.raises(BadInput, match=says):
        Space(spec)


def test_space_from_yaml_and_json(tmp_path):
    (tmp_path / "s.yaml").write_text("lr: {log_uniform: [1.0e-4, 1.0e-1]}\nwidth: {choice: [8, 16]}\n")
    (tmp_path / "s.json").write_text('{"lr": {"log_uniform": [1e-4, 1e-1]}, "width": {"choice": [8, 16]}}')
    yaml_space, json_space = Space.load(tmp_path / "s.yaml"), Space.load(tmp_path / "s.json")
    assert yaml_space.config(0, 1) == json_space.config(0, 1)
    assert len(json_space.grid(3)) == 6
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BadInput, match="not valid json"):
        Space.load(tmp_path / "bad.json")


def test_the_same_jobs_on_launch_ranks_give_the_inline_results(tmp_path):
    """Trials as processes: two `dlo.distributed.launch` ranks share the jobs (rank r runs jobs r, r + 2, ...)."""
    from dlo.tuning.store import Job, run_inline, run_on_ranks

    jobs = [Job(f"j{i}", SPACE.config(1, i), 3) for i in range(5)]
    spread = run_on_ranks(Study(tmp_path / "ranks"), curve_trial, jobs, world_size=2, timeout=120)
    inline = run_inline(Study(tmp_path / "inline"), curve_trial, jobs)
    assert [(r.trial, r.value) for r in spread] == [(r.trial, r.value) for r in inline]
    assert len(Study(tmp_path / "ranks").results()) == 5


def test_integers_are_drawn_uniformly_ends_included():
    space = Space({"layers": {"int": [1, 3]}})
    counts = [0, 0, 0]
    for i in range(3000):
        counts[space.config(0, i)["layers"] - 1] += 1
    assert min(counts) > 900, counts        # rounding a uniform draw would give the ends ~750 each


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_diverged_trial_is_never_the_best_nor_promoted_wherever_it_is_listed(bad):
    # nan compares false both ways: sorted() and min() left it where it was, so listed first it won
    for place in (0, 2, 5):
        values = [0.5, 0.1, 0.9, 0.3, 0.2]
        values.insert(place, bad)
        rung = [Result(f"t{i}", {}, 1, [v], 1, v) for i, v in enumerate(values)]
        diverged = f"t{place}"
        assert best(rung).trial != diverged
        assert best(rung).value == 0.1
        assert diverged not in promotable(rung, 2, set())
        assert promotable(rung, 2, set()) == [r.trial for r in sorted(rung[:place] + rung[place + 1:],
                                                                     key=lambda r: r.value)][:3]
    only = [Result("t0", {}, 1, [bad], 1, bad)]
    assert best(only).trial == "t0"  # every trial diverged: one of them is still returned
