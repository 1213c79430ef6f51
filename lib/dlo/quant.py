"""Uniform affine quantization, observers, fake quantization with the STE, PTQ and QAT helpers.

Q(r) = clamp(round(r / S) + Z, q_min, q_max) and r_hat = S (Q(r) - Z) (Gholami et al. 2021, Eq. 2-3).
Symmetric: Z = 0, S = max|r| / q_max on the restricted range [-(2^(b-1) - 1), 2^(b-1) - 1].
Asymmetric: the range [alpha, beta] (widened to contain 0, so 0 is exact) maps onto [-2^(b-1), 2^(b-1) - 1].
Granularity is the set of values sharing one (S, Z): the whole tensor, one output channel (row), or
a group of `group_size` consecutive inputs of one row (as GPTQ and AWQ group; Q-BERT, Shen et al. 2020,
groups whole output rows instead).

Scales always have shape (rows or 1, n_groups) for a 2-D tensor: (1, 1) per tensor, (R, 1) per
channel, (R, C / G) per group. A zero range gives S = 0 and codes Z, which dequantize to exact 0.
(About 310 lines: one pipeline, read in order with Day 8 - quantize, fake-quantize, observe, PTQ and
QAT modules - each section built on the one before.)
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GRANULARITIES = ("tensor", "channel", "group")


def qrange(bits: int, symmetric: bool = True) -> tuple[int, int]:
    """Integer range: symmetric restricted [-(2^(b-1)-1), 2^(b-1)-1], asymmetric [-2^(b-1), 2^(b-1)-1]."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    return (-(2 ** (bits - 1) - 1) if symmetric else -(2 ** (bits - 1))), 2 ** (bits - 1) - 1


def group_view(x: Tensor, granularity: str, group_size: int = 128) -> Tensor:
    """View a 2-D tensor as (rows or 1, n_groups, values per group) for the given granularity."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor (flatten conv weights to (out, -1) first), got {tuple(x.shape)}")
    R, C = x.shape
    if granularity == "tensor":
        return x.reshape(1, 1, R * C)
    if granularity == "channel":
        return x.reshape(R, 1, C)
    if granularity == "group":
        if group_size < 1 or C % group_size:
            raise ValueError(f"group_size={group_size} must divide the {C} columns")
        return x.reshape(R, C // group_size, group_size)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def scale_zero_point(lo: Tensor, hi: Tensor, bits: int, symmetric: bool = True) -> tuple[Tensor, Tensor]:
    """(S, Z) from a clipping range [lo, hi] (same shapes); S = 0 where the range is empty."""
    q_min, q_max = qrange(bits, symmetric)
    lo, hi = lo.float(), hi.float()
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("the clipping range holds inf or nan; clean the tensor or calibrate on finite data")
    if symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / q_max
        return scale, torch.zeros_like(scale)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # 0 must be representable (zero padding, ReLU zeros)
    scale = (hi - lo) / (q_max - q_min)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (q_min - torch.round(lo / safe)).clamp(q_min, q_max)
    return scale, zero


def quantize_affine(x: Tensor, scale: Tensor, zero: Tensor, bits: int, symmetric: bool = True) -> Tensor:
    """Codes clamp(round(x / S) + Z) as float (exact small integers); S = 0 gives Z."""
    q_min, q_max = qrange(bits, symmetric)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(x / safe) + zero).clamp(q_min, q_max)


def dequantize_affine(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    return (q - zero) * scale


def quantize(x: Tensor, bits: int = 8, granularity: str = "channel", group_size: int = 128,
             symmetric: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Min-max quantization of a 2-D tensor: (codes int8 like x, scale (R|1, n_groups), zero-point same)."""
    if not torch.isfinite(x).all():
        raise ValueError("x holds inf or nan: its scale would be inf or nan; fix the tensor first")
    g = group_view(x.float(), granularity, group_size)  # (R|1, groups, size)
    scale, zero = scale_zero_point(g.amin(-1), g.amax(-1), bits, symmetric)
    q = quantize_affine(g, scale[..., None], zero[..., None], bits, symmetric)
    return q.reshape(x.shape).to(torch.int8), scale, zero


