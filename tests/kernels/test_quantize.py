"""Per-channel / per-group quantize kernel vs its torch reference, in the interpreter on CPU.

Codes must match exactly (same IEEE division, same round-half-even); scales are one fp32 division
of the same max, so they match bit for bit too. Odd N, K not multiples of a block; bad input.
"""

import pytest
import torch

from dlo.kernels.quantize import dequantize_weight, pack_int4, quantize_ref, quantize_weight, unpack_int4

# (N, K, group_size); -1 = per-channel. The interpreter's blocks hold 64: the last two loop over their groups.
CASES = [(5, 12, 4), (7, 33, -1), (3, 96, 32), (1, 10, 10), (3, 200, -1), (2, 256, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,G", CASES)
def test_matches_reference(N, K, G, dtype, bits, device):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N * K)).to(device, dtype)
    q, s = quantize_weight(w, bits, G)
    q_ref, s_ref = quantize_ref(w, bits, G)
    assert torch.equal(s, s_ref)  # same fp32 max / q_max: bit-exact
    assert torch.equal(q, q_ref)  # same IEEE division and rounding: bit-exact
    q_max = 2 ** (bits - 1) - 1
    assert q.abs().max() <= q_max
    # Round-trip bound: |w - q s| <= s / 2 per element (no clipping, since s comes from the max).
    err = (w.float() - dequantize_weight(q, s)).abs()
    groups = s.shape[1]
    bound = (s / 2).repeat_interleave(K // groups, dim=1)
    # fp32 w / s is off by up to q_max * 2^-24 codes, hence the 1e-4 relative slack.
    assert (err <= bound * (1 + 1e-4) + 1e-12).all()


def test_ties_round_half_to_even(device):
    # 0.5 / (1 / 127) etc. is not exact; build exact ties instead: max 127 makes s = 1.
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.0, 0.0]], device=device)
    q, s = quantize_weight(w, 8, -1)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 3, 0]]


def test_zero_group_has_zero_scale(device):
    w = torch.zeros(3, 8, device=device)
    w[1, 4:] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    q, s = quantize_weight(w, 8, 4)
    assert torch.isfinite(s).all() and s[0].tolist() == [0.0, 0.0] and s[1, 0] == 0.0
    assert (q[0] == 0).all()
    assert torch.equal(dequantize_weight(q, s)[0], torch.zeros(8, device=device))


@pytest.mark.parametrize("fn", [quantize_weight, quantize_ref])
def test_bad_input(fn, device):
    with pytest.raises(ValueError, match="must divide"):
        fn(torch.randn(4, 10, device=device), 8, 4)
    with pytest.raises(ValueError, match="inf or nan"):
        fn(torch.tensor([[1.0, float("inf")]], device=device), 8, -1)
    with pytest.raises(ValueError, match="inf or nan"):
        fn(torch.tensor([[1.0, float("nan")]], device=device), 8, -1)
    with pytest.raises(ValueError, match="bits"):
        fn(torch.randn(2, 4, device=device), 3, -1)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("G", [8, -1])
def test_non_finite_found_in_any_program(bad, G, device):
    """The kernel finds inf / nan during its one read of W, in whichever program holds it: a group of
    a multi-row tile (G = 8) or the last block of a row quantized in a loop (a 150-wide row)."""
    w = torch.randn(5, 152, device=device)
    w[3, 149] = bad
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_weight(w, 8, G)


def test_int4_pack_roundtrip():
    q = torch.randint(-8, 8, (5, 14), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (5, 7) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(ValueError, match="even K"):
        pack_int4(q[:, :13])
