"""dlo.optim.offload: an offloaded AdamW gives plain AdamW's parameters after k steps (bit for bit on
the CPU), skips parameters without gradient as torch does, and accounts where its bytes live."""

import pytest
import torch
from torch import nn

from dlo.measure import optimizer_state_bytes, tensor_bytes
from dlo.optim.offload import CPUOffloadOptimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.LayerNorm(5))


def _train(model, opt, steps: int, seed: int, freeze_last_at: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k in range(steps):
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        model[-1].weight.requires_grad_(freeze_last_at is None or k < freeze_last_at)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("freeze_last_at", [None, 2])
def test_same_parameters_as_plain_adamw_after_k_steps(freeze_last_at):
    kw = dict(lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-7)
    plain, off = _model(0), _model(0)
    _train(plain, torch.optim.AdamW(plain.parameters(), **kw), 5, seed=1, freeze_last_at=freeze_last_at)
    _train(off, CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, **kw), 5, seed=1,
           freeze_last_at=freeze_last_at)
    for (name, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a, b), name  # the same single-tensor AdamW on the same fp32 numbers


def test_bytes_live_on_the_host_and_match_plain_adamw_state():
    model = _model(0)
    plain, off = torch.optim.AdamW(model.parameters()), CPUOffloadOptimizer(model.parameters())
    _train(model, plain, 1, seed=0)
    _train(model, off, 1, seed=0)
    n = sum(p.numel() for p in model.parameters())
    sides = off.bytes_by_side()
    assert sides["device"] == 0
    # host: fp32 master + its gradient (4 + 4 bytes) and the same state as plain AdamW (m, v, step)
    assert sides["host"] == 8 * n + optimizer_state_bytes(plain)
    assert optimizer_state_bytes(plain) == 8 * n + 4 * len(list(model.parameters()))  # + a float32 step each
    assert tensor_bytes(off.master) == 4 * n
    assert off.state_dict()["param_groups"][0]["lr"] == off.param_groups[0]["lr"]


def test_nothing_to_optimize_is_refused():
    with pytest.raises(ValueError, match="no parameter requires grad"):
        CPUOffloadOptimizer([nn.Parameter(torch.ones(2), requires_grad=False)])
