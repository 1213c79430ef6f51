"""dlo.claims: the verdict logic every claims table relies on (the logic, not any day's numbers)."""

import math
import os

import pytest

from dlo import claims as C
from dlo import estimates as E


def test_verdict_has_four_outcomes_decided_by_the_whole_interval():
    region = C.approx(2.0, rel=0.05)                       # [1.9, 2.1]
    assert C.verdict(E.Estimate(2.0, 1.95, 2.05), region) == C.AGREES
    assert C.verdict(E.Estimate(3.0, 2.5, 3.5), region) == C.DISAGREES
    # the point estimate inside, the interval straddling an edge: the noise decides nothing
    assert C.verdict(E.Estimate(2.0, 1.5, 2.5), region) == C.INCONCLUSIVE
    assert C.verdict(E.Estimate(2.5, 2.05, 2.95), region) == C.INCONCLUSIVE
    assert C.verdict(None, region) == C.NOT_MEASURABLE
    assert C.verdict(E.Estimate(math.nan, math.nan, math.nan), region) == C.NOT_MEASURABLE


def test_a_spread_wider_than_the_tolerance_is_not_an_agreement():
    # Day 2's old bug: a 7-point spread passed a 5-point equivalence tolerance.
    diff = E.from_samples([0.06, -0.01, 0.02])             # accuracy differences over three seeds
    assert diff.hi - diff.lo > 0.10
    assert C.verdict(diff, C.between(-0.05, 0.05)) == C.INCONCLUSIVE


def test_exact_values_agree_or_disagree_never_inconclusive():
    assert C.verdict(E.exact(16), C.approx(16, abs_tol=0.5)) == C.AGREES
    assert C.verdict(E.exact(18), C.approx(16, abs_tol=0.5)) == C.DISAGREES


