"""Day 11's experiments at toy sizes: the planner's cost of successive halving against a real run's steps, the
killed and resumed study, early stopping's restored weights, and the energy claim on a GPU (NVML mocked)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dlo import claims as C
from dlo.energy import Reading
from dlo.experiments import day11, day11_claims, day11_search
from dlo.presets import DAY11
from dlo.tuning.search import Asha
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study
from tests.tuning.toy import curve_trial

TOY = replace(DAY11["tiny"], width=2, batch_size=16, n_search_train=64, n_search_test=32, trials=4, trial_steps=4,
              min_steps=1, eta=2, n_pretrain=64, labelled=(8, 16), transfer_steps=2, es_train=32, n_test=32,
              max_epochs=4, patience=1, pretrain_steps=2)


def test_the_planned_cost_of_successive_halving_is_what_a_run_spends(tmp_path):
    for n, (r, big_r, eta) in ((9, (3, 27, 3)), (10, (1, 9, 2)), (81, (25, 2025, 3))):
        study = Study(tmp_path / f"n{n}-{r}")
        Asha(Space({"x": {"uniform": [0.0, 1.0]}}), min_steps=r, max_steps=big_r, eta=eta, n_configs=n,
             seed=0).run(study, curve_trial, width=None)
        assert study.steps_run() == day11.successive_halving_steps(r, big_r, eta, n)


def test_a_killed_study_resumes_to_the_uninterrupted_best(tmp_path):
    torch.set_num_threads(1)
    out = day11_search.one_seed(TOY, "", 0, tmp_path)
    assert out["successive halving"]["steps"] == day11.successive_halving_steps(1, 4, 2, 4)
    got = day11_search.killed_and_resumed(TOY, "", 0, tmp_path / "again", out["successive halving"]["best"])
    assert got["killed"] is not None and got["same best"], got


def test_early_stopping_restores_the_best_epoch(tmp_path):
    data = day11.tasks(TOY, "", 0, torch.device("cpu"))
    rows = day11.early_stopping(TOY, data, [0], torch.device("cpu"), tmp_path)
    r = rows[0]
    assert r["epochs run"] + r["epochs saved"] == TOY.max_epochs and len(r["val losses"]) == TOY.max_epochs
    assert r["acc stopped (best restored)"] == r["acc at best epoch (logged)"]


def _fake_found(values: list[float], source: str) -> dict:
    found = {}
    for s, v in enumerate(values):
        def result(name, value, acc):
            return Result(f"{name[0]}0000", {"lr": 1e-3, "weight_decay": 0.0}, 4, [{"val_acc": acc}], 4, value)
        found[s] = {name: {"best": result(name, v + d, 0.5 + s / 100), "results": [], "steps": steps,
                           "energy": [Reading(source, joules, 1.0, "mocked")]}
                    for name, d, steps, joules in (("grid", 0.1, 16, 100.0), ("random", 0.05, 16, 100.0),
                                                   ("successive halving", 0.0, 10, 40.0 + s),
                                                   (day11_search.STRATEGIES[3], 0.2, 8, 0.0))}
    return found


def test_the_energy_claim_is_measured_only_from_a_counter():
    resumed = {"same best": True, "killed": ("a0000", 2), "best": Result("a0000", {}, 4, [], 4, 1.0)}
    gpu = day11_claims.search_claims(TOY, _fake_found([1.0, 1.1, 1.2], "nvml"), resumed, energy_measured=True)
    row = next(c for c in gpu if "per kWh" in c.claim)
    assert row.verdict == C.AGREES and row.measured.n == 3
    cpu = day11_claims.search_claims(TOY, _fake_found([1.0, 1.1, 1.2], "estimate"), resumed, energy_measured=False)
    assert next(c for c in cpu if "per kWh" in c.claim).verdict == C.NOT_MEASURABLE
