"""Multi-tensor unscale kernel against its torch reference and torch's own foreach kernel.

Runs in the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU):
small odd sizes that leave partial blocks, one above BLOCK_SIZE, each gradient dtype, infs and nans.
"""

import math

import pytest
import torch

from dlo.kernels.amp_unscale import BLOCK_SIZE, amp_unscale_, amp_unscale_ref

SHAPES = [(1,), (7,), (13, 77), (BLOCK_SIZE * 2 + 1,)]  # the last one spans three programs
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_grads(dtype, device, seed=0, scale=1000.0):
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=gen)).to(device, dtype) for s in SHAPES]


def run_all(grads, inv_scale, device, start=0.0):
    """(grads, found_inf) after ours, the reference and torch's kernel, each on its own copy, on `device`.
    torch's kernel runs on CPU copies: its CUDA version takes fp32 and fp16 only (no bf16); the CPU one
    does the same fp32 multiply and one rounding for every dtype."""
    out = []
    for fn, where in ((amp_unscale_, device), (amp_unscale_ref, device),
                      (torch._amp_foreach_non_finite_check_and_unscale_, torch.device("cpu"))):
        gs = [g.to(where, copy=True) for g in grads]
        found = torch.full((1,), start, device=where)
        fn(gs, found, torch.full((1,), inv_scale, device=where))
        out.append(([g.to(device) for g in gs], found.to(device)))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_grads_unscaled_exactly(dtype, device):
    grads = make_grads(dtype, device)
    inv_scale = 1.0 / 3.0  # not a power of two: every element is rounded, so rounding mode matters
    (ours, f_ours), (ref, f_ref), (tor, f_tor) = run_all(grads, inv_scale, device)
    assert f_ours.item() == f_ref.item() == f_tor.item() == 0.0
    # One fp32 multiply, then one rounding to the grad dtype (nearest even): bit-identical to torch.
    for a, b, c in zip(ours, ref, tor):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(ours[-1], grads[-1])  # it did write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 2, 3])  # a 1-element tensor, a 2-D one, the multi-block one
def test_non_finite_detected(dtype, bad, where, device):
    grads = make_grads(dtype, device, seed=1)
    grads[where].view(-1)[-1] = bad  # the last element: in the partial block of the last program
    (ours, f_ours), (ref, f_ref), (tor, f_tor) = run_all(grads, 0.5, device)
    assert f_ours.item() == f_ref.item() == f_tor.item() == 1.0
    for a, c in zip(ours, tor):  # finite values still unscaled; inf/nan pass through
        torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True)


def test_found_inf_is_never_reset(device):
    """An earlier group (another dtype or device) may have set the flag; a clean group keeps it."""
    (ours, f_ours), *_ = run_all(make_grads(torch.float32, device), 0.5, device, start=1.0)
    assert f_ours.item() == 1.0


def test_empty_and_mixed_lists(device):
    grads = [torch.zeros(0, device=device), torch.ones(5, device=device, dtype=torch.float16),
             torch.ones(9, device=device)]
    found = torch.zeros(1, device=device)
    amp_unscale_(grads, found, torch.full((1,), 0.25, device=device))
    assert found.item() == 0.0
    assert torch.equal(grads[1], torch.full((5,), 0.25, device=device, dtype=torch.float16))
    assert torch.equal(grads[2], torch.full((9,), 0.25, device=device))


def test_bad_inputs(device):
    g = [torch.ones(3, device=device)]
    with pytest.raises(TypeError, match="one-element fp32"):
        amp_unscale_(g, torch.zeros(2, device=device), torch.ones(1, device=device))
    with pytest.raises(TypeError, match="dtype"):
        amp_unscale_([torch.ones(3, device=device, dtype=torch.float64)], torch.zeros(1, device=device),
                     torch.ones(1, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        amp_unscale_([torch.ones(4, 3, device=device).t()], torch.zeros(1, device=device),
                     torch.ones(1, device=device))


def test_a_changed_list_is_checked_again(device):
    """The launch plan is cached per list; a list that differs only in a checked property (the same
    address, size, dtype and device, but not contiguous; or another dtype) must still be refused."""
    g = torch.ones(4, 3, device=device)
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.5, device=device)
    amp_unscale_([g], found, inv)
    amp_unscale_([g], found, inv)  # the cached plan
    assert torch.equal(g, torch.full((4, 3), 0.25, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        amp_unscale_([g.t()], found, inv)
    with pytest.raises(TypeError, match="dtype"):
        amp_unscale_([g.view(torch.int32)], found, inv)
    assert torch.equal(g, torch.full((4, 3), 0.25, device=device))