def test_from_samples_is_a_t_interval_and_gives_none_from_fewer_than_three():
    est = E.from_samples([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)                      # t(2) * sd / sqrt(n)
    assert est.value == 2.0 and est.lo == pytest.approx(2 - half) and est.hi == pytest.approx(2 + half)
    assert not est.reason
    for xs in ([1.0], [1.0, 2.0]):                         # rule 1: no interval from 1 or 2 samples
        few = E.from_samples(xs)
        assert few.reason == f"{len(xs)} samples < 3" and few.lo == few.hi == few.value
        assert C.verdict(few, C.at_least(-100)) == C.NOT_MEASURABLE
    with pytest.raises(ValueError, match="no values"):
        E.from_samples([])


def test_binomial_is_wilson_and_stays_in_0_1():
    est = E.binomial(0, 10)
    assert est.lo == 0.0 and 0.2 < est.hi < 0.35             # Wilson's upper bound for 0/10 is ~0.28
    full = E.binomial(50, 50)
    assert full.hi == 1.0 and full.lo < 1.0
    assert E.accuracy(0.5, 100).value == 0.5
    with pytest.raises(ValueError):
        E.binomial(11, 10)


def test_median_interval_uses_order_statistics():
    times = list(range(1, 101))                            # 1..100
    est = E.median_interval(times)
    assert est.value == 50.5 and est.lo < 50.5 < est.hi and est.hi - est.lo < 30
    assert E.median_interval([3.0, 1.0, 2.0]) == E.Estimate(2.0, 1.0, 3.0, 3, "median of 3", E.TIMINGS)


def test_ratio_difference_and_paired_difference():
    r = E.ratio(E.Estimate(4, 3, 5), E.Estimate(2, 1, 4))
    assert (r.value, r.lo, r.hi) == (2.0, 0.75, 5.0)
    with pytest.raises(ValueError):
        E.ratio(E.exact(1), E.Estimate(0, -1, 1))
    d = E.difference(E.Estimate(5, 4, 6), E.Estimate(2, 1, 3))
    assert d.value == 3 and d.half_width == pytest.approx(math.sqrt(2))
    # a shared per-seed offset cancels in the paired difference, not in the independent one
    xs, ys = [10.0, 20.0, 30.0], [9.0, 19.1, 28.9]
    assert E.paired_difference(xs, ys).half_width < 0.5
    with pytest.raises(ValueError, match="pair them"):
        E.paired_difference([1, 2], [1])


def test_a_paired_log_ratio_is_a_geometric_mean_with_an_interval_symmetric_on_logs():
    ys = [60.0, 47.0, 63.0]
    g = E.paired_log_ratio([2 * ys[0], 8 * ys[1], 4 * ys[2]], ys)  # ratios 2, 8, 4: geometric mean 4
    assert g.value == pytest.approx(4.0) and g.lo * g.hi == pytest.approx(16.0) and g.lo < 4.0 < g.hi
    assert g.pairing == E.PAIRED_BY_SEED and g.kind == E.REPEATS and not g.reason
    assert E.paired_log_ratio([2.0, 3.0], [1.0, 1.0]).reason == "2 seeds < 3"
    with pytest.raises(ValueError, match="> 0"):
        E.paired_log_ratio([1.0, -2.0, 3.0], [1.0, 1.0, 1.0])
    # noise that scales with the value (Day 1's noise scale: 47-63 at the start, 230-403 at the end): the
    # difference's interval is set by the noisiest seed and nearly reaches 0, the ratio's stays well above 1
    start, end = [60.0, 47.0, 63.0], [275.0, 403.0, 230.0]
    assert E.paired_difference(end, start).lo < 0.02 * E.paired_difference(end, start).value
    assert E.paired_log_ratio(end, start).lo > 1.5


def test_regions_say_their_tolerance_and_refuse_nonsense():
    assert str(C.approx(2.0, rel=0.1)) == "2 +- 0.2"
    assert str(C.at_least(0.9)) == ">= 0.9"
    with pytest.raises(ValueError):
        C.approx(2.0)
    with pytest.raises(ValueError):
        C.between(2, 1)
    with pytest.raises(ValueError):
        E.Estimate(1.0, 2.0, 3.0)


def test_a_number_near_a_whole_one_shows_the_digits_that_tell_it_apart():
    # 3 significant digits, more where the rounding would read as a whole number x is not
    assert E.format_number(1.0044) == "1.004" and E.format_number(0.9996) == "0.9996"
    assert str(E.Estimate(1.0044, 1.001, 1.0078)) == "1.004 [1.001, 1.01]"
    assert E.format_number(1.0) == "1" and E.format_number(1.0000001) == "1"  # float noise stays hidden
    assert E.format_number(1.23456) == "1.23" and E.format_number(2.004) == "2.004"
    assert E.format_number(1234.5) == "1,234" and E.format_number(0.00123) == "1.23e-03"
    from dlo.tables import format_cell
    assert format_cell(1.0044) == "1.004" and format_cell(0.5) == "0.5"


def test_claims_table_keeps_not_measurable_rows_and_summary_counts_all_verdicts():
    rows = [C.Claim("bf16 matches fp32", "slides", "same accuracy", C.between(-0.01, 0.01), E.exact(0.0)),
            C.not_measurable("H100 bf16 speed-up", "slides", "2x", "no GPU in this run")]
    text = C.claims_table(rows)
    assert "not measurable here" in text and "no GPU in this run" in text and "agrees" in text
    assert C.summary(rows) == {**dict.fromkeys(C.VERDICTS, 0), C.AGREES: 1, C.NOT_MEASURABLE: 1}
    assert C.evidence(rows) == rows[:1]
    with pytest.raises(ValueError, match="say why"):
        C.Claim("x", "s", "c", C.at_least(1), None)


def test_a_rate_at_the_median_time_takes_the_interval_of_the_time():
    # MFU 0.36 measured at the median of 1.0 s; the median's interval [0.99, 1.01] maps through 1/t
    est = E.per_median_time(0.36, [1.0, 1.01, 0.99])
    assert est.value == pytest.approx(0.36) and (est.lo, est.hi) == pytest.approx((0.36 / 1.01, 0.36 / 0.99))
    assert E.per_median_time(0.36, [1.0]) is None  # one timing: no interval, "not measurable here"
    assert C.verdict(E.per_median_time(0.36, [1.0]), C.between(0.33, 0.39)) == C.NOT_MEASURABLE


# ----------------------------------------------------------------------------- the rules, with fixed numbers

def test_rule1_no_interval_from_fewer_than_three_samples():
    assert E.median_interval([1.0, 2.0]).reason == "2 timings < 3"
    assert E.median_interval([1.0, 2.0, 3.0]) == E.Estimate(2.0, 1.0, 3.0, 3, "median of 3", E.TIMINGS)
    rate = E.per_median_time(0.36, [1.0, 1.1])               # two timings: a value, no interval
    assert rate.reason and C.verdict(rate, C.at_least(0)) == C.NOT_MEASURABLE
    # the reason travels through ratio, difference and scaling
    assert E.ratio(E.exact(1), E.from_samples([1.0, 2.0])).reason == "2 samples < 3"
    assert E.difference(E.from_samples([1.0]), E.exact(0)).scaled(100).reason == "1 samples < 3"


def test_rule2_one_seed_on_a_shared_test_set_is_not_evidence():
    # Day 1's old LAMB row: four accuracies on one test set of 2048 images, one seed, Wilson intervals
    # added in quadrature as if independent -> now "not measurable here (one seed)"
    a, b = E.accuracy(0.60, 2048), E.accuracy(0.70, 2048)
    d = E.difference(a, b)
    assert d.reason == "one seed" and C.Claim("x", "s", "c", C.at_most(0), d).verdict == C.NOT_MEASURABLE
    row = C.Claim("x", "s", "c", C.at_most(0), d).row()
    assert row["verdict"] == "not measurable here (one seed)"
    # paired over one or two seeds: no interval; over three: a t-interval of the per-seed differences
    assert E.paired_difference([0.6], [0.7]).reason == "one seed"
    assert E.paired_difference([0.6, 0.61], [0.7, 0.7]).reason == "2 seeds < 3"
    three = E.paired_difference([0.60, 0.61, 0.62], [0.70, 0.70, 0.71])   # differences -0.10, -0.09, -0.09
    assert not three.reason and three.value == pytest.approx(-0.28 / 3) and three.hi < 0
    # independent estimates of other kinds (timings of two programs) still subtract
    assert not E.difference(E.median_interval([1, 2, 3]), E.median_interval([1, 2, 3])).reason


def test_rule2_per_example_pairing_mcnemar():
    # 100 examples: 80 both right, 6 only a right, 2 only b right, 12 both wrong
    a = [1] * 80 + [1] * 6 + [0] * 2 + [0] * 12
    b = [1] * 80 + [0] * 6 + [1] * 2 + [0] * 12
    d = E.paired_examples(a, b)
    half = 1.959964 * math.sqrt(8 - 100 * 0.04 ** 2) / 100       # sqrt(n10 + n01 - n d^2) / n
    assert d.value == pytest.approx(0.04) and d.half_width == pytest.approx(half) and d.kind == E.PAIRED
    # much narrower than two independent Wilson intervals of 0.86 and 0.82 on the same 100 examples
    assert d.half_width < 0.6 * E.difference(E.accuracy(0.86, 100), E.accuracy(0.82, 100)).half_width
    with pytest.raises(ValueError, match="same examples"):
        E.paired_examples([1, 0], [1])


def test_rule3_wall_clock_needs_the_hardware_it_claims():
    t = E.median_interval([1.0, 1.1, 0.9, 1.0, 1.05, 0.95])
    on_gpu = C.timed(t, device="cuda", gpu_claim=True, cores=8)
    assert not on_gpu.reason and on_gpu.basis == "6 timings, 1 rank(s) x 1 thread(s) on 8 cores, cuda, GPU claim"
    assert C.timed(t, device="cuda", cores=8).basis == "6 timings, 1 rank(s) x 1 thread(s) on 8 cores, cuda"
    assert C.timed(t, device="cpu", gpu_claim=True, cores=16).reason == "GPU claim timed on cpu"
    assert not C.timed(t, device="cpu", world_size=2, cores=2).reason             # 2 ranks x 1 thread on 2 cores
    late = C.timed(t, device="cpu", world_size=2, kernel=True, cores=2)           # + the notebook's kernel
    assert late.reason == "2 rank(s) x 1 thread(s) + kernel > 2 cores" and late.value == t.value
    assert C.timed(t, device="cpu", threads=4, cores=2).reason.endswith("> 2 cores")
    row = C.Claim("compile: fewer kernel launches, faster", "s", "1.3x", C.at_least(1), late).row()
    assert row["verdict"].startswith("not measurable here (") and "no evidence" in row["measured [95% interval]"]
    # a speed-up of two checked timings keeps the setup; an exact factor keeps the kind
    fast = C.timed(E.median_interval([0.5, 0.55, 0.45]), device="cpu", cores=2)
    slow = C.timed(E.median_interval([1.0, 1.1, 0.9]), device="cpu", cores=2)
    assert E.ratio(slow.scaled(2), fast).basis == "3 timings, unpaired, 1 rank(s) x 1 thread(s) on 2 cores, cpu"


def test_control_that_meets_the_claim_too_gets_its_own_verdict():
    # Day 8's distillation: the student keeps 97% of the teacher, the labels-only control 98%
    keeps = E.Estimate(0.97, 0.96, 0.98, 5, kind=E.REPEATS)
    control = E.Estimate(0.98, 0.97, 0.99, 5, kind=E.REPEATS)
    region = C.at_least(0.95)
    c = C.Claim("distilled student keeps >= 95%", "Hinton et al.", "97%", region, keeps, control=control)
    assert c.verdict == C.CONTROL_TOO and c in C.evidence([c])
    assert c.row()["control"] == "0.98 [0.97, 0.99] (agrees)"  # its own verdict, read by dlo.claims_audit
    below = E.Estimate(0.90, 0.88, 0.92, 5, kind=E.REPEATS)
    assert C.Claim("x", "s", "c", region, keeps, control=below).verdict == C.AGREES
    assert C.Claim("x", "s", "c", region, below, control=control).verdict == C.DISAGREES


def test_an_agreeing_row_whose_control_may_meet_the_claim_is_inconclusive():
    """Day 8's DistilBERT row (issue 34): the labels-only control kept 0.997 [0.965, 1.03] of the teacher
    against ">= 0.97"; its interval reaches the region, so it could not fail, and the row said "agrees"."""
    region = C.at_least(0.97, ">= 0.97")
    distilled = E.Estimate(1.0, 0.99, 1.01, 3, kind=E.REPEATS)
    wide = E.Estimate(0.997, 0.965, 1.03, 3, kind=E.REPEATS)
    c = C.Claim("the student keeps 97% of the teacher", "Sanh et al. 2019", ">= 0.97", region, distilled,
                control=wide)
    assert c.verdict == C.INCONCLUSIVE and c.row()["control"] == "0.997 [0.965, 1.03] (inconclusive at this scale)"
    two_seeds = E.from_samples([0.99, 1.0])  # no interval: a control that cannot be judged credits nothing
    assert C.Claim("x", "s", "c", region, distilled, control=two_seeds).verdict == C.INCONCLUSIVE


def test_by_construction_and_planned_rows_are_shown_but_not_evidence():
    forced = C.by_construction("GradScaler skips >= 1 step", "Micikevicius et al.", ">= 1 skip",
                               "a 2^40 starting scale overflows the first step", E.exact(3))
    plan = C.planned("AdamW state 16 B/param", "ZeRO", "16 B", C.approx(16, abs_tol=0.5), E.exact(16))
    rows = [forced, plan]
    assert forced.verdict == C.BY_CONSTRUCTION and plan.verdict == C.PLANNED and C.evidence(rows) == []
    assert C.summary(rows)[C.BY_CONSTRUCTION] == 1 and C.summary(rows)[C.PLANNED] == 1
    text = C.claims_table(rows)
    assert "2^40" in text and "agrees" not in text and "planned" in text
    with pytest.raises(ValueError, match="say why"):
        C.by_construction("x", "s", "c", "")
    with pytest.raises(ValueError, match="basis"):
        C.Claim("x", "s", "c", C.at_least(0), E.exact(1), "w", basis="agrees")


def test_not_tested_is_its_own_kind_never_evidence_and_needs_a_reason():
    row = C.not_tested("0/1 Adam saves 87% of the data", "Lu et al. 2022", "87%", "not implemented in this course")
    assert row.verdict == C.NOT_TESTED and row not in C.evidence([row])
    assert C.summary([row])[C.NOT_TESTED] == 1 and "not implemented" in row.row()["how"]
    with pytest.raises(ValueError):
        C.not_tested("x", "s", "c", "")


def test_a_timing_beside_another_notebook_counts_on_its_share_of_the_cores(monkeypatch):
    """`dlo run --jobs 2` on 2 cores gives each notebook DLO_CORES=1: one rank and the kernel then need
    more than the share, so the row is no evidence; unset, unreadable or above the mask, the mask counts."""
    from dlo.harness.run import share_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("DLO_CORES", raising=False)
    assert C.cpu_cores() == 2 and share_env(1) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert share_env(2) == {"DLO_CORES": "1"}  # the threads already set are left alone
    est = E.Estimate(1.2, 1.1, 1.3)
    assert C.timed(est, device="cpu", kernel=True).reason == ""
    for value, cores in (("1", 1), ("8", 2), ("", 2), ("x", 2), ("0", 2)):
        monkeypatch.setenv("DLO_CORES", value)
        assert C.cpu_cores() == cores
    monkeypatch.setenv("DLO_CORES", "1")
    assert C.timed(est, device="cpu", kernel=True).reason == "1 rank(s) x 1 thread(s) + kernel > 1 cores"


def test_the_control_column_is_printed_once_whichever_row_has_one():
    """Days 9 and 11 ordered their rows to dodge it: a first row with a control printed the column twice."""
    est = E.Estimate(0.97, 0.96, 0.98, 5, kind=E.REPEATS)
    with_control = C.Claim("with a control", "s", ">= 0.95", C.at_least(0.95), est,
                           control=E.Estimate(0.5, 0.4, 0.6, 5, kind=E.REPEATS))
    plain = C.Claim("without", "s", ">= 0.95", C.at_least(0.95), est)
    for rows in ([with_control, plain], [plain, with_control]):
        header = C.claims_table(rows).splitlines()[0].split()
        assert header.count("control") == 1 and header[-1] == "verdict"
