"""Day 9's experiments: what they count is what the arithmetic says (tensors read against `reservation`, the
hook's forwards against the steps), and the claims tables judge made-up numbers as the rules say: a GPU claim
gets a verdict only on a GPU, a control that meets the claim credits nothing."""

import math

import pytest
import torch

from dlo.claims import AGREES, BY_CONSTRUCTION, DISAGREES, INCONCLUSIVE, NOT_MEASURABLE
from dlo.experiments import day9, day9_claims, day9_serving
from dlo.inference.paged import reservation
from dlo.presets import DAY9
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")
P = DAY9["tiny"]


@pytest.fixture(scope="module")
def model():
    return day9.make_model("tiny", 0, "cpu", vocab_size=256)


def test_the_tensors_say_what_the_arithmetic_says(model):
    lengths = day9.random_lengths(12, 64, seed=3)
    got = day9.measured_reservation(model, lengths, 8, 64, seed=3)
    want = reservation(lengths, 8, 64)
    assert got["contiguous_written"] == got["paged_written"] == want["tokens"] == sum(lengths)
    assert got["contiguous_reserved"] == want["contiguous_slots"] and got["paged_reserved"] == want["paged_slots"]


def test_the_cache_gives_the_models_logits_and_the_control_does_not(model):
    out = day9.cache_equality(model, torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0)), 6)
    assert out["max_diff"] < 1e-5 < 1e-2 < out["control_diff"] and out["tokens"].shape == (1, 10)


def test_the_hook_counts_each_forward_and_its_tokens(model):
    with day9_serving.ForwardCounter(model) as counter:
        model(torch.zeros(3, 7, dtype=torch.long))
        model(torch.zeros(2, 1, dtype=torch.long))
    model(torch.zeros(1, 1, dtype=torch.long))  # after the hook is removed: not counted
    assert (counter.forwards, counter.tokens) == (2, 23)


def test_static_batching_needs_more_forwards_only_when_answers_differ(model):
    small = P.__class__(n_requests=6, max_batch=3, num_blocks=24)
    varied, equal = day9_serving.batching(model, small, 0), day9_serving.batching(model, small, 0, equal_lengths=True)
    assert varied["static"]["forwards"] > varied["continuous"]["forwards"]
    assert equal["static"]["forwards"] == equal["continuous"]["forwards"]
    assert varied["static"]["generated"] == varied["continuous"]["generated"]  # the same trace, the same tokens


def test_the_plan_reserves_max_len_contiguously_and_less_paged():
    rows = {r["config"]: r for r in day9.plan(DAY9["full"], gpus=1, gpu_mem_gb=80)}
    per_token = 2 * 28 * 8 * 128 * 2
    assert rows["contiguous cache at max_len"]["activations"] == 32 * 8192 * per_token
    assert rows["paged cache"]["activations"] < rows["contiguous cache at max_len"]["activations"] / 3


def _steps(nc0, nc1, c1):
    return {"no cache, L=16": [nc0] * 5, "no cache, L=240": [nc1] * 5, "cache, L=240": [c1] * 5}


KV = {"tensors B/token": 114688, "formula B/token": 114688, "no GQA B/token": 344064, "cache GB at 128k": 15.0,
      "weights GB": 6.4}


def test_cache_claims_time_on_the_cpu_and_need_a_failing_control():
    rows = day9_claims.cache_claims(KV, {"max_diff": 1e-7, "control_diff": 0.5}, _steps(1.0, 4.0, 1.5), "cpu")
    assert [r.verdict for r in rows] == [BY_CONSTRUCTION] * 3 + [AGREES] * 3
    rows = day9_claims.cache_claims(KV, {"max_diff": 1e-7, "control_diff": 1e-7}, _steps(1.0, 1.1, 1.5), "cpu")
    assert [r.verdict for r in rows[3:]] == ["the control meets it too", DISAGREES, DISAGREES]


def _batching(static, continuous, tps=1.0):
    def policy(forwards, rate):
        return {"forwards": forwards, "summary": {"tokens_per_s": rate}}
    return {"static": policy(static, 100.0), "continuous": policy(continuous, 100.0 * tps)}


@pytest.mark.parametrize("device,throughput", [("cpu", NOT_MEASURABLE), ("cuda", AGREES)])
def test_throughput_and_speed_up_are_gpu_claims(device, throughput):
    runs = [_batching(130, 100, 1.5), _batching(140, 100, 1.6), _batching(135, 100, 1.4)]
    rows = day9_claims.batching_claims(runs, [_batching(100, 100)] * 3, device)
    assert [r.verdict for r in rows] == [throughput, AGREES]
    spec = day9_claims.speculative_claims([0.8, 0.82, 0.78], [0.1, 0.09, 0.11],
                                          [{"tokens_per_pass": x} for x in (3.3, 3.4, 3.5)], 4, 0.05,
                                          [2.0, 2.1, 1.9], device)
    expected = (1 - 0.8 ** 5) / 0.2
    assert math.isclose(spec[0].region.lo, 0.8 * expected) and spec[0].verdict in (AGREES, INCONCLUSIVE)
    assert [r.verdict for r in spec[1:]] == [AGREES, BY_CONSTRUCTION, throughput]


def test_paging_claims_from_counted_slots():
    res = [{"contiguous_written": w, "contiguous_reserved": 1000, "paged_written": w, "paged_reserved": w + 10}
           for w in (300, 320, 310)]
    rows = day9_claims.paging_claims(res, [{"paged": 40, "contiguous": 16}] * 3, {"blocks_saved": 6}, 16)
    assert [r.verdict for r in rows] == [AGREES, AGREES, BY_CONSTRUCTION, BY_CONSTRUCTION]


def test_the_preset_refuses_too_few_repeats():
    with pytest.raises(ValueError, match="must be >= 3"):
        P.__class__(seeds=2).validate()
    P.validate(), DAY9["full"].validate(), P.smoke().validate()
    assert P.with_max_steps(7).train_steps == P.with_max_steps(7).distill_steps == 7
