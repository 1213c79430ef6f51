"""Day 7's exercise 7b (the pipeline's bytes against TP's, DDP's bucket): the check accepts the solution
notebook's functions, under the grader too, and rejects a stub, the reference itself and the plausible slips
(one direction of the boundary, the stage's 1/t forgotten, the ring factor left out, forward only, one layer
for the stage's, the bucket without N or with the latency held to the bandwidth term only)."""

from __future__ import annotations

import math

import pytest

from dlo import comm_compute
from dlo.checks import day7_volumes
from tests.checks.conftest import load_solution


@pytest.fixture(scope="module")
def sol():
    return load_solution("day7_tensor_parallel")


def stub(*args, **kwargs):
    raise NotImplementedError()


def pp_one_way(batch, seq, hidden, t=1, act_bytes=2):
    return batch * seq * hidden * act_bytes / t


def pp_unsplit(batch, seq, hidden, t=1, act_bytes=2):
    return 2 * batch * seq * hidden * act_bytes


def tp_no_ring_factor(batch, seq, hidden, t, layers=1, act_bytes=2):
    return 8 * batch * seq * hidden * layers * act_bytes if t > 1 else 0.0


def tp_forward_only(batch, seq, hidden, t, layers=1, act_bytes=2):
    return 4 * batch * seq * hidden * (t - 1) / t * layers * act_bytes


def tp_one_layer(batch, seq, hidden, t, layers=1, act_bytes=2):
    return 8 * batch * seq * hidden * (t - 1) / t * act_bytes


def _bucket(N, alpha, B, f, factor):
    return 0 if N == 1 else math.ceil(round(factor * alpha * B * (1 - f) / f, 6))


def bucket_without_n(N, alpha, B, latency_share=0.1):
    return _bucket(N, alpha, B, latency_share, 1)


def bucket_share_of_bandwidth(N, alpha, B, latency_share=0.1):
    """Latency at most f of the bandwidth term (not of the whole time): N alpha B / f."""
    return _bucket(N, alpha, B, latency_share, N / (1 - latency_share))


def bucket_rounded(N, alpha, B, latency_share=0.1):
    return 0 if N == 1 else round(N * alpha * B * (1 - latency_share) / latency_share)


def bucket_float(N, alpha, B, latency_share=0.1):
    return 0.0 if N == 1 else N * alpha * B * (1 - latency_share) / latency_share


def test_accepts_the_solution(sol):
    day7_volumes.check_pp_tp_bucket(sol.pp_p2p_bytes, sol.tp_bytes, sol.ddp_bucket_bytes, seed=1, trials=40)


def test_rejects_a_stub(sol):
    for fns in ((stub, sol.tp_bytes, sol.ddp_bucket_bytes), (sol.pp_p2p_bytes, stub, sol.ddp_bucket_bytes),
                (sol.pp_p2p_bytes, sol.tp_bytes, stub)):
        with pytest.raises(NotImplementedError):
            day7_volumes.check_pp_tp_bucket(*fns)


@pytest.mark.parametrize("wrong,match", [
    (pp_one_way, "sends .* per micro-batch.*one direction only"),  # caught by Day 6's engine
    (pp_unsplit, "not divided by t"),
    (lambda *a, **k: comm_compute.pp_p2p_bytes(*a, **k), "off limits")])
def test_rejects_pipeline_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_volumes.check_pp_tp_bucket(wrong, sol.tp_bytes, sol.ddp_bucket_bytes)


@pytest.mark.parametrize("wrong,match", [
    (tp_no_ring_factor, "GPT layers send.*ring's factor left out"),  # caught by Day 7's layers
    (tp_forward_only, "GPT layers send.*forward only"),
    (tp_one_layer, "one layer, not the stage's"),
    (lambda *a, **k: comm_compute.tp_bytes(*a, **k), "off limits")])
def test_rejects_tp_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_volumes.check_pp_tp_bucket(sol.pp_p2p_bytes, wrong, sol.ddp_bucket_bytes)


@pytest.mark.parametrize("wrong,match", [
    (bucket_without_n, "more than 0.1.*N left out"),
    (bucket_share_of_bandwidth, "not the smallest"),
    (bucket_rounded, "ddp_bucket_bytes"),
    (bucket_float, "an int"),
    (lambda *a, **k: comm_compute.ddp_bucket_bytes(*a, **k), "off limits")])
def test_rejects_bucket_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_volumes.check_pp_tp_bucket(sol.pp_p2p_bytes, sol.tp_bytes, wrong, seed=0, trials=12)


def test_passes_under_the_grader(sandbox, sol, capsys):
    """In the grader's trusted process the engines are measured (a fake group there) and the student's
    functions run in the sandbox."""
    sandbox.run(day7_volumes.check_pp_tp_bucket, sol.pp_p2p_bytes, sol.tp_bytes, sol.ddp_bucket_bytes, seed=1,
                trials=3)
    assert "pp_tp_bucket: ok (3 byte counts" in capsys.readouterr().out
