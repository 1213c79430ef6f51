"""Trials with known answers for the search tests, importable by name (a SLURM task loads them from study.json).

`curve_trial`: the loss of config x after t steps is q(x) + 1/t with q(x) = (x - 0.37)^2 + 0.1, so the
learning curves never cross and the order at every step is the final order (the best config is known).
It resumes from the step count it keeps in its workdir, as a checkpointed training does.
"""

from __future__ import annotations

import json
from pathlib import Path

BEST_X = 0.37


def q(x: float) -> float:
    return (x - BEST_X) ** 2 + 0.1


def curve_trial(config: dict, steps: int, workdir: Path) -> list[float]:
    state = Path(workdir) / "state.json"
    done = json.loads(state.read_text())["steps"] if state.exists() else 0
    losses = [q(config["x"]) + 1.0 / t for t in range(done + 1, steps + 1)]
    state.write_text(json.dumps({"steps": steps}))
    return losses


def noisy_quadratic(seed: int, dims: int = 100, start: float = 1.0, noise: float = 1.0):
    """A trial whose best learning rate falls as training goes on: SGD on 0.5 |theta|^2 with gradient noise.
    A large lr converges fast to a high noise floor (about dims * noise^2 * lr / 4), a small one slowly to a low
    one. theta and the step count are its checkpoint (workdir/theta.json); the noise of step t is drawn from
    (seed, t), the same for every member: paired."""
    import numpy as np

    def trial(config: dict, steps: int, workdir: Path) -> list[float]:
        state = Path(workdir) / "theta.json"
        saved = json.loads(state.read_text()) if state.exists() else {"steps": 0, "theta": [start] * dims}
        theta, losses = np.array(saved["theta"]), []
        for t in range(saved["steps"] + 1, steps + 1):
            grad = theta + noise * np.random.default_rng([seed, t]).standard_normal(dims)
            theta = theta - config["lr"] * grad
            losses.append(0.5 * float(theta @ theta))
        state.write_text(json.dumps({"steps": steps, "theta": theta.tolist()}))
        return losses

    return trial


def moving_optimum(halving: float = 50.0, start_best: float = 0.1, width: float = 0.3, rate: float = 0.1):
    """A trial whose best hyperparameter changes over time: step t multiplies the loss by
    1 - rate * exp(-(log10(lr / best(t)))^2 / (2 width^2)), with best(t) = start_best * 2^(-t / halving), so a
    fixed lr helps only while best(t) passes by it. Deterministic; the loss so far is its checkpoint."""
    import math

    def trial(config: dict, steps: int, workdir: Path) -> list[float]:
        state = Path(workdir) / "loss.json"
        saved = json.loads(state.read_text()) if state.exists() else {"steps": 0, "loss": 1.0}
        loss, losses = saved["loss"], []
        for t in range(saved["steps"] + 1, steps + 1):
            best = start_best * 2 ** (-t / halving)
            loss *= 1 - rate * math.exp(-math.log10(config["lr"] / best) ** 2 / (2 * width ** 2))
            losses.append(loss)
        state.write_text(json.dumps({"steps": steps, "loss": loss}))
        return losses

    return trial


def dying_curve_trial(config: dict, steps: int, workdir: Path) -> list[float]:
    """`curve_trial`, except that the trial named in the file $DLO_TEST_KILL (if it exists) is killed by
    SIGKILL once, mid-way, as a node failure or an out-of-memory kill would end it; the file is removed first."""
    import os
    import signal

    marker = Path(os.environ.get("DLO_TEST_KILL", "/nonexistent"))
    if marker.is_file() and marker.read_text().strip() == Path(workdir).parent.name:
        marker.unlink()
        (Path(workdir) / "state.json").write_text('{"steps": 1')      # a checkpoint cut short by the kill
        os.kill(os.getpid(), signal.SIGKILL)
    state = Path(workdir) / "state.json"
    if state.exists() and not state.read_text().endswith("}"):
        state.unlink()                                                 # the cut checkpoint: start this job again
    return curve_trial(config, steps, workdir)
