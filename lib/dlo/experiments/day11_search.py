"""Day 11's searches: grid vs random at equal budget, successive halving vs random at equal budget, a study
killed and resumed, every trial tracked (`dlo.tracking`, TensorBoard's HParams) and the energy of each search.

Every trial is a real training: `dlo.tuning.trials.small_cnn_trial` (SmallCNN on the 10-class images, AdamW,
resumable from its checkpoint), its metric the held-out loss. Two hyperparameters, one that matters (the
learning rate, log-uniform) and one that barely does over a few dozen steps (AdamW's decoupled weight decay):
Bergstra & Bengio 2012's setting, where a 3 x 3 grid tries 3 learning rates and 9 random trials try 9.
Each search is repeated with `search_seeds` data-and-initialisation seeds (the same for every strategy: paired).
"""

from __future__ import annotations

import contextlib
import io
import math
from functools import partial
from pathlib import Path

from dlo.energy import EnergyMeter
from dlo.progress import tqdm
from dlo.tracking import Run
from dlo.tuning.search import Asha, best, grid_search, random_search
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study
from dlo.tuning.trials import small_cnn_trial

SPACE = {"lr": {"log_uniform": [1e-4, 0.3]}, "weight_decay": {"uniform": [0.0, 0.1]}}
METRIC = "val_loss"
STRATEGIES = ("grid", "random", "successive halving", "random, ASHA's budget")


def trial_for(P, data_dir, seed: int, device="cpu"):
    """The trial of one search seed: small_cnn_trial with the preset's sizes fixed, only lr and decay searched."""
    fixed = {"device": str(device), "width": P.width, "image_size": P.image_size, "batch_size": P.batch_size,
             "n_train": P.n_search_train, "n_test": P.n_search_test, "data_dir": data_dir or None, "seed": seed}
    return partial(_trial, fixed)


def _trial(fixed: dict, config: dict, steps: int, workdir: Path) -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()):   # its data's one line per trial, hundreds of times
        return small_cnn_trial({**fixed, **config}, steps, workdir)


def _acc(result: Result) -> float:
    return result.metrics[-1]["val_acc"]


