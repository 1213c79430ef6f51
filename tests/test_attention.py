"""dlo.attention: naive and fused attention agree, the naive one saves the T x T scores, the fused one
does not (counted bytes, not times), naive attention's forward allocates O(T^2) bytes, the tiled
kernel's exactly O and L and its torch loop O(T), and compile_speedup reports a failure instead of raising."""

import torch

from dlo.attention import (
    attention_costs,
    compile_speedup,
    loglog_slope,
    naive_attention,
    qkv,
    sdpa_attention,
)
from dlo.kernels.flash_attention import attention_memory
from dlo.measure import allocated_peak


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


def test_forward_bytes_naive_quadratic_tiled_exactly_o_and_lse(device):
    """Where the kernel runs (the GPU, or the CPU under the interpreter: tests/conftest.py), so both columns
    are measured."""
    lengths = (32, 64)
    rows = attention_memory(lengths, heads=2, head_dim=16, device=device)
    for r in rows:
        assert r["tiled_bytes"] == r["o_lse_bytes"]  # O (fp32) and L: nothing of size T x T
        assert r["naive_bytes"] >= 2 * r["scores_bytes"]  # softmax writes P while S is alive
    assert abs(loglog_slope(lengths, [r["naive_bytes"] for r in rows]) - 2) < 0.15
    assert loglog_slope(lengths, [r["tiled_bytes"] for r in rows]) == 1
    # the same loop in torch (measured on any device): its (B, H, T, block_k) blocks grow with T, not T^2
    assert loglog_slope(lengths, [r["blocked_bytes"] for r in rows]) == 1
    assert rows[-1]["o_lse_bytes"] < rows[-1]["blocked_bytes"] < rows[-1]["naive_bytes"]


def test_allocated_peak_counts_temporaries_not_inputs():
    x = torch.ones(1000)
    def fn():
        y = x * 2  # 4000 B, freed before z is made
        del y
        return (x + 1).sum()  # 4000 B, then 4 B for the sum
    assert allocated_peak(fn) == 4004
    assert allocated_peak(lambda: x.view(10, 100).t()) == 0  # views of an input allocate nothing


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
