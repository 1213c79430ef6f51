"""Population-based training on a toy whose best learning rate falls over time (tests/tuning/toy.py):
it beats the same population trained with fixed hyperparameters, paired by seed; exploit copies the
winner's checkpoint and hyperparameters; a killed search resumes to the same result."""

import json
import math

import numpy as np

from dlo.tuning.pbt import exploit_and_explore, member_id, pbt, schedule
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


def test_a_diverged_member_is_replaced_and_never_copied():
    for values in ([math.nan, 1.0, 2.0, 3.0], [1.0, math.inf, 2.0, 3.0], [2.0, 1.0, math.nan, 3.0]):
        results = [Result(f"m{i}", {"lr": 0.01 * (i + 1)}, 10, [v], 1, v) for i, v in enumerate(values)]
        for seed in range(5):
            plan = exploit_and_explore(SPACE, results, 0.25, np.random.default_rng(seed))
            sick = next(i for i, v in enumerate(values) if not math.isfinite(v))
            assert plan[sick][0] != sick and all(parent != sick for parent, _ in plan), (values, plan)


def test_explore_moves_a_float_off_zero():
    # a product never left 0: a weight decay drawn at its lower bound stayed 0 for the whole population's life
    space = Space({"wd": {"uniform": [0.0, 0.1]}, "shift": {"uniform": [-1.0, 1.0]}})
    rng = np.random.default_rng(0)
    outs = [space.perturb({"wd": 0.0, "shift": 0.0}, rng) for _ in range(40)]
    assert {round(o["wd"], 12) for o in outs} == {0.0, 0.02}      # x0.8: held at the bound; x1.2: +0.2 of the range
    assert {round(o["shift"], 12) for o in outs} == {-0.4, 0.4}   # both directions where the range allows


def test_explore_stays_in_bounds_and_moves_every_kind():
    space = Space({"lr": {"log_uniform": [1e-4, 0.3]}, "wd": {"uniform": [0.0, 0.1]}, "layers": {"int": [1, 6]},
                   "width": {"choice": [8, 16, 32]}})
    rng = np.random.default_rng(0)
    edges = [{"lr": 1e-4, "wd": 0.1, "layers": 1, "width": 8}, {"lr": 0.3, "wd": 0.0, "layers": 6, "width": 32},
             {"lr": 0.29, "wd": 0.095, "layers": 2, "width": 16}]
    for config in edges + [space.config(3, i) for i in range(200)]:
        for _ in range(5):
            out = space.perturb(config, rng)
            for p in space.params:
                if p.kind == "choice":
                    assert out[p.name] in p.values
                    continue
                low, high = p.values
                assert low <= out[p.name] <= high, (p.name, config, out)
                if p.kind == "int":
                    assert isinstance(out[p.name], int) and abs(out[p.name] - config[p.name]) <= 2, (config, out)
                    # an int the factor rounds back to itself still moves (unless a bound stops it)
                    assert out[p.name] != config[p.name] or config[p.name] in (low, high), (config, out)
                elif low < config[p.name] * 0.8 and config[p.name] * 1.2 < high:
                    ratio = out[p.name] / config[p.name]
                    assert any(math.isclose(ratio, f) for f in (0.8, 1.2)), (p.name, config, out)


def test_exploit_starts_the_loser_from_the_winners_checkpoint_exactly(tmp_path):
    import torch

    from dlo.checkpoint import CheckpointManager
    from dlo.tuning.trials import small_cnn_trial

    fixed = {"width": 4, "image_size": 8, "batch_size": 16, "n_train": 64, "n_test": 32, "seed": 5}
    seen = {}

    def trial(config, steps, workdir):       # what the member finds in its workdir when it starts
        state, path = CheckpointManager(workdir).load_latest()
        seen[workdir.parent.name] = (path, state)
        return small_cnn_trial({**fixed, **config}, steps, workdir)

    space = Space({"lr": {"log_uniform": [1e-4, 0.3]}})
    study = Study(tmp_path / "s", metric="val_loss", durable=False)
    gens = pbt(study, trial, space, population=2, steps=4, interval=2, fraction=0.5, seed=0)
    loser = max(range(2), key=lambda m: (gens[0][m].value, m))
    winner = 1 - loser
    child = member_id(loser, 1)
    assert json.loads((study.trial_dir(child) / "parent.json").read_text())["parent"] == member_id(winner, 0)
    path, start = seen[child]
    parent_state, parent_path = CheckpointManager(study.trial_dir(member_id(winner, 0)) / "work").load_latest()
    assert path.name == parent_path.name == "ckpt-00000002.pt" and start is not None
    flat = lambda tree: {k: v for k, v in torch.utils._pytree.tree_flatten_with_path(tree)[0]}  # noqa: E731
    a, b = flat(start), flat(parent_state)
    assert a.keys() == b.keys() and any(isinstance(v, torch.Tensor) for v in a.values())
    for key in a:                              # the model, AdamW's moments, the batch position, every RNG
        x, y = a[key], b[key]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) \
            if isinstance(x, np.ndarray) else x == y
        assert same, key
    assert gens[1][loser].config["lr"] in (gens[0][winner].config["lr"] * 0.8, gens[0][winner].config["lr"] * 1.2)


def test_schedule_follows_the_exploits_back_to_step_zero(tmp_path):
    study = Study(tmp_path / "s", durable=False)
    gens = pbt(study, moving_optimum(), SPACE, seed=1, **RUN)
    final = min(gens[-1], key=lambda r: r.value)
    steps = schedule(study, final.trial)
    assert [(a, b) for a, b, _ in steps] == [(g * 10, (g + 1) * 10) for g in range(20)]
    assert steps[-1][2] == final.config and steps[0][2] in [SPACE.config(1, m) for m in range(RUN["population"])]
    lrs = [c["lr"] for _, _, c in steps]
    assert lrs[-1] < lrs[0], lrs            # the learning rate it found falls, as the toy's optimum does
