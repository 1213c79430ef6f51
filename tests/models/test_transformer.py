"""dlo.models.transformer: shapes, causality, policies that must agree, bad input."""

import pytest
import torch

from dlo.models.transformer import TransformerStack


def test_shapes_and_causality():
    torch.manual_seed(0)
    model = TransformerStack(vocab_size=11, d_model=12, n_heads=3, n_layers=2, max_len=9, dropout=0.0).eval()
    idx = torch.randint(0, 11, (2, 9))
    out = model(idx)
    assert out.shape == (2, 9, 11)
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    out2 = model(changed)
    assert torch.equal(out[:, :5], out2[:, :5]) and not torch.equal(out[:, 5:], out2[:, 5:])


def test_policies_same_forward_in_eval():
    torch.manual_seed(0)
    model = TransformerStack(vocab_size=11, d_model=12, n_heads=3, n_layers=3, max_len=7).eval()
    idx = torch.randint(0, 11, (2, 7))
    ref = model(idx)
    for policy in (dict(checkpoint_blocks=[1]), dict(checkpoint_attention=True), dict(checkpoint_segments=2)):
        assert torch.equal(model(idx, **policy), ref)


def test_bad_input():
    model = TransformerStack(vocab_size=11, d_model=12, n_heads=3, n_layers=2, max_len=5)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        model(torch.zeros(1, 5, dtype=torch.long), checkpoint_blocks=[2])
    with pytest.raises(ValueError, match="one policy"):
        model(torch.zeros(1, 5, dtype=torch.long), checkpoint_blocks=[0], checkpoint_segments=2)
    with pytest.raises(ValueError, match="divisible"):
        TransformerStack(d_model=10, n_heads=3)
