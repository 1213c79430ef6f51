"""The model Day 2's accounting check hands to the student's `matmul_params` (`_GPT`, built from a case's
configuration by `_gpt`) and the worker that does so, where the student's code runs (`_matmul_params_worker`).

Kept apart from `dlo.checks.day2_accounting`, which counts the expected answers: the student's code receives a
`_GPT`, and its methods' `__globals__` (and the worker's frame, `f_globals`) are this module, which holds none
(a red team called the check's own FLOP counter and byte measurement through `type(model).forward.__globals__`).
The answers' helpers are also in the check's forbid list, blocked wherever the student's code finds them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _GPT(nn.Module):
    """The check's own decoder (trusted): token (+ position) embeddings, pre-norm blocks whose
    attention is written as matmuls (FlopCounterMode counts them) with a raw (3d, d) projection
    parameter as nn.MultiheadAttention's in_proj_weight, a head tied to the token table or not.
    `raw`: the position table a raw 2-D parameter whose rows are indexed, and a Linear the forward
    never calls; the rule counts both, a measurement of FLOPs neither (`_unmeasured`)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, tied: bool, bias: bool, pos: int,
                 raw: bool = False):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(pos, d) if pos and not raw else None
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "out": nn.Linear(d, d, bias=bias),
            "ln2": nn.LayerNorm(d), "up": nn.Linear(d, ffn * d, bias=bias), "down": nn.Linear(ffn * d, d, bias=bias),
        }) for _ in range(layers))
        self.qkv = nn.ParameterList(nn.Parameter(torch.randn(3 * d, d) / math.sqrt(d)) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        if raw:
            self.pos_table = nn.Parameter(torch.randn(pos, d) / 10)  # indexed, never multiplied
            self.probe = nn.Linear(d, 3)  # a head this forward never calls

    def forward(self, idx):  # (B, T) -> (B, T, vocab)
        b, t = idx.shape
        h = self.tok(idx) + (self.pos(torch.arange(t)) if self.pos is not None else 0)  # (B, T, C)
        if hasattr(self, "pos_table"):
            h = h + self.pos_table[:t]
        for blk, w_qkv in zip(self.blocks, self.qkv):
            qkv = F.linear(blk["ln1"](h), w_qkv)  # (B, T, 3C)
            q, k, v = qkv.view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, C / H)
            att = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, T, T)
            h = h + blk["out"]((att @ v).transpose(1, 2).reshape(b, t, -1))
            h = h + blk["down"](F.gelu(blk["up"](blk["ln2"](h))))
        return self.head(self.norm(h))


def _gpt(cfg: dict) -> _GPT:
    torch.manual_seed(cfg["seed"])
    return _GPT(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["ffn"], cfg["tied"], cfg["bias"], cfg["pos"],
                cfg.get("raw", False))


def _matmul_params_worker(fn, cfg: dict):
    """Call the student's matmul_params on the check's model built from cfg; return what it gave."""
    got = fn(_gpt(cfg))
    return got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
