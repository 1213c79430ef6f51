"""clip_grad_norm vs torch.nn.utils.clip_grad_norm_, and gradient accumulation vs one full-batch backward."""

import pytest
import torch

from dlo.models import MLP
from dlo.optim import accumulate_gradients, clip_grad_norm, grad_norm

SHAPES = [(7,), (3, 5), (2, 3, 5), (13,)]


def _params_with_grads(seed, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen, dtype=dtype)
    params.append(torch.nn.Parameter(torch.randn(4, dtype=dtype)))  # no grad: must be ignored
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e3])  # clips hard, clips a little or not at all
def test_clip_matches_torch(norm_type, max_norm):
    for seed in range(3):
        ours, ref = _params_with_grads(seed), _params_with_grads(seed)
        total = clip_grad_norm(ours, max_norm, norm_type=norm_type)
        total_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
        # float32 sums in a different order than torch's foreach path: agree to ~1 ulp of the norm.
        torch.testing.assert_close(total, total_ref, rtol=1e-6, atol=0)
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
            assert (p.grad is None) == (r.grad is None)


def test_clip_bounds_norm_and_returns_norm_before():
    params = _params_with_grads(0, scale=10.0, dtype=torch.float64)
    before = torch.sqrt(sum((p.grad ** 2).sum() for p in params if p.grad is not None))
    total = clip_grad_norm(params, 1.0)
    torch.testing.assert_close(total, before)
    assert grad_norm(params).item() == pytest.approx(1.0 / (1.0 + 1e-6 / before.item()), rel=1e-12)


def test_clip_single_tensor_and_no_grads():
    p = torch.nn.Parameter(torch.ones(4))
    assert clip_grad_norm(p, 1.0).item() == 0.0
    p.grad = torch.full((4,), 3.0)
    assert clip_grad_norm(p, 1.0).item() == pytest.approx(6.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(p, -1.0)


def _full_batch_grads(model, x, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 13])  # 13 = 3 + 3 + 3 + 4 split unevenly for 3 and 4
def test_accumulation_equals_full_batch(micro_batches):
    torch.manual_seed(0)
    model = MLP(6, 11, 5, depth=3).double()
    x, y = torch.randn(13, 6, dtype=torch.float64), torch.randint(0, 5, (13,))
    loss_ref, grads_ref = _full_batch_grads(model, x, y)
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # stale gradients must be cleared first
    loss = accumulate_gradients(model, torch.nn.functional.cross_entropy, x, y, micro_batches)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-14)
    for p, g in zip(model.parameters(), grads_ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)


def test_accumulation_rejects_bad_input():
    model = MLP(3, 4, 2)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    for bad in (0, 6):
        with pytest.raises(ValueError, match="micro_batches"):
            accumulate_gradients(model, torch.nn.functional.cross_entropy, x, y, bad)
    with pytest.raises(ValueError, match="samples"):
        accumulate_gradients(model, torch.nn.functional.cross_entropy, x, y[:4], 2)
