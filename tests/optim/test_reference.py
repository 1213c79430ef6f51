"""dlo.optim.reference vs torch.optim.SGD / AdamW over many steps, odd shapes and hyper-parameters."""

import pytest
import torch

from dlo.optim.reference import adamw_step, sgd_momentum_step

SHAPES = [(7,), (3, 5), (2, 3, 5), (1, 13)]
# float64 agrees to rounding; float32 may differ in the last bits where torch fuses ops differently.
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _grads(shape, steps, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay", [
    (0.9, 0.0, False, 0.0), (0.9, 0.0, True, 1e-2), (0.8, 0.3, False, 5e-4), (0.0, 0.0, False, 1e-3),
    (0.99, 0.0, True, 0.0)])
def test_sgd_matches_torch(dtype, momentum, dampening, nesterov, weight_decay):
    hp = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    for i, shape in enumerate(SHAPES):
        p_ref = torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(dtype)
        p_ref.requires_grad_(True)
        p = p_ref.detach().clone()
        opt = torch.optim.SGD([p_ref], **hp)
        buf = None
        for g in _grads(shape, 25, dtype, seed=100 + i):
            p_ref.grad = g.clone()
            opt.step()
            buf = sgd_momentum_step(p, g.clone(), buf, **hp)
            torch.testing.assert_close(p, p_ref.detach(), **TOL[dtype])
        if momentum == 0:
            assert buf is None
        else:
            torch.testing.assert_close(buf, opt.state[p_ref]["momentum_buffer"], **TOL[dtype])


def test_sgd_first_step_buffer_is_grad_plus_decay_and_does_not_alias_grad():
    p, g = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25, -1.0])
    buf = sgd_momentum_step(p, g, None, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
    torch.testing.assert_close(buf, torch.tensor([0.6, 0.05, -0.7]))  # g + 0.1 * p_old, no dampening at step 1
    torch.testing.assert_close(p, torch.tensor([0.94, -2.005, 3.07]))
    g.zero_()
    assert buf.abs().sum() > 0


def test_sgd_rejects_bad_input():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        sgd_momentum_step(p, torch.zeros(4), None, lr=0.1)
    with pytest.raises(ValueError, match="nesterov"):
        sgd_momentum_step(p, torch.zeros(3), None, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lr,beta1,beta2,eps,weight_decay", [
    (1e-3, 0.9, 0.999, 1e-8, 1e-2), (3e-2, 0.8, 0.95, 1e-6, 0.1), (1e-2, 0.0, 0.99, 1e-4, 0.0)])
def test_adamw_matches_torch(dtype, lr, beta1, beta2, eps, weight_decay):
    for i, shape in enumerate(SHAPES):
        p_ref = torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(dtype)
        p_ref.requires_grad_(True)
        p = p_ref.detach().clone()
        opt = torch.optim.AdamW([p_ref], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for step, g in enumerate(_grads(shape, 30, dtype, seed=200 + i), start=1):
            p_ref.grad = g.clone()
            opt.step()
            adamw_step(p, g.clone(), m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
            torch.testing.assert_close(p, p_ref.detach(), **TOL[dtype])
        torch.testing.assert_close(m, opt.state[p_ref]["exp_avg"], **TOL[dtype])
        torch.testing.assert_close(v, opt.state[p_ref]["exp_avg_sq"], **TOL[dtype])


def test_adamw_rejects_bad_input():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="1-based"):
        adamw_step(p, torch.zeros(3), torch.zeros(3), torch.zeros(3), 0, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        adamw_step(p, torch.zeros(3), torch.zeros(3), torch.zeros(2), 1, lr=1e-3)
