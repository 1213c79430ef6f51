"""Day 7's exercise 7b (a stage boundary's bytes, DDP's bucket, both derived): the check accepts the solution
notebook's functions, under the grader too, and rejects a stub, the reference itself and the plausible slips
(one direction of the boundary, the stage's 1/t forgotten, the bucket without N or with the latency held to
the bandwidth term only, a plain ceiling that adds a byte where the bound is a whole number), and the two
guesses a student trial met (issue 34): whole bytes where t does not divide the boundary's bytes, and
latency_share = 0 answered (0, inf, a ZeroDivisionError) instead of refused with ValueError."""

from __future__ import annotations

import inspect
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


def _bucket(N, alpha, B, f, factor):
    return 0 if N == 1 else math.ceil(round(factor * alpha * B * (1 - f) / f, 6))


def bucket_without_n(N, alpha, B, latency_share=0.1):
    return _bucket(N, alpha, B, latency_share, 1)


def bucket_share_of_bandwidth(N, alpha, B, latency_share=0.1):
    """Latency at most f of the bandwidth term (not of the whole time): N alpha B / f."""
    return _bucket(N, alpha, B, latency_share, N / (1 - latency_share))


def bucket_rounded(N, alpha, B, latency_share=0.1):
    return 0 if N == 1 else round(N * alpha * B * (1 - latency_share) / latency_share)


def bucket_plain_ceiling(N, alpha, B, latency_share=0.1):
    """math.ceil of the float bound: 108,000,001 bytes where the A100's NVLink at N = 8 needs exactly 108e6
    (computed as 108000000.00000001)."""
    return 0 if N == 1 else math.ceil(N * alpha * B * (1 - latency_share) / latency_share)


def bucket_float(N, alpha, B, latency_share=0.1):
    return 0.0 if N == 1 else N * alpha * B * (1 - latency_share) / latency_share


def pp_whole_bytes(batch, seq, hidden, t=1, act_bytes=2):
    """Issue 34's guess: floor division, whole bytes per rank, where t does not divide the bytes."""
    return 2 * batch * seq * hidden * act_bytes // t


def _with_share(f_zero):
    """The reference, but latency_share = 0 answered by `f_zero` instead of refused."""
    def fn(N, alpha, B, latency_share=0.1):
        if latency_share == 0:
            return f_zero()
        return math.ceil(N * alpha * B * (1 - latency_share) / latency_share * (1 - 1e-12)) if N > 1 else 0
    return fn


def bucket_share_zero_divides(N, alpha, B, latency_share=0.1):
    """The formula as derived: latency_share = 0 divides by zero (ZeroDivisionError, not ValueError)."""
    return 0 if N == 1 else math.ceil(N * alpha * B * (1 - latency_share) / latency_share * (1 - 1e-12))


def test_accepts_the_solution(sol):
    day7_volumes.check_pp_bucket(sol.pp_p2p_bytes, sol.ddp_bucket_bytes, seed=1, trials=40)


def test_rejects_a_stub(sol):
    for fns in ((stub, sol.ddp_bucket_bytes), (sol.pp_p2p_bytes, stub)):
        with pytest.raises(NotImplementedError):
            day7_volumes.check_pp_bucket(*fns)


@pytest.mark.parametrize("wrong,match", [
    (pp_one_way, "sends .* per micro-batch.*one direction only"),  # caught by Day 6's engine
    (pp_unsplit, "not divided by t"),
    (pp_whole_bytes, "rounded to whole bytes: return the exact quotient"),
    (lambda *a, **k: comm_compute.pp_p2p_bytes(*a, **k), "off limits")])
def test_rejects_pipeline_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_volumes.check_pp_bucket(wrong, sol.ddp_bucket_bytes)


