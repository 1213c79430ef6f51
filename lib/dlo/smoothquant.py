"""SmoothQuant (Xiao et al. 2023): move the activation outliers' difficulty into the weights, then W8A8.

LLMs above a few billion parameters have a few input channels whose activations are 20-100x larger
than the rest, in every token (Dettmers et al. 2022, LLM.int8()). One per-tensor int8 scale for X is
set by those channels, so every other channel gets a handful of levels. Per-token scales do not help
(the outliers are per *channel*), and a per-channel activation scale cannot leave the int8 GEMM's
sum over k. SmoothQuant divides channel j of X by s_j and multiplies row j of W^T (column j of W)
by s_j, an exact identity Y = (X diag(s)^-1)(diag(s) W^T), with (their Eq. 4)

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

alpha = 0.5 splits the range evenly; larger alpha moves more onto the weights. diag(s)^-1 is folded
into whatever produces X: the weight of the RMSNorm before wq/wk/wv and w1/w3, the rows of w3 before
w2 (w2 reads silu(w1 x) * w3 x). The float model is unchanged; only its quantization is.

Order: calibration (`act_absmax`), the factors and the folding, W8A8 on `dlo.kernels.int8_gemm`
(its Triton kernel on CUDA; on a CPU its exact torch reference, or the kernel in the interpreter when
asked: `W8A8Linear(kernel=True)` under TRITON_INTERPRET=1), and the Llama-specific wiring
(`smooth_llama`, `quantize_llama`, `inject_outliers_`).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dlo import quant
from dlo.kernels import int8_gemm as gemm
from dlo.kernels.runtime import kernel_available

ACT_GRANULARITIES = ("tensor", "token")  # static per-tensor (SmoothQuant O3), dynamic per-token (O1)


# ----------------------------------------------------------------------------- calibration

@torch.no_grad()
def watch_inputs(model: nn.Module, batches, names: list[str], record) -> None:
    """Run `batches` (inputs or (x, y) pairs) through `model`, calling record(name, x) with the input of
    each named nn.Linear as (tokens, in) rows: the one calibration pass of SmoothQuant and AWQ."""
    mods = dict(model.named_modules())
    missing = [n for n in names if not isinstance(mods.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"not nn.Linear modules of the model: {missing}")
    handles = [mods[n].register_forward_pre_hook(
        lambda _mod, args, n=n: record(n, args[0].detach().reshape(-1, args[0].shape[-1]))) for n in names]
    seen = 0
    try:
        for batch in batches:
            model(batch[0] if isinstance(batch, (tuple, list)) else batch)
            seen += 1
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise ValueError("calibration saw no batch: pass at least one")


def act_absmax(model: nn.Module, batches, names: list[str]) -> dict[str, Tensor]:
    """max |x_j| over every token of `batches` of the input of each named nn.Linear: {name: (in,)}."""
    out: dict[str, Tensor] = {}

    def record(name, x):
        m = x.abs().amax(0).float()  # (in,)
        out[name] = m if name not in out else torch.maximum(out[name], m)

    watch_inputs(model, batches, names, record)
    return out


def outlier_stats(absmax: Tensor, factor: float = 6.0) -> dict:
    """How outlying the channels of one activation are: max / median of the per-channel absmax, and
    how many channels exceed `factor` x the median. A summary of this course, not LLM.int8()'s criterion
    (an absolute magnitude >= 6 in >= 25% of layers and >= 6% of tokens: `dlo.experiments.day8_smooth`)."""
    med = absmax.median().item()
    return {"channels": absmax.numel(), "max": absmax.max().item(), "median": med,
            "max/median": absmax.max().item() / med if med > 0 else float("inf"),
            f"> {factor:g}x median": int((absmax > factor * med).sum())}


# ----------------------------------------------------------------------------- the factors, folded

def smoothing_factors(act_absmax: Tensor, weight_absmax: Tensor, alpha: float) -> Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (Xiao et al. 2023, Eq. 4); a channel that is zero in
    X or W (nothing to balance) gets s = 1."""
    if act_absmax.shape != weight_absmax.shape or act_absmax.dim() != 1:
        raise ValueError(f"act_absmax and weight_absmax must be the same 1-D shape, got "
                       f"{tuple(act_absmax.shape)} and {tuple(weight_absmax.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a, w = act_absmax.double(), weight_absmax.double()
    ok = (a > 0) & (w > 0)
    s = a.clamp(min=1e-30) ** alpha / w.clamp(min=1e-30) ** (1.0 - alpha)
    return torch.where(ok, s, torch.ones_like(s)).to(act_absmax.dtype)


def weight_absmax(linears: list[nn.Linear]) -> Tensor:
    """max |W[:, j]| per input channel over all the linears reading the same X: (in,)."""
    return torch.cat([lin.weight.detach() for lin in linears]).abs().amax(0).float()


@torch.no_grad()
def fold_(producer: nn.Module, linears: list[nn.Linear], s: Tensor) -> None:
    """X -> X / s folded into `producer` (a norm: its weight (C,); a Linear: its output rows), and
    W[:, j] -> W[:, j] s_j into each consumer: the composed function is unchanged."""
    w = producer.weight
    if isinstance(producer, nn.Linear):
        w.div_(s.to(w)[:, None])
        if producer.bias is not None:
            producer.bias.div_(s.to(w))
    else:
        w.div_(s.to(w))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight)[None, :])


