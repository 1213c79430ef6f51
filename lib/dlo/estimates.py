"""Estimates: a measured value with the 95% interval that says how much it would move if the run were repeated.

A measurement is an `Estimate`: a t-interval over seeds (`from_samples`), a Wilson interval for an
accuracy on n test samples (`binomial`, `accuracy`), an interval of the median for timings
(`median_interval`), an exact count (`exact`), or one derived from others (`ratio`, `difference`,
`paired_difference`, `paired_examples`). `dlo.claims` turns an estimate and a claimed region into a
verdict; this module only measures, and enforces the two rules that decide whether a number is
evidence at all (an `Estimate` carries `reason` when it is not, and its verdict is then "not
measurable here (<reason>)"):

1. No interval from fewer than 3 samples: `from_samples`, `median_interval`, `paired_difference`
   with n < 3 give an estimate without an interval.
2. Two trainings compared on a shared test set are paired by seed over >= 3 seeds
   (`paired_difference`); `difference` of two accuracies on one test set is refused as evidence
   ("one seed"). Two arms that share their weights (a model and its quantised copy) have no
   training noise: compare them per example with `paired_examples` (McNemar's paired interval).

A comparison records how its two arms were paired (`Estimate.pairing`: "paired by seed", "McNemar",
"unpaired"), a value computed by a formula rather than measured says so (`formula`, kind FORMULA), and
so does a value the code under test reports about itself (`self_reported`: its own counter, its state's
bookkeeping, the copies it built and then counts; `Estimate.provenance` SELF_REPORTED): all show in
`basis`, the claims table's "evidence" column, where `dlo.claims_audit` checks them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

MIN_SAMPLES = 3  # rule 1: the fewest repeats (seeds, timings, trials) an interval is computed from

# Estimate.kind: how the interval was obtained (rule 2 reads it)
EXACT, REPEATS, TEST_SET, TIMINGS, PAIRED = "exact", "repeats", "test set", "timings", "paired examples"
FORMULA = "formula"  # computed, not measured: a row built on it restates its formula (by construction or planned)
# Estimate.provenance: a measured side read from the code under test itself cannot disagree with that code
SELF_REPORTED = "self-reported"
# Estimate.pairing: how a comparison's two arms were matched (shown in the evidence column)
PAIRED_BY_SEED, MCNEMAR, UNPAIRED = "paired by seed", "McNemar", "unpaired"

# Two-sided 95% quantiles of Student's t for df = 1..30 (beyond: the normal 1.96).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
Z95 = 1.959964


def t95(df: int) -> float:
    """Two-sided 95% Student-t quantile with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t95: need df >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else Z95


@dataclass(frozen=True)
class Estimate:
    """A measured value with a 95% interval [lo, hi] and how that interval was obtained.

    `kind` says what the interval covers (EXACT, REPEATS, TEST_SET, TIMINGS, PAIRED, FORMULA or ""
    when built by hand); `pairing` how a comparison's arms were matched ("" for one quantity); a
    non-empty `reason` says why this estimate is no evidence here (its verdict is then "not
    measurable here (<reason>)"), while its value is still shown."""

    value: float
    lo: float
    hi: float
    n: int = 1
    how: str = ""  # "t over 3 seeds", "Wilson, n=512", "median of 20 timings", "exact"
    kind: str = ""
    reason: str = ""
    setup: str = ""  # where a timing was taken, once `timed` has checked it ("1 rank x 2 threads on 2 cores")
    pairing: str = ""  # PAIRED_BY_SEED, MCNEMAR, UNPAIRED for a difference or ratio of two measured arms
    provenance: str = ""  # SELF_REPORTED: read from the code under test's own bookkeeping (`self_reported`)

    def __post_init__(self):
        if not self.lo <= self.value <= self.hi and not any(map(math.isnan, (self.value, self.lo, self.hi))):
            raise ValueError(f"Estimate: need lo <= value <= hi, got {self.lo} <= {self.value} <= {self.hi}")

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def scaled(self, factor: float) -> Estimate:
        """The same estimate in other units (x100 for percent, 1e3 for ms)."""
        lo, hi = sorted((self.lo * factor, self.hi * factor))
        return replace(self, value=self.value * factor, lo=lo, hi=hi)

    @property
    def basis(self) -> str:
        """What the interval rests on, for the table's "evidence" column (read by dlo.claims_audit)."""
        if self.kind in (EXACT, FORMULA):
            return ", ".join(filter(None, [self.kind, self.provenance]))
        what = {REPEATS: "repeats", TEST_SET: "test examples", TIMINGS: "timings", PAIRED: "paired examples"}
        return ", ".join(filter(None, [f"{self.n} {what.get(self.kind, 'samples')}", self.pairing, self.provenance,
                                       self.setup]))

    def __str__(self) -> str:
        if self.reason or self.lo == self.hi:
            return format_number(self.value) + (" (no evidence)" if self.reason else "")
        return f"{format_number(self.value)} [{format_number(self.lo)}, {format_number(self.hi)}]"


