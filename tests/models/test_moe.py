"""The MoE layer against its token-by-token reference (outputs and gradients, fp64, odd token counts),
its routing and capacity by hand, the auxiliary losses, and the wrong variants a Day 10 check must
reject (capacity off by one, combine in the wrong order), each shown to differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dlo.errors import BadInput
from dlo.models import moe

D = torch.float64
DIM, HIDDEN, E, S = 6, 5, 4, 13


def layer(top_k=2, capacity_factor=1.0, aux="switch", seed=0):
    torch.manual_seed(seed)
    return moe.MoE(DIM, HIDDEN, E, top_k=top_k, capacity_factor=capacity_factor, aux=aux).to(D)


def tokens(seed=1):
    return torch.randn(S, DIM, generator=torch.Generator().manual_seed(seed), dtype=D)


def grads(m, x, fn):
    x = x.clone().requires_grad_(True)
    m.zero_grad()
    y = fn(m, x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=D).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_equal_to_token_by_token_reference(top_k, capacity_factor):
    m, x = layer(top_k, capacity_factor), tokens()
    want = grads(m, x, moe.moe_ref)
    got = grads(m, x, lambda mod, z: mod(z).y)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-12, atol=1e-12)


def test_capacity_and_priority_by_hand():
    """One expert wanted by every token: the first C tokens (first choices first) get it."""
    assert moe.expert_capacity(13, 4, 2, 1.0) == 7 and moe.expert_capacity(13, 4, 1, 1.25) == 5
    assert moe.expert_capacity(13, 4, 2, None) == 13
    w = torch.tensor([[4.0, 0.0], [2.0, 0.0], [0.0, 0.0]], dtype=D)  # expert 0 first, 1 second, for x > 0
    x = torch.ones(5, 2, dtype=D)
    r = moe.route(x, w, top_k=2, capacity=3)
    assert r.routed.tolist() == [5, 5, 0] and r.kept.tolist() == [3, 3, 0] and r.dropped == 4
    assert r.token.tolist() == [0, 1, 2, 0, 1, 2] and r.expert.tolist() == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(r.gate[:3] + r.gate[3:], torch.ones(3, dtype=D))  # renormalised over k = 2
    # second choices queue behind every first choice: expert 1 is the first choice of tokens 3 and 4,
    # the second of tokens 0-2; token 2 loses expert 0 to tokens 0, 1 and expert 1 to tokens 3, 4
    w2 = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]], dtype=D)
    x2 = torch.tensor([[1.0, 0.5]] * 3 + [[0.5, 1.0]] * 2, dtype=D)
    r2 = moe.route(x2, w2, top_k=2, capacity=2)
    assert r2.token[r2.expert == 1].tolist() == [3, 4] and r2.token[r2.expert == 0].tolist() == [0, 1]
    assert 2 not in r2.token.tolist()


def test_dropped_token_leaves_as_zero_so_the_residual_carries_it():
    m, x = layer(top_k=1, capacity_factor=0.25), tokens()
    out = m(x)
    assert out.dropped > 0 and int(out.tokens_per_expert.max()) <= out.capacity
    r = m.route(x)
    lost = sorted(set(range(S)) - set(r.token.tolist()))
    assert lost and torch.equal(out.y[lost], torch.zeros(len(lost), DIM, dtype=D))
    assert torch.equal((x + out.y)[lost], x[lost])
    assert out.tokens_per_expert.sum() + out.dropped == S


def test_auxiliary_losses():
    probs = torch.full((8, E), 1 / E, dtype=D)
    balanced = torch.arange(8) % E
    assert moe.switch_aux_loss(probs, balanced).item() == pytest.approx(1.0)
    peaked = F.one_hot(torch.zeros(8, dtype=torch.long), E).to(D) * 0.97 + 0.01
    top1 = torch.zeros(8, dtype=torch.long)
    assert moe.switch_aux_loss(peaked, top1).item() == pytest.approx(E * 0.98)  # f_0 = 1, P_0 = 0.98
    m, x = layer(aux="gshard"), tokens()
    r = m.route(x)
    torch.testing.assert_close(moe.switch_aux_loss(r.probs, r.top1), E * E * moe.gshard_aux_loss(r.probs, r.top1))
    out = m(x)
    out.aux_loss.backward()
    assert m.router.weight.grad.abs().sum() > 0  # the loss trains the router


def test_flops_and_bad_input():
    f = moe.moe_flops_per_token(DIM, HIDDEN, E, 2)
    assert f["moe"] - f["dense_same_active"] == 2 * DIM * E
    assert f["params_total"] - f["params_active"] == (E - 2) * 3 * DIM * HIDDEN
    with pytest.raises(BadInput, match="top_k"):
        moe.MoE(DIM, HIDDEN, E, top_k=5)
    with pytest.raises(BadInput, match="capacity_factor"):
        moe.MoE(DIM, HIDDEN, E, capacity_factor=0)


# ----------------------------------------------------------------------------- the wrong variants

def route_capacity_off_by_one(x, w, top_k, capacity):
    """Wrong: an expert keeps C + 1 assignments (slot <= C)."""
    return moe.route(x, w, top_k, capacity + 1)


def combine_unsorted(y, routing, tokens):
    """Wrong: the expert outputs scattered back in the tokens' order, not the expert-sorted one."""
    order = torch.argsort(routing.token, stable=True)
    return y.new_zeros((tokens, y.shape[-1])).index_add(0, routing.token, routing.gate.unsqueeze(-1) * y[order])


def test_wrong_variants_differ_from_the_layer():
    m, x = layer(top_k=2, capacity_factor=0.5), tokens()
    right = m.route(x)
    wrong = route_capacity_off_by_one(x, m.router.weight, 2, right.capacity)
    assert right.dropped > 0 and not torch.equal(wrong.kept, right.kept)
    y = moe.run_experts(moe.dispatch(x, right), right.kept.tolist(), m.w1, m.w3, m.w2)
    want = moe.combine(y, right, S)
    torch.testing.assert_close(want, m(x).y)
    assert not torch.allclose(combine_unsorted(y, right, S), want, atol=1e-3)