def dequantize(q: Tensor, scale: Tensor, zero: Tensor | None = None) -> Tensor:
    """Float tensor from codes and (R|1, n_groups) scales: inverse of `quantize` up to rounding."""
    R, C = q.shape
    zero = torch.zeros_like(scale) if zero is None else zero
    # Values per group spelled out, not -1: an empty (0, C) tensor has no inferable size.
    g = q.float().reshape(*scale.shape, q.numel() // max(scale.numel(), 1))
    return dequantize_affine(g, scale[..., None], zero[..., None]).reshape(R, C)


def fake_quantize_tensor(x: Tensor, bits: int = 8, granularity: str = "channel", group_size: int = 128,
                         symmetric: bool = True) -> Tensor:
    """dequantize(quantize(x)) in one call, for any tensor (conv weights are viewed as (out, -1))."""
    x2 = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
    q, s, z = quantize(x2, bits, granularity, group_size, symmetric)
    return dequantize(q, s, z).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- fake quant with the STE

class FakeQuantSTE(torch.autograd.Function):
    """Forward: S (clamp(round(x / S) + Z) - Z). Backward: the straight-through estimator (Bengio et al.
    2013): round has zero gradient almost everywhere, so pass the gradient through as if it were the
    identity, but only inside the clipping range, where the clamp is not active."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, zero: Tensor, bits: int, symmetric: bool = True) -> Tensor:
        q_min, q_max = qrange(bits, symmetric)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        code = torch.round(x / safe) + zero
        ctx.save_for_backward((code >= q_min) & (code <= q_max))
        return (code.clamp(q_min, q_max) - zero) * scale

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (inside,) = ctx.saved_tensors
        return grad_out * inside, None, None, None, None


def fake_quant(x: Tensor, scale: Tensor, zero: Tensor | None = None, bits: int = 8, symmetric: bool = True) -> Tensor:
    """Differentiable fake quantization with broadcastable scale / zero (see FakeQuantSTE)."""
    zero = torch.zeros_like(scale) if zero is None else zero
    return FakeQuantSTE.apply(x, scale, zero, bits, symmetric)


# ----------------------------------------------------------------------------- observers (calibration)

class MinMaxObserver:
    """Running min and max over every batch seen (per tensor): sensitive to a single outlier."""

    def __init__(self):
        self.lo, self.hi = None, None

    def update(self, x: Tensor) -> None:
        x = x.detach().float()
        if not torch.isfinite(x).all():
            raise ValueError("calibration batch holds inf or nan")
        lo, hi = x.min(), x.max()
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def range(self) -> tuple[Tensor, Tensor]:
        if self.lo is None:
            raise RuntimeError("the observer has seen no data: call update(x) on calibration batches first")
        return self.lo, self.hi

    def qparams(self, bits: int = 8, symmetric: bool = False) -> tuple[Tensor, Tensor]:
        return scale_zero_point(*self.range(), bits, symmetric)


class PercentileObserver(MinMaxObserver):
    """Clip at the p-th and (100 - p)-th percentiles of all values seen: outliers get clamped
    instead of stretching the scale for everyone. Keeps every value (fine for calibration sizes)."""

    def __init__(self, percentile: float = 99.9):
        super().__init__()
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = percentile
        self.values: list[Tensor] = []

    def update(self, x: Tensor) -> None:
        super().update(x)
        self.values.append(x.detach().float().flatten().cpu())

    def range(self) -> tuple[Tensor, Tensor]:
        super().range()
        lo, hi = quantiles(torch.cat(self.values), [1.0 - self.percentile / 100.0, self.percentile / 100.0])
        return lo.float(), hi.float()


def quantiles(v: Tensor, qs: list[float]) -> Tensor:
    """torch.quantile(v.double(), qs) (linear interpolation between order statistics) at any size.

    torch.quantile refuses inputs of more than 2^24 elements (a full-size calibration holds 32 batches
    x 256 x 3072 values); `kthvalue` selects an order statistic in O(n) without that limit, and the
    interpolation is done in float64 as torch.quantile does. Returns a float64 tensor of len(qs)."""
    v = v.detach().flatten()
    n = v.numel()
    if n == 0:
        raise ValueError("quantiles of an empty tensor")
    out = []
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile levels must be in [0, 1], got {q}")
        pos = q * (n - 1)
        i = math.floor(pos)
        lo = v.kthvalue(i + 1).values.double()
        hi = v.kthvalue(min(i + 2, n)).values.double() if pos > i else lo
        out.append(torch.lerp(lo, hi, pos - i))  # lerp: the rounding torch.quantile does
    return torch.stack(out)


OBSERVERS = {"minmax": MinMaxObserver, "percentile": PercentileObserver}


def _make_observer(name: str, percentile: float) -> MinMaxObserver:
    if name not in OBSERVERS:
        raise ValueError(f"observer must be one of {list(OBSERVERS)}, got {name!r}")
    return OBSERVERS[name](percentile) if name == "percentile" else OBSERVERS[name]()


# ----------------------------------------------------------------------------- PTQ / QAT modules

class QuantLinear(nn.Module):
    """A Linear with int8 weight codes (4- or 8-bit values) and per-tensor/channel/group scales, plus
    optional static activation fake quantization with an observer-calibrated (scale, zero);
    `observer` names the calibration observer in OBSERVERS (`percentile` is for "percentile").
    symmetric=False stores the weight with one zero-point per scale (AWQ's int4 default); the
    symmetric layer has no `zero` buffer (None: not in its state_dict)."""

    def __init__(self, linear: nn.Linear, bits: int = 8, granularity: str = "channel", group_size: int = 128,
                 act_bits: int | None = None, observer: str = "minmax", percentile: float = 99.9,
                 symmetric: bool = True):
        super().__init__()
        q, s, z = quantize(linear.weight.detach(), bits, granularity, group_size, symmetric)
        self.bits, self.act_bits = bits, act_bits
        self.register_buffer("qweight", q)  # (out, in) int8 codes
        self.register_buffer("scale", s)  # (out|1, groups)
        self.register_buffer("zero", None if symmetric else z)  # same shape as scale, integer-valued floats
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_buffer("act_scale", torch.zeros(()))
        self.register_buffer("act_zero", torch.zeros(()))
        self.observer = _make_observer(observer, percentile) if act_bits else None

    def weight_hat(self) -> Tensor:
        return dequantize(self.qweight, self.scale, self.zero)

    def forward(self, x: Tensor) -> Tensor:
        if self.act_bits:
            if self.observer is not None:  # calibration pass: watch, do not quantize yet
                self.observer.update(x)
            else:
                x = fake_quant(x, self.act_scale, self.act_zero, self.act_bits, symmetric=False)
        return F.linear(x, self.weight_hat().to(x.dtype), self.bias)

    def freeze(self) -> None:
        """End calibration: set the activation (scale, zero) from what the observer saw."""
        if self.observer is None:
            return
        s, z = self.observer.qparams(self.act_bits, symmetric=False)
        self.act_scale.copy_(s)
        self.act_zero.copy_(z)
        self.observer = None

    def nbytes(self) -> int:
        """Storage of the deployed layer: codes at `bits` per weight (int4 packs two per byte), fp32 scales,
        zero-points at `bits` each (packed like the codes), bias."""
        n = self.qweight.numel() * self.bits // 8 + self.scale.numel() * 4
        n += 0 if self.zero is None else -(-self.zero.numel() * self.bits // 8)
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


def quantize_model(model: nn.Module, bits: int = 8, granularity: str = "channel", group_size: int = 128,
                   act_bits: int | None = None, calib_batches=None, observer: str = "minmax",
                   percentile: float = 99.9) -> nn.Module:
    """PTQ: a copy of `model` with every nn.Linear replaced by a QuantLinear. With act_bits, the
    activations are calibrated on `calib_batches` (an iterable of inputs or (x, y) pairs)."""
    _make_observer(observer, percentile)  # a bad name fails before the copy, even without act_bits
    model = copy.deepcopy(model)
    for child in list(model.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, QuantLinear(sub, bits, granularity, group_size, act_bits, observer, percentile))
    if act_bits:
        if calib_batches is None:
            raise ValueError("act_bits needs calib_batches to calibrate the activation ranges")
        device = next(model.parameters(), torch.zeros(())).device
        model.eval()
        with torch.no_grad():
            for batch in calib_batches:
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                model(x.to(device))
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.freeze()
    return model


class QATLinear(nn.Linear):
    """A Linear whose forward uses a fake-quantized weight (min-max scale recomputed every step);
    the STE lets the float weight keep learning through the rounding."""

    bits: int = 8
    granularity: str = "channel"
    group_size: int = 128

    def forward(self, x: Tensor) -> Tensor:
        g = group_view(self.weight, self.granularity, self.group_size)
        scale, zero = scale_zero_point(g.detach().amin(-1), g.detach().amax(-1), self.bits, True)
        w_hat = fake_quant(g, scale[..., None], zero[..., None], self.bits, True).reshape(self.weight.shape)
        return F.linear(x, w_hat, self.bias)


def prepare_qat(model: nn.Module, bits: int = 8, granularity: str = "channel", group_size: int = 128) -> nn.Module:
    """A copy of `model` whose nn.Linear layers train with fake-quantized weights (QAT)."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = QATLinear
            m.bits, m.granularity, m.group_size = bits, granularity, group_size
    return model


def model_nbytes(model: nn.Module) -> int:
    """Bytes of a model as deployed: QuantLinear at its bit width, everything else as stored."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.nbytes()
            continue
        for p in m.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total
