"""Claimed vs measured: one place that turns a measurement and its uncertainty into a verdict.

A claim of the course material ("bf16 trains to the same accuracy as fp32", "the ring sends
2(N-1)/N of the data") is a *region* of values: `Approx(2.0, rel=0.05)`, `AtLeast(0.9)`,
`Between(-0.01, 0.01)`. A measurement is an `Estimate`: a value with an interval that says how
much it would move if the run were repeated (a t-interval over seeds, a Wilson interval for an
accuracy on n test samples, an interval of the median for timings). The verdict compares the two,
the way an equivalence test does:

- **agrees**: the whole interval lies inside the claimed region;
- **disagrees**: the whole interval lies outside it;
- **inconclusive at this scale**: the interval straddles the region's edge (the noise is larger
  than the effect; more seeds, samples or a bigger run would decide);
- **not measurable here**: no measurement (a GPU claim on a CPU run, say), with the reason.

Every claims table of the course goes through `verdict` and `claims_table`, so a "yes" is never
printed where the numbers do not support it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive at this scale"
NOT_MEASURABLE = "not measurable here"
VERDICTS = (AGREES, DISAGREES, INCONCLUSIVE, NOT_MEASURABLE)

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


# ----------------------------------------------------------------------------- estimates

@dataclass(frozen=True)
class Estimate:
    """A measured value with a 95% interval [lo, hi] and how that interval was obtained."""

    value: float
    lo: float
    hi: float
    n: int = 1
    how: str = ""  # "t over 3 seeds", "Wilson, n=512", "median of 20 timings", "exact"

    def __post_init__(self):
        if not self.lo <= self.value <= self.hi and not any(map(math.isnan, (self.value, self.lo, self.hi))):
            raise ValueError(f"Estimate: need lo <= value <= hi, got {self.lo} <= {self.value} <= {self.hi}")

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def scaled(self, factor: float) -> Estimate:
        """The same estimate in other units (x100 for percent, 1e3 for ms)."""
        lo, hi = sorted((self.lo * factor, self.hi * factor))
        return Estimate(self.value * factor, lo, hi, self.n, self.how)

    def __str__(self) -> str:
        if self.lo == self.hi:
            return _num(self.value)
        return f"{_num(self.value)} [{_num(self.lo)}, {_num(self.hi)}]"


def _num(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    mag = abs(x)
    if mag >= 1000:
        return f"{x:,.0f}"
    if mag >= 0.01:
        return f"{x:.3g}"
    return f"{x:.2e}"


def exact(value: float, how: str = "exact") -> Estimate:
    """A quantity without noise: counted bytes, a parameter count, a deterministic output."""
    return Estimate(float(value), float(value), float(value), 1, how)


def from_samples(xs, how: str = "") -> Estimate:
    """Mean of repeats (seeds, runs) with a Student-t 95% interval; one sample gives a zero-width
    interval only if the caller says so with `exact`, so a single value is refused here."""
    xs = [float(x) for x in xs]
    if len(xs) < 2:
        raise ValueError("from_samples: need at least two repeats to know the noise (use exact() for one "
                         "deterministic value)")
    mean, sd = statistics.fmean(xs), statistics.stdev(xs)
    half = t95(len(xs) - 1) * sd / math.sqrt(len(xs))
    return Estimate(mean, mean - half, mean + half, len(xs), how or f"mean, t-interval over {len(xs)} repeats")


def binomial(successes: int, n: int, how: str = "") -> Estimate:
    """An accuracy k/n with its Wilson 95% interval (good at small n and near 0 or 1)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"binomial: need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p, z = successes / n, Z95
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # min/max with p: at k = 0 or k = n the bound equals p in exact arithmetic, not always in floats
    lo, hi = min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))
    return Estimate(p, lo, hi, n, how or f"Wilson, n={n}")


def accuracy(acc: float, n: int, how: str = "") -> Estimate:
    """`binomial` from an accuracy in [0, 1] measured on n samples."""
    return binomial(round(acc * n), n, how)


def median_interval(times, how: str = "") -> Estimate:
    """Median of repeated timings with a distribution-free 95% interval from order statistics
    (the ranks n/2 -+ 1.96 sqrt(n)/2); fewer than 6 timings give the min-max range."""
    xs = sorted(float(t) for t in times)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval: no timings")
    med = statistics.median(xs)
    if n < 6:
        lo, hi = xs[0], xs[-1]
    else:
        k = Z95 * math.sqrt(n) / 2
        lo, hi = xs[max(0, math.floor(n / 2 - k) - 1)], xs[min(n - 1, math.ceil(n / 2 + k))]
    return Estimate(med, min(lo, med), max(hi, med), n, how or f"median of {n}")


