"""W8A8 int8 GEMM (int32 accumulation, fused rescale) vs torch, interpreter sizes in the tens."""

import pytest
import torch

from dlo.kernels.int8_gemm import int8_gemm, int8_gemm_ref, quantize_rows

# The int32 sums are exact on both sides; only the final fp32 rescale and the cast differ in order.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),  # two fp32 multiplies in another order
       torch.bfloat16: dict(atol=2e-2, rtol=1e-2),  # the interpreter truncates: up to 1 bf16 ulp (2^-8)
       torch.float16: dict(atol=2e-3, rtol=2e-3)}    # up to 1 fp16 ulp (2^-11)
SHAPES = [(1, 16, 3), (17, 40, 23), (35, 24, 19)]


@pytest.mark.parametrize("out_dtype", list(TOL))
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_reference(M, K, N, out_dtype, device):
    gen = torch.Generator().manual_seed(M * N + K)
    a, sa = quantize_rows(torch.randn(M, K, generator=gen).to(device))
    b, sb = quantize_rows(torch.randn(N, K, generator=gen).to(device))
    c = int8_gemm(a, b, sa, sb, out_dtype)
    c_ref = int8_gemm_ref(a, b, sa, sb, out_dtype)
    assert c.dtype == out_dtype and c.shape == (M, N)
    torch.testing.assert_close(c.float(), c_ref.float(), **TOL[out_dtype])


def test_int32_accumulation_is_exact(device):
    # All codes 127: each sum is 127^2 * K = 774,193 for K = 48, which int8 or fp16 sums could not hold.
    a = torch.full((5, 48), 127, dtype=torch.int8, device=device)
    b = torch.full((3, 48), -127, dtype=torch.int8, device=device)
    c = int8_gemm(a, b, torch.ones(5, device=device), torch.ones(3, device=device), torch.float32)
    assert (c == -127 * 127 * 48).all()


def test_w8a8_close_to_float_matmul(device):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(21, 64, generator=gen), torch.randn(13, 64, generator=gen)
    a, sa = quantize_rows(x.to(device))
    b, sb = quantize_rows(w.to(device))
    y = int8_gemm(a, b, sa, sb, torch.float32).cpu()
    rel = (y - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < 2e-2  # int8 per-row quantization: ~0.5% relative error on Gaussian data


def test_bad_input(device):
    a = torch.zeros(4, 16, dtype=torch.int8, device=device)
    with pytest.raises(TypeError, match="int8"):
        int8_gemm(a.float(), a, torch.ones(4, device=device), torch.ones(4, device=device))
    with pytest.raises(ValueError, match="scales"):
        int8_gemm(a, a, torch.ones(3, device=device), torch.ones(4, device=device))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_rows(torch.tensor([[1.0, float("nan")]], device=device))
    q, s = quantize_rows(torch.zeros(2, 4, device=device))
    assert (s == 0).all() and (q == 0).all()


@pytest.mark.parametrize("M,K,want", [(1, 3072, ("DECODE_CONFIGS", 0)), (16, 8192, ("DECODE_CONFIGS", 0)),
                                      (17, 3072, ("GEMM_CONFIGS", 0)), (4096, 3072, ("GEMM_CONFIGS", 1)),
                                      (16, 3000, ("UNALIGNED_CONFIGS", 0)), (4096, 24, ("UNALIGNED_CONFIGS", 1))])
def test_autotuner_times_only_the_tiles_for_this_m_and_k(M, K, want):
    # Unaligned K (not a multiple of 16) spilled registers in the aligned tiles on every target.
    from dlo.kernels import int8_gemm
    kept = int8_gemm._configs_for(int8_gemm._int8_gemm_tuned.configs, {"M": M, "N": 8192, "K": K})
    pool, index = want
    assert str(int8_gemm._config(getattr(int8_gemm, pool)[index])) in [str(c) for c in kept]
    assert all(c.kwargs["BLOCK_M"] <= 16 for c in kept) == (M <= 16)
    assert len(kept) == len([c for c in getattr(int8_gemm, pool) if (c["BLOCK_M"] <= 16) == (M <= 16)])
