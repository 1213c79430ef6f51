"""Autograder checks for Day 9 (serving: the KV cache, paged attention, speculative decoding).

Each `check_<exercise>(fn, seed=0, trials=...)` draws odd shapes, lengths and operation sequences from
`case_seed(seed)` (a secret seed when graded), runs the student's code and the dlo reference
(`dlo.inference`, `dlo.kernels.paged_attention`), and raises AssertionError saying what to fix, or prints
one "ok" line. Where an output is wrong, the check computes the usual mistakes too (attending before
appending, no causal offset, the wrong KV head, an off-by-one block) and names the one that matches.

Attention with a cache and through a block table are plain calls (tensors in, tensors out; the cache's
in-place append comes back); the decode of a whole Llama through the student's attention, the block
manager (a class) and the acceptance rule (with its generator) run in workers. The speculative rule
is random: it is judged by what it must preserve, the target's distribution (Pearson's chi-square over
20,000 rounds, at a quantile a correct rule exceeds once in ~10^5 cases, so a secret seed cannot fail
it by chance), and a wrong rule's distribution is named when the counts fit it instead; the number of
drafts accepted and the tokens at later positions are held to the rule's distributions value by value
(`dlo.checks.day9_speculative`). The block manager's check lives in `dlo.checks.day9_blocks`, the acceptance
rule's in `dlo.checks.day9_speculative`, the scheduler step's in `dlo.checks.day9_schedule` (re-exported).
"""

from __future__ import annotations

import math
import random

import torch

from dlo.checks.day9_blocks import check_block_manager  # noqa: F401 (the notebook's)
from dlo.checks.day9_schedule import check_schedule_step  # noqa: F401 (the notebook's)
from dlo.checks.day9_speculative import check_accept_draft  # noqa: F401 (the notebook's)
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import assert_close, fmt, name_slip, ok
from dlo.inference.kv_cache import cached_attention, forward_cached
from dlo.kernels.paged_attention import paged_attention_ref
from dlo.models.llama import Llama, LlamaConfig

