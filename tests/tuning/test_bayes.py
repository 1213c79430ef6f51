"""Bayesian optimisation (GP + expected improvement) reaches the minimum of known 1-D and 2-D functions in
fewer evaluations than random search, on average over seeds (evaluations counted, not timed)."""

import math

import numpy as np
import pytest

from dlo.tuning.bayes import GP, bayes_search, expected_improvement, propose
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study

SEEDS = range(5)


def wavy(c):
    return math.sin(3 * c["x"]) + c["x"] ** 2 - 0.7 * c["x"]


def branin(c):   # three global minima of 0.397887 (Dixon & Szego 1978's test function)
    x1, x2 = c["x1"], c["x2"]
    return (x2 - 5.1 / (4 * math.pi ** 2) * x1 ** 2 + 5 / math.pi * x1 - 6) ** 2 \
        + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10


CASES = {
    "1-D": (wavy, Space({"x": {"uniform": [-1, 2]}}),
            float(min(wavy({"x": x}) for x in np.linspace(-1, 2, 100001))), 0.01, 20),
    "2-D": (branin, Space({"x1": {"uniform": [-5, 10]}, "x2": {"uniform": [0, 15]}}), 0.397887, 0.1, 40),
}


def evaluations_to_reach(values, target, budget):
    """1 + the index of the first value within the tolerance; budget + 1 when none is."""
    return next((i + 1 for i, v in enumerate(values) if v < target), budget + 1)


def bo_values(f, space, budget, seed, n_init=3):
    results = []
    for i in range(budget):
        config = space.config(seed, i) if i < n_init else propose(space, results, np.random.default_rng([seed, i, 1]))
        results.append(Result(f"b{i}", config, 1, [f(config)], 1, f(config)))
    return [r.value for r in results]


@pytest.mark.parametrize("case", CASES)
def test_gp_ei_needs_fewer_evaluations_than_random_search_on_average(case):
    f, space, minimum, tolerance, budget = CASES[case]
    bo = [evaluations_to_reach(bo_values(f, space, budget, s), minimum + tolerance, budget) for s in SEEDS]
    rnd = [evaluations_to_reach([f(space.config(s, i)) for i in range(budget)], minimum + tolerance, budget)
           for s in SEEDS]
    assert np.mean(bo) < np.mean(rnd), (bo, rnd)
    assert max(bo) <= budget, f"BO missed the minimum within {budget} evaluations for a seed: {bo}"


def test_gp_interpolates_and_ei_prefers_the_unexplored_or_the_better():
    x = np.array([[0.1], [0.5], [0.9]])
    y = np.array([1.0, 0.0, 1.0])
    gp = GP().fit(x, y)
    mu, sigma = gp.predict(x)
    assert np.allclose(mu, y, atol=1e-3) and sigma.max() < 1e-2       # noise-free: through the points
    ei = expected_improvement(np.array([0.5, 0.5, -0.1]), np.array([0.1, 1.0, 1e-3]), best=0.0)
    assert ei[1] > ei[0] and ei[2] > 0.09                               # more doubt or a better mean: more EI


def test_bayes_search_resumes_from_its_files(tmp_path):
    space = CASES["1-D"][1]
    trial = lambda c, s, w: [wavy(c)]  # noqa: E731
    first = bayes_search(Study(tmp_path), trial, space, steps=1, n=5, seed=2)
    calls = []
    again = bayes_search(Study(tmp_path), lambda c, s, w: calls.append(c) or [wavy(c)], space, steps=1, n=6, seed=2)
    assert [r.config for r in again[:5]] == [r.config for r in first] and len(calls) == 1
