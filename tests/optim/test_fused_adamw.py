"""FusedAdamW against torch.optim.AdamW (fp32) and against the reference math (bf16).

Without a GPU the Triton kernel runs in the interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports the kernels; its `device` fixture says where they run).
"""

import copy

import pytest
import torch

import dlo.optim.fused_adamw as fused_module
from dlo.kernels.fused_adamw import fused_adamw_ref
from dlo.optim.fused_adamw import FusedAdamW

SHAPES = [(7,), (13, 11), (129,), (5,), (1000,)]


def make_params(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]


def groups(params):
    # Two groups with their own lr and weight decay.
    return [dict(params=params[:3]), dict(params=params[3:], lr=3e-3, weight_decay=0.0)]


def set_grads(params, step, gen):
    """params[4] never gets a grad; params[1] gets none on every third step (so its step count lags)."""
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        p.grad = None if i == 4 or (i == 1 and step % 3 == 0) else g


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the optimizer's calls into the Triton launcher, to show which path ran."""
    calls = []
    launcher = fused_module.fused_adamw_

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return launcher(*args, **kwargs)
    monkeypatch.setattr(fused_module, "fused_adamw_", counting)
    return calls


def run_against_torch(device, steps=20):
    ours, theirs = make_params(device), make_params(device)
    opt = FusedAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(steps):
        set_grads(ours, step, gen_a)
        set_grads(theirs, step, gen_b)
        opt.step()
        ref.step()
    return opt, ref, ours, theirs


def assert_like_torch(opt, ref, ours, theirs):
    # After 20 steps the fp32 rounding differences of the kernel (a few ulps per step) stay < 1e-5
    # relative; a wrong bias correction or decay would be off by percents.
    torch.testing.assert_close([p.data for p in ours], [p.data for p in theirs], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[4].data, make_params(ours[4].device)[4].data)  # grad always None: untouched
    for p, q in zip(ours[:4], theirs[:4]):
        assert int(opt.state[p]["step"]) == int(ref.state[q]["step"])
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert int(opt.state[ours[1]]["step"]) < int(opt.state[ours[0]]["step"])


def test_matches_torch_adamw_fp32(kernel_calls, device):
    assert_like_torch(*run_against_torch(device))
    assert kernel_calls  # the Triton kernel did the updates


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback without the interpreter")
def test_cpu_fallback_matches_torch_adamw(monkeypatch, kernel_calls):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_like_torch(*run_against_torch("cpu", steps=8))
    assert not kernel_calls  # plain torch reference on CPU without the interpreter


def test_bf16_params_match_reference_math(kernel_calls, device):
    params = make_params(device, torch.bfloat16)
    opt = FusedAdamW(groups(params), lr=1e-2, weight_decay=0.1)
    shadow = [p.detach().clone() for p in params]
    state = [(torch.zeros(s, device=device), torch.zeros(s, device=device)) for s in SHAPES]
    counts = [0] * len(SHAPES)
    gen = torch.Generator().manual_seed(2)
    for step in range(10):
        set_grads(params, step, gen)
        opt.step()
        for i, p in enumerate(params):
            if p.grad is not None:
                counts[i] += 1
                lr, wd = (1e-2, 0.1) if i < 3 else (3e-3, 0.0)
                fused_adamw_ref([shadow[i]], [p.grad], [state[i][0]], [state[i][1]], step=counts[i], lr=lr,
                                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd)
    assert kernel_calls
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params[:4])  # fp32 optimizer state
    # Each step both sides round one fp32 result to bf16 (the kernel by explicit round-to-nearest-even);
    # allow one bf16 ulp where an ulp-level fp32 difference flips a tie.
    torch.testing.assert_close([p.data.float() for p in params], [s.float() for s in shadow], rtol=2.0 ** -7, atol=0)
    assert not torch.equal(params[0].data, make_params(device, torch.bfloat16)[0].data)


def test_non_contiguous_param_takes_torch_path(kernel_calls):
    base = torch.randn(6, 9)
    p, q = torch.nn.Parameter(base.t()), torch.nn.Parameter(base.t().clone())  # p is a strided view
    opt, ref = FusedAdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)
    for _ in range(3):
        p.grad, q.grad = torch.ones(9, 6), torch.ones(9, 6)
        opt.step()
        ref.step()
    torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)
    assert not kernel_calls


def test_closure_and_errors(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = FusedAdamW([p])
    assert opt.step(lambda: torch.tensor(1.5)).item() == 1.5
    with pytest.raises(ValueError, match="amsgrad=False"):
        FusedAdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="maximize=False"):
        FusedAdamW([p], maximize=True)
    with pytest.raises(ValueError, match="invalid betas"):
        FusedAdamW([p], betas=(0.9, 1.0))
    opt.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(2, device=device))], maximize=True))
    with pytest.raises(ValueError, match="maximize=False"):
        opt.step()
    e = torch.nn.Embedding(4, 3, sparse=True)
    e(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        FusedAdamW(e.parameters()).step()


def test_state_dict_round_trip_keeps_fp32_state(device):
    params = make_params(device, torch.bfloat16)
    opt = FusedAdamW(groups(params), lr=1e-2)
    set_grads(params, 1, torch.Generator().manual_seed(4))
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = FusedAdamW(groups(make_params(device, torch.bfloat16)), lr=1e-2)
    fresh.load_state_dict(saved)  # torch would cast the moments to bf16 here
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        assert fresh.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(fresh.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert fresh.state[q]["step"] == 1
    saved["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"loaded exp_avg has shape \(3,\) but its param has \(7,\)"):
        fresh.load_state_dict(saved)


def test_continues_from_torch_adamw_state(kernel_calls, device):
    ours, theirs = make_params(device), make_params(device)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    set_grads(theirs, 1, gen_b)
    ref.step()
    set_grads(ours, 1, gen_a)
    torch.optim.AdamW(ours, lr=1e-2).step()
    opt = FusedAdamW(ours, lr=1e-2)
    # A copy, as from a checkpoint: a live state dict would share its tensors with `ref` (as in torch).
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's "step" is a float tensor: read as an int
    for _ in range(3):
        set_grads(ours, 2, gen_a)
        set_grads(theirs, 2, gen_b)
        opt.step()
        ref.step()
    assert kernel_calls
    torch.testing.assert_close([p.data for p in ours], [p.data for p in theirs], rtol=1e-5, atol=1e-6)
