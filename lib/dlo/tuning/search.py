"""Grid and random search, successive halving and ASHA, over one trial interface (`dlo.tuning.store`).

Grid and random search run independent trials to the full budget: embarrassingly parallel, and random search
tries more distinct values of each hyperparameter at the same budget (Bergstra & Bengio 2012).

Successive halving and ASHA (Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning", Alg. 2)
give every config a small budget r and promote only the best 1/eta of each rung to eta times the steps, up to
the full budget R: rungs r, r*eta, r*eta^2, ... A promoted trial resumes from its checkpoint, so the search
costs about (number of rungs) x (configs x r) steps instead of configs x R. ASHA promotes as soon as a rung
has results (a config is promotable when it is in the top floor(n_k / eta) of the n_k results at its rung and
not yet promoted), so a worker never waits for a rung to fill; with every config dispatched at once
(`width=None`) it is synchronous successive halving.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dlo.errors import BadInput
from dlo.tuning.space import Space
from dlo.tuning.store import Job, Result, Study, Trial, run_inline

Runner = Callable[[Study, Trial, list], list]


def rank_key(r: Result) -> tuple:
    """Best first: the lowest objective, ties by trial id; a diverged trial (nan or +-inf) after every finite
    one, whatever its place in the list (`nan` compares false both ways: sorted() would leave it where it was)."""
    finite = math.isfinite(r.value)
    return (not finite, r.value if finite else 0.0, r.trial)


def best(results: list[Result]) -> Result:
    """The lowest objective among the results at the most steps any trial reached (ties: the lower trial id;
    a diverged trial only if every one diverged)."""
    if not results:
        raise ValueError("no results yet: run the search first")
    top = max(r.steps for r in results)
    return min((r for r in results if r.steps == top), key=rank_key)


def grid_search(study: Study, trial: Trial, space: Space, steps: int, points: int = 3,
                runner: Runner = run_inline) -> list[Result]:
    """Every grid config (`Space.grid(points)`) trained for `steps`."""
    jobs = [Job(f"g{i:04d}", config, steps) for i, config in enumerate(space.grid(points))]
    return runner(study, trial, jobs)


def random_search(study: Study, trial: Trial, space: Space, steps: int, n: int, seed: int = 0,
                  runner: Runner = run_inline) -> list[Result]:
    """`n` configs drawn from (seed, index), each trained for `steps`."""
    jobs = [Job(f"r{i:04d}", space.config(seed, i), steps) for i in range(n)]
    return runner(study, trial, jobs)


def rung_steps(min_steps: int, max_steps: int, eta: int) -> list[int]:
    """r, r*eta, r*eta^2, ... up to and including R (the last rung is R itself)."""
    if not (isinstance(eta, int) and eta >= 2 and 1 <= min_steps <= max_steps):
        raise BadInput(f"ASHA needs an integer eta >= 2 and 1 <= min_steps <= max_steps, "
                       f"got eta={eta}, min_steps={min_steps}, max_steps={max_steps}")
    rungs = [min_steps]
    while rungs[-1] * eta < max_steps:
        rungs.append(rungs[-1] * eta)
    return rungs + ([max_steps] if rungs[-1] < max_steps else [])


def promotable(rung: list[Result], eta: int, promoted: set[str]) -> list[str]:
    """ASHA's promotion rule at one rung: the trials in the top floor(n / eta) of the n results there
    (lowest objective first, ties by trial id, a diverged trial last) that have not been promoted yet, best
    first."""
    ranked = sorted(rung, key=rank_key)
    return [r.trial for r in ranked[:len(rung) // eta] if r.trial not in promoted]


class Asha:
    """Asynchronous successive halving over `n_configs` configs drawn from `space` (trial ids a0000, ...), or
    over a given list of `configs` (a grid, say)."""

    def __init__(self, space: Space, *, min_steps: int, max_steps: int, eta: int = 3, n_configs: int | None = None,
                 seed: int = 0, configs: list[dict] | None = None):
        self.rungs = rung_steps(min_steps, max_steps, eta)
        n_configs = len(configs) if configs is not None else n_configs
        if not n_configs or n_configs < 1:
            raise BadInput(f"ASHA needs n_configs >= 1 or a non-empty list of configs, got {n_configs}")
        self.space, self.eta, self.n_configs, self.seed, self.configs = space, eta, n_configs, seed, configs

    def trial_id(self, i: int) -> str:
        return f"a{i:04d}"

    def config(self, trial: str) -> dict:
        i = int(trial[1:])
        return dict(self.configs[i]) if self.configs is not None else self.space.config(self.seed, i)

    def next_job(self, results: list[Result], in_flight: set[tuple[str, int]]) -> Job | None:
        """Li et al.'s get_job: a promotion from the highest rung that has one, else a new config at the
        lowest rung (a killed job, neither finished nor in flight, is handed out again), else None."""
        finished = {(r.trial, r.steps) for r in results}
        busy = finished | in_flight
        for k in reversed(range(len(self.rungs) - 1)):
            here = [r for r in results if r.steps == self.rungs[k]]
            promoted = {t for t, s in busy if s == self.rungs[k + 1]}
            for trial in promotable(here, self.eta, promoted):
                return Job(trial, self.config(trial), self.rungs[k + 1])
        for i in range(self.n_configs):
            if (self.trial_id(i), self.rungs[0]) not in busy:
                return Job(self.trial_id(i), self.config(self.trial_id(i)), self.rungs[0])
        return None

    def next_jobs(self, results: list[Result], width: int | None = None,
                  in_flight: set[tuple[str, int]] = frozenset()) -> list[Job]:
        """Up to `width` jobs that can start now (None: all of them): one wave of a SLURM array."""
        flight, jobs = set(in_flight), []
        while width is None or len(jobs) < width:
            job = self.next_job(results, flight)
            if job is None:
                break
            jobs.append(job)
            flight.add((job.trial, job.steps))
        return jobs

    def run(self, study: Study, trial: Trial, width: int | None = 1, runner: Runner = run_inline) -> Result:
        """Waves of at most `width` jobs until no job is left; the best result at the top rung reached.
        width=1 is sequential ASHA; width=None dispatches every job that can start: successive halving."""
        while jobs := self.next_jobs(study.results(), width):
            runner(study, trial, jobs)
        return best(study.results())


def successive_halving(study: Study, trial: Trial, space: Space, *, min_steps: int, max_steps: int, eta: int = 3,
                       n_configs: int | None = None, seed: int = 0, configs: list[dict] | None = None,
                       runner: Runner = run_inline) -> Result:
    """Synchronous successive halving: all configs at r, the best 1/eta on to r*eta, ..."""
    asha = Asha(space, min_steps=min_steps, max_steps=max_steps, eta=eta, n_configs=n_configs, seed=seed,
                configs=configs)
    return asha.run(study, trial, width=None, runner=runner)

