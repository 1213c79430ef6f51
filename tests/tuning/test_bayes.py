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


def matern(r):   # Matern 5/2 of a scaled distance r, written out (Rasmussen & Williams 2006, eq. 4.17)
    return (1 + math.sqrt(5) * r + 5 * r * r / 3) * math.exp(-math.sqrt(5) * r)


def test_gp_posterior_mean_and_variance_match_the_closed_form_on_two_points():
    x, y = np.array([[0.2], [0.6]]), np.array([1.0, 3.0])
    gp = GP().fit(x, y)
    # standardised targets z = (y - 2) / 1; K = [[1 + e, c], [c, 1 + e]] inverted by hand
    e, z = 1e-6, np.array([-1.0, 1.0])

    def evidence(length):
        c = matern(0.4 / length)
        det = (1 + e) ** 2 - c * c
        quad = ((1 + e) * (z @ z) - 2 * c * z[0] * z[1]) / det
        return -0.5 * quad - 0.5 * math.log(det)

    from dlo.tuning.bayes import LENGTH_SCALES
    assert gp.length == max(LENGTH_SCALES, key=evidence)          # the marginal likelihood's choice
    c = matern(0.4 / gp.length)
    det = (1 + e) ** 2 - c * c
    for xs in (0.0, 0.3, 0.45, 1.0):
        k = np.array([matern(abs(xs - 0.2) / gp.length), matern(abs(xs - 0.6) / gp.length)])
        kinv_k = np.array([(1 + e) * k[0] - c * k[1], (1 + e) * k[1] - c * k[0]]) / det
        mu, sigma = gp.predict(np.array([[xs]]))
        assert math.isclose(mu[0], 2.0 + kinv_k @ z, rel_tol=1e-9, abs_tol=1e-9), xs
        assert math.isclose(sigma[0] ** 2, 1.0 - kinv_k @ k, rel_tol=1e-7, abs_tol=1e-12), xs


def test_expected_improvement_is_the_expected_gain_over_the_best():
    # E[max(best - f, 0)], f ~ N(mu, sigma^2), by quadrature: independent of the closed form
    for mu, sigma, best in [(0.0, 1.0, 0.0), (0.5, 0.2, 0.3), (-1.0, 2.0, 0.5), (2.0, 0.5, -1.0)]:
        f = np.linspace(mu - 12 * sigma, mu + 12 * sigma, 400001)
        density = np.exp(-0.5 * ((f - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        gain = np.maximum(best - f, 0) * density
        expected = float(((gain[1:] + gain[:-1]) / 2 * np.diff(f)).sum())
        got = float(expected_improvement(np.array([mu]), np.array([sigma]), best)[0])
        assert math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12), (mu, sigma, best, got, expected)


def test_a_diverged_trial_does_not_turn_the_search_into_random_search():
    space = CASES["1-D"][1]
    xs = [-0.8, -0.3, 0.2, 0.7, 1.2, 1.7]
    results = [Result(f"b{i}", {"x": x}, 1, [(x - 0.45) ** 2], 1, (x - 0.45) ** 2) for i, x in enumerate(xs)]
    results.append(Result("b9", {"x": 1.95}, 1, [math.nan], 1, math.nan))     # lr too high: the loss is nan
    for seed in range(5):
        proposed = propose(space, results, np.random.default_rng(seed))["x"]
        assert abs(proposed - 0.45) < 0.3, (seed, proposed)                   # where the model says, not anywhere


def test_bayes_search_takes_results_already_paid_for_as_its_first_trials(tmp_path):
    space = CASES["1-D"][1]
    trial = lambda c, s, w: [wavy(c)]  # noqa: E731
    alone = bayes_search(Study(tmp_path / "alone"), trial, space, steps=1, n=6, seed=4)
    from dlo.tuning.search import random_search
    first = random_search(Study(tmp_path / "random"), trial, space, steps=1, n=3, seed=4)
    calls = []
    reused = bayes_search(Study(tmp_path / "reused"), lambda c, s, w: calls.append(c) or [wavy(c)], space, steps=1,
                          n=6, seed=4, init=first)
    assert len(calls) == 3 and [r.config for r in reused] == [r.config for r in alone]
