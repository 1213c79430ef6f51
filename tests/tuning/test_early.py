"""Early stopping: stops after exactly `patience` evaluations without improvement, restores the best
weights bit for bit through Day 3's atomic checkpoint, and counts the epochs it saved."""

import copy

import pytest
import torch

from dlo.errors import BadInput
from dlo.models.small import MLP
from dlo.tuning.early import EarlyStopping, fit


def test_patience_counts_evaluations_without_improvement(tmp_path):
    model = torch.nn.Linear(2, 1)
    stopper = EarlyStopping(tmp_path, patience=2, min_delta=0.05)
    metrics = [1.0, 0.8, 0.79, 0.9, 0.5]      # 0.79 is within min_delta of 0.8: not an improvement
    stops = []
    for epoch, metric in enumerate(metrics):
        stops.append(stopper.step(epoch, metric, model))
        if stops[-1]:
            break
    assert stops == [False, False, False, True]
    assert stopper.best_epoch == 1 and stopper.best_metric == 0.8 and stopper.stopped_epoch == 3


def test_a_nan_stops_at_once_and_max_mode(tmp_path):
    model = torch.nn.Linear(2, 1)
    assert EarlyStopping(tmp_path / "a", patience=5).step(0, float("nan"), model)
    up = EarlyStopping(tmp_path / "b", patience=1, mode="max")
    assert not up.step(0, 0.5, model) and not up.step(1, 0.6, model) and up.step(2, 0.55, model)
    assert up.best_epoch == 1 and up.best_metric == 0.6
    with pytest.raises(BadInput, match="patience >= 1"):
        EarlyStopping(tmp_path, patience=0)


def test_overfitting_run_stops_early_and_restores_the_best_weights_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    x, xv = torch.randn(128, 20), torch.randn(256, 20)
    w = torch.randn(20)
    y = (x @ w > 0).long() ^ (torch.rand(128) < 0.3).long()     # 30% label noise: a wide MLP memorises it
    yv = (xv @ w > 0).long()
    model = MLP(20, 256, 2, depth=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = {}

    def train_epoch(epoch):
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    def evaluate():
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(xv), yv).item()
        seen[len(seen)] = (loss, copy.deepcopy(model.state_dict()))
        return loss

    report = fit(train_epoch, evaluate, model, max_epochs=60, stopper=EarlyStopping(tmp_path, patience=3))
    best_epoch = min(seen, key=lambda e: seen[e][0])
    assert 0 < best_epoch < len(seen) - 1, "the best is neither the first nor the last evaluation"
    assert report.best_epoch == best_epoch and report.best_metric == seen[best_epoch][0]
    assert report.epochs_run == best_epoch + 1 + 3 and report.epochs_saved == 60 - report.epochs_run > 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, seen[best_epoch][1][name]), name
    with pytest.raises(ValueError, match="does not fit this model"):
        EarlyStopping(tmp_path).restore(MLP(20, 64, 2, depth=3))
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]   # no temporary file left