def format_number(x: float) -> str:
    """x in 3 significant digits (thousands separated, small values in e-notation), for tables."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    mag = abs(x)
    if mag >= 1000:
        return f"{x:,.0f}"
    if mag >= 0.01:
        return significant(x)
    return f"{x:.2e}"


def significant(x: float, digits: int = 3, most: int = 6) -> str:
    """x in `digits` significant digits, more (up to `most`) while the rounding shows a whole number that x is
    not: a ratio of 1.0044 prints "1.004", never "1", which a reader would take for no effect at all."""
    for d in range(digits, most + 1):
        text = f"{x:.{d}g}"
        shown = float(text)
        if shown != round(shown) or math.isclose(shown, x, rel_tol=1e-9):
            return text
    return text


def _too_few(n: int, what: str = "samples") -> str:
    return "one seed" if n == 1 and what == "seeds" else f"{n} {what} < {MIN_SAMPLES}"


def exact(value: float, how: str = "exact") -> Estimate:
    """A quantity without noise: counted bytes, a parameter count, a deterministic output."""
    return Estimate(float(value), float(value), float(value), 1, how, EXACT)


def formula(value: float, how: str = "formula") -> Estimate:
    """A value computed by a formula, not measured: shown beside a claim, it restates that formula, so
    `dlo.claims.Claim` accepts it only on a by-construction or planned row."""
    return Estimate(float(value), float(value), float(value), 1, how, FORMULA)


def self_reported(value: float | Estimate, how: str = "") -> Estimate:
    """A value the code under test reports about itself: a course engine's own counter of what it sent, its
    state's bookkeeping of what it holds, a function counting the copies it built. It agrees with that code
    whatever the code does, so `dlo.claims.Claim` accepts it only on a by-construction or planned row (as a
    formula); read the same quantity from outside the code (a counter on the wire, the allocator) to make
    it evidence. A number gives an exact-valued estimate, an Estimate keeps its interval."""
    est = value if isinstance(value, Estimate) else exact(value)
    return replace(est, how=how or est.how, provenance=SELF_REPORTED)


def from_samples(xs, how: str = "", what: str = "samples", pairing: str = "") -> Estimate:
    """Mean of repeats (seeds, runs) with a Student-t 95% interval; fewer than MIN_SAMPLES repeats
    give the mean without an interval (rule 1: `reason` says how many; `what` names them). `pairing`:
    how each x compared two arms, when it is one's difference or ratio to the other on the same seed
    or batch (PAIRED_BY_SEED, "paired by batch"; shown in the evidence column)."""
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("from_samples: no values")
    mean = statistics.fmean(xs)
    if len(xs) < MIN_SAMPLES:
        return Estimate(mean, mean, mean, len(xs), how or f"mean of {len(xs)} {what}", REPEATS,
                        _too_few(len(xs), what), pairing=pairing)
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Estimate(mean, mean - half, mean + half, len(xs), how or f"mean, t-interval over {len(xs)} {what}",
                    REPEATS, pairing=pairing)


def binomial(successes: int, n: int, how: str = "") -> Estimate:
    """An accuracy k/n with its Wilson 95% interval (good at small n and near 0 or 1)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"binomial: need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p, z = successes / n, Z95
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # min/max with p: at k = 0 or k = n the bound equals p in exact arithmetic, not always in floats
    lo, hi = min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))
    return Estimate(p, lo, hi, n, how or f"Wilson, n={n}", TEST_SET)


def accuracy(acc: float, n: int, how: str = "") -> Estimate:
    """`binomial` from an accuracy in [0, 1] measured on n samples."""
    return binomial(round(acc * n), n, how)


def median_interval(times, how: str = "") -> Estimate:
    """Median of repeated timings with a distribution-free 95% interval from order statistics
    (the ranks n/2 -+ 1.96 sqrt(n)/2); 3 to 5 timings give the min-max range, fewer no interval."""
    xs = sorted(float(t) for t in times)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval: no timings")
    med = statistics.median(xs)
    if n < MIN_SAMPLES:
        return Estimate(med, med, med, n, how or f"median of {n}", TIMINGS, _too_few(n, "timings"))
    if n < 6:
        lo, hi = xs[0], xs[-1]
    else:
        k = Z95 * math.sqrt(n) / 2
        lo, hi = xs[max(0, math.floor(n / 2 - k) - 1)], xs[min(n - 1, math.ceil(n / 2 + k))]
    return Estimate(med, min(lo, med), max(hi, med), n, how or f"median of {n}", TIMINGS)


def per_median_time(value: float, times, how: str = "") -> Estimate | None:
    """A rate measured at the median of `times` (throughput, MFU: inversely proportional to the step
    time), with the interval the median's interval gives it; None for fewer than 2 timings, no
    interval (rule 1) for fewer than MIN_SAMPLES."""
    if len(times) < 2:
        return None
    t = median_interval(times)
    return ratio(exact(value * t.value), t, how or f"at the median of {t.n} steps")


def _reason(*ests: Estimate) -> str:
    return next((e.reason for e in ests if e.reason), "")


