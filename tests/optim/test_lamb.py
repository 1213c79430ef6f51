"""LAMB: the functional step against a hand computation, its special cases, and the Optimizer class."""

import math

import pytest
import torch

from dlo.optim import LAMB
from dlo.optim.reference import lamb_step


def _lamb_by_hand(w, grads, *, lr, b1, b2, eps, wd):
    """You et al. 2019, Alg. 2 on plain Python lists: returns the weights and trust ratios per step."""
    m, v, trusts = [0.0] * len(w), [0.0] * len(w), []
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        r = [(mi / (1 - b1 ** t)) / (math.sqrt(vi / (1 - b2 ** t)) + eps) for mi, vi in zip(m, v)]
        u = [ri + wd * wi for ri, wi in zip(r, w)]
        w_norm, u_norm = math.sqrt(sum(x * x for x in w)), math.sqrt(sum(x * x for x in u))
        trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = [wi - lr * trust * ui for wi, ui in zip(w, u)]
        trusts.append(trust)
    return w, trusts


@pytest.mark.parametrize("w0", [[3.0, 4.0, -1.0], [0.0, 0.0, 0.0]])  # the second: zero norm, trust must be 1
def test_lamb_step_matches_hand_computation(w0):
    hp = dict(lr=0.1, b1=0.9, b2=0.99, eps=1e-6, wd=0.05)
    grads = [[1.0, -2.0, 0.5], [0.3, 0.1, -4.0], [-1.0, 1.0, 2.0]]
    want_w, want_trusts = _lamb_by_hand(w0, grads, **hp)
    p = torch.tensor(w0, dtype=torch.float64)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    trusts = [lamb_step(p, torch.tensor(g, dtype=torch.float64), m, v, t, lr=hp["lr"], beta1=hp["b1"],
                        beta2=hp["b2"], eps=hp["eps"], weight_decay=hp["wd"]) for t, g in enumerate(grads, start=1)]
    assert all(isinstance(t, float) for t in trusts)
    assert trusts == pytest.approx(want_trusts, rel=1e-12)
    torch.testing.assert_close(p, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    if w0[0] == 0.0:
        assert trusts[0] == 1.0


def test_zero_update_gives_trust_one_and_no_change():
    p = torch.tensor([1.0, 2.0])
    trust = lamb_step(p, torch.zeros(2), torch.zeros(2), torch.zeros(2), 1, lr=0.1, weight_decay=0.0)
    assert trust == 1.0
    torch.testing.assert_close(p, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 3, 11)])
def test_step_size_is_lr_times_weight_norm(shape):
    # The trust ratio rescales u to ||w||, so every layer moves by exactly lr * ||w|| whatever the gradient scale.
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=gen, dtype=torch.float64)
    for scale in (1e-4, 1.0, 1e4):
        before = p.clone()
        lamb_step(p, scale * torch.randn(shape, generator=gen, dtype=torch.float64), torch.zeros_like(p),
                  torch.zeros_like(p), 1, lr=0.01)
        assert (p - before).norm().item() == pytest.approx(0.01 * before.norm().item(), rel=1e-10)


def test_optimizer_matches_functional_step_per_tensor():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    opt = LAMB(model.parameters(), lr=0.02, betas=(0.8, 0.95), eps=1e-5, weight_decay=0.1)
    x, y = torch.randn(9, 5), torch.randn(9, 3)
    for step in range(1, 6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        want = [lamb_step(r, g, m, v, step, lr=0.02, beta1=0.8, beta2=0.95, eps=1e-5, weight_decay=0.1)
                for r, g, (m, v) in zip(ref, grads, states)]
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)
        assert opt.trust_ratios() == pytest.approx(want, rel=1e-6)
        assert [opt.state[p]["step"] for p in model.parameters()] == [step] * 4


def test_optimizer_skips_params_without_grad_and_reduces_loss():
    torch.manual_seed(1)
    w, frozen = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    opt = LAMB([w, frozen], lr=0.05, weight_decay=0.0)
    x = torch.randn(32, 4)
    target = x @ torch.randn(4, 3)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = ((x @ w - target) ** 2).mean()
        loss.backward()
        losses.append(opt.step(lambda loss=loss: loss).item())
    assert "trust_ratio" not in opt.state[frozen]
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=-1e-6), dict(weight_decay=-0.1)])
def test_optimizer_rejects_bad_hyperparameters(kw):
    with pytest.raises(ValueError, match="invalid"):
        LAMB([torch.nn.Parameter(torch.zeros(2))], **kw)
