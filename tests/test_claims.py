"""dlo.claims: the verdict logic every claims table relies on (the logic, not any day's numbers)."""

import math

import pytest

from dlo import claims as C


def test_verdict_has_four_outcomes_decided_by_the_whole_interval():
    region = C.approx(2.0, rel=0.05)                       # [1.9, 2.1]
    assert C.verdict(C.Estimate(2.0, 1.95, 2.05), region) == C.AGREES
    assert C.verdict(C.Estimate(3.0, 2.5, 3.5), region) == C.DISAGREES
    # the point estimate inside, the interval straddling an edge: the noise decides nothing
    assert C.verdict(C.Estimate(2.0, 1.5, 2.5), region) == C.INCONCLUSIVE
    assert C.verdict(C.Estimate(2.5, 2.05, 2.95), region) == C.INCONCLUSIVE
    assert C.verdict(None, region) == C.NOT_MEASURABLE
    assert C.verdict(C.Estimate(math.nan, math.nan, math.nan), region) == C.NOT_MEASURABLE


def test_a_spread_wider_than_the_tolerance_is_not_an_agreement():
    # Day 2's old bug: a 7-point spread passed a 5-point equivalence tolerance.
    diff = C.from_samples([0.06, -0.01, 0.02])             # accuracy differences over three seeds
    assert diff.hi - diff.lo > 0.10
    assert C.verdict(diff, C.between(-0.05, 0.05)) == C.INCONCLUSIVE


def test_exact_values_agree_or_disagree_never_inconclusive():
    assert C.verdict(C.exact(16), C.approx(16, abs_tol=0.5)) == C.AGREES
    assert C.verdict(C.exact(18), C.approx(16, abs_tol=0.5)) == C.DISAGREES


def test_from_samples_is_a_t_interval_and_refuses_one_sample():
    est = C.from_samples([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)                      # t(2) * sd / sqrt(n)
    assert est.value == 2.0 and est.lo == pytest.approx(2 - half) and est.hi == pytest.approx(2 + half)
    with pytest.raises(ValueError, match="two repeats"):
        C.from_samples([1.0])


def test_binomial_is_wilson_and_stays_in_0_1():
    est = C.binomial(0, 10)
    assert est.lo == 0.0 and 0.2 < est.hi < 0.35             # Wilson's upper bound for 0/10 is ~0.28
    full = C.binomial(50, 50)
    assert full.hi == 1.0 and full.lo < 1.0
    assert C.accuracy(0.5, 100).value == 0.5
    with pytest.raises(ValueError):
        C.binomial(11, 10)


def test_median_interval_uses_order_statistics():
    times = list(range(1, 101))                            # 1..100
    est = C.median_interval(times)
    assert est.value == 50.5 and est.lo < 50.5 < est.hi and est.hi - est.lo < 30
    assert C.median_interval([3.0, 1.0, 2.0]) == C.Estimate(2.0, 1.0, 3.0, 3, "median of 3")


def test_ratio_difference_and_paired_difference():
    r = C.ratio(C.Estimate(4, 3, 5), C.Estimate(2, 1, 4))
    assert (r.value, r.lo, r.hi) == (2.0, 0.75, 5.0)
    with pytest.raises(ValueError):
        C.ratio(C.exact(1), C.Estimate(0, -1, 1))
    d = C.difference(C.Estimate(5, 4, 6), C.Estimate(2, 1, 3))
    assert d.value == 3 and d.half_width == pytest.approx(math.sqrt(2))
    # a shared per-seed offset cancels in the paired difference, not in the independent one
    xs, ys = [10.0, 20.0, 30.0], [9.0, 19.1, 28.9]
    assert C.paired_difference(xs, ys).half_width < 0.5
    with pytest.raises(ValueError, match="pair them"):
        C.paired_difference([1, 2], [1])


def test_regions_say_their_tolerance_and_refuse_nonsense():
    assert str(C.approx(2.0, rel=0.1)) == "2 +- 0.2"
    assert str(C.at_least(0.9)) == ">= 0.9"
    with pytest.raises(ValueError):
        C.approx(2.0)
    with pytest.raises(ValueError):
        C.between(2, 1)
    with pytest.raises(ValueError):
        C.Estimate(1.0, 2.0, 3.0)


def test_claims_table_keeps_not_measurable_rows_and_summary_counts_all_verdicts():
    rows = [C.Claim("bf16 matches fp32", "slides", "same accuracy", C.between(-0.01, 0.01), C.exact(0.0)),
            C.not_measurable("H100 bf16 speed-up", "slides", "2x", "no GPU in this run")]
    text = C.claims_table(rows)
    assert "not measurable here" in text and "no GPU in this run" in text and "agrees" in text
    assert C.summary(rows) == {C.AGREES: 1, C.DISAGREES: 0, C.INCONCLUSIVE: 0, C.NOT_MEASURABLE: 1}
    with pytest.raises(ValueError, match="say why"):
        C.Claim("x", "s", "c", C.at_least(1), None)


def test_a_rate_at_the_median_time_takes_the_interval_of_the_time():
    # MFU 0.36 measured at the median of 1.0 s; the median's interval [0.99, 1.01] maps through 1/t
    est = C.per_median_time(0.36, [1.0, 1.01, 0.99])
    assert est.value == pytest.approx(0.36) and (est.lo, est.hi) == pytest.approx((0.36 / 1.01, 0.36 / 0.99))
    assert C.per_median_time(0.36, [1.0]) is None  # one timing: no interval, "not measurable here"
    assert C.verdict(C.per_median_time(0.36, [1.0]), C.between(0.33, 0.39)) == C.NOT_MEASURABLE
