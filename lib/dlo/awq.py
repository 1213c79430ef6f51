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

The weights stay symmetric int4 codes with one scale per group (`dlo.quant`), so the W4A16 kernel
(`dlo.kernels.weight_only_matmul`, bits=4 after `pack_int4`) runs them unchanged: that is AWQ's point,
no new kernel. Not done here: the paper's asymmetric int4 with zero points (the kernel takes scales
only) and its second search, the weight clipping range (Sec. 3.2, last paragraph).
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


def group_size(in_features: int, group: int = GROUP) -> int:
    """The largest divisor of `in_features` not above `group`: 128 at LLM widths, the whole row of the
    tiny Llama's 64 inputs, 88 for its 176-wide w2 (a group must divide the row)."""
    if in_features < 1 or group < 1:
        raise ValueError(f"in_features and group must be >= 1, got {in_features} and {group}")
    return max(g for g in range(1, min(group, in_features) + 1) if in_features % g == 0)


def rtn(w: Tensor) -> Tensor:
    """W4 round-to-nearest with one symmetric scale per group: what the deployed layer holds, in float."""
    return quant.fake_quantize_tensor(w, BITS, "group", group_size(w.shape[1]))


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


def quantized_error(x: Tensor, linears: list[nn.Linear], s: Tensor) -> float:
    """L(s) = ||Q(W diag(s)) (diag(s)^-1 x) - W x||^2 per output value (Eq. 4), over all the linears
    reading x (wq, wk, wv share one input and one s: one fold serves them all)."""
    err, n = 0.0, 0
    for lin in linears:
        w = lin.weight.detach().float()
        y, y_hat = x @ w.T, (x / s) @ rtn(w * s).T
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
def search_alpha(x: Tensor, linears: list[nn.Linear], n_grid: int = N_GRID) -> Search:
    """alpha* = argmin L(s_X^alpha) over n_grid points of [0, 1] (Eq. 5). alpha = 0 is in the grid and
    wins ties, so the result never has a larger calibration error than RTN."""
    if n_grid < 2:
        raise ValueError(f"n_grid must be >= 2 (0 and 1 at least), got {n_grid}")
    grid = [i / (n_grid - 1) for i in range(n_grid)]
    errors = {a: quantized_error(x, linears, awq_scales(x, a)) for a in grid}
    best = min(grid, key=lambda a: (errors[a], a))
    return Search(best, awq_scales(x, best), errors)


# ----------------------------------------------------------------------------- the Llama

@torch.no_grad()
def quantize_w4(model: nn.Module) -> nn.Module:
    """A copy with every block Linear an int4 `dlo.quant.QuantLinear` (RTN, symmetric, `group_size`)."""
    model = copy.deepcopy(model).eval()
    names = set(sq.block_linears(model))
    sq.replace_linears(model, lambda n, lin: quant.QuantLinear(lin, BITS, "group", group_size(lin.in_features))
                       if n in names else None)
    return model


@torch.no_grad()
def awq_llama(model: nn.Module, batches, n_grid: int = N_GRID, max_tokens: int = 0) -> tuple[nn.Module, list[dict]]:
    """(a scaled float copy, one report row per group). Every group of `sq.llama_groups` is searched on
    the float model's inputs (the folds keep the function, so one calibration pass serves all groups,
    as in the authors' code), then folded. `quantize_w4` of the copy is the W4 AWQ model."""
    model = copy.deepcopy(model).eval()
    groups = sq.llama_groups(model)
    xs = layer_inputs(model, batches, [cs[0] for _, cs in groups], max_tokens)
    mods = dict(model.named_modules())
    report = []
    for producer, consumers in groups:
        lins = [mods[c] for c in consumers]
        found = search_alpha(xs[consumers[0]], lins, n_grid)
        sq.fold_(mods[producer], lins, found.s)
        report.append({"group": "/".join(c.rsplit(".", 1)[-1] for c in consumers), "layer": consumers[0].split(".")[1],
                       "alpha": found.alpha, "RTN error": found.rtn_error, "AWQ error": found.errors[found.alpha],
                       "AWQ / RTN": found.errors[found.alpha] / found.rtn_error if found.rtn_error > 0 else 1.0})
    return model, report
