"""Llama 3.2 in one file: RMSNorm, RoPE with llama3 frequency scaling, grouped-query attention, SwiGLU.

The architecture of Touvron et al. 2023 ("LLaMA", arXiv:2302.13971) as released in Llama 3.2, with
torchtitan's parameter names (`tok_embeddings`, `layers.{i}.attention.wq`, `feed_forward.w1`, ...)
so that its FSDP/TP plans read the same here. RoPE uses the Hugging Face "rotate_half" layout (the
two halves of a head are the real and imaginary parts), so HF checkpoints load without permuting q/k.

    cfg = LlamaConfig.from_name("llama3.2-3b")
    with torch.device("meta"):
        model = Llama(cfg)                        # nothing allocated: shard it first
    model.to_empty(device="cpu"); model.init_weights(seed=0)
    logits = model(tokens)                        # (B, T) int64 -> (B, T, vocab)

The HF loader (`config_from_hf`, `load_hf_weights`, `CheckpointError`) is `dlo.models.llama_hf`, which imports
this module (not the other way round: no cycle).
Tied embedding under sharding: keep `tok_embeddings` and `output` in one FSDP unit (e.g. the root), else
`fully_shard` unties them; after `parallelize_module` of both, call `tie_weights()` (or `to_empty`).
"""

from __future__ import annotations

import math
import re
import sys
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.models import count_parameters  # one definition; re-exported here

_LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 3072
    n_layers: int = 28
    n_heads: int = 24
    n_kv_heads: int = 8             # < n_heads: grouped-query attention (Ainslie et al. 2023)
    ffn_dim: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (rope_type "llama3"), None for plain RoPE
    max_seq_len: int = 131072
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"rope_scaling {self.rope_scaling!r}: only rope_type 'llama3' is supported")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> LlamaConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; known: {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, LlamaConfig] = {
    "llama3.2-3b": LlamaConfig(rope_scaling=dict(_LLAMA3_ROPE)),
    "llama3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, rope_scaling=dict(_LLAMA3_ROPE)),
    # Llama 3.1 (Dubey et al. 2024, Table 3; Hugging Face configs): untied head, RoPE factor 8
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, tie_embeddings=False,
                               rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    "llama3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, tie_embeddings=False,
                                rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    # CPU-sized, same architecture; an original context of 64 puts the scaled RoPE bands at short T
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                        max_seq_len=256, rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64}),
}


# ---------------------------------------------------------------- RoPE (RoFormer, Su et al. 2021)
def llama3_scale_frequencies(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                             original_max_position_embeddings: int, **_) -> Tensor:
    """Llama 3.1's long-context RoPE (`apply_scaling` in Meta's reference implementation).

    Frequencies whose wavelength is short next to the original context (< L/high) are kept; those
    longer than the context (> L/low) are divided by `factor`; in between, a linear blend in L/wavelen.
    """
    L = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > L / low_freq_factor, inv_freq / factor, blended)  # low band: slowed down
    return torch.where(wavelen < L / high_freq_factor, inv_freq, out)  # high band: unchanged


def rope_frequencies(cfg: LlamaConfig, device=None) -> Tensor:
    """theta_i = base^(-2i/d), i < d/2 (Su et al. 2021, Eq. 15), llama3-scaled; float32 (head_dim/2,)."""
    inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float64) / cfg.head_dim)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scale_frequencies(inv_freq, **cfg.rope_scaling)
    return inv_freq.float()


