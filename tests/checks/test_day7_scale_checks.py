"""Day 7's exercise 7 (compute against communication): the check accepts the solution notebook's
functions and rejects a stub, the reference itself, and the plausible slips (an all-reduce counted
for FSDP's all-gather, the latency left out, a rounded instead of a ceiling token count, one TP
all-reduce per layer, matmuls not split t ways)."""

from __future__ import annotations

import math

import pytest

from dlo import comm_compute
from dlo.checks import day7_scale
from tests.checks.conftest import load_solution


@pytest.fixture(scope="module")
def sol():
    return load_solution("day7_tensor_parallel")


def stub(*args, **kwargs):
    raise NotImplementedError()


def _tokens(P, N, F, B, alpha, b, factor=1.0):
    """The exact (real) token bound, times `factor`: the wrong variants below build on it (the
    reference is off limits to them as to a student)."""
    return factor * ((N - 1) * alpha + (N - 1) / N * P * b / B) * F / (2 * P)


def _ratio(P, h, t, T, F, B, alpha, b, allreduces=2, split=True):
    comm = allreduces * (2 * (t - 1) * alpha + 2 * (t - 1) / t * T * h * b / B)
    return comm / (2 * P * T / (t if split else 1) / F)


def fsdp_allreduce(P, N, F, B, alpha=0.0, param_bytes=2):
    """An all-reduce's 2(N-1)/N where the all-gather moves (N-1)/N."""
    return math.ceil(round(_tokens(P, N, F, B, alpha, param_bytes, factor=2.0), 6))


def fsdp_no_alpha(P, N, F, B, alpha=0.0, param_bytes=2):
    return math.ceil(round(_tokens(P, N, F, B, 0.0, param_bytes), 6))


def fsdp_rounded(P, N, F, B, alpha=0.0, param_bytes=2):
    """round() instead of the ceiling: one token short half of the time."""
    return round(_tokens(P, N, F, B, alpha, param_bytes))


def fsdp_floor_plus_one(P, N, F, B, alpha=0.0, param_bytes=2):
    """One token past the floor: 911 where the A100's NVLink at N = 8 needs exactly 910."""
    return 0 if N == 1 else math.floor(_tokens(P, N, F, B, alpha, param_bytes)) + 1


def fsdp_float(P, N, F, B, alpha=0.0, param_bytes=2):
    return _tokens(P, N, F, B, alpha, param_bytes)


def tp_one_allreduce(P, h, t, T, F, B, alpha=0.0, act_bytes=2):
    return _ratio(P, h, t, T, F, B, alpha, act_bytes, allreduces=1)


def tp_unsplit_matmuls(P, h, t, T, F, B, alpha=0.0, act_bytes=2):
    return _ratio(P, h, t, T, F, B, alpha, act_bytes, split=False)


def test_accepts_the_solution(sol):
    day7_scale.check_comm_compute(sol.fsdp_min_tokens, sol.tp_comm_ratio, seed=1, trials=40)


def test_rejects_a_stub(sol):
    with pytest.raises(NotImplementedError):
        day7_scale.check_comm_compute(stub, sol.tp_comm_ratio)
    with pytest.raises(NotImplementedError):
        day7_scale.check_comm_compute(sol.fsdp_min_tokens, stub)


@pytest.mark.parametrize("wrong,match", [
    (lambda *a, **k: comm_compute.fsdp_min_tokens(*a, **k), "off limits"),
    (fsdp_allreduce, "x2 the reference: an all-reduce"),
    (fsdp_no_alpha, "too few"),
    (fsdp_rounded, "too few"),
    (fsdp_floor_plus_one, "521 tokens is not the fewest.*a bound that is a whole number is that number"),  # 520 exactly
    (fsdp_float, "an int")])
def test_rejects_fsdp_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_scale.check_comm_compute(wrong, sol.tp_comm_ratio, seed=0, trials=12)


@pytest.mark.parametrize("wrong,match", [
    (tp_one_allreduce, "one all-reduce per layer"),
    (tp_unsplit_matmuls, "tp_comm_ratio: "),
    (lambda *a, **k: comm_compute.tp_comm_ratio(*a, **k), "off limits")])
def test_rejects_tp_slips(sol, wrong, match):
    with pytest.raises(AssertionError, match=match):
        day7_scale.check_comm_compute(sol.fsdp_min_tokens, wrong, seed=0, trials=12)


def test_a_whole_token_bound_is_that_number():
    """Issue 34: the A100's NVLink at N = 8 needs exactly 910 tokens, which float arithmetic gives as
    909.9999999999999; the check used to accept 910 and 911 alike, so "the fewest whole tokens" sat on a
    rounding edge. Now the reference, the solution and the check all say 910."""
    from dlo.hardware import link_bytes_per_s, peak_for_name

    F, B = peak_for_name("A100 80GB SXM")["bf16_tflops"] * 1e12, link_bytes_per_s("A100 80GB SXM", "nvlink")
    P = day7_scale.LLAMA_3B_LAYER
    assert comm_compute.fsdp_min_tokens(P, 8, F, B) == 910
    with pytest.raises(AssertionError, match="911 tokens is not the fewest"):
        day7_scale._hold_tokens(911, P, F, comm_compute.allgather_time(2 * P, 8, 0.0, 1 / B), {})
    day7_scale._hold_tokens(910, P, F, comm_compute.allgather_time(2 * P, 8, 0.0, 1 / B), {})


