"""Day 9 (serving a Llama): what the notebook's experiment cells call, over `dlo.inference`.

- the models: a target Llama trained on a synthetic language (a Markov chain whose next token is
  predictable, so that a model has something to say and a draft something to imitate), `train_lm`;
- the KV cache: bytes per token and at 8k / 128k tokens beside the weights (`kv_rows`, from the config on
  the meta device), equal logits with and without the cache (`cache_equality`), decode time per token
  against the prefix length (`decode_times`);
- paging: reserved vs used token slots of a batch of random lengths, counted from the caches' tensors
  after a real prefill (`measured_reservation`), the batch a budget holds, prefix sharing;
- `plan` for `dlo plan day9_inference`.

Continuous batching and speculative decoding are `dlo.experiments.day9_serving`; the claims tables
`dlo.experiments.day9_claims`.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from dlo.inference.kv_cache import KVCache, decode_step_times, forward_cached, kv_bytes_per_token
from dlo.inference.paged import PagedKVCache, batch_that_fits, parallel_sampling
from dlo.measure import time_interleaved
from dlo.models.llama import Llama, LlamaConfig
from dlo.plan import param_bytes, row
from dlo.progress import tqdm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- models and their language

def make_model(name: str, seed: int, device, dtype: str = "float32", **overrides) -> Llama:
    """A `dlo.models.llama` config, initialised from `seed` on `device` (built on the meta device first: a
    3B model is not initialised twice, nor on the host), in `dtype`, in eval mode."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name, **overrides))
    model.to_empty(device=device).init_weights(seed=seed)
    return model.to(dtype=DTYPES[dtype]).eval()


def markov_corpus(vocab: int, n_tokens: int, seed: int, fanout: int = 3) -> torch.Tensor:
    """A synthetic language: each token is followed by one of `fanout` successors of its own, with
    probabilities (0.6, 0.3, 0.1): a model that learns it predicts well, one that did not cannot."""
    rng = random.Random(seed)
    succ = [rng.sample(range(vocab), fanout) for _ in range(vocab)]
    probs = [0.6, 0.3, 0.1][:fanout]
    out, t = [], rng.randrange(vocab)
    for _ in range(n_tokens):
        out.append(t)
        t = rng.choices(succ[t], probs)[0]
    return torch.tensor(out)