def rope_cos_sin(inv_freq: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles t * theta_i for positions t < T, each half repeated: 2 x (T, D)."""
    angles = torch.outer(torch.arange(T, device=inv_freq.device, dtype=torch.float32), inv_freq.float())  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D): the same angle for dims i and i + D/2
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x_i, x_{i+D/2}) by t * theta_i: (x1 + i x2) e^{i t theta}; x: (B, H, T, D)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


# ---------------------------------------------------------------- the blocks
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, no mean subtraction, no bias (Zhang & Sennrich 2019, Eq. 4)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32 (Meta, HF); float64 stays
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def grouped_query_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention where each of Hkv key/value heads serves H/Hkv query heads (Ainslie et al. 2023).

    q: (B, H, T, D), k and v: (B, Hkv, T, D); query head h reads KV head h // (H/Hkv), as HF's repeat_kv.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        # head counts from the shapes (-1), not the config: under tensor parallelism a rank holds a slice
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = grouped_query_attention(q, k, v)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(.)) (Touvron et al. 2023, §2.2)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------- the model
class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # a dict keyed "0".."n-1" (torchtitan): a pipeline stage deletes blocks and the names stay the same
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # the RoPE frequencies: recomputed (not loaded, not saved) by init_weights and the HF loader
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def tie_weights(self) -> None:
        """Make `output.weight` the very Parameter of `tok_embeddings.weight` (Press & Wolf 2017).

        Needed again after anything that replaces parameters per module: `to_empty` (done by the
        override below), `load_state_dict(assign=True)`, `parallelize_module` of the two modules.
        """
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device, recurse: bool = True) -> Llama:
        super().to_empty(device=device, recurse=recurse)  # gives each module its own new Parameter...
        self.tie_weights()  # ...so the shared one is shared again
        return self

    @torch.no_grad()
    def init_rope(self) -> None:
        """Recompute the RoPE frequencies in place (after `to_empty` the buffer holds garbage)."""
        self.inv_freq.copy_(rope_frequencies(self.config, device=self.inv_freq.device))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place (DTensor shards too) and recompute the RoPE buffer.

        Normal(0, 0.02) for embeddings and projections (HF's initializer_range); the residual-branch
        outputs wo and w2 get 0.02 / sqrt(2 n_layers) (GPT-2, Radford et al. 2019); norms get 1.
        With a seed, each parameter draws from its own generator seeded by (seed, its name), so its
        values do not depend on the other blocks, on wrappers, or on how it is sharded: a shard is
        cut from the full draw, one parameter at a time. seed=None draws from the global RNG.
        """
        self.tie_weights()
        self.init_rope()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():  # a tied weight comes once, under tok_embeddings
            name = _WRAPPER_PREFIXES.sub("", name)  # the same seed with activation checkpointing or compile
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            if seed is None:
                nn.init.normal_(p, 0.0, std)
            else:
                _seeded_normal_(p, std, seed * 1_000_003 + zlib.crc32(name.encode()))

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab); a pipeline stage without embedding takes (B, T, C)."""
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, C)
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # model.to(bf16) rounded it: angles t*theta need float32
            inv_freq = rope_frequencies(self.config, device=inv_freq.device)
        cos, sin = rope_cos_sin(inv_freq, T)  # (T, D) each, shared by all blocks
        for layer in self.layers.values():
            h = layer(h, cos, sin)  # (B, T, C)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (B, T, vocab)


def _is_dtensor(p: Tensor) -> bool:
    """Whether p is a DTensor, without importing torch.distributed.tensor (0.9 s of a notebook's start on
    a CPU): a DTensor exists only once that module has been imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


_WRAPPER_PREFIXES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def _seeded_normal_(p: Tensor, std: float, seed: int) -> None:
    """p ~ Normal(0, std) from a generator seeded by `seed`; a DTensor gets its shard of the full draw."""
    dtensor = _is_dtensor(p)
    local = p.to_local() if dtensor else p
    gen = torch.Generator(device=local.device).manual_seed(seed)
    if not dtensor:
        nn.init.normal_(p, 0.0, std, generator=gen)
        return
    from torch.distributed.tensor import distribute_tensor

    full = nn.init.normal_(torch.empty(p.shape, dtype=p.dtype, device=local.device), 0.0, std, generator=gen)
    # src_data_rank=None: every rank cuts its own shard from its own (identical) draw, no communication
    local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


__all__ = ["PRESETS", "Attention", "FeedForward", "Llama", "LlamaConfig", "RMSNorm", "TransformerBlock", "apply_rope",
           "count_parameters", "grouped_query_attention", "llama3_scale_frequencies", "rope_cos_sin",
           "rope_frequencies", "rotate_half"]
