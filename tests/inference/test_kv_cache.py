"""dlo.inference.kv_cache: bytes per token against the cache's tensors, decode with the cache against the
model without it (fp64 and fp32, odd prompt lengths, GQA), generate greedy and sampled."""

import pytest
import torch

from dlo.errors import BadInput
from dlo.inference.kv_cache import (
    KVCache,
    decode_step_times,
    forward_cached,
    generate,
    kv_bytes_per_token,
    kv_cache_bytes,
    sample,
)
from dlo.models.llama import Llama, LlamaConfig
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(dtype=torch.float64, seed=0, **overrides) -> Llama:
    model = Llama(LlamaConfig.from_name("tiny", **overrides))
    model.init_weights(seed=seed)
    return model.to(dtype).eval()


def prompt(B, T, seed=0, vocab=256):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_bytes_per_token_formula_and_the_cache_tensors():
    cfg = LlamaConfig.from_name("llama3.2-3b")
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 28 * 8 * 128 * 2 == 114688  # 112 KiB
    assert kv_cache_bytes(cfg, 131072) == 114688 * 131072  # 15.0e9 B at 128k tokens
    tiny = LlamaConfig.from_name("tiny")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        cache = KVCache(tiny, batch=3, max_len=37, dtype=dtype)
        assert cache.nbytes == kv_cache_bytes(tiny, 37, 3, dtype) == 3 * 37 * kv_bytes_per_token(tiny, dtype)


def test_gqa_divides_the_cache_by_the_group():
    mha = LlamaConfig.from_name("llama3.2-3b", n_kv_heads=24)
    assert kv_bytes_per_token(mha) == 3 * kv_bytes_per_token(LlamaConfig.from_name("llama3.2-3b"))


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10),  # only summation order differs
                                        (torch.float32, 2e-5)])  # logits ~1: fp32 rounding over 2 layers
@pytest.mark.parametrize("T0", [1, 5, 13])
def test_decode_with_the_cache_gives_the_models_logits(dtype, atol, T0):
    model = tiny_model(dtype)  # tiny: 4 query heads on 2 KV heads (GQA)
    tokens = prompt(2, T0 + 6, seed=T0)
    want = model(tokens)  # (B, T, vocab), no cache
    cache = KVCache.for_model(model, 2, T0 + 6)
    got = [forward_cached(model, tokens[:, :T0], cache)]  # prefill
    for t in range(T0, T0 + 6):  # decode, one token at a time
        got.append(forward_cached(model, tokens[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=atol)
    assert cache.lengths == [T0 + 6, T0 + 6]


def test_rows_of_different_lengths_decode_together():
    """Sequences at different positions share one decode step (what continuous batching needs)."""
    model = tiny_model()
    a, b = prompt(1, 7, seed=1), prompt(1, 3, seed=2)
    cache = KVCache.for_model(model, 2, 16)
    forward_cached(model, a, cache, rows=[0])
    forward_cached(model, b, cache, rows=[1])
    nxt = torch.tensor([[11], [22]])
    step = forward_cached(model, nxt, cache)[:, 0]
    torch.testing.assert_close(step[0], model(torch.cat([a, nxt[:1]], 1))[0, -1], rtol=0, atol=1e-10)
    torch.testing.assert_close(step[1], model(torch.cat([b, nxt[1:]], 1))[0, -1], rtol=0, atol=1e-10)


def test_generate_greedy_with_and_without_the_cache():
    model = tiny_model(torch.float32)
    p = prompt(2, 5)
    with_cache = generate(model, p, 12)
    assert with_cache.shape == (2, 17) and torch.equal(with_cache[:, :5], p)
    assert torch.equal(with_cache, generate(model, p, 12, use_cache=False))


def test_generate_sampled_is_reproducible_by_its_generator():
    model = tiny_model()
    p = prompt(3, 4)
    runs = [generate(model, p, 10, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    no_cache = generate(model, p, 10, temperature=1.0, generator=torch.Generator().manual_seed(7), use_cache=False)
    assert torch.equal(runs[0], no_cache)  # fp64: the same distributions, the same draws


def test_sample_greedy_and_at_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample(logits).tolist() == [1, 0]
    draws = sample(logits[:1].expand(4000, 3), 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3) / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], 0), rtol=0, atol=0.03)  # 4 sigma of 4000 draws


def test_bad_input():
    cfg = LlamaConfig.from_name("tiny")
    with pytest.raises(BadInput, match="longer than the model's max_seq_len=256"):
        KVCache(cfg, 1, 257)
    cache = KVCache(cfg, 1, 4)
    model = tiny_model()
    with pytest.raises(BadInput, match="do not fit the cache's max_len=4"):
        forward_cached(model, prompt(1, 5), cache)
    with pytest.raises(BadInput, match="max_new_tokens must be an int >= 0"):
        generate(model, prompt(1, 2), -1)
    with pytest.raises(BadInput, match=r"tokens must be \(B, T\) int64"):
        forward_cached(model, prompt(1, 2).float(), KVCache(cfg, 1, 4))


def test_decode_step_times_time_each_length():
    """Timings only, no threshold (measure, don't assert): one per length, with and without the cache."""
    model = tiny_model(torch.float32)
    for use_cache in (True, False):
        timings = decode_step_times(model, [4, 16], use_cache=use_cache, reps=2)
        assert len(timings) == 2 and all(t.n >= 2 and t.median_ms > 0 for t in timings)
