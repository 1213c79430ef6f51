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
# (M, K, N, G): M, N not multiples of the 16-wide tiles. Groups of 8: several scales per 16-wide K tile
# (each element gathers its scale); groups of 16 or 32: one scale per row of a tile. M <= 16 is the
# decode path, whose K is split over two programs in the interpreter (three and a half tiles at K=56).
# G = K: per channel, where the scale multiplies the accumulator once after the loop.
SHAPES = [(1, 24, 5, 8), (19, 40, 23, 8), (33, 72, 17, 8), (1, 48, 5, 16), (3, 56, 17, 8), (20, 64, 9, 32),
          (2, 40, 6, 40), (21, 48, 7, 48)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", list(ULPS))
@pytest.mark.parametrize("M,K,N,G", SHAPES)
def test_matches_reference(M, K, N, G, dtype, bits, device):
    gen = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = torch.randn(N, K, generator=gen).to(device)
    q, s = quantize_ref(w, bits, G)
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


@pytest.mark.parametrize("M,K,G,pool,block_k", [(1, 3072, 128, "DECODE_CONFIGS", (64, 128)),
                                                (16, 3072, 192, "DECODE_CONFIGS", (64,)),  # 128 does not divide 192
                                                (17, 3072, 128, "GEMM_CONFIGS", (64,)),
                                                (4096, 3072, 32, "GEMM_CONFIGS", (64,)),  # none fits a group
                                                (16, 3000, 3000, "UNALIGNED_CONFIGS", (64,)),
                                                (4096, 24, 8, "UNALIGNED_CONFIGS", (64,))])
def test_autotuner_times_only_the_tiles_for_this_m_k_and_g(M, K, G, pool, block_k):
    # Unaligned K (not a multiple of 16) spilled registers in the aligned tiles; a BLOCK_K that divides
    # G loads one scale per row instead of one per element.
    from dlo.kernels import weight_only_matmul as wom
    kept = wom._configs_for(wom._weight_only_matmul_tuned.configs, {"M": M, "N": 8192, "K": K}, G=G)
    assert kept and all(str(c) in [str(wom._config(p)) for p in getattr(wom, pool)] for c in kept)
    assert all((c.kwargs["BLOCK_M"] <= 16) == (M <= 16) for c in kept)
    assert sorted({c.kwargs["BLOCK_K"] for c in kept}) == list(block_k)


def test_autotuner_times_a_split_with_its_sum():
    """A split-K configuration is timed together with the sum of its partials (the autotuner's
    post_hook, run inside each timed call); the launcher adds them the same way after the real run."""
    from dlo.kernels import weight_only_matmul as wom
    assert wom._weight_only_matmul_tuned.user_defined_post_hook
    part = torch.randn(wom.MAX_SPLIT_K, 2, 3, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(2, 3, dtype=torch.bfloat16)
    wom._timed_with_the_sum({"y_ptr": y, "part_ptr": part, "SPLIT_K": 1})
    assert not y.any()  # one split: the kernel wrote y itself
    wom._timed_with_the_sum({"y_ptr": y, "part_ptr": part, "SPLIT_K": 3}, exception=RuntimeError("launch"))
    assert not y.any()
    wom._timed_with_the_sum({"y_ptr": y, "part_ptr": part, "SPLIT_K": 3})
    assert torch.equal(y, part[:3].sum(dim=0).to(torch.bfloat16))
