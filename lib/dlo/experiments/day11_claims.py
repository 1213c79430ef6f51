"""Day 11's claims: each measured over seeds, paired (every arm of a seed sees the same data and initialisation).

The measured sides are test accuracies and held-out losses of real trainings, read by the notebook from the
models and the result files, not from the code under test's account of itself; the counts that hold by the
schedule's design (steps a search costs, distinct learning rates a grid tries) are rows "by construction".
"""

from __future__ import annotations

from dlo import claims as C
from dlo.estimates import exact, paired_difference
from dlo.experiments.day11 import WAYS
from dlo.experiments.day11_search import STRATEGIES

HEAD, FINE, SCRATCH, CONTROL = WAYS


def transfer_claims(P, acc: dict) -> list[C.Claim]:
    small, large = min(P.labelled), max(P.labelled)
    gap = [h - s for h, s in zip(acc[HEAD][small], acc[SCRATCH][small])]
    gap_large = [h - s for h, s in zip(acc[HEAD][large], acc[SCRATCH][large])]
    return [  # the row with a control is not the first: claims_table takes its columns from the first row
        C.Claim(f"fine-tuning everything at lr/{P.finetune_factor:g} beats scratch with {small} labels",
                "FIDLE seq. 16.3", "fine-tuning starts from better features", C.at_least(0.0),
                paired_difference(acc[FINE][small], acc[SCRATCH][small], "fine-tune - scratch, test acc")),
        C.Claim(f"a new head on pretrained frozen features beats training from scratch with {small} labels",
                "FIDLE seq. 16.3; Yosinski et al. 2014", "transfer pays when labels are few", C.at_least(0.0),
                paired_difference(acc[HEAD][small], acc[SCRATCH][small], "head - scratch, test acc"),
                control=paired_difference(acc[CONTROL][small], acc[SCRATCH][small],
                                          "head on random features - scratch")),
        C.Claim(f"the frozen head's lead over scratch shrinks from {small} to {large} labels",
                "FIDLE seq. 16.3", "with enough labels, training from scratch catches up", C.at_least(0.0),
                paired_difference(gap, gap_large, f"(head - scratch) at {small} minus at {large}")),
    ]


def early_claims(rows: list[dict]) -> list[C.Claim]:
    stopped = [r["acc stopped (best restored)"] for r in rows]
    return [
        C.Claim("early stopping gives up at most 2 points of test accuracy against training to the end",
                "Prechelt 1998", "little accuracy lost for the epochs saved", C.at_most(0.02),
                paired_difference([r["acc to the end"] for r in rows], stopped, "to the end - stopped, test acc")),
        C.Claim("the weights restored are the best epoch's: the same test accuracy, exactly",
                "dlo.tuning.early (Day 3's checkpoints)", "the restored model scores as the best epoch did",
                C.approx(0.0, abs_tol=1e-9, text="0 exactly"),
                exact(max(abs(s - r["acc at best epoch (logged)"]) for s, r in zip(stopped, rows)),
                      "max |restored - logged at the best epoch| over seeds")),
        C.by_construction("early stopping saves epochs", "Prechelt 1998", "epochs not run",
                          f"counted by the loop: {[r['epochs saved'] for r in rows]} of each seed's max epochs"),
    ]


