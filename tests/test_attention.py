"""dlo.attention: naive and fused attention agree, the naive one saves the T x T scores, the fused one
does not (counted bytes, not times), and compile_speedup reports a failure instead of raising."""

import torch

from dlo.attention import attention_costs, compile_speedup, loglog_slope, naive_attention, qkv, sdpa_attention


def test_naive_and_fused_attention_agree_forward_and_backward():
    for causal in (True, False):
        a = qkv(2, 3, 17, 8, seed=1)
        b = [t.detach().clone().requires_grad_() for t in a]
        out_a, out_b = naive_attention(*a, causal=causal), sdpa_attention(*b, causal=causal)
        torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-5)
        out_a.square().sum().backward()
        out_b.square().sum().backward()
        for x, y in zip(a, b):
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5)


def test_saved_bytes_grow_as_t_squared_for_naive_and_t_for_fused():
    rows = attention_costs((64, 128), heads=2, head_dim=8, reps=1)
    by = {impl: [r["saved_bytes"] for r in rows if r["impl"] == impl] for impl in ("naive", "sdpa")}
    assert abs(loglog_slope((64, 128), by["naive"]) - 2) < 0.15
    assert abs(loglog_slope((64, 128), by["sdpa"]) - 1) < 0.15
    assert all(r["timing"].n == 1 for r in rows)


def test_compile_failure_is_reported(monkeypatch):
    def broken(fn):
        def call(*args):
            raise RuntimeError("no C compiler here\nmore")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    assert compile_speedup(args=(torch.ones(4), torch.ones(4)))["error"] == "RuntimeError: no C compiler here"


def test_kernel_launches_counts_top_level_operators():
    from dlo.attention import gelu_residual, kernel_launches

    # add, gelu, sigmoid, mul, add: one launch each on a GPU (gelu's own internals are not counted twice)
    assert kernel_launches(gelu_residual, torch.randn(8, 8), torch.randn(8)) == 5
