"""dlo.kernels.runtime's in-kernel helpers, run in a kernel of the test's own (interpreter on CPU, compiled on GPU)."""

import torch
import triton
import triton.language as tl

from dlo.kernels.runtime import round_to_bf16


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, round_to_bf16(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_round_to_bf16_matches_torch_and_keeps_every_nan(device):
    # Ties both ways, a carry into the exponent, overflow to inf, subnormals, and nans whose mantissa is all
    # ones: 0x7FFFFFFF is what an NVIDIA GPU's arithmetic returns for nan, and the rounding carry of a plain
    # bit trick runs from it into the sign bit (-0.0): the bug the H100 run of 2026-11-26 showed.
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x7F7FFFFF, 0x00000001, 0x80008000, 0x7F800000,
                         0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7F800001], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([x, torch.randn(1000, generator=gen) * 1e3]).to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), BLOCK=128)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(y.isnan(), x.isnan())  # every nan stays nan, nothing else becomes one
    finite_or_inf = ~x.isnan()
    assert torch.equal(y[finite_or_inf].view(torch.int32), want[finite_or_inf].view(torch.int32))