def per_median_time(value: float, times, how: str = "") -> Estimate | None:
    """A rate measured at the median of `times` (throughput, MFU: inversely proportional to the step
    time), with the interval the median's interval gives it; None for fewer than 2 timings (no
    interval: the claim built on it is "not measurable here")."""
    if len(times) < 2:
        return None
    t = median_interval(times)
    return ratio(exact(value * t.value), t, how or f"at the median of {t.n} steps")


def ratio(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a / b, both positive, with the interval of the quotient of the two intervals (conservative)."""
    if b.lo <= 0 or a.lo < 0:
        raise ValueError("ratio: needs a >= 0 and b > 0 over their whole intervals")
    return Estimate(a.value / b.value, a.lo / b.hi, a.hi / b.lo, min(a.n, b.n), how or "ratio of intervals")


def difference(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a - b for independent estimates: half-widths added in quadrature (normal approximation)."""
    half = math.hypot(a.half_width, b.half_width)
    d = a.value - b.value
    return Estimate(d, d - half, d + half, min(a.n, b.n), how or "difference, independent")


def paired_difference(xs, ys, how: str = "") -> Estimate:
    """Mean of xs[i] - ys[i] over paired repeats (same seed for both arms): the seed's own noise cancels."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"paired_difference: {len(xs)} and {len(ys)} values; pair them by seed")
    return from_samples([x - y for x, y in zip(xs, ys)], how or f"paired over {len(xs)} seeds")


# ----------------------------------------------------------------------------- claimed regions

@dataclass(frozen=True)
class Region:
    """The values a claim allows: lo <= x <= hi (either end may be infinite)."""

    lo: float = -math.inf
    hi: float = math.inf
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"[{_num(self.lo)}, {_num(self.hi)}]"


def approx(target: float, *, rel: float = 0.0, abs_tol: float = 0.0, text: str = "") -> Region:
    """target within a relative and/or absolute tolerance (the tolerance is part of the claim)."""
    tol = abs(target) * rel + abs_tol
    if tol <= 0:
        raise ValueError("approx: give rel or abs_tol > 0 (no measurement equals a number exactly)")
    return Region(target - tol, target + tol, text or f"{_num(target)} +- {_num(tol)}")


def at_least(x: float, text: str = "") -> Region:
    return Region(x, math.inf, text or f">= {_num(x)}")


def at_most(x: float, text: str = "") -> Region:
    return Region(-math.inf, x, text or f"<= {_num(x)}")


def between(lo: float, hi: float, text: str = "") -> Region:
    if lo > hi:
        raise ValueError(f"between: lo {lo} > hi {hi}")
    return Region(lo, hi, text or f"[{_num(lo)}, {_num(hi)}]")


def verdict(measured: Estimate | None, region: Region) -> str:
    """agrees / disagrees / inconclusive at this scale / not measurable here (module docstring)."""
    if measured is None:
        return NOT_MEASURABLE
    if any(math.isnan(v) for v in (measured.value, measured.lo, measured.hi)):
        return NOT_MEASURABLE
    if region.lo <= measured.lo and measured.hi <= region.hi:
        return AGREES
    if measured.hi < region.lo or measured.lo > region.hi:
        return DISAGREES
    return INCONCLUSIVE


# ----------------------------------------------------------------------------- claims and tables

@dataclass
class Claim:
    """One row of a claims table: what the source says, what this run measured, and the verdict.

    `claimed` is the source's wording of the value; `region` its testable form with the tolerance
    stated; `measured` None (with `why`) when it cannot be measured on this hardware."""

    claim: str
    source: str
    claimed: str
    region: Region
    measured: Estimate | None
    why: str = ""
    verdict: str = field(init=False)

    def __post_init__(self):
        self.verdict = verdict(self.measured, self.region)
        if self.verdict == NOT_MEASURABLE and not self.why:
            raise ValueError(f"claim {self.claim!r} is not measurable here: say why (why=...)")

    def row(self) -> dict:
        return {"claim": self.claim, "source": self.source, "claimed": self.claimed,
                "tested as": str(self.region),
                "measured [95% interval]": str(self.measured) if self.measured is not None else "-",
                "how": self.measured.how if self.measured is not None else self.why,
                "verdict": self.verdict}


def not_measurable(claim: str, source: str, claimed: str, why: str, region: Region | None = None) -> Claim:
    """A claim this run cannot test (shown as a row, never dropped)."""
    return Claim(claim, source, claimed, region or Region(text="-"), None, why)


def claims_table(claims: list[Claim]) -> str:
    """The aligned text table of claims, one row each, verdict last."""
    from dlo.tables import format_table

    return format_table([c.row() for c in claims])


def summary(claims: list[Claim]) -> dict[str, int]:
    """How many claims got each verdict (all four keys, zeros included)."""
    return {v: sum(c.verdict == v for c in claims) for v in VERDICTS}
