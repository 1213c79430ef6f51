"""Transfer learning and fine-tuning: freezing, a new head on frozen features, discriminative learning rates.

Three ways to reuse a pretrained network on a second task: train only a new head on its frozen features
(cheap, little data needed), fine-tune everything at a small learning rate ("there is *fine* in fine-tuning":
the weights should move little), or train from scratch (the control). Discriminative learning rates give each
layer group its own rate, smaller towards the input whose features are the most general (Howard & Ruder 2018,
"Universal Language Model Fine-tuning", 3.2: each group below the top gets the rate of the one above / 2.6).

A frozen part must really not change: `requires_grad=False` keeps the optimizer off its weights, but its
BatchNorm layers still update their running statistics in train mode, so `freeze` also puts them in eval mode
and `train_frozen` keeps them there after `model.train()`.
"""

from __future__ import annotations

import torch
from torch import nn

from dlo.errors import BadInput

NORMS = (nn.modules.batchnorm._BatchNorm,)   # torch's common base of BatchNorm1d/2d/3d and SyncBatchNorm


def freeze(module: nn.Module) -> int:
    """No gradient for `module`'s parameters and its BatchNorm statistics fixed; how many parameters froze."""
    count = 0
    for p in module.parameters():
        p.requires_grad_(False)
        count += p.numel()
    module._dlo_frozen = True   # train_frozen finds the frozen parts by this mark
    _norms_eval(module)
    return count


def unfreeze(module: nn.Module) -> int:
    """The reverse of `freeze` (gradual unfreezing: the top group first); how many parameters thawed."""
    count = 0
    for p in module.parameters():
        p.requires_grad_(True)
        count += p.numel()
    module._dlo_frozen = False
    module.train(module.training)   # its BatchNorm layers follow the module's mode again
    return count


def _norms_eval(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, NORMS):
            m.eval()


def train_frozen(model: nn.Module) -> nn.Module:
    """`model.train()`, then the frozen parts' BatchNorm layers back in eval mode."""
    model.train()
    for m in model.modules():
        if getattr(m, "_dlo_frozen", False):
            _norms_eval(m)
    return model


def trainable(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def new_head(model: nn.Module, attr: str, num_classes: int, freeze_rest: bool = True) -> nn.Linear:
    """Replace the last Linear of `model.<attr>` (a Linear, or a Sequential ending in one) by a fresh one with
    `num_classes` outputs; everything else frozen unless freeze_rest=False (then: fine-tuning)."""
    head = getattr(model, attr, None)
    last = head[-1] if isinstance(head, nn.Sequential) and len(head) else head
    if not isinstance(last, nn.Linear):
        raise BadInput(f"new_head: model.{attr} is {type(head).__name__}, not a Linear or a Sequential ending in one")
    fresh = nn.Linear(last.in_features, num_classes, bias=last.bias is not None).to(last.weight.device)
    if freeze_rest:
        freeze(model)
    if isinstance(head, nn.Sequential):
        head[-1] = fresh
    else:
        setattr(model, attr, fresh)
    return fresh


def discriminative_groups(groups: list[nn.Module], lr: float, factor: float = 2.6) -> list[dict]:
    """Optimizer parameter groups for `groups` ordered from input to output: the last gets `lr`, each one below
    it the rate above divided by `factor`. Frozen parameters are left out; a parameter in two groups is refused."""
    if not groups or lr <= 0 or factor < 1:
        raise BadInput(f"discriminative_groups needs groups, lr > 0 and factor >= 1; got {len(groups)} groups, "
                       f"lr={lr}, factor={factor}")
    seen: set[int] = set()
    out = []
    for depth, module in enumerate(reversed(groups)):
        params = [p for p in module.parameters() if p.requires_grad]
        if any(id(p) in seen for p in params):
            raise BadInput(f"discriminative_groups: group {len(groups) - 1 - depth} shares parameters with a "
                           f"later group; give disjoint modules")
        seen.update(id(p) for p in params)
        if params:
            out.append({"params": params, "lr": lr / factor ** depth})
    return out[::-1]


def untouched(before: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    """The state entries (weights and buffers) of `model` equal to `before` bit for bit: to check a freeze."""
    now = model.state_dict()
    return [k for k, v in before.items() if torch.equal(v, now[k])]