def test_the_engines_bytes_are_checked_first(sol):
    # Day 5's FSDP sends (N-1)/N of a block's bf16 parameters per layer in forward: 20,832 parameters here
    assert day7_scale.fsdp_layer_sent(4) == (3 / 4 * 20_832 * 2, 20_832)
    with pytest.raises(AssertionError, match=r"Day 5's FSDP sends per layer .*x2 the reference: an all-reduce"):
        day7_scale.check_comm_compute(fsdp_allreduce, sol.tp_comm_ratio)
    with pytest.raises(AssertionError, match=r"Day 7's GPT layer sends .*one all-reduce per layer"):
        day7_scale.check_comm_compute(sol.fsdp_min_tokens, tp_one_allreduce)


def test_the_check_passes_under_the_grader(sandbox, sol, capsys):
    """Under the grader the student's functions run in the sandbox and only plain values come back. (Exercise 8,
    the layout search, moved to Day 10: tests/checks/test_day10_layout_checks.py.)"""
    sandbox.run(day7_scale.check_comm_compute, sol.fsdp_min_tokens, sol.tp_comm_ratio, seed=1, trials=3)
    assert capsys.readouterr().out.count(": ok (") == 1


# ----------------------------------------------------------------------------- red team (2026-11-30)

def _table_of_answers():
    """A student who copied the check's case generator tabulates the notebook's own reference, outside the check,
    for seeds 0..9 (and the engines' few fixed cases); the graded functions only look up, 0 elsewhere."""
    import random

    from dlo.hardware import LINKS, link_bytes_per_s, peak_for_name

    gpu, link = next((g, next(iter(links))) for g, links in LINKS.items())
    F, B = peak_for_name(gpu)["bf16_tflops"] * 1e12, link_bytes_per_s(gpu, link)
    tok = {(20_832, N, F, B, 0.0, 2): comm_compute.fsdp_min_tokens(20_832, N, F, B) for N in (2, 4)}
    rat = {(10_800, 30, t, T, F, B, 0.0, 2): comm_compute.tp_comm_ratio(10_800, 30, t, T, F, B)
           for t in (2, 3) for T in (5, 7, 15, 21)}
    for seed in range(10):
        for c in day7_scale._cases(random.Random(seed), 12):
            P, h, N, t, T, F, B, a, b = (c[k] for k in ("P", "h", "N", "t", "T", "F", "B", "alpha", "b"))
            tok[(P, N, F, B, a, b)] = comm_compute.fsdp_min_tokens(P, N, F, B, alpha=a, param_bytes=b)
            rat[(P, h, t, T, F, B, a, b)] = comm_compute.tp_comm_ratio(P, h, t, T, F, B, alpha=a, act_bytes=b)

    def fsdp_looked_up(P, N, F, B, alpha=0.0, param_bytes=2):
        return tok.get((P, N, F, B, alpha, param_bytes), 0)

    def tp_looked_up(P, h, t, T, F, B, alpha=0.0, act_bytes=2):
        return rat.get((P, h, t, T, F, B, alpha, act_bytes), 0.0)
    return fsdp_looked_up, tp_looked_up


def test_a_table_of_answers_fails_under_the_grader(sandbox):
    """Red team: the random cases were drawn from the test cell's seed (not `case_seed`), so a table of the
    reference's answers, made outside the check, got full marks under the grader too. Now it works only in the
    notebook, where the seed is known (as for exercise 7b)."""
    fns = _table_of_answers()
    day7_scale.check_comm_compute(*fns, seed=3)  # the direct backend: the cheat sees the case, as in any notebook
    for seed in (0, 3, 7):
        with pytest.raises(AssertionError, match=r"fsdp_min_tokens: 0 tokens is too few|tp_comm_ratio: got 0,"):
            sandbox.run(day7_scale.check_comm_compute, *fns, seed=seed)


class _AlwaysHidden:
    """What a product with a lying token count compares as: never too few, never one too many."""
    def __lt__(self, other):
        return False

    def __ge__(self, other):
        return False


class _LyingTokens(int):
    def __mul__(self, other):
        return _AlwaysHidden()

    def __sub__(self, other):
        return _LyingTokens(int(self) - other)


def fsdp_lying_int(P, N, F, B, alpha=0.0, param_bytes=2):
    """Red team (the direct backend hands the object over): an int whose products answer "hidden" to every
    comparison the check made with it."""
    return _LyingTokens(1)


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_an_int_with_lying_arithmetic_fails(sol, seed):
    with pytest.raises(AssertionError, match="fsdp_min_tokens: 1 tokens is too few"):
        day7_scale.check_comm_compute(fsdp_lying_int, sol.tp_comm_ratio, seed=seed)


def test_a_numpy_integer_is_a_whole_number(sol):
    """An honest count returned as a numpy integer (np.ceil then .astype, say) keeps full marks."""
    import numpy as np

    day7_scale.check_comm_compute(lambda *a, **k: np.int64(sol.fsdp_min_tokens(*a, **k)), sol.tp_comm_ratio, seed=0)


def test_a_search_over_day4s_cost_model_fails(sol):
    """Red team (2026-12-03): no formula, a binary search for the smallest T over Day 4's `allreduce_time` (an
    all-gather is half an all-reduce) passed; Day 4's alpha-beta model is off limits while the check runs."""
    from dlo.distributed.collectives import allreduce_time

    def searched(layer_params, world_size, peak_flops, link_bytes_per_s, alpha=0.0, param_bytes=2):
        need = allreduce_time(layer_params * param_bytes, world_size, alpha, 1.0 / link_bytes_per_s) / 2
        lo, hi, per = 0, 1, 2 * layer_params / peak_flops
        while hi * per < need * (1 - 1e-12):
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if mid * per >= need * (1 - 1e-12) else (mid + 1, hi)
        return lo
    with pytest.raises(AssertionError, match="allreduce_time is off limits"):
        day7_scale.check_comm_compute(searched, sol.tp_comm_ratio)
