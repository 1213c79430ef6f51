"""Day 1 presets: consistent numbers, setup() overrides, and one tiny-scale run that learns."""

import dataclasses

import pytest
import torch

import dlo
from dlo.data import cifar, cifar10
from dlo.models import SmallCNN
from dlo.presets import Day1Preset
from dlo.registry import DAYS
from dlo.schedules import warmup_cosine
from dlo.train import make_loader, train


@pytest.mark.parametrize("profile", ["tiny", "full"])
def test_day1_presets_are_consistent(profile):
    p = DAYS["day1_optimizers"].presets[profile]
    assert isinstance(p, Day1Preset)
    assert p.small_batch < p.large_batch <= p.n_train
    assert 0 < p.warmup_steps < p.max_steps
    assert all(v > 0 for v in (p.sgd_lr, p.adamw_lr, p.lamb_lr, p.lr_finder_steps, p.bench_numel, p.width))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_steps = 1


def test_full_is_cifar_scale():
    """The full profile uses all of CIFAR-10, sized from its binary format: five training files and
    one test file of 10000 records each (https://www.cs.toronto.edu/~kriz/cifar.html), and records of
    one label byte plus 3 x S x S pixel bytes."""
    full = DAYS["day1_optimizers"].presets["full"]
    records_per_file = 10_000
    assert full.n_train == len(cifar.TRAIN_FILES) * records_per_file
    assert full.n_test == len(cifar.TEST_FILES) * records_per_file
    assert 3 * full.image_size ** 2 == cifar.RECORD - 1


def test_setup_overrides_max_steps(tmp_path):
    run = dlo.setup("day1_optimizers", profile="tiny", device="cpu", max_steps=7, log_dir=str(tmp_path))
    assert run.preset.max_steps == 7 and run.preset.n_train == DAYS["day1_optimizers"].presets["tiny"].n_train


def test_tiny_preset_sgd_run_learns():
    p = DAYS["day1_optimizers"].presets["tiny"]
    train_set, test_set = cifar10(None, n_train=p.n_train, n_test=p.n_test, seed=0, image_size=p.image_size)
    torch.manual_seed(0)
    model = SmallCNN(width=p.width)
    opt = torch.optim.SGD(model.parameters(), lr=p.sgd_lr, momentum=p.momentum, weight_decay=p.sgd_weight_decay)
    hist = train(model, opt, make_loader(train_set, p.small_batch, seed=0), steps=p.max_steps, device="cpu",
                 lr_fn=lambda s: warmup_cosine(s, base_lr=p.sgd_lr, warmup_steps=p.warmup_steps,
                                               total_steps=p.max_steps),
                 clip=p.clip, eval_data=test_set, progress=False)
    assert not hist["diverged"]
    assert hist["eval_acc"] > 0.3  # chance is 0.10
