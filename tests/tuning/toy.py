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
