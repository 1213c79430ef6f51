"""Early stopping with patience, the best weights kept in an atomic checkpoint and restored at the end.

The validation metric is noisy, so training stops only after `patience` evaluations in a row without an
improvement of at least `min_delta` (Prechelt 1998, "Early Stopping - But When?", calls this the patience
criterion); the weights kept are those of the best evaluation, not the last. They go to disk through Day 3's
`dlo.checkpoint.save_atomic` (a kill while saving leaves the previous best whole), and `restore` checks the
file against the model key by key (`check_compatible`) before loading it, bit for bit.

What early stopping buys is counted, not assumed: `epochs_saved` is the budget it did not spend, to be put
beside the metric given up against training to the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dlo.checkpoint import check_compatible, save_atomic
from dlo.errors import BadInput


class EarlyStopping:
    """`step(epoch, metric, model)` after each evaluation; True means stop. Lower is better unless mode="max"."""

    def __init__(self, folder, patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if patience < 1 or min_delta < 0 or mode not in ("min", "max"):
            raise BadInput(f"EarlyStopping needs patience >= 1, min_delta >= 0 and mode 'min' or 'max'; "
                           f"got patience={patience}, min_delta={min_delta}, mode={mode!r}")
        self.path = Path(folder) / "best.pt"
        self.patience, self.min_delta, self.sign = patience, min_delta, 1.0 if mode == "min" else -1.0
        self.best, self.best_epoch, self.bad, self.stopped_epoch = math.inf, None, 0, None

    def improved(self, metric: float) -> bool:
        return self.sign * metric < self.best - self.min_delta

    def step(self, epoch: int, metric: float, model: torch.nn.Module) -> bool:
        if not math.isfinite(metric):
            self.bad = self.patience  # a diverged run never comes back: stop now, the best stays on disk
        elif self.improved(metric):
            self.best, self.best_epoch, self.bad = self.sign * metric, epoch, 0
            save_atomic({"epoch": epoch, "metric": metric, "model": model.state_dict()}, self.path)
        else:
            self.bad += 1
        if self.bad >= self.patience:
            self.stopped_epoch = epoch
            return True
        return False

    @property
    def best_metric(self) -> float:
        return self.sign * self.best

    def restore(self, model: torch.nn.Module) -> int:
        """Load the best weights into `model` (checked first); the epoch they come from."""
        if not self.path.is_file():
            raise FileNotFoundError(f"no best checkpoint at {self.path}: step() has not seen a finite metric yet")
        saved = torch.load(self.path, map_location="cpu", weights_only=False)
        check_compatible(model, saved["model"])
        model.load_state_dict(saved["model"])
        return saved["epoch"]


@dataclass(frozen=True)
class EarlyStopReport:
    best_epoch: int
    best_metric: float
    epochs_run: int
    epochs_saved: int      # of max_epochs, not run because training stopped early


def fit(train_epoch: Callable[[int], None], evaluate: Callable[[], float], model: torch.nn.Module, max_epochs: int,
        stopper: EarlyStopping) -> EarlyStopReport:
    """Train up to `max_epochs` (train_epoch(epoch), then evaluate()), stop early, restore the best weights."""
    epochs_run = 0
    for epoch in range(max_epochs):
        train_epoch(epoch)
        epochs_run += 1
        if stopper.step(epoch, evaluate(), model):
            break
    stopper.restore(model)
    return EarlyStopReport(stopper.best_epoch, stopper.best_metric, epochs_run, max_epochs - epochs_run)
