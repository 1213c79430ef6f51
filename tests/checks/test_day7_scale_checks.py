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


# ----------------------------------------------------------------------------- 8. choosing a layout

def _search_with(fits_fn, tps=None):
    """A search that differs from the reference only in its fit test or its tensor degrees."""
    from dlo.layout import Layout, step_time

    def search(model, cluster, batch):
        n, best = cluster.gpus, None
        for tp in tps or [d for d in range(1, n + 1) if n % d == 0 and model.kv_heads % d == 0]:
            for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0 and model.layers % d == 0):
                dp = n // (tp * pp)
                if n % tp or batch % dp:
                    continue
                for m in (k for k in range(pp, batch // dp + 1) if (batch // dp) % k == 0):
                    for lay in (Layout(dp, tp, pp, f, m, ac) for f in ((False, True) if dp > 1 else (False,))
                                for ac in (False, True)):
                        if fits_fn(model, lay, cluster, batch):
                            t = step_time(model, lay, cluster, batch)
                            best = (t, lay) if best is None or t < best[0] else best
        return best[1]
    return search


def states_only_fit(model, lay, cluster, batch):
    """Plausible and wrong: the model states (and FSDP's gathered layers) fit, activations forgotten."""
    from dlo.layout import memory_bytes

    without = memory_bytes(model, lay, cluster, batch) - _activations(model, lay, batch)
    return without <= cluster.mem_gib * 2 ** 30


def _activations(model, lay, batch):
    b = batch / (lay.dp * lay.m)
    per_layer = (2 * b * model.seq * model.hidden if lay.ac else b * model.act_layer) / lay.tp
    return min(lay.pp, lay.m) * model.layers // lay.pp * per_layer


def test_layout_search_accepts_the_solution(sol):
    day7_scale.check_layout_search(sol.search_layout, seed=1, trials=6)


def test_layout_search_rejects_a_stub_and_the_mistakes(sol):
    from dlo.layout import Layout, fits

    with pytest.raises(NotImplementedError):
        day7_scale.check_layout_search(stub)
    with pytest.raises(AssertionError, match="does not fit"):
        day7_scale.check_layout_search(_search_with(states_only_fit))
    with pytest.raises(AssertionError, match="a faster one fits"):  # tp = 8 never tried: the 70B's best
        day7_scale.check_layout_search(_search_with(fits, tps=[1, 2, 4]))
    with pytest.raises(AssertionError, match="not a layout of this problem: dp x tp x pp = 0"):
        day7_scale.check_layout_search(lambda model, cluster, batch: Layout(cluster.gpus // 16, 16, 1, True, 1, True))
    from dlo import layout

    with pytest.raises(AssertionError, match="off limits"):
        day7_scale.check_layout_search(lambda *a: layout.search(*a))


def test_layout_search_must_raise_when_nothing_fits(sol):
    """Issue 34: what to return when no layout fits was unspecified; it is ValueError, and the check tries
    Llama 3.1 70B on 8 H100s (140 GB of model states per GPU)."""
    from dlo.layout import Cluster

    with pytest.raises(ValueError):
        sol.search_layout(day7_scale._model("llama3.1-70b", 4096), Cluster("H100 SXM", 8), 8)

    def none_when_nothing_fits(model, cluster, batch):
        try:
            return sol.search_layout(model, cluster, batch)
        except ValueError:
            return None

    with pytest.raises(AssertionError, match="must raise ValueError; it returned None"):
        day7_scale.check_layout_search(none_when_nothing_fits, seed=1, trials=1)


def test_both_checks_pass_under_the_grader(sandbox, sol, capsys):
    """Under the grader the student's functions run in the sandbox and only plain values come back: the
    layout a search returns arrives as a handle to the student's object, read field by field (the
    check once refused it as "not a Layout", and the solution scored 0)."""
    sandbox.run(day7_scale.check_layout_search, sol.search_layout, seed=1, trials=1)
    sandbox.run(day7_scale.check_comm_compute, sol.fsdp_min_tokens, sol.tp_comm_ratio, seed=1, trials=3)
    assert capsys.readouterr().out.count(": ok (") == 2


def test_a_layout_with_a_wrong_field_type_is_refused(sol):
    from dlo.layout import Layout

    def bool_degree(model, cluster, batch):
        lay = sol.search_layout(model, cluster, batch)
        return Layout(True, lay.tp, lay.pp, lay.fsdp, lay.m, lay.ac)  # True == 1, but no degree

    with pytest.raises(AssertionError, match="its dp a int"):
        day7_scale.check_layout_search(bool_degree, trials=1)
