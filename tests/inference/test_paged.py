"""dlo.inference.paged: the allocator (free list, reference counts), block tables with fork and
copy-on-write, the paged cache against the contiguous one through the same Llama, reserved vs used."""

import math
import random

import pytest
import torch

from dlo.errors import BadInput
from dlo.inference.kv_cache import KVCache, forward_cached
from dlo.inference.paged import (
    BlockAllocator,
    BlockManager,
    OutOfBlocks,
    PagedKVCache,
    batch_that_fits,
    reservation,
)
from dlo.models.llama import Llama, LlamaConfig
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(dtype=torch.float64):
    model = Llama(LlamaConfig.from_name("tiny"))
    model.init_weights(seed=0)
    return model.to(dtype).eval()


def tokens(n, seed):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- allocator and tables
def test_allocator_free_list_and_reference_counts():
    a = BlockAllocator(3)
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 3 blocks are in use"):
        a.allocate()
    a.share(got[1])
    a.free(got[1])
    assert a.num_free == 0  # still held by its other owner
    a.free(got[1])
    assert a.num_free == 1 and a.allocate() == got[1]
    a.free(got[0])
    with pytest.raises(ValueError, match="already free"):
        a.free(got[0])
    with pytest.raises(ValueError, match="is free: it cannot be shared"):
        a.share(got[0])


