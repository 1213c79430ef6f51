"""The key/value cache: generate with one forward over the prompt, then one token per forward.

A causal transformer's keys and values at position t depend only on tokens <= t, so once computed they
never change. Generation therefore runs in two phases (the seeds' "KV Caching" slide):

    prefill:  the prompt's T0 tokens in one forward; every layer's K, V (B, Hkv, T0, D) go into the cache
    decode:   one new token per forward: its q, k, v (T = 1); k, v appended to the cache, then q attends
              to all t + 1 cached keys. Work per token O(t) instead of O(t^2) recomputing the prefix.

The price is memory, per token of every sequence (Pope et al. 2022, "Efficiently Scaling Transformer
Inference"):

    bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element

Grouped-query attention (Ainslie et al. 2023) divides it by H / Hkv: Llama 3.2 3B keeps 8 KV heads of
24, 2 x 28 x 8 x 128 x 2 B = 112 KiB per token in bf16 (15.0 GB at 128k tokens, beside 6.4 GB of weights).

`forward_cached` is `Llama.forward` with a cache: the same modules, RoPE at each token's own position,
attention with a mask by position. Any cache with `append_slots` and `update_and_attend` works: the
contiguous `KVCache` below, or `dlo.inference.paged.PagedKVCache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dlo.errors import BadInput
from dlo.measure import time_fn
from dlo.models.llama import Llama, LlamaConfig, apply_rope, rope_cos_sin, rope_frequencies


def kv_bytes_per_token(cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """2 x layers x KV heads x head dim x bytes per element: the cache one token of one sequence costs."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_cache_bytes(cfg: LlamaConfig, tokens: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the cache of `batch` sequences of `tokens` tokens each."""
    return batch * tokens * kv_bytes_per_token(cfg, dtype)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Attention of new queries to cached keys, causal by position.

    q: (B, H, T, D) at `positions` (B, T); k, v: (B, Hkv, L, D), the keys of positions 0..L-1 (beyond a
    sequence's own length: whatever, they are masked). Query at position p sees keys j <= p. (B, H, T, D).
    """
    visible = torch.arange(k.shape[2], device=q.device) <= positions[:, :, None]  # (B, T, L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=q.shape[1] != k.shape[1])


class KVCache:
    """A contiguous cache: per layer, K and V of shape (B, Hkv, max_len, D), reserved at max length up front.

    Row b holds sequence b; `lengths[b]` tokens of it are cached. This is the layout a plain cache uses
    (Hugging Face's static cache, FasterTransformer): every sequence reserves max_len slots whatever it
    will generate, the waste paging removes (dlo.inference.paged).
    """

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if not (isinstance(batch, int) and batch >= 1 and isinstance(max_len, int) and max_len >= 1):
            raise BadInput(f"batch and max_len must be positive ints, got {batch!r} and {max_len!r}")
        if max_len > cfg.max_seq_len:
            raise BadInput(f"max_len={max_len} is longer than the model's max_seq_len={cfg.max_seq_len}")
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: Llama, batch: int, max_len: int) -> KVCache:
        """A cache in the model's dtype and on its device."""
        w = model.output.weight
        return cls(model.config, batch, max_len, dtype=w.dtype, device=w.device)

    @property
    def nbytes(self) -> int:
        """The bytes this cache holds (reserved, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def append_slots(self, rows: list[int], T: int) -> Tensor:
        """Make room for T new tokens of each sequence in `rows`; their positions (B, T) int64."""
        if any(self.lengths[r] + T > self.max_len for r in rows):
            raise BadInput(f"{T} more tokens do not fit the cache's max_len={self.max_len} "
                           f"(lengths {[self.lengths[r] for r in rows]}): make the cache longer")
        start = torch.tensor([self.lengths[r] for r in rows], device=self.k.device)
        for r in rows:
            self.lengths[r] += T
        return start[:, None] + torch.arange(T, device=self.k.device)  # (B, T)

    def truncate(self, row: int, length: int) -> None:
        """Forget row's tokens from `length` on (rejected draft tokens, dlo.inference.speculative): they are
        masked from then on and overwritten by the next ones."""
        if not 0 <= length <= self.lengths[row]:
            raise BadInput(f"cannot truncate row {row} of {self.lengths[row]} tokens to {length}")
        self.lengths[row] = length

    def update_and_attend(self, layer: int, rows: list[int], q: Tensor, k: Tensor, v: Tensor,
                          positions: Tensor) -> Tensor:
        """Write the new k, v (B, Hkv, T, D) at `positions`, then attend with q (B, H, T, D): append first,
        so that a token sees its own key."""
        index = torch.tensor(rows, device=q.device)[:, None]  # (B, 1)
        # advanced indices split by a slice put their dims first: the slot is (B, T, Hkv, D)
        self.k[layer, index, :, positions] = k.transpose(1, 2)
        self.v[layer, index, :, positions] = v.transpose(1, 2)
        L = int(positions.max()) + 1  # no sequence in this batch sees further
        return cached_attention(q, self.k[layer, rows, :, :L], self.v[layer, rows, :, :L], positions)


def rope_at(cfg: LlamaConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin at each token's position, (B, 1, T, D): the rows of `rope_cos_sin`'s table, the very
    values `Llama.forward` computes for those positions."""
    cos, sin = rope_cos_sin(rope_frequencies(cfg, device=positions.device), int(positions.max()) + 1)
    return cos[positions][:, None], sin[positions][:, None]


def forward_cached(model: Llama, tokens: Tensor, cache, rows: list[int] | None = None) -> Tensor:
    """`model`'s logits (B, T, vocab) for `tokens` (B, T) that follow what `cache` holds for `rows`
    (default: every row of a KVCache); the tokens' keys and values are appended to the cache."""
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise BadInput(f"tokens must be (B, T) int64, got {tuple(tokens.shape)} {tokens.dtype}")
    rows = list(range(tokens.shape[0])) if rows is None else list(rows)
    if len(rows) != tokens.shape[0]:
        raise BadInput(f"{tokens.shape[0]} rows of tokens for {len(rows)} sequences")
    B, T = tokens.shape
    positions = cache.append_slots(rows, T)  # (B, T)
    cos, sin = rope_at(model.config, positions)
    h = model.tok_embeddings(tokens)  # (B, T, C)
    for i, block in enumerate(model.layers.values()):
        attn, x = block.attention, block.attention_norm(h)
        q = attn.wq(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = attn.wk(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = attn.wv(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cache.update_and_attend(i, rows, q, k, v, positions)  # (B, H, T, D)
        h = h + attn.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = h + block.feed_forward(block.ffn_norm(h))
    return model.output(model.norm(h))  # (B, T, vocab)


def probabilities(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """softmax(logits / temperature) in fp32 at least: the distribution a sampler draws from."""
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def sample(logits: Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
    """Next tokens (B,) from logits (B, vocab): argmax at temperature 0 (greedy), else a draw from
    `probabilities` with `generator` (a fixed seed gives the same tokens)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: Llama, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             generator: torch.Generator | None = None, use_cache: bool = True) -> Tensor:
    """prompt (B, T0) int64 -> (B, T0 + max_new_tokens): prefill, then one token per step.

    Without the cache every step runs the model over the whole sequence so far (O(t^2) per token over
    the layers' attention, O(t) for the rest); with it, over the new token only."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise BadInput(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise BadInput(f"prompt must be (B, T0) with T0 >= 1, got {tuple(prompt.shape)}")
    tokens = prompt
    cache = KVCache.for_model(model, prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    logits = forward_cached(model, prompt, cache)[:, -1] if use_cache else None  # prefill
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(tokens)[:, -1]
        nxt = sample(logits, temperature, generator)  # (B,)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if use_cache and tokens.shape[1] < prompt.shape[1] + max_new_tokens:
            logits = forward_cached(model, nxt[:, None], cache)[:, -1]  # decode
    return tokens


@torch.no_grad()
def decode_step_times(model: Llama, lengths: list[int], *, use_cache: bool = True, reps: int = 5,
                      seed: int = 0) -> list:
    """One decode step after L tokens, for each L in `lengths`: `dlo.measure.Timing`s of the forward of
    one token over L cached keys (the cache reset to L before every call), or, without the cache, of
    the forward over all L + 1 tokens. The first grows linearly in L (attention reads L keys; the
    projections do not grow), the second quadratically (attention over L + 1 queries)."""
    device = model.output.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (1, max(lengths) + 1), device=device,
                           generator=torch.Generator(device=device).manual_seed(seed))
    cache = KVCache.for_model(model, 1, max(lengths) + 1) if use_cache else None
    timings = []
    for L in lengths:
        if use_cache:
            cache.truncate(0, 0)
            forward_cached(model, tokens[:, :L], cache)  # the prefill, untimed
            timings.append(time_fn(lambda L=L: forward_cached(model, tokens[:, L:L + 1], cache), device=device,
                                   warmup=1, reps=reps, before=lambda L=L: cache.truncate(0, L)))
        else:
            timings.append(time_fn(lambda L=L: model(tokens[:, :L + 1]), device=device, warmup=1, reps=reps))
    return timings


__all__ = ["KVCache", "cached_attention", "decode_step_times", "forward_cached", "generate", "kv_bytes_per_token",
           "kv_cache_bytes", "probabilities", "rope_at", "sample"]
