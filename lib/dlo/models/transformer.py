"""A small pre-LayerNorm transformer (GPT-style) for activation-memory measurements.

Attention is written out (scores, softmax, dropout, weighted sum) instead of calling
F.scaled_dot_product_attention, so that its (B, H, T, T) activations really exist and are saved for
backward: those are what activation checkpointing trades for compute (Vaswani et al. 2017, Eq. 1).

`TransformerStack.forward` takes a per-block policy: `checkpoint_blocks` is a set of block indices to
recompute in backward, `checkpoint_attention` recomputes only the attention core (selective
checkpointing, Korthikanti et al. 2022), `checkpoint_segments` cuts the stack into that many runs of
blocks and checkpoints each run whole (Chen et al. 2016), and `checkpoint_fn(fn, *tensors)` is the
checkpoint implementation used (default `dlo.activation_ckpt.checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attention_core(q: Tensor, k: Tensor, v: Tensor, dropout: float, training: bool) -> Tensor:
    """Causal softmax(q k^T / sqrt(d)) v with dropout on the probabilities; q, k, v: (B, H, T, D)."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    probs = F.dropout(probs, dropout, training)
    return probs @ v  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, checkpoint_fn: Callable | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if checkpoint_fn is None:
            y = attention_core(q, k, v, self.dropout, self.training)
        else:  # selective: only the O(T^2) part is recomputed, the projections stay saved
            y = checkpoint_fn(lambda q_, k_, v_: attention_core(q_, k_, v_, self.dropout, self.training), q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)) with a 4x GELU MLP and residual dropout."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor, checkpoint_fn: Callable | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), checkpoint_fn)  # (B, T, C)
        return x + self.mlp(self.ln2(x))


def _run_blocks(blocks, x: Tensor) -> Tensor:
    for block in blocks:
        x = block(x)
    return x


class TransformerStack(nn.Module):
    """Token + position embeddings, `n_layers` blocks, final LayerNorm and a linear LM head."""

    def __init__(self, vocab_size: int = 256, d_model: int = 64, n_heads: int = 4, n_layers: int = 8,
                 max_len: int = 128, dropout: float = 0.1):
        super().__init__()
        if min(vocab_size, d_model, n_heads, n_layers, max_len) < 1:
            raise ValueError("vocab_size, d_model, n_heads, n_layers and max_len must all be >= 1")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: Tensor, checkpoint_blocks: Iterable[int] = (), checkpoint_fn: Callable | None = None,
                checkpoint_attention: bool = False, checkpoint_segments: int = 0) -> Tensor:
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"TransformerStack expects token ids (B, T) of dtype long, got {tuple(idx.shape)} "
                             f"{idx.dtype}")
        B, T = idx.shape
        if T > self.max_len:
            raise ValueError(f"sequence length {T} > max_len {self.max_len}")
        ckpt = set(checkpoint_blocks)
        if sum((bool(ckpt), checkpoint_attention, checkpoint_segments > 0)) > 1:
            raise ValueError("choose one policy: checkpoint_blocks, checkpoint_attention or checkpoint_segments")
        if (ckpt or checkpoint_attention or checkpoint_segments) and checkpoint_fn is None:
            from dlo.activation_ckpt import checkpoint as checkpoint_fn
        bad = sorted(i for i in ckpt if not 0 <= i < len(self.blocks))
        if bad:
            raise ValueError(f"checkpoint_blocks {bad} out of range for {len(self.blocks)} blocks")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))  # (B, T, C)
        if checkpoint_segments > 0:  # Chen et al. 2016: keep only the inputs of each run of blocks
            for seg in torch.arange(len(self.blocks)).tensor_split(checkpoint_segments):
                run = [self.blocks[i] for i in seg.tolist()]
                if run:
                    x = checkpoint_fn(lambda h, run=run: _run_blocks(run, h), x)
            return self.head(self.ln_f(x))
        for i, block in enumerate(self.blocks):
            if i in ckpt:
                x = checkpoint_fn(block, x)
            else:
                x = block(x, checkpoint_fn if checkpoint_attention else None)
        return self.head(self.ln_f(x))  # (B, T, vocab)
