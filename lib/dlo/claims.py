"""Claimed vs measured: one place that turns a measurement and its uncertainty into a verdict.

A claim of the course material ("bf16 trains to the same accuracy as fp32", "the ring sends
2(N-1)/N of the data") is a *region* of values: `approx(2.0, rel=0.05)`, `at_least(0.9)`,
`between(-0.01, 0.01)`. A measurement is an `Estimate`: a value with an interval that says how
much it would move if the run were repeated (a t-interval over seeds, a Wilson interval for an
accuracy on n test samples, an interval of the median for timings). The verdict compares the two,
the way an equivalence test does:

- **agrees**: the whole interval lies inside the claimed region;
- **disagrees**: the whole interval lies outside it;
- **inconclusive at this scale**: the interval straddles the region's edge (the noise is larger
  than the effect; more seeds, samples or a bigger run would decide);
- **not measurable here**: no evidence on this run, with the reason (see the rules below);
- **the control meets it too**: the claim holds, but so does its control (`Claim(control=...)`), so
  the run cannot credit the claim's cause;
- **by construction**: the row holds whatever happens (a forced event, a formula restated);
  shown, never counted as evidence (`by_construction`);
- **planned**: a number from the plan (`dlo.plan`), not a measurement (`planned`).

The rules are enforced here, not left to each day (an `Estimate` carries `reason` when it is no
evidence, and the verdict is then "not measurable here (<reason>)"):

1. No interval from fewer than 3 samples: `from_samples`, `median_interval`, `paired_difference`
   with n < 3 give an estimate without an interval.
2. Two trainings compared on a shared test set are paired by seed over >= 3 seeds
   (`paired_difference`); `difference` of two accuracies on one test set is refused as evidence
   ("one seed"). Two arms that share their weights (a model and its quantised copy) have no
   training noise: compare them per example with `paired_examples` (McNemar's paired interval).
3. Wall-clock claims go through `timed`: a GPU claim timed on a CPU, or ranks x threads (+ the
   notebook's kernel) needing more cores than there are, is "not measurable here" with the
   reason; the day then adds a row for the CPU-measurable proxy where one exists (kernel launches
   for torch.compile, exact bytes for compression, saved-tensor bytes for recompute).

`evidence(claims)` is the rows that count; `summary` counts every verdict. Every claims table of the
course goes through `Claim` and `claims_table`, so a "yes" is never printed where the numbers do
not support it. (Over 300 lines: the estimates and the rules that judge them are one vocabulary,
imported as `dlo.claims` by every day.)
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field, replace

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive at this scale"
NOT_MEASURABLE = "not measurable here"
CONTROL_TOO = "the control meets it too"
BY_CONSTRUCTION = "by construction"
PLANNED = "planned"
VERDICTS = (AGREES, DISAGREES, INCONCLUSIVE, NOT_MEASURABLE, CONTROL_TOO, BY_CONSTRUCTION, PLANNED)
EVIDENCE = (AGREES, DISAGREES, INCONCLUSIVE, CONTROL_TOO)  # the verdicts a measurement decided

MIN_SAMPLES = 3  # rule 1: the fewest repeats (seeds, timings, trials) an interval is computed from

# Estimate.kind: how the interval was obtained (rule 2 reads it)
EXACT, REPEATS, TEST_SET, TIMINGS, PAIRED = "exact", "repeats", "test set", "timings", "paired examples"

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
    """A measured value with a 95% interval [lo, hi] and how that interval was obtained.

    `kind` says what the interval covers (EXACT, REPEATS, TEST_SET, TIMINGS, PAIRED or "" when
    built by hand); a non-empty `reason` says why this estimate is no evidence here (its verdict is
    then "not measurable here (<reason>)"), while its value is still shown."""

    value: float
    lo: float
    hi: float
    n: int = 1
    how: str = ""  # "t over 3 seeds", "Wilson, n=512", "median of 20 timings", "exact"
    kind: str = ""
    reason: str = ""
    setup: str = ""  # where a timing was taken, once `timed` has checked it ("1 rank x 2 threads on 2 cores")

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
        if self.kind == EXACT:
            return "exact"
        what = {REPEATS: "repeats", TEST_SET: "test examples", TIMINGS: "timings", PAIRED: "paired examples"}
        return f"{self.n} {what.get(self.kind, 'samples')}" + (f", {self.setup}" if self.setup else "")

    def __str__(self) -> str:
        if self.reason or self.lo == self.hi:
            return _num(self.value) + (" (no evidence)" if self.reason else "")
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


def _too_few(n: int, what: str = "samples") -> str:
    return "one seed" if n == 1 and what == "seeds" else f"{n} {what} < {MIN_SAMPLES}"


def exact(value: float, how: str = "exact") -> Estimate:
    """A quantity without noise: counted bytes, a parameter count, a deterministic output."""
    return Estimate(float(value), float(value), float(value), 1, how, EXACT)


def from_samples(xs, how: str = "", what: str = "samples") -> Estimate:
    """Mean of repeats (seeds, runs) with a Student-t 95% interval; fewer than MIN_SAMPLES repeats
    give the mean without an interval (rule 1: `reason` says how many; `what` names them)."""
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("from_samples: no values")
    mean = statistics.fmean(xs)
    if len(xs) < MIN_SAMPLES:
        return Estimate(mean, mean, mean, len(xs), how or f"mean of {len(xs)} {what}", REPEATS,
                        _too_few(len(xs), what))
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Estimate(mean, mean - half, mean + half, len(xs), how or f"mean, t-interval over {len(xs)} {what}",
                    REPEATS)


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


def _combined(a: Estimate, b: Estimate) -> tuple[str, str, str]:
    """kind, reason and setup of an estimate computed from a and b (an exact factor keeps the other's)."""
    kinds = {a.kind, b.kind} - {EXACT}
    kind = kinds.pop() if len(kinds) == 1 else (EXACT if not kinds else "")
    return kind, _reason(a, b), a.setup if a.setup == b.setup or not b.setup else b.setup if not a.setup else ""


def ratio(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a / b, both positive, with the interval of the quotient of the two intervals (conservative)."""
    if b.lo <= 0 or a.lo < 0:
        raise ValueError("ratio: needs a >= 0 and b > 0 over their whole intervals")
    return Estimate(a.value / b.value, a.lo / b.hi, a.hi / b.lo, min(a.n, b.n), how or "ratio of intervals",
                    *_combined(a, b))


def difference(a: Estimate, b: Estimate, how: str = "") -> Estimate:
    """a - b for independent estimates: half-widths added in quadrature (normal approximation).
    Two accuracies on one test set are not independent (rule 2): their difference carries the
    reason "one seed" (pair the runs by seed with `paired_difference`, or per example)."""
    half = math.hypot(a.half_width, b.half_width)
    d = a.value - b.value
    kind, reason, setup = _combined(a, b)
    reason = reason or ("one seed" if a.kind == b.kind == TEST_SET else "")
    return Estimate(d, d - half, d + half, min(a.n, b.n), how or "difference, independent", kind, reason, setup)


def paired_difference(xs, ys, how: str = "") -> Estimate:
    """Mean of xs[i] - ys[i] over paired repeats (same seed for both arms): the seed's own noise
    cancels. Fewer than MIN_SAMPLES pairs: no interval ("one seed", "2 seeds < 3")."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"paired_difference: {len(xs)} and {len(ys)} values; pair them by seed")
    return from_samples([x - y for x, y in zip(xs, ys)], how or f"paired over {len(xs)} seeds", "seeds")


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
    return Estimate(d, d - half, d + half, n, how or f"McNemar paired, n={n} ({n10} vs {n01} discordant)", PAIRED)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, as a batch scheduler sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timed(est: Estimate, *, device: str, gpu_claim: bool = False, world_size: int = 1, threads: int = 1,
          kernel: bool = False, cores: int | None = None) -> Estimate:
    """A wall-clock estimate, checked against where it was measured (rule 3): a GPU claim timed on
    a CPU, or ranks x threads (+1 for the notebook's kernel when it runs beside the ranks) above the
    cores, makes it no evidence (`reason` says which); else the estimate records its `setup`, which
    the table's "evidence" column shows. `device` is "cpu", "cuda", ..."""
    cores = cores or cpu_cores()
    need = world_size * threads + int(kernel)
    used = f"{world_size} rank(s) x {threads} thread(s){' + kernel' if kernel else ''}"
    if gpu_claim and not str(device).startswith("cuda"):
        return replace(est, reason=est.reason or f"GPU claim timed on {device}")
    if need > cores:
        return replace(est, reason=est.reason or f"{used} > {cores} cores")
    return replace(est, setup=f"{used} on {cores} cores, {device}")


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
    if measured is None or measured.reason:
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
    stated; `measured` None (with `why`) when it cannot be measured on this hardware. `control`: the
    same quantity for the control arm (the verdict is CONTROL_TOO when it meets the region too).
    `basis`: BY_CONSTRUCTION or PLANNED for rows that are no measurement (`why` says what makes
    them hold); use `by_construction` and `planned`."""

    claim: str
    source: str
    claimed: str
    region: Region
    measured: Estimate | None
    why: str = ""
    control: Estimate | None = None
    basis: str = ""
    verdict: str = field(init=False)

    def __post_init__(self):
        if self.basis not in ("", BY_CONSTRUCTION, PLANNED):
            raise ValueError(f"claim {self.claim!r}: basis is {BY_CONSTRUCTION!r} or {PLANNED!r}, not {self.basis!r}")
        self.verdict = self.basis or verdict(self.measured, self.region)
        if self.verdict == AGREES and self.control is not None and verdict(self.control, self.region) == AGREES:
            self.verdict = CONTROL_TOO
        reason = self.measured.reason if self.measured is not None else ""
        if (self.verdict == NOT_MEASURABLE or self.basis) and not (self.why or reason):
            raise ValueError(f"claim {self.claim!r} is {self.verdict}: say why (why=...)")

    @property
    def reason(self) -> str:
        """Why this row is no evidence ('' when it is)."""
        return "" if self.verdict in EVIDENCE else (self.measured.reason if self.measured else "") or self.why

    def row(self) -> dict:
        m = self.measured
        how = " ".join(filter(None, [m.how if m is not None else "", self.why if m is None or self.basis else ""]))
        out = {"claim": self.claim, "source": self.source, "claimed": self.claimed, "tested as": str(self.region),
               "measured [95% interval]": str(m) if m is not None else "-", "how": how or "-",
               "evidence": m.basis if m is not None else "-"}
        if self.control is not None:
            out["control"] = str(self.control)
        short = m.reason if m is not None and self.verdict == NOT_MEASURABLE else ""
        out["verdict"] = f"{self.verdict} ({short})" if short else self.verdict
        return out


def not_measurable(claim: str, source: str, claimed: str, why: str, region: Region | None = None) -> Claim:
    """A claim this run cannot test (shown as a row, never dropped)."""
    return Claim(claim, source, claimed, region or Region(text="-"), None, why)


def by_construction(claim: str, source: str, claimed: str, why: str, measured: Estimate | None = None,
                    region: Region | None = None) -> Claim:
    """A row that holds whatever the run does (`why`: what forces it); shown, not counted as evidence."""
    return Claim(claim, source, claimed, region or Region(text="-"), measured, why, basis=BY_CONSTRUCTION)


def planned(claim: str, source: str, claimed: str, region: Region, value: Estimate,
            why: str = "from the plan") -> Claim:
    """A row whose number comes from the plan (`dlo.plan`), not from a measurement."""
    return Claim(claim, source, claimed, region, value, why, basis=PLANNED)


def claims_table(claims: list[Claim]) -> str:
    """The aligned text table of claims, one row each, verdict last."""
    from dlo.tables import format_table

    rows = [c.row() for c in claims]
    columns = [k for k in rows[0] if k != "verdict"] if rows else None
    if columns is not None:
        columns += ["control"] * any("control" in r for r in rows) + ["verdict"]
    return format_table(rows, columns)


def summary(claims: list[Claim]) -> dict[str, int]:
    """How many claims got each verdict (every key of VERDICTS, zeros included)."""
    return {v: sum(c.verdict == v for c in claims) for v in VERDICTS}


def evidence(claims: list[Claim]) -> list[Claim]:
    """The rows a measurement decided (not "not measurable", "by construction" or "planned")."""
    return [c for c in claims if c.verdict in EVIDENCE]