def one_seed(P, data_dir, seed: int, folder: Path, device="cpu") -> dict:
    """The three searches for one seed, each inside an EnergyMeter; results, best, steps run, energy."""
    space, trial = Space(SPACE), trial_for(P, data_dir, seed, device)
    out = {}
    for name in STRATEGIES[:3]:
        study = Study(Path(folder) / f"seed{seed}" / name.replace(" ", "_"), metric=METRIC, durable=False)
        with EnergyMeter(tdp_watts=P.tdp_watts) as meter:
            if name == "grid":
                grid_search(study, trial, space, P.trial_steps, points=math.isqrt(P.trials))
            elif name == "random":
                random_search(study, trial, space, P.trial_steps, P.trials, seed=seed)
            else:   # every config dispatched at once: synchronous successive halving (Li et al. 2020, Alg. 1)
                Asha(space, min_steps=P.min_steps, max_steps=P.trial_steps, eta=P.eta, n_configs=P.trials,
                     seed=seed).run(study, trial, width=None)
        results = study.results()
        out[name] = {"study": study, "results": results, "best": best(results), "steps": study.steps_run(),
                     "energy": meter.readings}
    # random search cut to ASHA's budget: its first k trials, k x R <= ASHA's steps (the same draws, paired)
    k = max(1, out["successive halving"]["steps"] // P.trial_steps)
    first = [r for r in out["random"]["results"] if int(r.trial[1:]) < k]
    out[STRATEGIES[3]] = {"results": first, "best": best(first), "steps": sum(r.ran for r in first), "energy": None}
    return out


def searches(P, data_dir, seeds: list[int], folder: Path, device="cpu") -> dict[int, dict]:
    return {s: one_seed(P, data_dir, s, folder, device) for s in tqdm(seeds, desc="searches")}


def best_so_far(results: list[Result], top_steps: int) -> list[float]:
    """The best objective after each full-budget trial, in the order the trials ran (ids)."""
    values = [r.value for r in sorted(results, key=lambda r: r.trial) if r.steps == top_steps]
    return [min(values[:i + 1]) for i in range(len(values))]


def summary_rows(found: dict[int, dict]) -> list[dict]:
    rows = []
    for seed, out in found.items():
        for name in STRATEGIES:
            b = out[name]["best"]
            rows.append({"seed": seed, "search": name, "trials": len({r.trial for r in out[name]["results"]}),
                         "steps run": out[name]["steps"], "best lr": b.config["lr"],
                         "best decay": b.config["weight_decay"], f"best {METRIC}": b.value, "its val_acc": _acc(b)})
    return rows


def energy_rows(found: dict[int, dict], grams_per_kwh: float) -> list[dict]:
    rows = []
    for seed, out in found.items():
        for name in STRATEGIES[:3]:
            for reading in out[name]["energy"]:
                kwh = reading.kwh
                rows.append({"seed": seed, "search": name, "source": reading.source, "J": reading.joules,
                             "kWh": kwh, "gCO2e": reading.co2e_grams(grams_per_kwh),
                             "val_acc per kWh": _acc(out[name]["best"]) / kwh if kwh > 0 else math.nan,
                             "how": reading.how})
    return rows


def track(found: dict[int, dict], root: Path, writer_for) -> Path:
    """Every trial of every search as a `dlo.tracking.Run` (parameters, val_loss per rung, status) and as a
    TensorBoard HParams entry (`add_hparams`: the plugin's table and parallel-coordinates view)."""
    root = Path(root)
    for seed, out in found.items():
        for name in STRATEGIES[:3]:
            by_trial: dict[str, list[Result]] = {}
            for r in out[name]["results"]:
                by_trial.setdefault(r.trial, []).append(r)
            for trial, rs in by_trial.items():
                params = {"search": name, "seed": seed, **rs[0].config}
                with Run(root, f"seed{seed}-{name.replace(' ', '_')}-{trial}", params) as run:
                    for r in sorted(rs, key=lambda r: r.steps):
                        run.log(r.steps, val_loss=r.value, val_acc=_acc(r))
                last = max(rs, key=lambda r: r.steps)
                w = writer_for(f"hparams/seed{seed}/{name.replace(' ', '_')}/{trial}")
                w.add_hparams({"lr": last.config["lr"], "weight_decay": last.config["weight_decay"], "search": name},
                              {"hparam/val_loss": last.value, "hparam/val_acc": _acc(last), "hparam/steps": last.steps},
                              run_name=".")
                w.close()
    return root


class Killed(RuntimeError):
    """What the killed job raises: its checkpoint is on disk, its result is not."""


def killed_and_resumed(P, data_dir, seed: int, folder: Path, reference: Result, device="cpu") -> dict:
    """Successive halving with one job killed after its checkpoint and before its result file (the worst moment),
    then the study resumed from its folder; its best against the uninterrupted run's (`reference`)."""
    space, trial = Space(SPACE), trial_for(P, data_dir, seed, device)
    study = Study(Path(folder) / f"seed{seed}" / "killed_and_resumed", metric=METRIC, durable=False)
    victim = {"job": None}

    def fragile(config, steps, workdir):
        metrics = trial(config, steps, workdir)
        if victim["job"] is None and steps > P.min_steps:   # the first promoted job dies
            victim["job"] = (Path(workdir).parent.name, steps)
            raise Killed(f"killed {victim['job']}")
        return metrics

    asha = Asha(space, min_steps=P.min_steps, max_steps=P.trial_steps, eta=P.eta, n_configs=P.trials, seed=seed)
    try:
        asha.run(study, fragile, width=None)
    except Killed:
        pass
    before = len(study.results())
    resumed = asha.run(study, trial, width=None)
    return {"killed": victim["job"], "results before the kill": before, "best": resumed,
            "same best": (resumed.trial, resumed.steps, resumed.value) == (reference.trial, reference.steps,
                                                                          reference.value),
            "steps run": study.steps_run()}
