"""Optimizers of Day 1: functional reference steps, LAMB, clipping, accumulation and the fused AdamW."""

from dlo.optim.fused_adamw import FusedAdamW
from dlo.optim.lamb import LAMB
from dlo.optim.reference import adamw_step, lamb_step, sgd_momentum_step
from dlo.optim.utils import accumulate_gradients, clip_grad_norm, grad_norm

__all__ = ["FusedAdamW", "LAMB", "accumulate_gradients", "adamw_step", "clip_grad_norm", "grad_norm",
           "lamb_step", "sgd_momentum_step"]