RTOL, ATOL = 1e-9, 1e-10  # float64 inputs: a correct softmax agrees to rounding
GARBAGE = 1e3  # the scale of what a cache's free slots hold: finite (masked to -inf, weighted by 0), and large
FUSED = ("scaled_dot_product", "_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
ATTENTION = ("torch.nn.functional.scaled_dot_product_attention", "dlo.inference.kv_cache.cached_attention",
             "dlo.inference.kv_cache.KVCache", "dlo.inference.kv_cache.generate", "dlo.inference.paged.PagedKVCache",
             "dlo.models.llama.grouped_query_attention", "dlo.kernels.paged_attention.paged_attention",
             "dlo.kernels.paged_attention.paged_attention_ref", "dlo.kernels.paged_attention.gather_blocks",
             "dlo.attention.*", "torch.nn.functional.multi_head_attention_forward",
             "torch.nn.MultiheadAttention.forward", "aten::_native_multi_head_attention*",
             "dlo.models.transformer.attention_core", "torch.nn.attention.flex_attention.flex_attention",
             # the library's other attentions (a red team's Day 9 padded q into Day 7's, 2026-12-02), and this
             # module's own, with which the check names the usual mistakes (reachable from the student's process)
             "dlo.distributed.tp_gpt._attention", "dlo.distributed.context_parallel.*", "dlo.distributed.ulysses.*",
             "dlo.kernels.flash_attention.*", "dlo.checks.day9._attend", "dlo.checks.day9._per_head",
             *(f"aten::{op}*" for op in FUSED))


def _attend(q, k, v, visible) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the keys `visible` (B or 1, 1, T, L) lets each query see; k, v already
    one per query head (B, H, L, D)."""
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _per_head(x, H: int, interleave: bool = True):
    """KV heads (B, Hkv, L, D) -> one per query head: head h reads h // g (right) or h % Hkv (wrong)."""
    g = H // x.shape[1]
    return x.repeat_interleave(g, dim=1) if interleave else x.repeat(1, g, 1, 1)


def _cache_mistakes(q, k, v, length: int) -> dict[str, torch.Tensor]:
    """What the usual mistakes return, on the appended cache k, v (B, Hkv, length + T, D)."""
    B, H, T, _ = q.shape
    pos = length + torch.arange(T)
    keys = torch.arange(k.shape[2])
    out = {"no causal offset: query i is at position length + i, so it sees keys j <= length + i, not j <= i":
           _attend(q, _per_head(k, H), _per_head(v, H), (keys <= torch.arange(T)[:, None])[None, None]),
           "no causal mask: a prefill chunk's query i must not see the keys of the tokens after it":
           _attend(q, _per_head(k, H), _per_head(v, H), torch.ones(1, 1, T, k.shape[2], dtype=torch.bool)),
           "the wrong KV head: query head h reads KV head h // (H // Hkv) (repeat_interleave, not repeat)":
           _attend(q, _per_head(k, H, False), _per_head(v, H, False), (keys <= pos[:, None])[None, None])}
    if length:  # attended to the old cache, then appended: no token sees its own key
        old = (keys[:length] <= pos[:, None])[None, None]
        out["attended before appending: write k_new, v_new into the cache first, so that a token sees itself"] = \
            _attend(q, _per_head(k[:, :, :length], H), _per_head(v[:, :, :length], H), old)
    return out


def _dtype(name: str, got, want, where: dict) -> None:
    if isinstance(got, torch.Tensor) and got.dtype != want.dtype:
        raise AssertionError(f"{name}: returned {got.dtype}, expected q's dtype {want.dtype} ({fmt(where)})")


def _float32_slip(name: str, got, want, where: dict) -> None:
    """The inputs are float64: an answer right to float32's rounding only was computed in float32 (`.float()`
    rounds float64 down); a student trial met it."""
    if isinstance(got, torch.Tensor) and got.shape == want.shape and got.is_floating_point() \
            and torch.allclose(got.to(want.dtype), want, 1e-5, 1e-6) and not torch.allclose(got, want, RTOL, ATOL):
        raise AssertionError(f"{name}: right to float32's rounding only: the check's inputs are float64 and the "
                             f"answer must keep their precision (compute in the inputs' dtype: `.float()` rounds "
                             f"float64 down to float32) ({fmt(where)})")


@check(forbid=ATTENTION)
def check_attend_with_cache(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(q, k_new, v_new, k_cache, v_cache, length) -> o`: k_new, v_new (B, Hkv, T, D) written into the
    caches (B, Hkv, L_max, D) at positions length..length+T-1, then q (B, H, T, D) at those positions attends
    causally to keys 0..length+T-1 (grouped-query: head h reads KV head h // (H // Hkv)). Against
    `dlo.inference.kv_cache.cached_attention`; then a Llama decoded through `fn` against its no-cache logits."""
    name, rng = "attend_with_cache", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for t in range(trials):
        Hkv, g = (rng.choice([1, 2, 3]), rng.choice([1, 2, 3])) if t else (2, 3)  # the first: grouped-query
        B, T, D = rng.choice([1, 2, 3]), (1, rng.choice([2, 5, 7]))[t % 2], rng.choice([4, 8])
        length = rng.choice([0, 3, 9, 17]) if t > 1 else 6
        if t == trials - 1 and t > 1:  # a long cache: every query sees more than 128 keys (no window suffices)
            length = rng.choice([131, 157, 193])
        L_max = length + T + rng.choice([0, 4])
        q = torch.randn(B, Hkv * g, T, D, generator=gen, dtype=torch.float64)
        k_new, v_new = (torch.randn(B, Hkv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
        k_cache, v_cache = (torch.randn(B, Hkv, L_max, D, generator=gen, dtype=torch.float64) for _ in range(2))
        # free slots hold anything (stale keys of a freed row): not zeros, which would tell `length` without it
        for cache in (k_cache, v_cache):
            cache[:, :, length:] *= GARBAGE
        where = dict(B=B, H=Hkv * g, Hkv=Hkv, T=T, D=D, length=length, L_max=L_max)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        k_want[:, :, length:length + T], v_want[:, :, length:length + T] = k_new, v_new
        k_got, v_got = k_cache.clone(), v_cache.clone()
        o = fn(q.clone(), k_new.clone(), v_new.clone(), k_got, v_got, length)
        pos = (length + torch.arange(T)).expand(B, T)
        want = cached_attention(q, k_want[:, :, :length + T], v_want[:, :, :length + T], pos)
        if not (torch.equal(k_got, k_want) and torch.equal(v_got, v_want)):
            raise AssertionError(f"{name}: the cache was not appended: after the call k_cache[:, :, length:length+T] "
                                 f"and v_cache[...] must hold k_new and v_new (written in place), the rest "
                                 f"unchanged ({fmt(where)})")
        if isinstance(o, torch.Tensor) and o.shape != want.shape:
            raise AssertionError(f"{name}: returned shape {tuple(o.shape)}, expected (B, H, T, D) = "
                                 f"{tuple(want.shape)} ({fmt(where)})")
        _dtype(name, o, want, where)
        if not (isinstance(o, torch.Tensor) and torch.allclose(o, want, RTOL, ATOL)):
            name_slip(name, o, _cache_mistakes(q, k_want[:, :, :length + T], v_want[:, :, :length + T], length),
                          where)
            _float32_slip(name, o, want, where)
        assert_close(name, "attention output", o, want, where, rtol=RTOL, atol=ATOL)
    _check_decode(name, fn, rng)
    ok(name, f"{trials} trials and a Llama's decode, seed={seed}")


# ----------------------------------------------------------------------------- the decode through fn

class _StudentCache:
    """A contiguous cache for `forward_cached` whose attention is the student's function (one sequence)."""

    def __init__(self, fn, cfg: LlamaConfig, max_len: int):
        self.fn, self.length = fn, 0
        gen = torch.Generator().manual_seed(max_len)  # free slots hold anything, as in the trials
        self.k, self.v = ([GARBAGE * torch.randn(1, cfg.n_kv_heads, max_len, cfg.head_dim, generator=gen,
                                                 dtype=torch.float64) for _ in range(cfg.n_layers)] for _ in "kv")

    def append_slots(self, rows, T: int):
        self.start, self.length = self.length, self.length + T
        return self.start + torch.arange(T)[None]  # (1, T)

    def update_and_attend(self, layer, rows, q, k, v, positions):
        return self.fn(q, k, v, self.k[layer], self.v[layer], self.start)


def _decode_worker(fn, seed: int, prompt, n_new: int):
    """The tiny Llama (fp64, weights from `seed`) prefills `prompt` (1, T0) through `fn`, then decodes
    the given continuation one token at a time: the logits of every position (1, T0 + n_new, vocab)."""
    model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    model.init_weights(seed=seed)
    model = model.double().eval()
    cache = _StudentCache(fn, model.config, prompt.shape[1])
    T0 = prompt.shape[1] - n_new
    with torch.no_grad():
        logits = [forward_cached(model, prompt[:, :T0], cache)]
        logits += [forward_cached(model, prompt[:, t:t + 1], cache) for t in range(T0, prompt.shape[1])]
    return torch.cat(logits, dim=1)


def _check_decode(name: str, fn, rng: random.Random) -> None:
    seed, T0, n_new = rng.randrange(1 << 20), rng.choice([3, 5, 8]), rng.choice([4, 6])
    prompt = torch.randint(0, 256, (1, T0 + n_new), generator=torch.Generator().manual_seed(seed))
    got = run_student(_decode_worker, fn, seed, prompt, n_new)
    model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    model.init_weights(seed=seed)
    with torch.no_grad():
        want = model.double().eval()(prompt)  # the no-cache model over the whole sequence
    assert_close(name, "a Llama's logits decoded through your attention (prefill, then one token per step) "
                 "against the same model without a cache", got, want, dict(prompt=T0, decoded=n_new),
                 rtol=1e-7, atol=1e-9)


# ----------------------------------------------------------------------------- exercise 4: through the block table

def _block_mistakes(q, k_cache, v_cache, tables, lens) -> dict[str, torch.Tensor]:
    """The usual slips of attention through a block table, as they would compute."""
    B, H, D = q.shape
    page = k_cache.shape[1]
    shifted = torch.cat([tables[:, 1:], tables[:, -1:]], dim=1)  # logical block t // block_size + 1
    out = {"off-by-one block index: token t lies in block_tables[b, t // block_size] at slot t % block_size":
           paged_attention_ref(q, k_cache, v_cache, shifted, lens, validate=False),
           "read past the sequence's length: mask the slots of its last block beyond seq_lens[b]":
           paged_attention_ref(q, k_cache, v_cache, tables, ((lens + page - 1) // page * page).int(), validate=False)}
    if bool((lens >= page).all()):  # the partial last block left out: floor instead of ceil
        out["the last, partial block left out: a sequence of n tokens uses ceil(n / block_size) blocks"] = \
            paged_attention_ref(q, k_cache, v_cache, tables, (lens // page * page).int(), validate=False)
    Hkv = k_cache.shape[2]
    if H // Hkv > 1:  # query head h = kv * g + i read KV head h % Hkv instead of h // g
        perm = torch.arange(H).view(H // Hkv, Hkv).t().flatten()  # the heads sharing h % Hkv, side by side
        wrong = paged_attention_ref(q[:, perm], k_cache, v_cache, tables, lens, validate=False)
        out["the wrong KV head: query head h reads KV head h // (H // Hkv)"] = wrong[:, torch.argsort(perm)]
    return out


@check(forbid=ATTENTION)
def check_paged_attention(fn, seed: int = 0, trials: int = 5) -> None:
    """`fn(q, k_cache, v_cache, block_tables, seq_lens) -> o (B, H, D)`: one query per sequence, attending to
    its seq_lens[b] tokens read through block_tables[b]. Against `dlo.kernels.paged_attention_ref`."""
    name, rng = "paged_attention", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for t in range(trials):
        B, D = rng.choice([1, 2, 3]), rng.choice([4, 8])
        Hkv, g = (rng.choice([1, 2]), rng.choice([1, 2, 3])) if t else (2, 3)  # the first: grouped-query
        page, num_blocks = rng.choice([2, 3, 4, 5]), rng.choice([11, 17])
        lens = [rng.randint(1, 3 * page + 1) for _ in range(B)]
        lens[0] = page + 1 if t == 0 else lens[0]  # one token into a second block
        if t == trials - 1 and t > 0:  # long tables: 17 to 24 blocks a sequence, the pool larger than a table
            lens, num_blocks = [rng.randint(16 * page + 1, 24 * page) for _ in range(B)], rng.choice([29, 37])
        width = max(-(-n // page) for n in lens)
        pool = rng.sample(range(num_blocks), num_blocks)
        tables = torch.tensor([[pool[(b * width + i) % num_blocks] for i in range(width)] for b in range(B)],
                              dtype=torch.int32)
        q = torch.randn(B, Hkv * g, D, generator=gen, dtype=torch.float64)
        k_cache, v_cache = (torch.randn(num_blocks, page, Hkv, D, generator=gen, dtype=torch.float64) for _ in "kv")
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        where = dict(B=B, H=Hkv * g, Hkv=Hkv, D=D, block_size=page, seq_lens=lens)
        o = fn(q.clone(), k_cache.clone(), v_cache.clone(), tables.clone(), seq_lens.clone())
        want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens)
        _dtype(name, o, want, where)
        if not (isinstance(o, torch.Tensor) and o.shape == want.shape and torch.allclose(o, want, RTOL, ATOL)):
            name_slip(name, o, _block_mistakes(q, k_cache, v_cache, tables, seq_lens), where)
            _float32_slip(name, o, want, where)
        assert_close(name, "attention output", o, want, where, rtol=RTOL, atol=ATOL)
    ok(name, f"{trials} trials, seed={seed}")
