"""Counting before measuring: the parameters a token's matmuls use, and the bytes of training state.

Two numbers every plan of Days 5-7 starts from (with `dlo.measure.transformer_flops_per_token` and
`dlo.measure.mfu`):

- `matmul_params(model)`: the N of "6N FLOPs per token" (Kaplan et al. 2020, Sec. 2.1): every weight
  matrix a token is multiplied by, the output head included; embedding tables that are only looked
  up are left out, a table tied to the head counts once (as the head); vectors (biases, norms) are
  left out, their FLOPs are a rounding error and FlopCounterMode does not count them either.
- `training_bytes_per_param(precision, optimizer)`: weights + gradients + fp32 master copy +
  optimizer state, per parameter. Mixed-precision Adam costs 2 + 2 + 4 + 4 + 4 = 16 bytes (ZeRO,
  Rajbhandari et al. 2020, Sec. 3.1), the same as fp32 Adam's 4 + 4 + 8: mixed precision saves
  activations and time, not model-state memory ("16 bytes per parameter", Lippe 2024).
"""

from __future__ import annotations

from torch import nn

PRECISIONS = {
    # precision -> (bytes per weight, per gradient, per fp32 master weight, per optimizer state value)
    "fp32": (4, 4, 0, 4),    # everything fp32 (also torch.autocast: the fp32 parameters are the master)
    "mixed": (2, 2, 4, 4),   # bf16/fp16 weights and gradients, fp32 master weights and optimizer state
    "bf16": (2, 2, 0, 2),    # pure bf16: no master copy, bf16 optimizer state (cheaper, less accurate)
}
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # state values kept per parameter


def matmul_params(model: nn.Module) -> int:
    """Parameters a token's matmuls multiply through: the weights with >= 2 dimensions, except
    embedding tables that are only looked up; a table tied to a Linear (the LM head) counts once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() for p in model.parameters()  # parameters(): a shared tensor appears once
               if p.dim() >= 2 and (id(p) not in embeddings or id(p) in linears))


def training_bytes_per_param(precision: str, optimizer: str) -> int:
    """Bytes of model state per parameter while training: weights, gradients, master weights (mixed
    precision only) and the optimizer's state (`OPTIMIZER_STATES` values, at the state's width)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZER_STATES)}")
    weight, grad, master, state = PRECISIONS[precision]
    return weight + grad + master + OPTIMIZER_STATES[optimizer] * state