def _combined(a: Estimate, b: Estimate) -> tuple[str, str, str, str, str]:
    """kind, reason, setup, pairing and provenance of an estimate computed from a and b: a factor without
    noise (exact or a formula: a measurement against its prediction) keeps the other's; two measured arms
    are unpaired; a self-reported factor makes the result self-reported."""
    noiseless = {EXACT, FORMULA}
    kinds = {a.kind, b.kind} - noiseless
    kind = kinds.pop() if len(kinds) == 1 else "" if kinds else EXACT if EXACT in (a.kind, b.kind) else FORMULA
    setup = a.setup if a.setup == b.setup or not b.setup else b.setup if not a.setup else ""
    if a.kind in noiseless or b.kind in noiseless:
        pairing = b.pairing if a.kind in noiseless else a.pairing
    else:
        pairing = UNPAIRED
    provenance = SELF_REPORTED if SELF_REPORTED in (a.provenance, b.provenance) else ""
    return kind, _reason(a, b), setup, pairing, provenance


def _n(a: Estimate, b: Estimate) -> int:
    """The samples an estimate computed from a and b rests on (a factor without noise adds none)."""
    noisy = [e.n for e in (a, b) if e.kind not in (EXACT, FORMULA)]
    return min(noisy or [a.n, b.n])


def ratio(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a / b, both positive, with the interval of the quotient of the two intervals (conservative)."""
    if b.lo <= 0 or a.lo < 0:
        raise ValueError("ratio: needs a >= 0 and b > 0 over their whole intervals")
    return Estimate(a.value / b.value, a.lo / b.hi, a.hi / b.lo, _n(a, b), how or "ratio of intervals",
                    *_combined(a, b))


def difference(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a - b for independent estimates: half-widths added in quadrature (normal approximation).
    Two accuracies on one test set are not independent (rule 2): their difference carries the
    reason "one seed" (pair the runs by seed with `paired_difference`, or per example)."""
    half = math.hypot(a.half_width, b.half_width)
    d = a.value - b.value
    kind, reason, setup, pairing, provenance = _combined(a, b)
    reason = reason or ("one seed" if a.kind == b.kind == TEST_SET else "")
    return Estimate(d, d - half, d + half, _n(a, b), how or "difference, independent", kind, reason, setup,
                    pairing, provenance)


def paired_difference(xs, ys, how: str = "") -> Estimate:
    """Mean of xs[i] - ys[i] over paired repeats (same seed for both arms): the seed's own noise
    cancels. Fewer than MIN_SAMPLES pairs: no interval ("one seed", "2 seeds < 3")."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"paired_difference: {len(xs)} and {len(ys)} values; pair them by seed")
    return from_samples([x - y for x, y in zip(xs, ys)], how or f"paired over {len(xs)} seeds", "seeds",
                        PAIRED_BY_SEED)


def paired_ratio(xs, ys, how: str = "") -> Estimate:
    """Mean of xs[i] / ys[i] over paired repeats (same seed for both arms, e.g. a student's accuracy over
    its teacher's), with `from_samples`'s t-interval (none under MIN_SAMPLES)."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"paired_ratio: {len(xs)} and {len(ys)} values; pair them by seed")
    return from_samples([x / y for x, y in zip(xs, ys)], how or f"ratio paired over {len(xs)} seeds", "seeds",
                        PAIRED_BY_SEED)


def paired_log_ratio(xs, ys, how: str = "") -> Estimate:
    """Geometric mean of xs[i] / ys[i] over paired repeats, with the t-interval of the mean log ratio taken
    back through exp: for positive scale quantities whose noise is multiplicative (an estimate of a ratio of
    variances, a speed-up), where the arithmetic ratio's interval is dominated by its largest repeat.
    Every value must be positive; fewer than MIN_SAMPLES pairs: no interval."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"paired_log_ratio: {len(xs)} and {len(ys)} values; pair them by seed")
    if not all(x > 0 and y > 0 for x, y in zip(xs, ys)):
        raise ValueError(f"paired_log_ratio: every value must be > 0, got {xs} and {ys}")
    logs = from_samples([math.log(x / y) for x, y in zip(xs, ys)], how or f"geometric mean ratio over {len(xs)} seeds",
                        "seeds", PAIRED_BY_SEED)
    return replace(logs, value=math.exp(logs.value), lo=math.exp(logs.lo), hi=math.exp(logs.hi))


def paired_examples(correct_a, correct_b, how: str = "") -> Estimate:
    """Accuracy of a minus accuracy of b on the same test examples (per-example 0/1 correctness),
    with McNemar's paired interval: only the discordant examples carry the difference. For arms
    that share their weights (a model and its quantised copy); two trainings need seeds (rule 2)."""
    a, b = [bool(x) for x in correct_a], [bool(x) for x in correct_b]
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_examples: {len(a)} and {len(b)} examples; score both arms on the same examples")
    n = len(a)
    n10, n01 = sum(x and not y for x, y in zip(a, b)), sum(y and not x for x, y in zip(a, b))
    d = (n10 - n01) / n
    half = Z95 * math.sqrt(max(n10 + n01 - n * d * d, 0.0)) / n
    return Estimate(d, d - half, d + half, n, how or f"McNemar paired, n={n} ({n10} vs {n01} discordant)", PAIRED,
                    pairing=MCNEMAR)
