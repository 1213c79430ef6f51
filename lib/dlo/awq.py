"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys; arXiv:2306.00978): weight-only 4-bit group quantization that protects the
weights which see large activations.

Round-to-nearest (RTN) gives every weight of a group the same step S = max|W_group| / 7. The error of
output y = sum_j W_j x_j is sum_j (Q(W_j) - W_j) x_j: a weight's rounding error is multiplied by its
input, so the input channels with large |x_j| (the "salient" ~1%, Sec. 3.1) dominate. Keeping them in
fp16 fixes most of it but needs a mixed-precision kernel; AWQ scales them instead (Sec. 3.2):

    Q(W diag(s)) (diag(s)^-1 x)      (an identity in float; their Eq. 4 minimises its error)

Scaling column j up by s_j > 1 leaves its rounding error ~S/2 absolute (S barely moves while W_j is
not the group's max), so relative to W_j it shrinks by s_j; x_j / s_j then carries it. s = s_X^alpha
with s_X the mean |x_j| over calibration tokens (Eq. 5), alpha grid-searched in [0, 1] per layer
group on the calibration batch (alpha = 0: s = 1, plain RTN). diag(s)^-1 is folded into the producer
of x with `dlo.smoothquant.fold_`, the same groups as SmoothQuant (`llama_groups`).

Two details of the authors' released code (llm-awq, `awq/quantize/`), both optional here:
- **Zero points** (`symmetric=False`): llm-awq quantizes with q_config zero_point=True by default
  (`entry.py`; `pseudo_quantize_tensor`'s symmetric branch is marked "we actually never used this"):
  S = (max - min) / 15 and a zero point z per group, so a group's 16 levels span [min, max] instead of
  [-max|w|, max|w|]. `dlo.quant`'s asymmetric mode is the same quantizer with codes and zero points
  stored signed, 8 below llm-awq's unsigned 0..15 (`pack_int4` adds the 8 back); it also widens
  [min, max] to contain 0, which changes nothing for a weight group holding both signs. The search
  runs with the quantizer it is searched for (as llm-awq's does).
- **Clipping** (`clip=True`, llm-awq `auto_clip.py`): after the scaling, each group's range is
  clipped to ratio x max|w_group|, the ratio from a grid over (0.5, 1] (1, 0.95, .., 0.55) minimising
  the squared error of that group's part of the output on the calibration inputs, per output row and
  group; wq and wk are skipped ("due to qk bmm, it is hard to clip precisely").

The symmetric codes run through the W4A16 kernel (`dlo.kernels.weight_only_matmul`, bits=4 after
`pack_int4`) unchanged: that is AWQ's point, no new kernel. That kernel takes scales only, so codes
with zero points run through the torch path (`dlo.quant.QuantLinear`, which dequantizes S (q - z) in
fp32). Adding them outside the kernel, y = x (S q)^T - sum_g (sum of x over group g) (S z)_g, is exact
algebra but not in bf16: the kernel rounds the uncorrected x (S q)^T, larger than y when a group's codes
sit far from its zero, to bf16 before the correction (tried on the 64 -> 48 outlier layer of the
tests: largest error 0.12 against 0.012 for the symmetric codes). llm-awq's CUDA kernel takes the zero
points (qzeros) and subtracts them per weight before the multiply; the Triton kernel here was not changed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dlo import quant
from dlo import smoothquant as sq

BITS = 4
GROUP = 128  # the paper's INT4 "g128"
N_GRID = 20  # their grid over [0, 1]
CLIP_GRID, MAX_SHRINK = 20, 0.5  # llm-awq auto_clip_layer's n_grid and max_shrink: ratios 1, 0.95, .., 0.55
NO_CLIP = ("wq", "wk")  # the linears llm-awq does not clip (their q_/k_proj)


def group_size(in_features: int, group: int = GROUP) -> int:
    """The largest divisor of `in_features` not above `group`: 128 at LLM widths, the whole row of the
    tiny Llama's 64 inputs, 88 for its 176-wide w2 (a group must divide the row)."""
    if in_features < 1 or group < 1:
        raise ValueError(f"in_features and group must be >= 1, got {in_features} and {group}")
    return max(g for g in range(1, min(group, in_features) + 1) if in_features % g == 0)


def rtn(w: Tensor, symmetric: bool = True) -> Tensor:
    """W4 round-to-nearest with one scale (and, asymmetric, one zero point) per group: what the deployed
    layer holds, in float."""
    return quant.fake_quantize_tensor(w, BITS, "group", group_size(w.shape[1]), symmetric)


# ----------------------------------------------------------------------------- calibration

def layer_inputs(model: nn.Module, batches, names: list[str], max_tokens: int = 0) -> dict[str, Tensor]:
    """The inputs of each named nn.Linear over `batches`, as (tokens, in) float rows; at most
    `max_tokens` (0: all) - the search's cost is linear in tokens and a few hundred suffice."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    seen: dict[str, list[Tensor]] = {n: [] for n in names}
    sq.watch_inputs(model, batches, names, lambda n, x: seen[n].append(x.float()))
    return {n: torch.cat(v)[:max_tokens or None] for n, v in seen.items()}


# ----------------------------------------------------------------------------- the search (Sec. 3.2)

def awq_scales(x: Tensor, alpha: float) -> Tensor:
    """s = s_X^alpha, s_X = mean |x_j| over the tokens (Eq. 5). Divided by sqrt(max s * min s), as the
    authors' code does: a common factor changes nothing for a per-group scale (it scales S too) but
    keeps W diag(s) near W's magnitude. The clamp keeps a dead channel from a division by zero."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    s = x.abs().mean(0).clamp(min=1e-4) ** alpha
    return s / (s.max() * s.min()).sqrt()


def quantized_error(x: Tensor, linears: list[nn.Linear], s: Tensor, symmetric: bool = True) -> float:
    """L(s) = ||Q(W diag(s)) (diag(s)^-1 x) - W x||^2 per output value (Eq. 4), over all the linears
    reading x (wq, wk, wv share one input and one s: one fold serves them all)."""
    err, n = 0.0, 0
    for lin in linears:
        w = lin.weight.detach().float()
        y, y_hat = x @ w.T, (x / s) @ rtn(w * s, symmetric).T
        err, n = err + (y_hat - y).pow(2).sum().item(), n + y.numel()
    return err / n


@dataclass
class Search:
    """One group's search: the chosen alpha, its factors s, and L at every alpha of the grid."""

    alpha: float
    s: Tensor
    errors: dict[float, float]

    @property
    def rtn_error(self) -> float:
        return self.errors[0.0]


@torch.no_grad()
def search_alpha(x: Tensor, linears: list[nn.Linear], n_grid: int = N_GRID, symmetric: bool = True) -> Search:
    """alpha* = argmin L(s_X^alpha) over n_grid points of [0, 1] (Eq. 5). alpha = 0 is in the grid and
    wins ties, so the result never has a larger calibration error than RTN (with the same quantizer)."""
    if n_grid < 2:
        raise ValueError(f"n_grid must be >= 2 (0 and 1 at least), got {n_grid}")
    grid = [i / (n_grid - 1) for i in range(n_grid)]
    errors = {a: quantized_error(x, linears, awq_scales(x, a), symmetric) for a in grid}
    best = min(grid, key=lambda a: (errors[a], a))
    return Search(best, awq_scales(x, best), errors)


# ----------------------------------------------------------------------------- the clipping search

def clip_ratios(n_grid: int = CLIP_GRID, max_shrink: float = MAX_SHRINK) -> list[float]:
    """llm-awq's grid: 1 - i / n_grid for i < max_shrink * n_grid, largest first (1: no clipping)."""
    if n_grid < 1 or not 0.0 < max_shrink < 1.0 or int(max_shrink * n_grid) < 1:
        raise ValueError(f"need n_grid >= 1 and 0 < max_shrink < 1 with max_shrink * n_grid >= 1, "
                         f"got {n_grid} and {max_shrink}")
    return [1.0 - i / n_grid for i in range(int(max_shrink * n_grid))]


def clip_errors(x: Tensor, w: Tensor, ratio: float, symmetric: bool = True) -> Tensor:
    """(rows, groups): per output row and group, the mean over tokens of the squared error of that
    group's part of the output, x_g . (Q(clip(w_g)) - w_g), with w_g clipped to +-ratio max|w_g|."""
    (R, C), G = w.shape, group_size(w.shape[1])
    g = w.float().reshape(R, C // G, G)
    m = g.abs().amax(-1, keepdim=True) * ratio
    err = rtn(torch.clamp(g, -m, m).reshape(R, C), symmetric).reshape(R, C // G, G) - g
    return torch.einsum("tgk,rgk->rgt", x.float().reshape(-1, C // G, G), err).pow(2).mean(-1)


@dataclass
class Clip:
    """One linear's clipping: the chosen ratio and its clip value max|w| x ratio per (row, group), the
    objective there and without clipping."""

    ratio: Tensor
    max_val: Tensor
    error: Tensor
    unclipped_error: Tensor


@torch.no_grad()
def search_clip(x: Tensor, w: Tensor, symmetric: bool = True, ratios: list[float] | None = None) -> Clip:
    """Per (row, group), the ratio of `ratios` (default `clip_ratios()`) minimising `clip_errors`.
    As in llm-awq, the error of each group's part of the output is minimised on its own (the cross
    terms between a row's groups are left out); ratio 1 is tried first and kept on ties, so no group's
    error is ever above its unclipped one."""
    ratios = clip_ratios() if ratios is None else ratios
    if not ratios or ratios[0] != 1.0 or not all(0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"ratios must start with 1.0 (no clipping) and lie in (0, 1], got {ratios}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x (tokens, in) and w (out, in) must share `in`, got {tuple(x.shape)}, {tuple(w.shape)}")
    unclipped = best = clip_errors(x, w, 1.0, symmetric)
    ratio = torch.ones_like(best)
    for r in ratios[1:]:
        err = clip_errors(x, w, r, symmetric)
        better = err < best
        best, ratio = torch.where(better, err, best), torch.where(better, torch.full_like(ratio, r), ratio)
    absmax = w.float().reshape(*ratio.shape, -1).abs().amax(-1)
    return Clip(ratio, absmax * ratio, best, unclipped)


@torch.no_grad()
def clip_(linear: nn.Linear, max_val: Tensor) -> None:
    """Clamp each (row, group) of the weight to +-max_val (rows, groups), in place (llm-awq apply_clip)."""
    w = linear.weight
    g = w.data.reshape(*max_val.shape, -1)
    w.data.copy_(torch.clamp(g, -max_val[..., None].to(g), max_val[..., None].to(g)).reshape(w.shape))


@torch.no_grad()
def clip_llama_(model: nn.Module, batches, symmetric: bool = True, max_tokens: int = 0) -> list[dict]:
    """Clip every block Linear but wq and wk of `model` (in place; the float function changes) by
    `search_clip` on its inputs over `batches`; one report row per linear."""
    names = [n for n in sq.block_linears(model) if n.rsplit(".", 1)[-1] not in NO_CLIP]
    xs = layer_inputs(model, batches, names, max_tokens)
    mods = dict(model.named_modules())
    rows = []
    for n in names:
        found = search_clip(xs[n], mods[n].weight, symmetric)
        clip_(mods[n], found.max_val)
        before = found.unclipped_error.sum().item()
        rows.append({"linear": n.rsplit(".", 1)[-1], "layer": n.split(".")[1],
                     "clipped groups": f"{(found.ratio < 1).sum().item()}/{found.ratio.numel()}",
                     "mean ratio": found.ratio.mean().item(),
                     "clip / no clip": found.error.sum().item() / before if before > 0 else 1.0})
    return rows


# ----------------------------------------------------------------------------- the Llama

@torch.no_grad()
def quantize_w4(model: nn.Module, symmetric: bool = True) -> nn.Module:
    """A copy with every block Linear an int4 `dlo.quant.QuantLinear` (RTN, `group_size`)."""
    model = copy.deepcopy(model).eval()
    names = set(sq.block_linears(model))
    sq.replace_linears(model, lambda n, lin: quant.QuantLinear(lin, BITS, "group", group_size(lin.in_features),
                                                               symmetric=symmetric) if n in names else None)
    return model


@torch.no_grad()
def awq_llama(model: nn.Module, batches, n_grid: int = N_GRID, max_tokens: int = 0, symmetric: bool = True,
              clip: bool = False) -> tuple[nn.Module, dict[str, list[dict]]]:
    """(a scaled float copy, {"scales": one row per group, "clip": one row per clipped linear}). Every
    group of `sq.llama_groups` is searched on the float model's inputs (the folds keep the function, so
    one calibration pass serves all groups, as in the authors' code), then folded; with `clip`, the
    scaled copy is then clipped (`clip_llama_`). `quantize_w4(copy, symmetric)` is the W4 AWQ model."""
    model = copy.deepcopy(model).eval()
    groups = sq.llama_groups(model)
    xs = layer_inputs(model, batches, [cs[0] for _, cs in groups], max_tokens)
    mods = dict(model.named_modules())
    report = []
    for producer, consumers in groups:
        lins = [mods[c] for c in consumers]
        found = search_alpha(xs[consumers[0]], lins, n_grid, symmetric)
        sq.fold_(mods[producer], lins, found.s)
        report.append({"group": "/".join(c.rsplit(".", 1)[-1] for c in consumers), "layer": consumers[0].split(".")[1],
                       "alpha": found.alpha, "RTN error": found.rtn_error, "AWQ error": found.errors[found.alpha],
                       "AWQ / RTN": found.errors[found.alpha] / found.rtn_error if found.rtn_error > 0 else 1.0})
    return model, {"scales": report, "clip": clip_llama_(model, batches, symmetric, max_tokens) if clip else []}
