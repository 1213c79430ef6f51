"""Bayesian optimisation with a Gaussian-process surrogate and expected improvement (Snoek et al. 2012,
"Practical Bayesian Optimization of Machine Learning Algorithms"), in numpy only.

Sequential, unlike grid and random search: each new config is the one the model of the results so far
expects to improve most on the best. The GP works in the unit cube of the search space (log scale where the
space says so) on standardised objectives, with Snoek et al.'s Matern 5/2 kernel; its length scale is the
one of a small log-spaced set that maximises the marginal likelihood. Expected improvement (for minimising,
best f*, posterior mean mu and deviation s, z = (f* - mu) / s):

    EI(x) = (f* - mu) Phi(z) + s phi(z)

is maximised over random candidates and small moves around the best points so far. A trial that diverged
(a nan or inf objective) enters the model as the worst finite value seen: it still tells the GP "not here"
instead of turning every posterior into nan (and the search into a random one).
"""

from __future__ import annotations

import math

import numpy as np

from dlo.errors import BadInput
from dlo.tuning.space import Space
from dlo.tuning.store import Job, Result, Study, Trial

LENGTH_SCALES = np.geomspace(0.03, 1.0, 8)
NOISE = 1e-6          # jitter on the diagonal: the objectives here are (nearly) noise-free


def matern52(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) / length
    return (1 + math.sqrt(5) * d + 5.0 / 3.0 * d ** 2) * np.exp(-math.sqrt(5) * d)


class GP:
    """Exact GP regression on (n, d) inputs in [0, 1]^d; fit picks the length scale by marginal likelihood."""

    def fit(self, x: np.ndarray, y: np.ndarray) -> GP:
        self.x, self.mean, self.scale = x, y.mean(), y.std() or 1.0
        z = (y - self.mean) / self.scale
        best = None
        for length in LENGTH_SCALES:
            chol = np.linalg.cholesky(matern52(x, x, length) + NOISE * np.eye(len(x)))
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
            # log p(z) = -z'K^-1 z / 2 - log|K| / 2 - n log(2 pi) / 2; the last term is the same for every length
            evidence = -0.5 * z @ alpha - np.log(np.diag(chol)).sum()
            if best is None or evidence > best[0]:
                best = (evidence, length, chol, alpha)
        _, self.length, self.chol, self.alpha = best
        return self

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of the objective at `xs`."""
        k = matern52(xs, self.x, self.length)
        mu = k @ self.alpha
        v = np.linalg.solve(self.chol, k.T)
        var = np.clip(1.0 - (v ** 2).sum(0), 1e-12, None)
        return self.mean + self.scale * mu, self.scale * np.sqrt(var)


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float) -> np.ndarray:
    """E[max(best - f, 0)] for f ~ N(mu, sigma^2): Jones et al. 1998, eq. 15; Snoek et al. 2012, eq. 2."""
    z = (best - mu) / sigma
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    pdf = np.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi)
    return (best - mu) * cdf + sigma * pdf


def finite_objectives(values) -> np.ndarray:
    """The objectives as float64, a nan or inf (a diverged trial) replaced by the worst finite one (0 if none)."""
    y = np.array(values, dtype=np.float64)
    ok = np.isfinite(y)
    return np.where(ok, y, y[ok].max() if ok.any() else 0.0)


def propose(space: Space, results: list[Result], rng: np.random.Generator, candidates: int = 2000) -> dict:
    """The config of highest expected improvement given the finished results."""
    x = np.array([space.to_unit(r.config) for r in results], dtype=np.float64)
    y = finite_objectives([r.value for r in results])
    gp = GP().fit(x, y)
    dims = len(space.params)
    near = x[np.argsort(y)[:3]]
    local = (near[rng.integers(len(near), size=candidates // 2)]
             + rng.normal(0, 0.05, size=(candidates // 2, dims))).clip(0, 1)
    pool = np.vstack([rng.random((candidates - len(local), dims)), local])
    mu, sigma = gp.predict(pool)
    return space.from_unit(pool[int(np.argmax(expected_improvement(mu, sigma, y.min())))])


def bayes_search(study: Study, trial: Trial, space: Space, steps: int, n: int, n_init: int = 3,
                 seed: int = 0, init: list[Result] = ()) -> list[Result]:
    """`n` trials (ids b0000, ...): `n_init` random configs, then one EI proposal after each result.
    Resumable: finished trials are read back, and proposal i draws from (seed, i), so it is the same again.
    `init`: results already paid for that stand for the first trials (random search's first `n_init` trials
    of the same seed and steps are exactly the configs drawn here): they count in `n` and are not run again."""
    results = list(init)
    if len(results) > n or any(r.steps != steps for r in results):
        raise BadInput(f"bayes_search: init needs at most n={n} results at steps={steps}, got "
                       f"{[(r.trial, r.steps) for r in results]}")
    for i in range(len(results), n):
        if i < n_init:
            config = space.config(seed, i)
        else:
            config = propose(space, results, np.random.default_rng([seed, i, 1]))
        results.append(study.run(trial, Job(f"b{i:04d}", config, steps)))
    return results