# ----------------------------------------------------------------------------- W8A8 on the int8 GEMM

class W8A8Linear(nn.Module):
    """int8 weights per output channel, int8 activations per tensor (a static, calibrated scale) or
    per token (dynamic); y = int8_gemm(q_x, q_w, s_x, s_w) + bias, summed exactly in int32.
    `kernel`: None runs the Triton kernel on CUDA and its exact torch reference elsewhere (the
    interpreter would take minutes per model on a CPU); True forces the kernel (on a CPU it needs
    TRITON_INTERPRET=1: the tests), False the reference."""

    def __init__(self, linear: nn.Linear, act_absmax: Tensor, act: str = "tensor", kernel: bool | None = None):
        super().__init__()
        if act not in ACT_GRANULARITIES:
            raise ValueError(f"act must be one of {ACT_GRANULARITIES}, got {act!r}")
        q, s, _ = quant.quantize(linear.weight.detach(), 8, "channel", symmetric=True)
        self.act, self.kernel = act, kernel
        self.register_buffer("qweight", q)  # (out, in) int8
        self.register_buffer("w_scale", s[:, 0].contiguous())  # (out,)
        self.register_buffer("x_scale", act_absmax.max().float().reshape(()) / 127.0)  # per tensor, static
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.act == "token":
            qx, sx = gemm.quantize_rows(x2)
        else:
            sx = self.x_scale.expand(x2.shape[0]).contiguous()
            qx = quant.quantize_affine(x2, self.x_scale, torch.zeros(()), 8).to(torch.int8)
        use = x.device.type == "cuda" and kernel_available(x.device) if self.kernel is None else self.kernel
        mm = gemm.int8_gemm if use else gemm.int8_gemm_ref
        y = mm(qx, self.qweight, sx, self.w_scale, out_dtype=torch.float32).to(x.dtype)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def replace_linears(model: nn.Module, make) -> None:
    """Every named nn.Linear `name` for which make(name, linear) gives a module is replaced by it."""
    for parent_name, parent in list(model.named_modules()):
        for attr, sub in list(parent.named_children()):
            name = f"{parent_name}.{attr}" if parent_name else attr
            new = make(name, sub) if isinstance(sub, nn.Linear) else None
            if new is not None:
                setattr(parent, attr, new)


# ----------------------------------------------------------------------------- Llama wiring

def llama_groups(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(producer, consumers) of every block of a `dlo.models.llama.Llama`: the norms before the
    attention and MLP inputs, w3 before w2. wo reads attention output (no foldable producer: with
    grouped-query attention a v channel feeds several heads) and stays unsmoothed."""
    groups = []
    for i in model.layers:
        p = f"layers.{i}"
        groups += [(f"{p}.attention_norm", [f"{p}.attention.{w}" for w in ("wq", "wk", "wv")]),
                   (f"{p}.ffn_norm", [f"{p}.feed_forward.w1", f"{p}.feed_forward.w3"]),
                   (f"{p}.feed_forward.w3", [f"{p}.feed_forward.w2"])]
    return groups


def block_linears(model: nn.Module) -> list[str]:
    """The nn.Linear names inside the blocks (the tied LM head stays in float, as is usual)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")]


@torch.no_grad()
def smooth_llama(model: nn.Module, batches, alpha: float) -> nn.Module:
    """A smoothed copy of a Llama: factors from the activations seen on `batches`, folded group by group."""
    model = copy.deepcopy(model).eval()
    groups = llama_groups(model)
    stats = act_absmax(model, batches, [c for _, cs in groups for c in cs])
    mods = dict(model.named_modules())
    for producer, consumers in groups:
        lins = [mods[c] for c in consumers]
        fold_(mods[producer], lins, smoothing_factors(stats[consumers[0]], weight_absmax(lins), alpha))
    return model


@torch.no_grad()
def quantize_llama(model: nn.Module, batches, mode: str = "w8a8", act: str = "tensor") -> nn.Module:
    """A copy with every block Linear quantized: "w8a8" (W8A8Linear, activations calibrated on
    `batches`) or "w8a16" (weight-only int8 per channel, `dlo.quant.QuantLinear`)."""
    if mode not in ("w8a8", "w8a16"):
        raise ValueError(f"mode must be 'w8a8' or 'w8a16', got {mode!r}")
    model = copy.deepcopy(model).eval()
    names = block_linears(model)
    if mode == "w8a16":
        replace_linears(model, lambda n, lin: quant.QuantLinear(lin, 8, "channel") if n in names else None)
        return model
    stats = act_absmax(model, batches, names)
    replace_linears(model, lambda n, lin: W8A8Linear(lin, stats[n], act) if n in names else None)
    return model


@torch.no_grad()
def inject_outliers_(model: nn.Module, channels: list[int], factor: float) -> None:
    """The controlled case: the attention and MLP norms' weights x factor on `channels`, the columns
    of the linears they feed / factor. The float model is unchanged (up to rounding); those input
    channels of wq/wk/wv/w1/w3 become `factor` x larger in every token, as LLM.int8() measured."""
    mods = dict(model.named_modules())
    s = torch.ones(model.config.dim)
    s[channels] = 1.0 / factor
    for producer, consumers in llama_groups(model):
        if isinstance(mods[producer], nn.Linear):
            continue
        fold_(mods[producer], [mods[c] for c in consumers], s)