def batches(corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """Endless (B, seq_len + 1) windows of the corpus at random offsets (`seed`)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size,), generator=gen)
        yield torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()])


def train_lm(model: Llama, corpus, P, *, steps: int, seed: int, teacher: Llama | None = None, writer=None,
             desc: str = "train") -> list[float]:
    """AdamW on next-token cross-entropy, or, given a `teacher`, on Day 8's distillation loss (the KL to
    the teacher's distribution at T = 1, no labels: a draft must match the target's distribution, which
    is what speculative decoding accepts). The loss per step (and in TensorBoard under `writer`)."""
    from dlo.distill import distillation_loss

    device = model.output.weight.device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
    losses = []
    for step, window in zip(tqdm(range(steps), desc=desc), batches(corpus, P.batch_size, P.seq_len, seed)):
        x, y = window[:, :-1].to(device), window[:, 1:].to(device)
        logits = model(x).flatten(0, 1)  # (B T, vocab)
        if teacher is None:
            loss = F.cross_entropy(logits, y.flatten())
        else:
            with torch.no_grad():
                target = teacher(x).flatten(0, 1)
            loss = distillation_loss(logits, target, None, temperature=1.0, lam=0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if writer is not None:
            writer.add_scalar("loss", losses[-1], step)
    model.eval()
    return losses


# ----------------------------------------------------------------------------- the KV cache

def kv_rows(names=("tiny", "llama3.2-3b"), dtype: torch.dtype = torch.bfloat16, lengths=(8192, 131072)) -> list[dict]:
    """Per config: the formula's bytes per token, the bytes per token of a cache's tensors (a KVCache built
    on the meta device: its shapes, no memory), the same with one KV head per query head (no GQA), and
    the cache of one sequence at `lengths` beside the weights (meta model, `dtype`)."""
    rows = []
    for name in names:
        cfg = LlamaConfig.from_name(name)
        cache = KVCache(cfg, 1, min(1024, cfg.max_seq_len), dtype=dtype, device="meta")
        with torch.device("meta"):
            weights = param_bytes(Llama(cfg).to(dtype))
        mha = LlamaConfig.from_name(name, n_kv_heads=cfg.n_heads)
        out = {"model": name, "layers": cfg.n_layers, "KV heads": f"{cfg.n_kv_heads} of {cfg.n_heads}",
               "head dim": cfg.head_dim, "formula B/token": kv_bytes_per_token(cfg, dtype),
               "tensors B/token": cache.nbytes // cache.max_len, "no GQA B/token": kv_bytes_per_token(mha, dtype),
               "weights GB": weights / 1e9}
        out.update({f"cache GB at {n // 1024}k": n * out["formula B/token"] / 1e9 for n in lengths})
        rows.append(out)
    return rows


@torch.no_grad()
def cache_equality(model: Llama, prompt: torch.Tensor, n_new: int) -> dict:
    """Greedy decode of `n_new` tokens with the cache; the logits of every step against the model's own
    forward over the whole sequence (no cache), and the control: each new token alone, without context.
    Returns max |difference| / max |logit| of each, and the tokens."""
    cache = KVCache.for_model(model, prompt.shape[0], prompt.shape[1] + n_new)
    logits = [forward_cached(model, prompt, cache)[:, -1]]
    tokens = prompt
    for _ in range(n_new - 1):
        tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
        logits.append(forward_cached(model, tokens[:, -1:], cache)[:, -1])
    full = model(tokens)[:, prompt.shape[1] - 1:]  # (B, n_new, vocab): the no-cache logits of the same steps
    alone = torch.stack([model(tokens[:, t:t + 1])[:, 0] for t in range(prompt.shape[1] - 1, tokens.shape[1])], 1)
    cached = torch.stack(logits, dim=1)
    scale = full.float().abs().max().item()  # differences relative to the largest logit: bf16 rounds at 2^-8
    return {"max_diff": (cached - full).float().abs().max().item() / scale,
            "control_diff": (alone - full).float().abs().max().item() / scale, "tokens": tokens}


def decode_times(model: Llama, lengths, reps: int) -> dict[str, list]:
    """`dlo.measure.Timing`s of one decode step after each length, with and without the cache."""
    return {"cache": decode_step_times(model, list(lengths), use_cache=True, reps=reps),
            "no cache": decode_step_times(model, list(lengths), use_cache=False, reps=reps)}


@torch.no_grad()
def interleaved_steps(model: Llama, L0: int, L1: int, reps: int, seed: int = 0, inner: int = 8) -> dict[str, list]:
    """Seconds per decode step, round by round (`dlo.measure.time_interleaved`: a slow phase of a shared
    machine hits every variant of its round, so per-round ratios cancel it), each call `inner` steps long
    (a millisecond step is shorter than the scheduler's time slice): without the cache after L0 and after L1
    tokens, and with the cache after L1 (truncated back to L1 before each step: a list assignment)."""
    device = model.output.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (1, L1 + 1), device=device,
                           generator=torch.Generator(device=device).manual_seed(seed))
    cache = KVCache.for_model(model, 1, L1 + 1)
    forward_cached(model, tokens[:, :L1], cache)  # the prefill, untimed

    def cached_steps():
        for _ in range(inner):
            cache.truncate(0, L1)
            forward_cached(model, tokens[:, L1:L1 + 1], cache)

    def full_steps(L):
        for _ in range(inner):
            model(tokens[:, :L + 1])

    fns = {f"no cache, L={L0}": lambda: full_steps(L0), f"no cache, L={L1}": lambda: full_steps(L1),
           f"cache, L={L1}": cached_steps}
    timings = time_interleaved(fns, device=device, warmup=1, reps=reps)
    return {name: [x / inner for x in t.times_s] for name, t in timings.items()}


# ----------------------------------------------------------------------------- paging

def random_lengths(n: int, max_len: int, seed: int) -> list[int]:
    """Sequence lengths as a chat server sees them: a prompt of 8-64 tokens and an answer of geometric
    length (mean max_len / 6), capped at max_len. The waste of a max-length reservation is 1 - mean / max_len:
    it is set by this distribution, not by the cache."""
    rng = random.Random(seed)
    p = 6 / max_len
    return [min(max_len, rng.randint(8, 64) + int(math.log(1 - rng.random()) / math.log(1 - p))) for _ in range(n)]



@torch.no_grad()
def measured_reservation(model: Llama, lengths: list[int], block_size: int, max_len: int, seed: int) -> dict:
    """Prefill each sequence (random tokens) into a contiguous cache reserved at max_len per sequence and
    into a paged cache, then count from the tensors themselves: slots reserved (the contiguous tensor's
    (batch, max_len) slots; the paged blocks holding any written slot, times block_size) and slots written."""
    device = model.output.weight.device
    gen = torch.Generator().manual_seed(seed)
    contiguous = KVCache.for_model(model, len(lengths), max_len)
    paged = PagedKVCache.for_model(model, sum(math.ceil(n / block_size) for n in lengths) + 1, block_size)
    for b, n in enumerate(tqdm(lengths, desc="prefill")):
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
        forward_cached(model, tokens, contiguous, rows=[b])
        paged.add(b)
        forward_cached(model, tokens, paged, rows=[b])
    # contiguous k: (layers, B, Hkv, max_len, D) -> slots (B, max_len); paged: (layers, blocks, size, Hkv, D) ->
    # (blocks, size); a layer at a time (at 3B and 8k tokens a whole-cache mask would take gigabytes)
    c_written = torch.zeros(contiguous.k.shape[1], max_len, dtype=torch.bool, device=device)
    p_written = torch.zeros(paged.k.shape[1:3], dtype=torch.bool, device=device)
    for layer in range(model.config.n_layers):
        c_written |= contiguous.k[layer].ne(0).any(dim=1).any(dim=-1)
        p_written |= paged.k[layer].ne(0).flatten(2).any(dim=-1)
    blocks_touched = int(p_written.any(-1).sum())
    return dict(tokens=sum(lengths), contiguous_reserved=c_written.numel(), contiguous_written=int(c_written.sum()),
                paged_reserved=blocks_touched * block_size, paged_written=int(p_written.sum()),
                contiguous_bytes=contiguous.nbytes, paged_bytes_used=blocks_touched * paged.nbytes // paged.k.shape[1])


def budget_batches(lengths: list[int], budget_tokens: int, block_size: int, max_len: int) -> dict:
    """The sequences (in order) whose caches a budget of `budget_tokens` slots holds, each way."""
    return batch_that_fits(lengths, budget_tokens, block_size, max_len)


def prefix_sharing(model: Llama, prompt_len: int, n: int, max_new: int, block_size: int, seed: int) -> dict:
    """n samples of one prompt with its blocks shared (`parallel_sampling`): blocks in use vs unshared."""
    gen = torch.Generator(device=model.output.weight.device).manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen, device=gen.device)
    _, usage = parallel_sampling(model, prompt, n, max_new, block_size=block_size, generator=gen)
    return usage


# ----------------------------------------------------------------------------- dlo plan

def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Rows: the served model's weights (P.dtype) with the KV cache of P.max_batch sequences at P.max_len
    reserved contiguously, and the same batch paged at the mean of `random_lengths` (the cache of one
    sequence at 128k tokens is `kv_rows`'). Inference: no gradients, no optimizer. One GPU: `gpus` does not
    change them."""
    cfg, dtype = LlamaConfig.from_name(P.model), DTYPES[P.dtype]
    with torch.device("meta"):
        weights = param_bytes(Llama(cfg).to(dtype))
    per_token = kv_bytes_per_token(cfg, dtype)
    lengths = random_lengths(P.n_sequences, P.max_len, 0)
    paged = sum(math.ceil(n / P.block_size) * P.block_size for n in lengths) * P.max_batch // len(lengths)
    rows = []
    for name, tokens, note, main in (
            ("contiguous cache at max_len", P.max_batch * P.max_len, f"{P.max_batch} x {P.max_len} tokens reserved",
             True),
            ("paged cache", paged, f"{P.max_batch} sequences of random lengths in blocks of {P.block_size}", False)):
        rows.append(row(name, 1, params=weights, grads=0, optimizer=0, activations=tokens * per_token,
                        gpu_mem_gb=gpu_mem_gb, main=main, note=f"{note}; {per_token:,} B of K and V per token"))
    return rows
