"""Day 11's searches that adapt as they go: Bayesian optimisation (`dlo.tuning.bayes`) and population-based
training (`dlo.tuning.pbt`), on the trial, space and seeds of the other searches (`dlo.experiments.day11_search`).

Each is held to random search's own trials of the same seed, at the same budget, so the control costs nothing:
- BO's first `P.bayes_init` trials are random search's first ones (the same draws from (seed, i): reused, not
  run again), then `P.bayes_trials - P.bayes_init` proposals of expected improvement; against the best of
  random search's first `P.bayes_trials` trials;
- PBT's members start from random search's first `P.pbt_population` configs and train to the same `R` steps,
  exploiting and exploring every `P.pbt_interval` steps; against the best of those configs trained on their own
  (the same steps in all). A member never exploited resumes its own checkpoint each generation (Day 3's resume
  is bit for bit), so it must end exactly where its independent trial ends: the mechanism's own check.
"""

from __future__ import annotations

from pathlib import Path

from dlo.experiments.day11_search import METRIC, SPACE, trial_for
from dlo.progress import tqdm
from dlo.tuning.bayes import bayes_search
from dlo.tuning.pbt import lineage, member_of, pbt, schedule
from dlo.tuning.search import best
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study

FRACTION = 0.25   # PBT's truncation selection: the bottom quarter copies the top quarter (Jaderberg et al. 4.1)


def _first(results: list[Result], n: int) -> list[Result]:
    """A search's first n trials, in the order they were drawn (ids r0000, r0001, ...)."""
    return sorted(results, key=lambda r: r.trial)[:n]


def one_seed(P, data_dir, seed: int, random: list[Result], folder: Path, device="cpu") -> dict:
    """BO and PBT for one seed, beside random search's results (`random`) of the same seed."""
    space, trial = Space(SPACE), trial_for(P, data_dir, seed, device)
    folder = Path(folder) / f"seed{seed}"
    bo_study = Study(folder / "bayes", metric=METRIC, durable=False)
    bo = bayes_search(bo_study, trial, space, P.trial_steps, n=P.bayes_trials, n_init=P.bayes_init, seed=seed,
                      init=_first(random, P.bayes_init))
    pbt_study = Study(folder / "pbt", metric=METRIC, durable=False)
    generations = pbt(pbt_study, trial, space, population=P.pbt_population, steps=P.trial_steps,
                      interval=P.pbt_interval, fraction=FRACTION, seed=seed)
    final = generations[-1]
    schedules = [schedule(pbt_study, r.trial) for r in final]
    alone = _first(random, P.pbt_population)
    # members whose every generation was their own, at their own config: nothing was copied into them
    kept = [m for m, r in enumerate(final) if {member_of(t) for t in lineage(pbt_study, r.trial)} == {m}]
    return {"bayes": bo, "random": _first(random, P.bayes_trials), "pbt": final, "schedules": schedules,
            "independent": alone, "never exploited": [(final[m], alone[m]) for m in kept],
            "steps": {"bayes": bo_study.steps_run(), "pbt": pbt_study.steps_run()}}


def runs(P, data_dir, found: dict[int, dict], seeds: list[int], folder: Path, device="cpu") -> dict[int, dict]:
    return {s: one_seed(P, data_dir, s, found[s]["random"]["results"], folder, device)
            for s in tqdm(seeds, desc="BO and PBT")}


def trials_to_reach(values: list[float], target: float) -> int | None:
    """1 + the index of the first value at or below `target`; None when none is."""
    return next((i + 1 for i, v in enumerate(values) if v <= target), None)


def summary_rows(P, out: dict[int, dict]) -> list[dict]:
    rows = []
    for seed, o in out.items():
        rnd, bo = [r.value for r in o["random"]], [r.value for r in o["bayes"]]
        pop, alone = best(o["pbt"]), best(o["independent"])
        rows.append({"seed": seed, f"random best of {len(rnd)}": min(rnd), f"BO best of {len(bo)}": min(bo),
                     "BO reaches random's best at trial": trials_to_reach(bo, min(rnd)) or "-",
                     "random at trial": rnd.index(min(rnd)) + 1,
                     f"independent best of {len(o['independent'])}": alone.value, "PBT best": pop.value,
                     "PBT best lr (end)": pop.config["lr"],
                     "members exploited": len(o["pbt"]) - len(o["never exploited"])})
    return rows


def log(out: dict[int, dict], writer_for) -> None:
    """TensorBoard: BO's objective and best so far per trial; each PBT member's lr and val_loss per step."""
    for seed, o in out.items():
        w = writer_for(f"bayes/seed{seed}")
        for i, r in enumerate(o["bayes"]):
            w.add_scalar("val_loss", r.value, i + 1)
            w.add_scalar("best_so_far", min(x.value for x in o["bayes"][:i + 1]), i + 1)
        w.close()
        for m, (final, steps) in enumerate(zip(o["pbt"], o["schedules"])):
            w = writer_for(f"pbt/seed{seed}/member{m}")
            for start, _, config in steps:     # the lr each generation trained with, at its first step
                w.add_scalar("lr", config["lr"], start)
            w.add_scalar("val_loss", final.value, steps[-1][1])
            w.close()