@pytest.mark.parametrize("wrong,match", [
    (bucket_without_n, "more than 0.1.*N left out"),
    (bucket_share_of_bandwidth, "not the smallest"),
    (bucket_rounded, "ddp_bucket_bytes"),
    (bucket_float, "an int"),
    (bucket_plain_ceiling, "108,000,001 bytes is not the smallest.*a bound that is a whole number"),
    (bucket_share_zero_divides, r"latency_share=0.0 is outside \(0, 1\].*got ZeroDivisionError"),
    (_with_share(lambda: 0), r"latency_share=0.0 is outside \(0, 1\].*got a return value 0"),
    (_with_share(lambda: math.inf), r"latency_share=0.0 .*got a return value inf"),
    (lambda *a, **k: comm_compute.ddp_bucket_bytes(*a, **k), "off limits")])
def test_rejects_bucket_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_volumes.check_pp_bucket(sol.pp_p2p_bytes, wrong, seed=0, trials=12)


def test_a_whole_bound_is_that_number_whatever_the_float_noise():
    """Issue 34: 108e6 bytes (A100 NVLink, N = 8, 5 us, f = 0.1) is computed as 108000000.00000001; the
    check used to accept both 108,000,000 and 108,000,001, so "the fewest whole bytes" was a guess."""
    from dlo.hardware import link_bytes_per_s

    B = link_bytes_per_s("A100 80GB SXM", "nvlink")
    assert 8 * 5e-6 * B * 0.9 / 0.1 > 108_000_000
    assert comm_compute.ddp_bucket_bytes(8, 5e-6, B, 0.1) == 108_000_000
    assert comm_compute.ddp_bucket_bytes(8, 5e-6, B, 0.5) == 12_000_000


def test_tp_bytes_is_the_texts_not_an_exercise(sol):
    """Issue 34: tp_bytes only copied section 4's equation 5; it is folded into the text (the library's
    `dlo.comm_compute.tp_bytes` prints the table), and the exercise asks for what the text does not give."""
    assert not hasattr(sol, "tp_bytes")
    assert list(inspect.signature(day7_volumes.check_pp_bucket).parameters)[:2] == ["pp_p2p_bytes_fn",
                                                                                  "ddp_bucket_bytes_fn"]


def test_passes_under_the_grader(sandbox, sol, capsys):
    """In the grader's trusted process the engine is measured (a fake group there) and the student's
    functions run in the sandbox."""
    sandbox.run(day7_volumes.check_pp_bucket, sol.pp_p2p_bytes, sol.ddp_bucket_bytes, seed=1, trials=3)
    assert "pp_bucket: ok (1 byte count" in capsys.readouterr().out


def test_a_numpy_integer_is_a_whole_number(sol):
    """An honest bucket returned as a numpy integer keeps full marks (it is a whole number of bytes)."""
    import numpy as np

    day7_volumes.check_pp_bucket(sol.pp_p2p_bytes, lambda *a, **k: np.int64(sol.ddp_bucket_bytes(*a, **k)), seed=0)


def test_a_search_over_day4s_cost_model_fails(sol):
    """Red team (2026-12-03): the bucket found by a binary search over Day 4's `allreduce_time`, without the
    formula, passed; Day 4's alpha-beta model is off limits while the check runs."""
    from dlo.distributed.collectives import allreduce_time

    def searched(world_size, alpha, link_bytes_per_s, latency_share=0.1):
        if not 0 < latency_share <= 1:
            raise ValueError("latency_share outside (0, 1]")
        f, lat = latency_share, allreduce_time(0, world_size, alpha, 1.0 / link_bytes_per_s)
        ok = lambda n: (1 - f) * lat * (1 - 1e-12) <= f * allreduce_time(n, world_size, 0.0,  # noqa: E731
                                                                            1.0 / link_bytes_per_s)
        lo, hi = 0, 1
        while not ok(hi):
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo
    with pytest.raises(AssertionError, match="allreduce_time is off limits"):
        day7_volumes.check_pp_bucket(sol.pp_p2p_bytes, searched)
