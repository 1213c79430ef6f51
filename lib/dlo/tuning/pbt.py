"""Population-based training (Jaderberg et al. 2017, "Population Based Training of Neural Networks").

A population trains in parallel; every `interval` steps the members are ranked, and each member in the
bottom `fraction` exploits a member of the top `fraction` chosen at random (copies its weights and its
hyperparameters: here its whole checkpoint folder) and explores (perturbs the copied hyperparameters by 0.8 or
1.2, `Space.perturb`): truncation selection, the paper's 4.1. The hyperparameters thus follow a schedule the
search finds, which a fixed setting cannot (a learning rate that should fall as training goes on, say).

Each member's generation g is a trial of its own (`m03g005`: member 3 trained to (g + 1) x interval steps),
whose workdir starts as a copy of its parent's (itself or the member it exploited) at g x interval steps.
Results are immutable files, and generation g's choices are drawn from (seed, g), so a killed search
resumes where it stopped and makes the same choices again.
"""

from __future__ import annotations

import json
import shutil

import numpy as np

from dlo.errors import BadInput
from dlo.tuning.search import rank_key
from dlo.tuning.space import Space
from dlo.tuning.store import Job, Result, Study, Trial, run_inline, write_json_atomic


def member_id(member: int, generation: int) -> str:
    return f"m{member:02d}g{generation:03d}"


def member_of(trial: str) -> int:
    """The member a trial id belongs to (m03g005 -> 3)."""
    return int(trial[1:trial.index("g")])


def exploit_and_explore(space: Space, results: list[Result], fraction: float,
                        rng: np.random.Generator) -> list[tuple[int, dict]]:
    """For each member (results in member order): (the member whose weights it continues from, its next config).
    A member whose objective is nan or inf (diverged) ranks last: it is replaced, never copied."""
    order = sorted(range(len(results)), key=lambda i: rank_key(results[i]))  # ids m00g.., m01g..: member order
    cut = max(1, int(len(results) * fraction))
    top, bottom = order[:cut], set(order[-cut:])
    plan = []
    for i, result in enumerate(results):
        if i in bottom:
            winner = int(rng.choice(top))
            plan.append((winner, space.perturb(results[winner].config, rng)))
        else:
            plan.append((i, result.config))
    return plan


def _start_from(study: Study, job: Job, parent: str | None) -> None:
    """The job's workdir as a fresh copy of its parent's (a partial one left by a kill is replaced)."""
    work = study.trial_dir(job.trial) / "work"
    if study.done(job) is not None or parent is None:
        return
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(study.trial_dir(parent) / "work", work)
    write_json_atomic(study.trial_dir(job.trial) / "parent.json", {"parent": parent}, study.durable)


def pbt(study: Study, trial: Trial, space: Space, *, population: int, steps: int, interval: int,
        fraction: float = 0.25, seed: int = 0, runner=run_inline) -> list[list[Result]]:
    """Train `population` members to `steps`, exploiting and exploring every `interval` steps.
    Returns the results per generation (the last one holds the final members)."""
    if population < 2 or not 0 < fraction <= 0.5 or interval < 1 or steps % interval:
        raise BadInput(f"PBT needs population >= 2, 0 < fraction <= 0.5 and steps a multiple of interval; got "
                       f"population={population}, fraction={fraction}, steps={steps}, interval={interval}")
    plan = [(None, space.config(seed, m)) for m in range(population)]
    generations = []
    for g in range(steps // interval):
        jobs = [Job(member_id(m, g), config, (g + 1) * interval) for m, (_, config) in enumerate(plan)]
        for job, (parent, _) in zip(jobs, plan):
            _start_from(study, job, None if parent is None else member_id(parent, g - 1))
        results = runner(study, trial, jobs)
        generations.append(results)
        rng = np.random.default_rng([seed, g])
        plan = exploit_and_explore(space, results, fraction, rng)
    return generations


def lineage(study: Study, trial: str) -> list[str]:
    """The trials a final member descends from, generation 0 first, following `parent.json` through every
    exploit (a member that was never exploited: its own generations, m03g000, m03g001, ...)."""
    chain = []
    while trial is not None:
        chain.append(trial)
        parent = study.trial_dir(trial) / "parent.json"
        trial = json.loads(parent.read_text())["parent"] if parent.is_file() else None
    return chain[::-1]


def schedule(study: Study, trial: str) -> list[tuple[int, int, dict]]:
    """The hyperparameters a final member trained with, generation by generation: [(first step, last step,
    config), ...] from step 0. What PBT discovers is this schedule, not one config."""
    out, start = [], 0
    for t in lineage(study, trial):
        folder = study.trial_dir(t)
        steps = int(json.loads(max(folder.glob("steps-*.json")).read_text())["steps"])
        out.append((start, steps, json.loads((folder / "config.json").read_text())))
        start = steps
    return out
