"""dlo.prune: exact target sparsity, global vs layer scope, the cubic schedule, channel pruning, 2:4."""

import pytest
import torch
from torch import nn

from dlo import prune
from dlo.models import MLP


def weights():
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(10, 7, generator=gen) * 10, "b": torch.randn(5, 3, generator=gen)}


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.9, 1.0])
def test_layer_scope_hits_target(sparsity):
    masks = prune.magnitude_masks(weights(), sparsity, "layer")
    for k, w in weights().items():
        assert (~masks[k]).sum() == round(sparsity * w.numel())
        if 0 < sparsity < 1:  # every kept |w| >= every pruned |w|
            assert w.abs()[masks[k]].min() >= w.abs()[~masks[k]].max()


def test_global_scope_prunes_small_layer_more():
    masks = prune.magnitude_masks(weights(), 0.5, "global")
    total = sum(int((~m).sum()) for m in masks.values())
    assert total == round(0.5 * 85)
    assert (~masks["b"]).float().mean() > (~masks["a"]).float().mean()  # b's weights are 10x smaller
    with pytest.raises(ValueError, match="sparsity"):
        prune.magnitude_masks(weights(), 1.5)


def test_masks_stay_applied_during_training():
    model = MLP(8, 16, 3)
    masks = prune.magnitude_masks(prune.prunable(model), 0.7)
    prune.apply_masks_(model, masks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prune.keep_masked(model, opt, masks)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert abs(prune.sparsity_of(prune.prunable(model)) - 0.7) < 0.01


def test_gradual_schedule():
    s = [prune.gradual_sparsity(t, 0.8, 10, 50) for t in range(0, 61)]
    assert s[0] == s[10] == 0.0 and s[50] == s[60] == pytest.approx(0.8)
    assert all(a <= b for a, b in zip(s, s[1:]))
    assert s[20] - s[10] > s[50] - s[40]  # prunes fast early, slowly at the end
    assert s[30] == pytest.approx(0.8 * (1 - 0.5 ** 3))


def test_structured_pruning_shrinks_and_keeps_function():
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(6, 10), nn.Linear(10, 2)
    with torch.no_grad():
        fc1.weight[[1, 4, 7]] *= 1e-3  # three nearly dead units
        fc1.bias[[1, 4, 7]] = -5.0     # ReLU keeps them at 0
    new1, new2 = prune.prune_linear_pair(fc1, fc2, 7)
    assert new1.weight.shape == (7, 6) and new2.weight.shape == (2, 7)
    x = torch.randn(5, 6)
    torch.testing.assert_close(new2(torch.relu(new1(x))), fc2(torch.relu(fc1(x))))
    mlp = prune.prune_mlp_channels(MLP(8, 20, 3, depth=3), 0.5)
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [10, 10, 3]


def test_2to4():
    w = torch.randn(6, 12)
    m = prune.mask_2to4(w)
    assert prune.is_2to4(m) and m.sum() == w.numel() // 2
    assert not prune.is_2to4(torch.ones(2, 8))
    with pytest.raises(ValueError, match="multiple of 4"):
        prune.mask_2to4(torch.randn(3, 6))


def test_rewind():
    model = MLP(4, 8, 2)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    masks = prune.magnitude_masks(prune.prunable(model), 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    prune.rewind_(model, init, masks)
    w = model.net[1].weight
    assert torch.equal(w, init["net.1.weight"] * masks["net.1.weight"])
