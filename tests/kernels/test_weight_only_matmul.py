"""W8A16 / W4A16 dequant-on-the-fly matmul vs the torch reference, interpreter sizes in the tens."""

import pytest
import torch

from dlo.kernels.quantize import pack_int4, quantize_ref
from dlo.kernels.weight_only_matmul import weight_only_matmul, weight_only_matmul_ref

# Both sides round the same dequantized weights to bf16/fp16 and accumulate in fp32; they differ by
# the interpreter's truncating fp32 -> 16-bit casts (of each weight and of the output) and the
# summation order. Absolute tolerance in ulps of the largest output |y|max: bf16 has 8 mantissa
# bits (ulp = 2^-7 of a value in [1, 2)), fp16 11 bits; truncation costs up to 1 ulp per cast.
ULPS = {torch.bfloat16: 2 * 2 ** -7, torch.float16: 2 * 2 ** -10}
SHAPES = [(1, 24, 5), (19, 40, 23), (33, 72, 17)]  # (M, K, N): none a multiple of the 16-wide tiles


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", list(ULPS))
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_reference(M, K, N, dtype, bits, device):
    gen = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = torch.randn(N, K, generator=gen).to(device)
    q, s = quantize_ref(w, bits, 8)  # groups of 8: several scales per 16-wide K tile
    w_codes = pack_int4(q) if bits == 4 else q
    y = weight_only_matmul(x, w_codes, s, bits)
    y_ref = weight_only_matmul_ref(x, w_codes, s, bits)
    assert y.dtype == dtype and y.shape == (M, N)
    atol = ULPS[dtype] * y_ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=0.0)


def test_bad_input(device):
    x = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    q, s = quantize_ref(torch.randn(8, 16, device=device), 8, 8)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        weight_only_matmul(x.float(), q, s)
    with pytest.raises(TypeError, match="packed"):
        weight_only_matmul(x, q, s, bits=4)
    with pytest.raises(ValueError, match="K=12"):
        weight_only_matmul(x[:, :12], q, s)


@pytest.mark.parametrize("M,K,want", [(1, 3072, "DECODE"), (16, 3000, "DECODE"), (17, 3072, "GEMM"),
                                      (4096, 3000, "GEMM_UNALIGNED_K"), (4096, 40, "CPU")])
def test_launch_config(M, K, want):
    # An unaligned K (not a multiple of 16) spilled registers in the GEMM tile on every target.
    from dlo.kernels import weight_only_matmul as wom
    assert wom.launch_config(M, K, "cpu" if want == "CPU" else "cuda") is getattr(wom, want)
