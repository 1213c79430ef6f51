"""A study's files: one folder per trial, every result written atomically, so a killed job loses nothing.

The one interface every search runs its trials through:

    trial(config: dict, steps: int, workdir: Path) -> list of metrics, one per step it ran

`steps` is the total the trial should have reached when it returns; `workdir` is the trial's own folder,
kept between calls, where it may keep a checkpoint (Day 3's `dlo.checkpoint`) and resume from it, so that a
promotion (ASHA) or an exploit (PBT: the best member's workdir copied over a worse one's) continues training
instead of starting again. A metric is a number (minimised) or a dict holding `metric`. The same callable runs
in a notebook, on `dlo.distributed.launch` ranks, or in a SLURM array task (`python -m dlo.tuning work`).

    STUDY/study.json                   the search's settings, written once
    STUDY/trials/<id>/config.json      the trial's hyperparameters
    STUDY/trials/<id>/steps-<n>.json   its result at n steps: the metric per step run, the steps it ran
    STUDY/trials/<id>/work/            its checkpoint folder

A result file exists only once complete (temporary file, fsync, rename), so a search resumed after a kill
skips exactly the finished (trial, steps) jobs and reruns the rest.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dlo.checkpoint import write_atomic
from dlo.errors import BadInput

Trial = Callable[[dict, int, Path], list]


def write_json_atomic(path, data, durable: bool = True) -> Path:
    """`data` as JSON at `path`: a reader (or a resumed search) sees the old file or the new one, never half
    (`dlo.checkpoint.write_atomic`). durable=False skips the fsync: worth it for thousands of tiny trials on a
    slow disk."""
    return write_atomic(path, lambda f: json.dump(data, f, indent=1, sort_keys=True), mode="w", durable=durable)


def metric_value(point, metric: str = "loss") -> float:
    """A step's metric: the number itself, or `point[metric]` of a dict."""
    if isinstance(point, dict):
        if metric not in point:
            raise KeyError(f"the trial's metrics {sorted(point)} have no {metric!r}: pass metric= to the search")
        return float(point[metric])
    return float(point)


def load_trial(spec: str) -> Trial:
    """`package.module:function` -> the callable (how a SLURM task finds the trial in study.json)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise BadInput(f"trial {spec!r} not found ({err}); write it as package.module:function, importable here") \
            from None
    return fn


@dataclass(frozen=True)
class Job:
    trial: str       # the trial's id, e.g. "t0007"
    config: dict
    steps: int       # the total steps the trial reaches


@dataclass(frozen=True)
class Result:
    trial: str
    config: dict
    steps: int
    metrics: list    # per step run in this call
    ran: int         # steps actually run (fewer than `steps` when the trial resumed)
    value: float     # the objective at `steps`: the last metric

    def as_dict(self) -> dict:
        return {"trial": self.trial, "config": self.config, "steps": self.steps, "metrics": self.metrics,
                "ran": self.ran, "value": self.value}


class Study:
    """The folder of one search."""

    def __init__(self, folder, metric: str = "loss", durable: bool = True):
        self.folder, self.metric, self.durable = Path(folder), metric, durable

    def trial_dir(self, trial: str) -> Path:
        return self.folder / "trials" / trial

    def result_path(self, trial: str, steps: int) -> Path:
        return self.trial_dir(trial) / f"steps-{steps:06d}.json"

    def settings(self) -> dict:
        path = self.folder / "study.json"
        if not path.is_file():
            raise BadInput(f"{self.folder} holds no study.json: start the study with `python -m dlo.tuning init`")
        return json.loads(path.read_text())

    def results(self) -> list[Result]:
        """Every finished (trial, steps), in trial then step order."""
        found = sorted((self.folder / "trials").glob("*/steps-*.json"))
        return [Result(**json.loads(p.read_text())) for p in found]

    def done(self, job: Job) -> Result | None:
        path = self.result_path(job.trial, job.steps)
        return Result(**json.loads(path.read_text())) if path.is_file() else None

    def run(self, trial: Trial, job: Job) -> Result:
        """Run one job (or return its result when a previous run finished it) and record it atomically."""
        finished = self.done(job)
        if finished is not None:
            return finished
        work = self.trial_dir(job.trial) / "work"
        work.mkdir(parents=True, exist_ok=True)
        if not (self.trial_dir(job.trial) / "config.json").exists():  # a trial's config is fixed (PBT: new id)
            write_json_atomic(self.trial_dir(job.trial) / "config.json", job.config, self.durable)
        metrics = list(trial(dict(job.config), job.steps, work))
        if not metrics:
            raise ValueError(f"trial {job.trial} returned no metric for steps={job.steps}: return one per step run")
        result = Result(job.trial, job.config, job.steps, metrics, len(metrics),
                        metric_value(metrics[-1], self.metric))
        write_json_atomic(self.result_path(job.trial, job.steps), result.as_dict(), self.durable)
        return result

    def steps_run(self) -> int:
        """What the search cost, in training steps actually run (summed over every result)."""
        return sum(r.ran for r in self.results())


def run_inline(study: Study, trial: Trial, jobs: Iterable[Job]) -> list[Result]:
    """The jobs one after another in this process (a notebook cell)."""
    return [study.run(trial, job) for job in jobs]


def run_on_ranks(study: Study, trial: Trial, jobs: list[Job], world_size: int, timeout: float = 3600) -> list[Result]:
    """The jobs shared over `world_size` processes by `dlo.distributed.launch` (rank r runs jobs r, r + W, ...),
    locally or under srun/torchrun; each writes its own result files, the results come back in job order."""
    from dlo.distributed import launch

    def share(rank_jobs):
        from dlo.distributed import rank
        return [(i, study.run(trial, job)) for i, job in enumerate(rank_jobs) if i % world_size == rank()]

    per_rank = launch(share, world_size, jobs, timeout=timeout)
    return [result for _, result in sorted((pair for part in per_rank for pair in part), key=lambda p: p[0])]

