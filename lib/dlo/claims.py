"""Claimed vs measured: one place that turns a measurement and its uncertainty into a verdict.

A claim of the course material ("bf16 trains to the same accuracy as fp32", "the ring sends
2(N-1)/N of the data") is a *region* of values: `approx(2.0, rel=0.05)`, `at_least(0.9)`,
`between(-0.01, 0.01)`. A measurement is a `dlo.estimates.Estimate`: a value with a 95% interval.
The verdict compares the two, the way an equivalence test does:

- **agrees**: the whole interval lies inside the claimed region;
- **disagrees**: the whole interval lies outside it;
- **inconclusive at this scale**: the interval straddles the region's edge (the noise is larger
  than the effect; more seeds, samples or a bigger run would decide);
- **not measurable here**: no evidence on this run, with the reason (see the rules below);
- **the control meets it too**: the claim holds, but so does its control (`Claim(control=...)`), so
  the run cannot credit the claim's cause; a control whose interval reaches the region (or that has
  none) makes an agreeing row **inconclusive**: only a control that disagrees can fail and did; the
  "control" column prints the control's own verdict;
- **by construction**: the row holds whatever happens (a forced event, a formula restated);
  shown, never counted as evidence (`by_construction`). A measured side computed by a formula
  (`dlo.estimates.formula`, kind FORMULA) is accepted only on such a row or a planned one: a claim
  checked against its own formula is circular; so is a measured side the code under test reports
  about itself (`dlo.estimates.self_reported`: its own counter or bookkeeping), self-verification;
- **planned**: a number from the plan (`dlo.plan`), not a measurement (`planned`);
- **not tested here**: the course does not implement what the claim is about, so nothing was
  tried, although this machine could (`not_tested`; unlike "not measurable here", no limit of the
  machine is implied).

The rules are enforced where the numbers are made, not left to each day: rules 1 (no interval from
fewer than 3 samples) and 2 (trainings compared on one test set are paired by seed) in
`dlo.estimates`; rule 3 here:

3. Wall-clock claims go through `timed`: a GPU claim timed on a CPU, or ranks x threads (+ the
   notebook's kernel) needing more cores than there are, is "not measurable here" with the
   reason; the day then adds a row for the CPU-measurable proxy where one exists (kernel launches
   for torch.compile, exact bytes for compression, saved-tensor bytes for recompute).

`evidence(claims)` is the rows that count; `summary` counts every verdict. Every claims table of the
course goes through `Claim` and `claims_table`, so a "yes" is never printed where the numbers do
not support it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# Re-exported: Day 5's notebook and the harness read the cores a timing may count on from here (the
# `timed` rule below applies it); they live in dlo.cpus, beside the notebooks' thread count.
from dlo.cpus import SHARE_ENV, cpu_cores  # noqa: F401

# Re-exported: the notebooks in solutions/ import these estimators from dlo.claims (and Days 4, 5, 7's
# reports still reach them as C.<name>); new code imports them from dlo.estimates.
from dlo.estimates import (  # noqa: F401
    FORMULA,
    SELF_REPORTED,
    Estimate,
    accuracy,
    difference,
    exact,
    format_number,
    from_samples,
    median_interval,
    per_median_time,
    ratio,
)

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive at this scale"
NOT_MEASURABLE = "not measurable here"
CONTROL_TOO = "the control meets it too"
BY_CONSTRUCTION = "by construction"
PLANNED = "planned"
NOT_TESTED = "not tested here"
VERDICTS = (AGREES, DISAGREES, INCONCLUSIVE, NOT_MEASURABLE, CONTROL_TOO, BY_CONSTRUCTION, PLANNED, NOT_TESTED)
EVIDENCE = (AGREES, DISAGREES, INCONCLUSIVE, CONTROL_TOO)  # the verdicts a measurement decided


GPU_CLAIM = "GPU claim"  # the evidence column's mark of a timing `timed` took as a GPU claim on a GPU


def timed(est: Estimate, *, device: str, gpu_claim: bool = False, world_size: int = 1, threads: int = 1,
          kernel: bool = False, cores: int | None = None) -> Estimate:
    """A wall-clock estimate, checked against where it was measured (rule 3): a GPU claim timed on
    a CPU, or ranks x threads (+1 for the notebook's kernel when it runs beside the ranks) above the
    cores, makes it no evidence (`reason` says which); else the estimate records its `setup`, which
    the table's "evidence" column shows (ending in GPU_CLAIM for a GPU claim timed on a GPU: the audit
    catches a GPU claim that skipped this path). `device` is "cpu", "cuda", ..."""
    cores = cores or cpu_cores()
    need = world_size * threads + int(kernel)
    used = f"{world_size} rank(s) x {threads} thread(s){' + kernel' if kernel else ''}"
    if gpu_claim and not str(device).startswith("cuda"):
        return replace(est, reason=est.reason or f"GPU claim timed on {device}")
    if need > cores:
        return replace(est, reason=est.reason or f"{used} > {cores} cores")
    # a GPU claim says so in its evidence column, so the audit tells it from a CPU claim timed on a GPU
    return replace(est, setup=f"{used} on {cores} cores, {device}{', ' + GPU_CLAIM if gpu_claim else ''}")



# ----------------------------------------------------------------------------- claimed regions

@dataclass(frozen=True)
class Region:
    """The values a claim allows: lo <= x <= hi (either end may be infinite)."""

    lo: float = -math.inf
    hi: float = math.inf
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"[{format_number(self.lo)}, {format_number(self.hi)}]"


def approx(target: float, *, rel: float = 0.0, abs_tol: float = 0.0, text: str = "") -> Region:
    """target within a relative and/or absolute tolerance (the tolerance is part of the claim)."""
    tol = abs(target) * rel + abs_tol
    if tol <= 0:
        raise ValueError("approx: give rel or abs_tol > 0 (no measurement equals a number exactly)")
    return Region(target - tol, target + tol, text or f"{format_number(target)} +- {format_number(tol)}")


def at_least(x: float, text: str = "") -> Region:
    return Region(x, math.inf, text or f">= {format_number(x)}")


def at_most(x: float, text: str = "") -> Region:
    return Region(-math.inf, x, text or f"<= {format_number(x)}")


def between(lo: float, hi: float, text: str = "") -> Region:
    if lo > hi:
        raise ValueError(f"between: lo {lo} > hi {hi}")
    return Region(lo, hi, text or f"[{format_number(lo)}, {format_number(hi)}]")


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
    same quantity for the control arm (the verdict is CONTROL_TOO unless the control disagrees).
    `basis`: BY_CONSTRUCTION, PLANNED or NOT_TESTED for rows that are no measurement (`why` says
    what makes them hold, or what was not built); use `by_construction`, `planned`, `not_tested`."""

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
        if self.basis not in ("", BY_CONSTRUCTION, PLANNED, NOT_TESTED):
            raise ValueError(f"claim {self.claim!r}: basis is {BY_CONSTRUCTION!r}, {PLANNED!r} or {NOT_TESTED!r}, "
                             f"not {self.basis!r}")
        if self.measured is not None and self.basis not in (BY_CONSTRUCTION, PLANNED):
            if self.measured.kind == FORMULA:
                raise ValueError(f"claim {self.claim!r}: its measured side is computed by a formula, which restates "
                                 f"the claim (circular): make it {BY_CONSTRUCTION!r} or {PLANNED!r}, or measure it")
            if self.measured.provenance == SELF_REPORTED:
                raise ValueError(f"claim {self.claim!r}: its measured side is reported by the code under test itself "
                                 f"(self-verification): make it {BY_CONSTRUCTION!r}, or measure it from outside that "
                                 "code (a counter on the wire, the allocator)")
        self.verdict = self.basis or verdict(self.measured, self.region)
        if self.verdict == AGREES and self.control is not None:
            # only a control that disagrees credits the claim's cause; one that meets the region, or may
            # (its interval reaches it, or it has none), leaves the run unable to tell the two arms apart
            against = verdict(self.control, self.region)
            self.verdict = AGREES if against == DISAGREES else CONTROL_TOO if against == AGREES else INCONCLUSIVE
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
            out["control"] = f"{self.control} ({verdict(self.control, self.region)})"  # read by dlo.claims_audit
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


def not_tested(claim: str, source: str, claimed: str, why: str) -> Claim:
    """A claim about something the course does not implement (`why` names it): shown, never counted,
    and not blamed on the machine as "not measurable here" would be."""
    return Claim(claim, source, claimed, Region(text="-"), None, why, basis=NOT_TESTED)


def claims_table(claims: list[Claim]) -> str:
    """The aligned text table of claims, one row each, verdict last."""
    from dlo.tables import format_table

    rows = [c.row() for c in claims]
    columns = [k for k in rows[0] if k not in ("verdict", "control")] if rows else None
    if columns is not None:  # a control column wherever a row has one (the first row may not), once
        columns += ["control"] * any("control" in r for r in rows) + ["verdict"]
    return format_table(rows, columns)


def summary(claims: list[Claim]) -> dict[str, int]:
    """How many claims got each verdict (every key of VERDICTS, zeros included)."""
    return {v: sum(c.verdict == v for c in claims) for v in VERDICTS}


def evidence(claims: list[Claim]) -> list[Claim]:
    """The rows a measurement decided (not "not measurable", "by construction" or "planned")."""
    return [c for c in claims if c.verdict in EVIDENCE]
