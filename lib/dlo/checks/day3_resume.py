"""Autograder check for Day 3's exact resume of training state (`check_resume`, re-exported by
`dlo.checks.day3`, whose name the test cell calls).

The interrupted run is two processes, as a real restart is: the first `cut` steps and the student's
`save_training_state` run on a rank of their own (`on_ranks`, a fresh process), which then ends; the
student's `load_training_state` and the rest of the run happen in the check's process (`run_student`),
where the save never ran. So only what reached the file carries over: state kept in a module global, a
class attribute or any other object of the saving process is gone, as after a crash. The reference is
an uninterrupted run, computed here; the resumed losses must be bit-identical.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dlo.config import seed_everything
from dlo.grading.api import case_seed, check, on_ranks, run_student
from dlo.grading.compare import ok

TRAINING_STATE = ("dlo.checkpoint.training_state", "dlo.checkpoint.restore_training_state", "dlo.checkpoint.rng_state",
                  "dlo.checkpoint.set_rng_state", "dlo.checkpoint.CheckpointManager")


def _objects(init_seed: int, data_seed: int):
    from dlo.checkpoint import ResumableBatches

    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Dropout(0.25), nn.Linear(9, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.3 * s))  # lr depends on the step count
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=1)
    gen = torch.Generator().manual_seed(data_seed)
    data = (torch.randn(29, 6, generator=gen), torch.randint(0, 4, (29,), generator=gen))
    loader = ResumableBatches(data, batch_size=rng_batch(data_seed), seed=data_seed)
    return dict(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)


def rng_batch(data_seed: int) -> int:
    return [4, 5, 7][data_seed % 3]


def _train_step(o: dict) -> float:
    x, y = next(o["loader"])
    x = x + 0.05 * torch.from_numpy(np.random.standard_normal(x.shape)).float()  # numpy RNG
    if random.random() < 0.5:  # python RNG
        x = x.flip(1)
    loss = F.cross_entropy(o["model"](x), y)  # torch RNG: dropout
    o["optimizer"].zero_grad(set_to_none=True)
    o["scaler"].scale(loss).backward()
    o["scaler"].step(o["optimizer"])
    o["scaler"].update()
    o["scheduler"].step()
    return loss.item()


def _save_half(save_training_state, runs: list[dict]) -> dict:
    """On a rank of its own (a process that ends with it): each run's first `cut` steps from its secret seeds
    (the RNGs' and the model's initial weights', which never reach the load's process), then the student's save
    into a new folder; the losses and the folder (removed here if anything goes wrong)."""
    folder = tempfile.mkdtemp(prefix="dlo-resume-")
    try:
        losses = []
        for i, r in enumerate(runs):
            seed_everything(r["seed"])
            o = _objects(r["init"], r["data_seed"])
            losses.append([_train_step(o) for _ in range(r["cut"])])
            save_training_state(Path(folder) / f"state-{i}.pt", step=r["cut"], **o)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"folder": folder, "losses": losses}


def _load_half(load_training_state, folder: str, jobs: list[dict]) -> list[dict]:
    """In a process where the save never ran: a new "job" per run (other RNG states and weights, the loader at
    its start), the student's load from the file, the remaining steps. `jobs` holds what a restarted job knows
    (the data's seed, its own seed, how many steps are left), none of the interrupted run's seeds: nothing here
    can replay the first half, only the file brings its state. Stops at a load that raises."""
    out = []
    try:
        for i, job in enumerate(jobs):
            seed_everything(job["new_seed"])
            o = _objects(job["new_seed"], job["data_seed"])
            try:
                step = load_training_state(Path(folder) / f"state-{i}.pt", **o)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - the student's error, named in the message (and chained)
                raise AssertionError(f"resume: load_training_state raised {type(e).__name__}: {e}; the save ran in "
                                     f"another process, which has ended (as before a restart): everything the load "
                                     f"needs must come from the file at `path`") from e
            plain = isinstance(step, (int, float, str)) or step is None
            losses = [_train_step(o) for _ in range(job["rest"])]
            out.append({"step": step if plain else type(step).__name__, "losses": losses,
                        "scale": float(o["scaler"].get_scale())})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _complete(name: str, saved, loaded, runs: list[dict]) -> None:
    """Both halves came back whole: each run's losses before the cut, and a record of each resumed run: a short
    reply leaves runs unchecked."""
    losses = saved.get("losses") if isinstance(saved, dict) else None
    if not isinstance(losses, list) or len(losses) != len(runs):
        n = len(losses) if isinstance(losses, list) else 0
        raise AssertionError(f"{name}: the save half returned {n} of {len(runs)} runs' losses: the grader got no "
                             f"record of the rest")
    n = len(loaded) if isinstance(loaded, list) else 0
    if not all(isinstance(res, dict) for res in loaded or []) or n != len(runs):
        raise AssertionError(f"{name}: the load half returned {n} of {len(runs)} resumed runs: the grader got no "
                             f"record of the rest")


@check(forbid=TRAINING_STATE)
def check_resume(save_training_state, load_training_state, seed: int = 0, trials: int = 3) -> None:
    """`save_training_state(path, *, model, optimizer, scheduler, scaler, loader, step)` in one process
    (then ended), `load_training_state(path, *, model, optimizer, scheduler, scaler, loader) -> step` in
    another, a fresh "job" (other initial weights, other RNG states): the run must continue with exactly
    the losses of an uninterrupted run. Only the file carries the state from one process to the other."""
    name, cs = "resume", case_seed(seed)  # a secret seed when graded
    rng = random.Random(cs)
    runs, wants = [], []
    for t in range(trials):
        steps, data_seed = rng.choice([9, 12]), rng.randrange(1000)
        # the interrupted run's RNG seed and its model's initialisation seed, drawn from cs (which stays here):
        # the save's rank gets them, the load's process never (a new job: seeds of its own, `_load_half`)
        r = dict(steps=steps, data_seed=data_seed, cut=rng.randrange(2, steps - 2), seed=rng.randrange(2 ** 32),
                 init=rng.randrange(2 ** 63), new_seed=12345 + t)
        seed_everything(r["seed"])
        o = _objects(r["init"], data_seed)
        wants.append(([_train_step(o) for _ in range(steps)], o["scaler"].get_scale()))
        runs.append(r)
    saved = on_ranks(_save_half, 1, save_training_state, runs)[0]
    jobs = [dict(data_seed=r["data_seed"], new_seed=r["new_seed"], rest=r["steps"] - r["cut"]) for r in runs]
    loaded = run_student(_load_half, load_training_state, saved["folder"], jobs)
    _complete(name, saved, loaded, runs)
    for t, (r, (want, scale_want), res) in enumerate(zip(runs, wants, loaded)):
        hp = dict(trial=t, steps=r["steps"], interrupted_after=r["cut"], batch=rng_batch(r["data_seed"]))
        if res["step"] != r["cut"]:
            raise AssertionError(f"{name}: load_training_state returned step {res['step']!r}, expected {r['cut']} "
                                 f"({hp})")
        got = saved["losses"][t] + res["losses"]
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise AssertionError(
                f"{name}: resumed losses differ from the uninterrupted run from step {first} on ({hp}): "
                f"expected {want[first]!r}, got {got[first]!r}. Saved to the file and restored from it (the load "
                f"runs in another process): model, optimizer, scheduler, scaler, loader position (state_dict) "
                f"and the python, numpy, torch (and CUDA) RNGs?")
        if res["scale"] != scale_want:
            raise AssertionError(f"{name}: the AMP scaler's scale after the resumed run is "
                                 f"{res['scale']}, expected {scale_want}: restore scaler.state_dict()")
    ok(name, f"{trials} trials, seed={seed}")