def test_slots_follow_the_block_table():
    m = BlockManager(num_blocks=8, block_size=4)
    m.add("a")
    m.add("b")
    slots_a, _ = m.append_slots("a", 3)
    slots_b, _ = m.append_slots("b", 6)
    more_a, _ = m.append_slots("a", 2)  # fills block 0 of "a", opens a new one
    ta, tb = m.tables["a"], m.tables["b"]
    assert len(ta) == 2 and len(tb) == 2 and not set(ta) & set(tb)
    assert slots_a + more_a == [ta[t // 4] * 4 + t % 4 for t in range(5)]
    assert slots_b == [tb[t // 4] * 4 + t % 4 for t in range(6)]
    assert m.usage() == dict(blocks_used=4, slots_reserved=16, tokens=11, blocks_shared_saved=0)


def test_fork_shares_and_copy_on_write_copies_only_the_partial_block():
    m = BlockManager(num_blocks=6, block_size=4)
    m.add("parent")
    m.append_slots("parent", 6)  # one full block, one partial (2 of 4)
    m.fork("parent", "child")
    full, partial = m.tables["parent"]
    assert m.tables["child"] == [full, partial] and m.allocator.ref_counts[full] == 2
    assert m.usage()["blocks_shared_saved"] == 2
    slots, copies = m.append_slots("child", 1)  # writes the shared partial block: copy it first
    new = m.tables["child"][1]
    assert copies == [(partial, new)] and new != partial and slots == [new * 4 + 2]
    assert m.tables["child"][0] == full and m.allocator.ref_counts[partial] == 1
    _, copies = m.append_slots("parent", 1)  # the parent now owns `partial` alone: no copy
    assert copies == [] and m.tables["parent"] == [full, partial]
    m.fork("parent", "c2")
    m.append_slots("parent", 1)  # the parent's block is now full (8 tokens)
    _, copies = m.append_slots("c2", 1)  # c2's last block is full and shared: a new block, no copy
    assert copies == [] and m.tables["c2"][:2] == [full, partial] and m.allocator.ref_counts[full] == 3
    for seq in ("parent", "child", "c2"):
        m.free(seq)
    assert m.allocator.num_free == 6 and set(m.allocator.ref_counts) == {0}


def test_append_is_all_or_nothing():
    m = BlockManager(num_blocks=2, block_size=4)
    m.add("a")
    m.append_slots("a", 5)
    with pytest.raises(OutOfBlocks, match="needs 1 blocks, 0 are free"):
        m.append_slots("a", 4)
    assert m.lengths["a"] == 5 and len(m.tables["a"]) == 2
    with pytest.raises(BadInput, match="already has a block table"):
        m.add("a")
    with pytest.raises(BadInput, match="block_size must be a positive int"):
        BlockManager(4, 0)


# ---------------------------------------------------------------- the paged cache through the model
def run(model, cache, seqs, prompts, steps):
    """Prefill each sequence alone, then decode them together `steps` times; every logit row."""
    out = {s: [forward_cached(model, p, cache, rows=[s])[0]] for s, p in zip(seqs, prompts)}
    for t in range(steps):
        nxt = torch.tensor([[(7 * t + 3 * i) % 256] for i in range(len(seqs))])
        step = forward_cached(model, nxt, cache, rows=seqs)
        for i, s in enumerate(seqs):
            out[s].append(step[i])
    return {s: torch.cat(v) for s, v in out.items()}


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_cache_gives_the_contiguous_caches_logits(block_size):
    model = tiny_model()
    prompts = [tokens(n, n) for n in (5, 1, 12)]
    contiguous = run(model, KVCache.for_model(model, 3, 20), [0, 1, 2], prompts, 6)
    paged = PagedKVCache.for_model(model, num_blocks=3 * math.ceil(18 / block_size), block_size=block_size)
    for s in "abc":
        paged.add(s)
    got = run(model, paged, list("abc"), prompts, 6)
    for i, s in enumerate("abc"):
        torch.testing.assert_close(got[s], contiguous[i], rtol=0, atol=1e-10)  # fp64: summation order only


def test_decode_through_the_triton_kernel(device):
    """The same, fp32, decode through the kernel (the interpreter here): within fp32 rounding."""
    model = tiny_model(torch.float32).to(device)
    prompts = [tokens(n, n).to(device) for n in (4, 9)]
    ref = PagedKVCache.for_model(model, 8, 3)
    kern = PagedKVCache.for_model(model, 8, 3, kernel=True)
    for cache in (ref, kern):
        cache.add(0)
        cache.add(1)
    a, b = run(model, ref, [0, 1], prompts, 3), run(model, kern, [0, 1], prompts, 3)
    for s in (0, 1):
        torch.testing.assert_close(b[s], a[s], rtol=0, atol=2e-5)  # logits ~1, fp32 over two layers


def test_parallel_sampling_shares_the_prompt_and_copies_on_write():
    """Three samples of one 10-token prompt: the prompt's blocks are stored once; each sample's first
    token copies the shared partial block; every sample's logits are the no-cache model's."""
    model, prompt = tiny_model(), tokens(10, 1)
    cache = PagedKVCache.for_model(model, num_blocks=12, block_size=4)
    cache.add("s0")
    forward_cached(model, prompt, cache, rows=["s0"])
    cache.fork("s0", "s1")
    cache.fork("s0", "s2")
    assert cache.manager.usage() == dict(blocks_used=3, slots_reserved=12, tokens=30, blocks_shared_saved=6)
    seqs = {s: prompt for s in ("s0", "s1", "s2")}
    for step in range(3):
        nxt = torch.tensor([[10 + step], [20 + step], [30 + step]])
        logits = forward_cached(model, nxt, cache, rows=list(seqs))
        for i, s in enumerate(seqs):
            seqs[s] = torch.cat([seqs[s], nxt[i:i + 1]], dim=1)
            torch.testing.assert_close(logits[i, 0], model(seqs[s])[0, -1], rtol=0, atol=1e-10)
    usage = cache.manager.usage()  # 13 tokens each: 2 shared full blocks + 2 own blocks per sample
    assert usage["blocks_used"] == 2 + 3 * 2 and usage["blocks_shared_saved"] == 2 * 2


def test_cache_refuses_what_does_not_fit():
    model = tiny_model()
    cache = PagedKVCache.for_model(model, num_blocks=2, block_size=4)
    cache.add("a")
    with pytest.raises(OutOfBlocks, match="more than the 2 free blocks"):
        forward_cached(model, tokens(9, 0), cache, rows=["a"])
    assert cache.manager.lengths["a"] == 0
    assert cache.nbytes == 2 * 2 * 2 * 4 * 2 * 16 * 8  # 2 tensors x layers x blocks x bs x Hkv x D x 8 B


# ---------------------------------------------------------------- reserved vs used
def test_paged_waste_is_under_one_block_per_sequence():
    rng = random.Random(0)
    lengths = [rng.randint(1, 2048) for _ in range(200)]
    r = reservation(lengths, block_size=16, max_len=2048)
    assert r["max_internal_waste"] < 16
    assert r["paged_slots"] - r["tokens"] < 16 * len(lengths)
    assert r["paged_waste"] < 0.01 and 0.45 < r["contiguous_waste"] < 0.55  # uniform lengths: half reserved
    assert r["contiguous_slots"] == 200 * 2048


def test_batch_that_fits_a_budget():
    fits = batch_that_fits([100, 30, 17, 500], budget_slots=600, block_size=16, max_len=512)
    assert fits == dict(contiguous=1, paged=3)  # 112 + 32 + 32 = 176 slots; 500 -> 512 more would exceed 600
    with pytest.raises(BadInput, match=r"lengths must lie in \[0, max_len=512\]"):
        reservation([600], 16, 512)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parallel_sampling_draws_what_a_repeated_batch_draws(temperature):
    """n samples sharing the prompt's blocks draw the tokens `generate` draws for the prompt repeated n
    times (fp64: equal logits, one generator), in fewer blocks."""
    from dlo.inference.kv_cache import generate
    from dlo.inference.paged import parallel_sampling

    model, prompt = tiny_model(), tokens(11, 3)
    got, usage = parallel_sampling(model, prompt, 4, 6, block_size=4, temperature=temperature,
                                   generator=torch.Generator().manual_seed(0))
    want = generate(model, prompt.expand(4, -1), 6, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)
    # 16 cached tokens each (the last one is never fed): 2 full prompt blocks shared, 2 own blocks per sample
    assert usage == dict(blocks_used=2 + 4 * 2, blocks_unshared=4 * 4, blocks_saved=2 * 3)
