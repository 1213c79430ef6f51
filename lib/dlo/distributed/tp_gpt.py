"""Korthikanti et al. 2022's GPT layer split by hand over a tensor-parallel group: the model of
Day 7's communication and activation tables (`dlo.experiments.day7.gpt_stack`).

`TensorParallelGPTBlock` takes `dlo.models.transformer.Block`'s weights and splits them with the
Megatron layers of `dlo.distributed.tensor_parallel` (a module of its own because it is the
seminar's layer - LayerNorm, 4h GELU MLP, dropout, attention written out - not the Llama those
layers split). `MODES`: "none" (one rank), "tp", "tp+sp", "tp+sp (megatron)".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from dlo.distributed.tp_comms import gather_from_sp, tp_size
from dlo.models.transformer import Block

MODES = ("none", "tp", "tp+sp", "tp+sp (megatron)")


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout that keeps a 1-byte mask for backward, as CUDA's kernel does (torch's CPU kernel keeps
    it in the activation's dtype): the memory Korthikanti et al. count on every device."""
    if not training or p == 0:
        return x
    keep = torch.rand(x.shape, device=x.device) >= p  # bool: the only tensor saved
    return x * keep / (1 - p)


def _attention(q: Tensor, k: Tensor, v: Tensor, p: float, training: bool) -> Tensor:
    """Causal softmax(q k^T / sqrt(d)) v with dropout on the probabilities; (B, H, T, D)."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), p, training) @ v


class TensorParallelGPTBlock(nn.Module):
    """Korthikanti et al. 2022's GPT layer (`dlo.models.transformer.Block`'s weights, dropout after
    the attention projection and after the MLP as in their count) split over `group`: the fused
    [q|k|v] projection and fc1 column-parallel, the attention output projection and fc2
    row-parallel, a/t heads per rank. On a group of one rank it is the plain layer.

    mode "tp": replicated norms and residuals (f and g around each half);
    "tp+sp": norms, dropout and residuals on 1/t of the sequence, an all-gather of the normed shard
    before the column layers (which then save the gathered input, as DTensor's plan does) and a
    reduce-scatter after the row layers; "tp+sp (megatron)": the column layers save only the shard
    and all-gather it again in backward (Korthikanti et al. 2022, Sec. 4.2.2)."""

    def __init__(self, block: Block, group=None, mode: str = "tp"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        t = tp_size(group)
        if block.attn.n_heads % t:
            raise ValueError(f"tensor-parallel degree {t} does not divide n_heads={block.attn.n_heads}")
        self.group, self.sp, self.regather = group, mode.startswith("tp+sp"), mode == "tp+sp (megatron)"
        col = dict(sequence_parallel=self.sp, comm_input=not self.sp or self.regather)
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.qkv = ColumnParallelLinear(block.attn.qkv, group, parts=3, **col)
        self.proj = RowParallelLinear(block.attn.proj, group, sequence_parallel=self.sp)
        self.fc1 = ColumnParallelLinear(block.mlp[0], group, **col)
        self.fc2 = RowParallelLinear(block.mlp[2], group, sequence_parallel=self.sp)
        self.heads, self.p = block.attn.n_heads // t, block.attn.dropout

    def _enter(self, x: Tensor) -> Tensor:
        return gather_from_sp(x, 1, self.group) if self.sp and not self.regather else x

    def forward(self, x: Tensor) -> Tensor:
        h = self.qkv(self._enter(self.ln1(x)))  # (B, T, 3C/t)
        B, T, _ = h.shape
        q, k, v = (z.view(B, T, self.heads, -1).transpose(1, 2) for z in h.chunk(3, -1))  # (B, a/t, T, d)
        y = _attention(q, k, v, self.p, self.training).transpose(1, 2).reshape(B, T, -1)  # (B, T, C/t)
        x = x + dropout(self.proj(y), self.p, self.training)  # (B, T, C) or (B, T/t, C)
        return x + dropout(self.fc2(F.gelu(self.fc1(self._enter(self.ln2(x))))), self.p, self.training)


__all__ = ["MODES", "TensorParallelGPTBlock", "dropout"]
