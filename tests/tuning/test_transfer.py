"""Freezing, a new head on frozen features and discriminative learning rates: a frozen part stays bit-equal
through training steps (weights and BatchNorm statistics), the groups get the rates in the right order."""

import copy

import pytest
import torch

from dlo.errors import BadInput
from dlo.models.small import SmallCNN
from dlo.tuning.transfer import discriminative_groups, freeze, new_head, train_frozen, trainable, unfreeze, untouched


def _steps(model, params, n=3, lr=0.1):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)     # weight decay would move a frozen weight too
    for _ in range(n):
        train_frozen(model)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 8, 8)), torch.randint(0, 4, (8,))).backward()
        opt.step()


def test_new_head_on_frozen_features_trains_only_the_head():
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10, width=4)
    before = copy.deepcopy(model.state_dict())
    head = new_head(model, "head", 4)
    assert trainable(model) == ["head.1.weight", "head.1.bias"] and head.out_features == 4
    fresh = head.weight.detach().clone()
    _steps(model, [p for p in model.parameters() if p.requires_grad])
    features = [k for k in before if k.startswith("features.")]
    assert set(features) <= set(untouched(before, model))          # running_mean/var included
    assert not torch.equal(head.weight, fresh)                       # the head did learn


def test_requires_grad_alone_leaves_batchnorm_statistics_moving():
    """Why freeze() also fixes BatchNorm: the wrong variant (requires_grad only) changes running statistics."""
    torch.manual_seed(0)
    model = SmallCNN(num_classes=4, width=4)
    for p in model.features.parameters():
        p.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    _steps(model, [p for p in model.parameters() if p.requires_grad])
    assert "features.0.1.running_mean" not in untouched(before, model)


def test_unfreeze_and_discriminative_learning_rates():
    model = SmallCNN(num_classes=4, width=4)
    freeze(model.features)
    groups = discriminative_groups([model.features[0], model.features[1], model.head], lr=1e-3)
    assert len(groups) == 1 and groups[0]["lr"] == 1e-3              # frozen groups are left out
    unfreeze(model.features)
    assert len(trainable(model)) == len(list(model.parameters()))
    groups = discriminative_groups([model.features[0], model.features[1], model.head], lr=1e-3)
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 / 2.6 ** 2, 1e-3 / 2.6, 1e-3])  # input side smallest
    assert groups[0]["params"][0] is model.features[0][0].weight
    with pytest.raises(BadInput, match="shares parameters"):
        discriminative_groups([model.features, model.features[0]], lr=1e-3)
    with pytest.raises(BadInput, match="not a Linear"):
        new_head(model, "features", 3)
