"""Pruning: magnitude masks (global or per layer), the gradual schedule, structured channel pruning,
2:4 masks and the lottery-ticket rewind.

Magnitude pruning (Han et al. 2015; Gale et al. 2019) zeroes the weights with the smallest |w|.
Global scope ranks all prunable weights together (layers end up with different sparsities);
layer-wise scope prunes every layer to the same fraction. Zhu & Gupta (2017, Eq. 1) raise the
sparsity gradually while training: s_t = s_f + (s_i - s_f) (1 - (t - t_0) / (n dt))^3.
Unstructured zeros only save time with sparse kernels; removing whole neurons (structured) gives a
smaller dense layer; 2:4 (two zeros in every 4) is the pattern sparse tensor cores accelerate.
Lottery tickets (Frankle & Carbin 2019): train, prune, rewind survivors to their initial values, retrain.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def prunable(model: nn.Module) -> dict[str, Tensor]:
    """name -> weight of every Linear / Conv layer (biases and norms are not pruned)."""
    return {f"{name}.weight": m.weight for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))}


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity is the fraction of zeros, in [0, 1]; got {sparsity}")


def _smallest_mask(scores: Tensor, n_prune: int) -> Tensor:
    """Bool keep-mask removing exactly the n_prune smallest scores (ties: lower flat index pruned first)."""
    keep = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if n_prune > 0:
        order = torch.sort(scores.flatten(), stable=True).indices
        keep[order[:n_prune]] = False
    return keep.reshape(scores.shape)


def magnitude_masks(weights: dict[str, Tensor], sparsity: float, scope: str = "global") -> dict[str, Tensor]:
    """Keep-masks (bool, like each weight) zeroing round(sparsity * n) of the smallest |w|,
    counted over all weights together (scope="global") or in each weight (scope="layer")."""
    _check_sparsity(sparsity)
    if scope == "layer":
        return {k: _smallest_mask(w.detach().abs(), round(sparsity * w.numel())) for k, w in weights.items()}
    if scope != "global":
        raise ValueError(f"scope must be 'global' or 'layer', got {scope!r}")
    flat = torch.cat([w.detach().abs().flatten().float() for w in weights.values()])
    keep = _smallest_mask(flat, round(sparsity * flat.numel()))
    masks, start = {}, 0
    for k, w in weights.items():
        masks[k] = keep[start:start + w.numel()].reshape(w.shape)
        start += w.numel()
    return masks


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: dict[str, Tensor]) -> None:
    """Zero the pruned weights in place."""
    params = dict(model.named_parameters())
    for k, m in masks.items():
        params[k].mul_(m.to(params[k].dtype))


def keep_masked(model: nn.Module, optimizer: torch.optim.Optimizer, masks: dict[str, Tensor]):
    """Re-apply `masks` after every optimizer step, so fine-tuning cannot regrow pruned weights.
    Returns the hook handle (call .remove() to stop)."""
    return optimizer.register_step_post_hook(lambda *_: apply_masks_(model, masks))


def sparsity_of(weights: dict[str, Tensor]) -> float:
    total = sum(w.numel() for w in weights.values())
    zeros = sum(int((w == 0).sum()) for w in weights.values())
    return zeros / max(total, 1)


def gradual_sparsity(step: int, final_sparsity: float, begin_step: int, end_step: int,
                     initial_sparsity: float = 0.0) -> float:
    """Zhu & Gupta's cubic schedule: s_i before begin_step, s_f after end_step, fast early, slow late."""
    _check_sparsity(final_sparsity)
    _check_sparsity(initial_sparsity)
    if end_step <= begin_step:
        raise ValueError(f"end_step ({end_step}) must be after begin_step ({begin_step})")
    t = min(max(step, begin_step), end_step)
    frac = (t - begin_step) / (end_step - begin_step)
    return final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - frac) ** 3


@torch.no_grad()
def prune_linear_pair(fc1: nn.Linear, fc2: nn.Linear, n_keep: int) -> tuple[nn.Linear, nn.Linear]:
    """Structured pruning of the hidden units between fc1 and fc2: keep the n_keep units whose fc1
    rows have the largest L2 norm (ties: lower index) and return two smaller dense layers that
    compute the same function restricted to those units (rows of fc1, columns of fc2)."""
    if fc1.out_features != fc2.in_features:
        raise ValueError(f"fc1 has {fc1.out_features} outputs but fc2 has {fc2.in_features} inputs")
    if not 1 <= n_keep <= fc1.out_features:
        raise ValueError(f"n_keep must be in 1..{fc1.out_features}, got {n_keep}")
    norms = fc1.weight.float().norm(dim=1)  # (hidden,)
    keep = torch.sort(torch.sort(-norms, stable=True).indices[:n_keep]).values  # kept units, in order
    new1 = nn.Linear(fc1.in_features, n_keep, bias=fc1.bias is not None).to(fc1.weight)
    new2 = nn.Linear(n_keep, fc2.out_features, bias=fc2.bias is not None).to(fc2.weight)
    new1.weight.copy_(fc1.weight[keep])
    if fc1.bias is not None:
        new1.bias.copy_(fc1.bias[keep])
    new2.weight.copy_(fc2.weight[:, keep])
    if fc2.bias is not None:
        new2.bias.copy_(fc2.bias)
    return new1, new2


def prune_mlp_channels(mlp: nn.Module, keep_fraction: float) -> nn.Module:
    """A dlo.models.MLP (or any Sequential-of-Linear model) with every hidden layer shrunk to
    round(keep_fraction * width) units, in place on the module, returned for chaining."""
    linears = [(parent, name, m) for parent in mlp.modules() for name, m in parent.named_children()
               if isinstance(m, nn.Linear)]
    for (p1, n1, _), (p2, n2, _) in zip(linears[:-1], linears[1:]):
        fc1, fc2 = getattr(p1, n1), getattr(p2, n2)
        new1, new2 = prune_linear_pair(fc1, fc2, max(1, round(keep_fraction * fc1.out_features)))
        setattr(p1, n1, new1)
        setattr(p2, n2, new2)
    return mlp


def mask_2to4(w: Tensor) -> Tensor:
    """Bool mask keeping the 2 largest |w| of every 4 consecutive values along the last dim."""
    if w.shape[-1] % 4:
        raise ValueError(f"the last dimension ({w.shape[-1]}) must be a multiple of 4 for 2:4 sparsity")
    g = w.detach().abs().float().reshape(-1, 4)
    top = torch.sort(g, dim=1, descending=True, stable=True).indices[:, :2]
    return torch.zeros_like(g, dtype=torch.bool).scatter_(1, top, True).reshape(w.shape)


def is_2to4(mask: Tensor) -> bool:
    """True when every group of 4 along the last dim keeps at most 2 values (the hardware rule)."""
    if mask.shape[-1] % 4:
        return False
    return bool(((mask != 0).reshape(-1, 4).sum(1) <= 2).all())


@torch.no_grad()
def rewind_(model: nn.Module, init_state: dict[str, Tensor], masks: dict[str, Tensor]) -> None:
    """Lottery-ticket rewind: reset every weight to its initial value, then re-apply the masks."""
    model.load_state_dict(init_state)
    apply_masks_(model, masks)
