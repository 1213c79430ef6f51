"""Population-based training on a toy whose best learning rate falls over time (tests/tuning/toy.py):
it beats the same population trained with fixed hyperparameters, paired by seed; exploit copies the
winner's checkpoint and hyperparameters; a killed search resumes to the same result."""

import json
import math

import numpy as np

from dlo.tuning.pbt import exploit_and_explore, member_id, pbt
from dlo.tuning.search import best, random_search
from dlo.tuning.space import Space
from dlo.tuning.store import Result, Study
from tests.tuning.toy import moving_optimum

SPACE = Space({"lr": {"log_uniform": [1e-3, 1.0]}})
RUN = dict(population=8, steps=200, interval=10)


def test_pbt_beats_fixed_hyperparameters_paired_by_seed(tmp_path):
    trial = moving_optimum()
    for seed in range(3):
        found = best(pbt(Study(tmp_path / f"pbt{seed}", durable=False), trial, SPACE, seed=seed, **RUN)[-1])
        fixed = best(random_search(Study(tmp_path / f"fixed{seed}", durable=False), trial, SPACE, steps=200,
                                   n=RUN["population"], seed=seed))   # the same eight starting configs, never changed
        assert found.value < fixed.value / 10, (seed, found.value, fixed.value)
        # the schedule it found ends near the optimum of the last steps (0.1 x 2^-4), which no fixed lr can follow
        assert abs(math.log2(found.config["lr"] / (0.1 * 2 ** -4))) < 1.5, found.config


def test_exploit_copies_the_winners_weights_and_hyperparameters_then_explores():
    results = [Result(f"m{i}", {"lr": lr}, 10, [v], 1, v)
               for i, (lr, v) in enumerate([(0.1, 3.0), (0.01, 1.0), (0.5, 9.0), (0.05, 2.0)])]
    plan = exploit_and_explore(SPACE, results, 0.25, np.random.default_rng(0))
    assert plan[0] == (0, {"lr": 0.1}) and plan[1] == (1, {"lr": 0.01}) and plan[3] == (3, {"lr": 0.05})
    parent, config = plan[2]                                  # the worst continues from the best, perturbed
    assert parent == 1 and any(math.isclose(config["lr"], 0.01 * f) for f in (0.8, 1.2)), plan[2]


def test_exploited_member_starts_from_the_winners_checkpoint_and_resume_repeats_the_search(tmp_path):
    trial = moving_optimum()
    study = Study(tmp_path / "s", durable=False)
    whole = pbt(study, trial, SPACE, seed=1, **RUN)
    copied = [p for p in (tmp_path / "s" / "trials").glob("*/parent.json")
              if json.loads(p.read_text())["parent"][:3] != p.parent.name[:3]]
    assert copied, "no member exploited another"
    child = copied[0].parent
    parent = json.loads(copied[0].read_text())["parent"]
    result = lambda folder: json.loads(next(folder.glob("steps-*.json")).read_text())  # noqa: E731
    first, before = result(child), result(tmp_path / "s" / "trials" / parent)
    # the child's first step continues from the parent's loss (its weights), not from a fresh start of 1.0
    assert first["metrics"][0] < before["value"] < 1.0
    # kill: generation 12 onwards lost, including a half-written workdir; the rerun makes the same choices
    for g in range(12, 20):
        for m in range(RUN["population"]):
            for f in (tmp_path / "s" / "trials" / member_id(m, g)).glob("steps-*.json"):
                f.unlink()
    (tmp_path / "s" / "trials" / member_id(0, 12) / "work" / "loss.json").write_text('{"steps": 999, "loss": 0}')
    again = pbt(study, trial, SPACE, seed=1, **RUN)
    assert [(r.config, r.value) for r in again[-1]] == [(r.config, r.value) for r in whole[-1]]
