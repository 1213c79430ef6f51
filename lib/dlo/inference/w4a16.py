"""Weight-only int4 linears in the decode loop: Day 8's W4A16 format, Day 9's split-K kernel at decode.

`W4A16Linear` holds an nn.Linear's weight as Day 8's packed int4 codes with one fp32 scale per group
(`dlo.kernels.weight_only_decode.pack_weight`; groups of up to 128 inputs, `dlo.awq.group_size`) and computes
y = x W_hat^T with the implementation chosen when it is made, never silently another (a reference timed under a
kernel's name would be a wrong table, `dlo.kernels.runtime`):

- "kernel": a decode step's rows (at most `DECODE_MAX_M` tokens) through the split-K kernel (`w4a16_decode`), a
  prefill's through Day 8's W4A16 GEMM kernel (`weight_only_matmul`);
- "reference": Day 8's torch reference, dequantize then matmul: a CPU without Triton's interpreter.

`quantize_linears` swaps the seven projections of every block of a Llama (the embeddings and the output layer
keep the model's dtype), in a copy; `dlo.inference.kv_cache.forward_cached` and `generate` run it unchanged.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from dlo.awq import group_size
from dlo.kernels.weight_only_decode import pack_weight, w4a16_decode, w4a16_decode_ref
from dlo.kernels.weight_only_matmul import ACT_DTYPES, DECODE_MAX_M, weight_only_matmul

IMPLS = ("kernel", "reference")
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # a Llama block's linears (attention, then feed-forward)


class W4A16Linear(nn.Module):
    """A bias-free nn.Linear as packed int4 codes (N, K/2) and fp32 group scales (N, K/G); bf16/fp16 activations."""

    def __init__(self, linear: nn.Linear, group: int = 128, impl: str = "kernel"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if linear.bias is not None:
            raise ValueError("W4A16Linear takes a bias-free nn.Linear (a Llama's projections have none)")
        self.in_features, self.out_features, self.impl = linear.in_features, linear.out_features, impl
        packed, scale = pack_weight(linear.weight.detach(), group_size(linear.in_features, group))
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype not in ACT_DTYPES:
            raise TypeError(f"W4A16Linear takes bf16 or fp16 activations (the A16), got {x.dtype}: convert the "
                            "model first (model.to(torch.bfloat16))")
        rows = x.reshape(-1, self.in_features)
        if self.impl == "reference":
            y = w4a16_decode_ref(rows, self.packed, self.scale)
        elif rows.shape[0] <= DECODE_MAX_M:
            y = w4a16_decode(rows, self.packed, self.scale)
        else:
            y = weight_only_matmul(rows, self.packed, self.scale, 4)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        G = self.in_features // self.scale.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, group={G}, impl={self.impl}"


def quantize_linears(model: nn.Module, group: int = 128, impl: str = "kernel") -> nn.Module:
    """A copy of a Llama with each block's projections (`PROJECTIONS`) as W4A16Linear; the rest unchanged."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    model = copy.deepcopy(model)
    for block in model.layers.values():
        for part in (block.attention, block.feed_forward):
            for name in PROJECTIONS:
                if isinstance(getattr(part, name, None), nn.Linear):
                    setattr(part, name, W4A16Linear(getattr(part, name), group, impl))
    return model


def linear_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the blocks' projection weights as stored: W4A16Linear's codes and scales, nn.Linear's weight."""
    out = {"W4A16": 0, "dense": 0}
    for m in model.layers.modules():
        if isinstance(m, W4A16Linear):
            out["W4A16"] += m.packed.numel() + 4 * m.scale.numel()
        elif isinstance(m, nn.Linear):
            out["dense"] += m.weight.numel() * m.weight.element_size()
    return out


__all__ = ["IMPLS", "PROJECTIONS", "W4A16Linear", "linear_bytes", "quantize_linears"]
