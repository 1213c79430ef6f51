"""`python -m dlo.tuning`: a study run as waves of a SLURM job array (slurm/search.sbatch), one trial per task.

    python -m dlo.tuning init STUDY CONFIG      the study's settings from a JSON/YAML file (checked, kept)
    python -m dlo.tuning next STUDY [--width N] the next wave of jobs from the results so far: prints its size
    python -m dlo.tuning work STUDY WAVE INDEX  run job INDEX of the wave (SLURM_ARRAY_TASK_ID), result atomic
    python -m dlo.tuning drive STUDY [--width N] [--sbatch ARG ...]   next, sbatch --wait the array, repeat
    python -m dlo.tuning best STUDY             the best result and the steps the study ran

CONFIG:

    trial: mypackage.train:trial      # trial(config, steps, workdir) -> metrics per step, importable on nodes
    metric: loss                      # minimised
    seed: 0
    search: asha                      # asha, random or grid
    space: {lr: {log_uniform: [1.0e-4, 1.0e-1]}, width: {choice: [16, 32]}}
    asha: {min_steps: 1, max_steps: 27, eta: 3, n_configs: 27}   # random: {n, steps}; grid: {points, steps}

The driver is light (it reads result files and writes a wave file): run it on a login node. Each wave is
decided from the finished results only, so a killed task's job is in the next wave again, a finished one
never is, and a driver stopped and started again continues the same search.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dlo.errors import USAGE, BadInput
from dlo.tuning.search import Asha, best
from dlo.tuning.space import Space, read_config
from dlo.tuning.store import Job, Study, load_trial, write_json_atomic

SEARCHES = {"asha": ("min_steps", "max_steps", "eta", "n_configs"), "random": ("n", "steps"),
            "grid": ("points", "steps")}
SBATCH = Path(__file__).resolve().parents[3] / "slurm" / "search.sbatch"


def check_settings(settings: dict) -> dict:
    """The config, refused in one line when something a wave needs is missing or wrong."""
    for key in ("trial", "search", "space"):
        if key not in settings:
            raise BadInput(f"study config has no {key!r}; see python -m dlo.tuning --help")
    search = settings["search"]
    if search not in SEARCHES:
        raise BadInput(f"search {search!r} unknown: use one of {', '.join(SEARCHES)}")
    given = settings.get(search, {})
    missing = [k for k in SEARCHES[search] if k not in given and not (search == "asha" and k == "eta")]
    if missing:
        raise BadInput(f"study config: {search} needs {', '.join(missing)} (e.g. {search}: {{...}})")
    Space(settings["space"])
    load_trial(settings["trial"])
    return settings


def all_jobs(settings: dict) -> list[Job] | None:
    """Every job of a random or grid search (None for ASHA, whose jobs depend on the results)."""
    space, opts, seed = Space(settings["space"]), settings.get(settings["search"], {}), settings.get("seed", 0)
    if settings["search"] == "random":
        return [Job(f"r{i:04d}", space.config(seed, i), opts["steps"]) for i in range(opts["n"])]
    if settings["search"] == "grid":
        return [Job(f"g{i:04d}", c, opts["steps"]) for i, c in enumerate(space.grid(opts["points"]))]
    return None


def next_wave(study: Study, width: int | None) -> list[Job]:
    settings = study.settings()
    jobs = all_jobs(settings)
    if jobs is not None:
        return [j for j in jobs if study.done(j) is None][:width]
    opts = {"eta": 3, **settings["asha"]}
    asha = Asha(Space(settings["space"]), min_steps=opts["min_steps"], max_steps=opts["max_steps"], eta=opts["eta"],
                n_configs=opts["n_configs"], seed=settings.get("seed", 0))
    return asha.next_jobs(study.results(), width)


def write_wave(study: Study, jobs: list[Job]) -> Path:
    waves = study.folder / "waves"
    number = len(list(waves.glob("wave-*.json"))) + 1 if waves.is_dir() else 1
    return write_json_atomic(waves / f"wave-{number:04d}.json",
                             {"jobs": [{"trial": j.trial, "config": j.config, "steps": j.steps} for j in jobs]})


def init(study: Study, config: Path) -> None:
    settings = check_settings(read_config(config))
    path = study.folder / "study.json"
    if path.exists() and json.loads(path.read_text()) != settings:
        raise BadInput(f"{path} holds other settings: a study's settings never change; start a new study folder")
    write_json_atomic(path, settings)


def work(study: Study, wave: Path, index: int) -> None:
    jobs = json.loads(Path(wave).read_text())["jobs"]
    if not 0 <= index < len(jobs):
        raise BadInput(f"{wave} has {len(jobs)} jobs; index {index} is outside 0..{len(jobs) - 1}")
    result = study.run(load_trial(study.settings()["trial"]), Job(**jobs[index]))
    print(f"{result.trial} at {result.steps} steps: {study.metric} {result.value:.6g} ({result.ran} steps run)")


def drive(study: Study, width: int | None, sbatch: list[str]) -> None:
    """Waves until none is left: each an array of one task per job, waited for (sbatch --wait)."""
    while jobs := next_wave(study, width):
        wave = write_wave(study, jobs)
        print(f"{wave.name}: {len(jobs)} jobs", flush=True)
        # a failed task ends sbatch --wait non-zero: its job stays undone and the next wave has it again
        subprocess.run(["sbatch", "--wait", f"--array=0-{len(jobs) - 1}", *sbatch, str(SBATCH),
                        str(study.folder.resolve()), str(wave.resolve())], check=False, cwd=SBATCH.parents[1])
        if not any(study.done(j) for j in jobs):
            raise SystemExit(f"python -m dlo.tuning: no job of {wave.name} finished; see the array's logs")
    report(study)


def report(study: Study) -> None:
    if not study.results():
        print("no results yet: run `python -m dlo.tuning drive` (or the waves by hand)")
        return
    top = best(study.results())
    print(f"best: {top.trial} {top.config} {study.metric} {top.value:.6g} at {top.steps} steps; "
          f"{study.steps_run()} steps run in all")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlo.tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("init", "next", "work", "drive", "best"):
        p = sub.add_parser(name)
        p.add_argument("study", type=Path)
        if name == "init":
            p.add_argument("config", type=Path)
        if name == "work":
            p.add_argument("wave", type=Path)
            p.add_argument("index", type=int)
        if name in ("next", "drive"):
            p.add_argument("--width", type=int, default=None, help="at most this many tasks per wave")
        if name == "drive":
            p.add_argument("--sbatch", nargs=argparse.REMAINDER, default=[], help="passed on to sbatch")
    args = parser.parse_args(argv)
    try:
        study = Study(args.study)
        if args.command == "init":
            init(study, args.config)
        else:
            study.metric = study.settings().get("metric", "loss")
        if args.command == "next":
            jobs = next_wave(study, args.width)
            print(f"{len(jobs)} {write_wave(study, jobs) if jobs else '-'}")
        elif args.command == "work":
            work(study, args.wave, args.index)
        elif args.command == "drive":
            drive(study, args.width, args.sbatch)
        elif args.command == "best":
            report(study)
    except BadInput as err:
        print(f"python -m dlo.tuning {args.command}: {err}", file=sys.stderr)
        return USAGE
    return 0
