"""dlo.inference.batching: continuous vs static batching on a simulated trace (every request served, the
block budget held, preemption by recompute), and through the Llama: the same tokens as generating each
request alone, greedy and sampled, with and without preemptions."""

import pytest
import torch

from dlo.errors import BadInput
from dlo.inference.batching import ModelExecutor, Request, Scheduler, make_trace, serve, simulate, summary
from dlo.inference.kv_cache import generate
from dlo.inference.paged import BlockManager, PagedKVCache
from dlo.models.llama import Llama, LlamaConfig
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def simulated(trace, policy, num_blocks=64, block_size=4, max_batch=8, max_len=72):
    manager = BlockManager(num_blocks, block_size)
    return serve(trace, Scheduler(manager, max_batch, policy, max_len), simulate(manager))


def test_every_request_gets_its_tokens_and_continuous_takes_fewer_steps():
    trace = make_trace(24, seed=0)
    runs = {policy: simulated(trace, policy) for policy in ("continuous", "static")}
    for result in runs.values():
        assert {rid: len(out) for rid, out in result["outputs"].items()} == {r.rid: r.output_len for r in trace}
        assert all(s["blocks_used"] <= 64 for s in result["steps"])
    cont, stat = runs["continuous"]["steps"], runs["static"]["steps"]
    assert len(cont) < len(stat)  # no waiting for a batch's longest sequence
    assert sum(s["padding"] for s in cont) == 0 and sum(s["padding"] for s in stat) > 0
    assert all(s["blocks_reserved"] <= 64 for s in stat)  # reserved at max_len 72: 18 blocks each, 3 fit in 64
    assert max(s["batch"] for s in stat) == 3 and max(s["batch"] for s in cont) == 8
    fast, slow = summary(runs["continuous"]), summary(runs["static"])
    assert fast["tokens"] == slow["tokens"] == sum(r.output_len for r in trace)
    assert fast["tokens_per_step"] > slow["tokens_per_step"]


def test_tight_budget_preempts_and_recomputes():
    trace = make_trace(10, seed=1, prompt_lens=(6, 10), output_lens=(20, 30), max_new_tokens=30)
    result = simulated(trace, "continuous", num_blocks=24, block_size=4, max_batch=10)
    assert sum(r["preemptions"] for r in result["requests"].values()) > 0
    assert {rid: len(out) for rid, out in result["outputs"].items()} == {r.rid: r.output_len for r in trace}
    assert max(s["blocks_used"] for s in result["steps"]) <= 24


def test_swap_space_takes_the_victims_while_it_lasts():
    trace = make_trace(10, seed=1, prompt_lens=(6, 10), output_lens=(20, 30), max_new_tokens=30)
    manager = BlockManager(24, 4)
    result = serve(trace, Scheduler(manager, 10, swap_blocks=8), simulate(manager))
    assert sum(s["swapped_out"] for s in result["steps"]) > 0
    assert {rid: len(out) for rid, out in result["outputs"].items()} == {r.rid: r.output_len for r in trace}
    assert manager.allocator.num_free == 24


def test_arrivals_over_time_and_latencies():
    trace = make_trace(12, seed=2, arrivals_per_step=0.5)
    assert trace[-1].arrival > 0
    result = simulated(trace, "continuous")
    for r in result["requests"].values():
        assert r["arrival"] <= r["first_token"] <= r["finished"]
    s = summary(result, step_ms=2.0, token_ms=0.1)
    assert s["median_ttft_ms"] >= 2.0 and s["tokens_per_s"] > 0 and len(s["ttft_ms"]) == 12
    measured = summary(result)  # the steps' wall times (the simulator's here)
    assert all(step["ms"] >= 0 for step in result["steps"]) and measured["tokens"] == s["tokens"]


def tiny_model():
    model = Llama(LlamaConfig.from_name("tiny"))
    model.init_weights(seed=0)
    return model.double().eval()


def model_trace():
    gen = torch.Generator().manual_seed(0)
    lengths = [(5, 9), (3, 14), (11, 4), (7, 12), (2, 10), (9, 6)]  # (prompt, new tokens)
    return [Request(i, tuple(torch.randint(0, 256, (p,), generator=gen).tolist()), n, arrival=i // 2, seed=100 + i)
            for i, (p, n) in enumerate(lengths)]


@pytest.mark.parametrize("policy,num_blocks,temperature,swap", [
    ("continuous", 40, 0.0, 0), ("continuous", 8, 0.0, 0), ("continuous", 8, 1.0, 0), ("continuous", 8, 1.0, 6),
    ("static", 24, 1.0, 0)])
def test_served_tokens_are_one_at_a_time_generation(policy, num_blocks, temperature, swap):
    """8 blocks of 4 tokens for six requests of up to 20 tokens: preemptions (recompute, or swap while 6
    blocks of swap space last); the tokens stay the same."""
    model, trace = tiny_model(), model_trace()
    cache = PagedKVCache.for_model(model, num_blocks, 4)
    executor = ModelExecutor(model, cache, temperature)
    result = serve(trace, Scheduler(cache.manager, 4, policy, max_len=24, swap_blocks=swap), executor)
    for r in trace:
        alone = generate(model, torch.tensor([r.prompt]), r.max_new_tokens, temperature=temperature,
                         generator=torch.Generator().manual_seed(r.seed))
        assert result["outputs"][r.rid] == alone[0, len(r.prompt):].tolist(), r.rid
    preempted = sum(r["preemptions"] for r in result["requests"].values())
    assert (preempted > 0) == (num_blocks == 8)
    assert cache.manager.allocator.num_free == num_blocks and not executor.swapped  # every block back
    assert (sum(s["swapped_out"] for s in result["steps"]) > 0) == (swap > 0)


def test_bad_input():
    manager = BlockManager(4, 4)
    with pytest.raises(BadInput, match="policy must be 'continuous' or 'static'"):
        Scheduler(manager, 2, "fifo")
    with pytest.raises(BadInput, match="give max_len >= 1"):
        Scheduler(manager, 2, "static")
    with pytest.raises(BadInput, match=r"request 0 \(20 tokens\) can never fit: 4 blocks of 4"):
        Scheduler(manager, 2).add(Request(0, (1,) * 10, 10))
