"""SmallCNN and MLP: shapes, sizes, gradients and input checks."""

import pytest
import torch

from dlo.models import MLP, SmallCNN


@pytest.mark.parametrize("size", [32, 16, 13, 8])
def test_small_cnn_output_shape_any_image_size(size):
    model = SmallCNN(num_classes=7, width=4, in_channels=2)
    assert model(torch.randn(3, 2, size, size)).shape == (3, 7)


def test_small_cnn_size_and_backward():
    n_params = sum(p.numel() for p in SmallCNN(width=32).parameters())
    assert 200_000 < n_params < 600_000  # "a few hundred k" at width 32
    model = SmallCNN(width=8, dropout=0.5)
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_small_cnn_dropout_only_in_train_mode():
    torch.manual_seed(0)
    model = SmallCNN(width=4, dropout=0.9).eval()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(model(x), model(x))
    model.train()  # dropout 0.9 on 32 features: two forwards draw different masks
    assert not torch.allclose(model(x), model(x))
    with pytest.raises(ValueError, match="width"):
        SmallCNN(width=0)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        model(torch.randn(3, 8, 8))


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_mlp_depth_counts_linear_layers(depth):
    model = MLP(in_features=12, hidden=9, out_features=5, depth=depth)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == depth
    assert linears[0].in_features == 12 and linears[-1].out_features == 5
    assert model(torch.randn(6, 3, 2, 2)).shape == (6, 5)  # the input is flattened


def test_mlp_norm_puts_batchnorm_after_each_hidden_linear():
    model = MLP(in_features=12, hidden=9, out_features=5, depth=3, norm=True)
    kinds = [type(m).__name__ for m in model.net]
    assert kinds == ["Flatten", "Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Linear"]
    out = model.train()(torch.randn(6, 12))
    assert out.shape == (6, 5)
    # BatchNorm draws no random numbers: under one seed the Linear layers match the plain MLP's
    torch.manual_seed(0)
    plain = [m.weight for m in MLP(12, 9, 5, depth=3).modules() if isinstance(m, torch.nn.Linear)]
    torch.manual_seed(0)
    normed = [m.weight for m in MLP(12, 9, 5, depth=3, norm=True).modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.equal(a, b) for a, b in zip(plain, normed, strict=True))


def test_mlp_rejects_zero_depth():
    with pytest.raises(ValueError, match="depth"):
        MLP(4, 4, 2, depth=0)