def search_claims(P, found: dict, resumed: dict, energy_measured: bool) -> list[C.Claim]:
    seeds = sorted(found)

    def best(name):
        return [found[s][name]["best"].value for s in seeds]

    points = round(P.trials ** 0.5)
    return [
        C.Claim("random search finds a config at least as good as grid search at equal budget",
                "Bergstra & Bengio 2012", "random >= grid when one of two hyperparameters matters", C.at_least(0.0),
                paired_difference(best("grid"), best("random"), "grid best - random best, val loss")),
        C.by_construction("random search tries more values of the important hyperparameter",
                          "Bergstra & Bengio 2012", f"{P.trials} distinct lrs vs {points}",
                          f"{P.trials} random draws vs a {points} x {points} grid"),
        C.Claim("successive halving beats random search at the same number of steps", "Li et al. 2020",
                "early rungs weed out bad configs cheaply", C.at_least(0.0),
                paired_difference(best(STRATEGIES[3]), best("successive halving"),
                                  "random (ASHA's budget) - SH, val loss")),
        C.by_construction("successive halving costs a fraction of a full random search",
                          "Li et al. 2020", "about (rungs) x n r steps instead of n R",
                          f"its schedule: {found[seeds[0]]['successive halving']['steps']} steps vs "
                          f"{found[seeds[0]]['random']['steps']} (steps_run of the study files)"),
        C.Claim("a study killed mid-way and resumed finds the same best trial", "dlo.tuning.store",
                "same best (trial, steps, value)", C.approx(1.0, abs_tol=1e-9, text="1 (same)"),
                exact(float(resumed["same best"]), f"killed {resumed['killed']}, resumed: best {resumed['best'].trial}"
                      f" vs the uninterrupted run's")),
        C.not_measurable("successive halving reaches more accuracy per kWh than random search",
                         "Schwartz et al. 2019 (Green AI)", "fewer steps, less energy",
                         "no energy counter readable here (RAPL is root-only, no GPU): CPU time x TDP is an "
                         "estimate, not a measurement") if not energy_measured else
        C.Claim("successive halving reaches more accuracy per kWh than random search",
                "Schwartz et al. 2019 (Green AI)", "fewer steps, less energy", C.at_least(0.0),
                paired_difference(*[[_per_kwh(found[s][n]) for s in seeds] for n in ("successive halving", "random")],
                                  "SH - random, val_acc per kWh")),
    ]


def _per_kwh(out: dict) -> float:
    kwh = sum(r.kwh for r in out["energy"])
    return out["best"].metrics[-1]["val_acc"] / kwh


def adaptive_claims(P, out: dict) -> list[C.Claim]:
    """BO against random search's first trials, PBT against its members trained alone (day11_adaptive)."""
    seeds = sorted(out)
    random_best = [min(r.value for r in out[s]["random"]) for s in seeds]
    bo_best = [min(r.value for r in out[s]["bayes"]) for s in seeds]
    alone = [min(r.value for r in out[s]["independent"]) for s in seeds]
    population = [min(r.value for r in out[s]["pbt"]) for s in seeds]
    kept = [(p.value, a.value) for s in seeds for p, a in out[s]["never exploited"]]
    pbt_steps, alone_steps = out[seeds[0]]["steps"]["pbt"], sum(r.ran for r in out[seeds[0]]["independent"])
    rows = [
        C.Claim(f"Bayesian optimisation finds a config at least as good as random search in {P.bayes_trials} trials",
                "Snoek et al. 2012; Jones et al. 1998", "expected improvement proposes better configs than random "
                "draws", C.at_least(0.0),
                paired_difference(random_best, bo_best, f"random best - BO best, val loss (first {P.bayes_init} "
                                  f"trials shared)")),
        C.Claim("PBT's population ends at least as good as the same configs trained independently",
                "Jaderberg et al. 2017", "exploit and explore beat fixed hyperparameters at the same steps",
                C.at_least(0.0), paired_difference(alone, population, "independent best - PBT best, val loss")),
        C.by_construction("PBT costs what training its members independently costs", "Jaderberg et al. 2017",
                          "the same steps", f"its schedule: {pbt_steps} steps vs {alone_steps} (steps_run, seed "
                          f"{seeds[0]})"),
    ]
    if not kept:
        return rows + [C.not_measurable("a PBT member never exploited ends exactly where its own training ends",
                                        "dlo.tuning.pbt (Day 3's resume)", "the same val loss",
                                        "every member was exploited at least once in this run")]
    return rows + [
        C.Claim("a PBT member never exploited ends exactly where its own training ends", "dlo.tuning.pbt (Day 3's "
                "resume)", "copying and resuming its checkpoint changes nothing", C.approx(0.0, abs_tol=1e-9,
                                                                                          text="0 exactly"),
                exact(max(abs(p - a) for p, a in kept), f"max |PBT - independent| val loss over {len(kept)} "
                      "members never exploited"))]
