"""Read the claims tables an executed notebook printed and check each verdict against its evidence.

`dlo.claims` and `dlo.estimates` enforce their rules when a row is built; this module checks the *printed* tables of a
whole run, so a row assembled by hand, an `Estimate` built without its basis, or a timing that never
went through `dlo.claims.timed` is caught where students see it. A row whose verdict counts as
evidence (agrees, disagrees, inconclusive, the control meets it too) must show in its "evidence"
column (`Estimate.basis`):

- an exact value, or an interval from >= 3 repeats, timings or examples (no interval from fewer);
- for timings, the setup `timed` checked, whose ranks x threads (+ kernel) fit its cores;
- for a comparison on a shared test set, its pairing ("paired by seed", "McNemar"): an "unpaired"
  difference of two accuracies on one test set is no evidence (`dlo.estimates` rule 2), whether its
  interval is over test examples or over seeds whose "how" names the test set;
- not "formula": a measured side computed by a formula restates the claim (circular), so such a row
  must say "by construction" or "planned" (`dlo.estimates.formula`);
- not "self-reported" (`dlo.estimates.self_reported`), nor a "how" that says the number is the code under
  test's own account of itself (`SELF_HOW`: "its own counter", "restates", a `...State` object's
  bookkeeping): self-verification cannot fail, so such a row is "by construction";
- a control (`Claim(control=...)`, printed with its own verdict) that does not disagree with the claimed
  region leaves an "agrees" unearned: the run cannot credit the claim's cause (`dlo.claims`);
- a GPU claim (`GPU_WORDS` in its claim, claimed value or source: a GPU, its utilisation, MFU, "the
  hardware") judged on timings taken on a CPU: it goes through `dlo.claims.timed(..., gpu_claim=True)`,
  which makes it "not measurable here" there;
- an effect the run put there itself (`INJECTED` in its claim or "how": injected, planted, synthetic
  outliers, on purpose) is a demonstration of the mechanism: "by construction", never evidence.

Every verdict must be one of `dlo.claims.VERDICTS` (a "not measurable here" may carry its reason).
The solutions CI step (tests/harness/test_course.py) runs `audit_notebook` on every day's executed
solution notebook (the smoke version), and `make run` on the tiny profile's own run:

    python -m dlo.claims_audit NOTEBOOK_OR_FOLDER ...   (exit 1 with each problem, 2 for a bad path)
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from dlo.claims import AGREES, DISAGREES, EVIDENCE, NOT_MEASURABLE, VERDICTS
from dlo.estimates import FORMULA, MIN_SAMPLES, SELF_REPORTED, UNPAIRED

HEADER = ("claim", "tested as", "evidence", "verdict")  # the columns that mark a claims table
_TEST_SET = re.compile(r"\btest (images|examples|set|accuracy|accuracies)\b")  # a "how" naming a shared test set
_SETUP = re.compile(r"(\d+) rank\(s\) x (\d+) thread\(s\)( \+ kernel)? on (\d+) cores, (\w+)")
# a "how" that names the code under test as the source of its own number (self-verification)
SELF_HOW = re.compile(r"\bself-report|\b(its|their) own (count|counter|bookkeeping|accounting|record)|\brestates\b"
                      r"|\b[A-Z]\w*State\b\s*:", re.I)
# a claim about a GPU: its device, its utilisation, its peak
GPU_WORDS = re.compile(r"\b(GPUs?|CUDA|tensor cores?|HBM|NVLink|[AHB]100|H200|MFU|utili[sz](ation|es?)|"
                       r"the hardware|accelerators?)\b", re.I)
# an effect the run put in itself
INJECTED = re.compile(r"\binject(ed|ion|ing)?\b|\bplant(ed|ing)\b|\bsynthetic outliers?\b|\bon purpose\b", re.I)
_CONTROL = re.compile(r"\((" + "|".join(map(re.escape, VERDICTS)) + r")\)$")


def parse_tables(text: str) -> list[list[dict]]:
    """The claims tables (`dlo.claims.claims_table`'s format) in a printed text, as lists of rows."""
    lines, tables, i = text.splitlines(), [], 0
    while i < len(lines) - 1:
        header, rule = lines[i], lines[i + 1]
        if all(h in header for h in HEADER) and set(rule) <= {"-", " "} and "-" in rule:
            spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
            names = [header[a:b].strip() for a, b in spans]
            rows, i = [], i + 2
            # a row has the table's column gaps (format_table pads every cell): the first line without them,
            # or a blank one, ends the table (a count or a log line printed right after it is no row)
            while i < len(lines) and lines[i].strip() and all(lines[i][a - 1:a] in (" ", "") for a, _ in spans[1:]):
                line = lines[i]
                cells = [line[a:spans[k + 1][0]] if k + 1 < len(spans) else line[a:] for k, (a, _) in enumerate(spans)]
                rows.append(dict(zip(names, (c.strip() for c in cells))))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def audit_row(row: dict) -> list[str]:
    """What is wrong with one parsed row ([] when its verdict follows from its evidence)."""
    v, basis = row.get("verdict", ""), row.get("evidence", "")
    name = row.get("claim", "?")
    if v not in VERDICTS and not (v.startswith(NOT_MEASURABLE + " (") and v.endswith(")")):
        return [f"{name!r}: unknown verdict {v!r}"]
    if v not in EVIDENCE:
        return []
    problems = _design_problems(row)
    if basis == FORMULA:
        return problems + [f"{name!r}: {v} on a value computed by a formula (circular): by construction or planned"]
    if basis == "exact" or basis.startswith("exact, "):
        return problems
    m = re.match(r"(\d+) (\w[\w ]*?)(?:,|$)", basis)
    if not m:
        return [f"{name!r}: {v} without a stated basis (evidence column {basis!r})"]
    n, what = int(m.group(1)), m.group(2)
    problems += [f"{name!r}: {v} from {n} {what} (< {MIN_SAMPLES})"] if n < MIN_SAMPLES else []
    shared = what == "test examples" or _TEST_SET.search(row.get("how", ""))
    if shared and UNPAIRED in basis.split(", "):
        problems.append(f"{name!r}: {v} from an unpaired comparison on a shared test set (pair by seed or per example)")
    if what == "timings":
        setup = _SETUP.search(basis)
        if not setup:
            problems.append(f"{name!r}: {v} on timings never checked against the hardware (dlo.claims.timed)")
        else:
            world_size, threads, kernel, cores, device = setup.groups()
            if int(world_size) * int(threads) + bool(kernel) > int(cores):
                problems.append(f"{name!r}: {v} on timings of {setup.group(0)}")
            gpu = GPU_WORDS.search(" ".join(row.get(k, "") for k in ("claim", "claimed", "source")))
            if gpu and device != "cuda":
                problems.append(f"{name!r}: {v}: a GPU claim ({gpu.group(0)!r}) judged on timings on {device}, "
                                "outside dlo.claims.timed(..., gpu_claim=True)")
    return problems


def _design_problems(row: dict) -> list[str]:
    """What makes a row's verdict unearned whatever its numbers: its measured side reported by the code
    under test, a control that cannot fail, an effect the run injected."""
    v, name, how = row["verdict"], row.get("claim", "?"), row.get("how", "")
    problems = []
    self_how = SELF_HOW.search(how)
    if SELF_REPORTED in row.get("evidence", "").split(", ") or self_how:
        said = f"its 'how' says {self_how.group(0)!r}" if self_how else "its evidence is self-reported"
        problems.append(f"{name!r}: {v} on a number the code under test reports about itself ({said}): "
                        "self-verification, by construction, or measure it from outside that code")
    injected = INJECTED.search(f"{name} {how}")
    if injected:
        problems.append(f"{name!r}: {v} on an effect the run put there itself ({injected.group(0)!r}): a demonstration "
                        "of the mechanism, by construction")
    if row.get("control", "-") not in ("", "-") and v == AGREES:  # format_table prints "-" for a row without one
        against = _control_verdict(row)
        if against != DISAGREES:
            problems.append(f"{name!r}: agrees, but its control ({row['control']}) "
                            f"{'does not disagree: ' + against if against else 'has no verdict'}; only a control "
                            "that can fail credits the claim's cause")
    return problems


def _control_verdict(row: dict) -> str:
    """The control's verdict: printed in its cell by `dlo.claims` ("0.8 [0.7, 0.9] (disagrees)"), or, in a
    table printed before that, its interval against the "tested as" region when that reads as one
    (">= x", "<= x", "> x", "< x", "x +- t", "[a, b]", "a .. b"); "" when neither says."""
    cell = row["control"]
    m = _CONTROL.search(cell)
    if m:
        return m.group(1)
    num = r"(-?[\d.,]+(?:e-?\d+)?)"
    c = re.match(rf"{num}(?: \[{num}, {num}\])?", cell)
    if not c:
        return ""
    value, lo, hi = (float(x.replace(",", "")) if x else None for x in c.groups())
    lo, hi = (value, value) if lo is None else (lo, hi)
    region = _region(row.get("tested as", ""))
    if region is None:
        return ""
    a, b = region
    return AGREES if a <= lo and hi <= b else DISAGREES if hi < a or lo > b else "its interval reaches the region"


def _region(text: str) -> tuple[float, float] | None:
    """(lo, hi) of a printed region, or None when its words do not say it as a number."""
    num = r"(-?[\d.,]+(?:e-?\d+)?)"
    text = re.sub(r"^[a-z ]+(?=[<>=\[\d-])", "", text.strip())  # "gap > 0", "ratio >= 1.1"
    for pattern, make in ((rf"^>=? ?{num}$", lambda x: (x, math.inf)), (rf"^<=? ?{num}$", lambda x: (-math.inf, x)),
                          (rf"^{num} \+- {num}$", lambda x, t: (x - t, x + t)),
                          (rf"^\[{num}, {num}\]$", lambda a, b: (a, b)), (rf"^{num} \.\. {num}$", lambda a, b: (a, b))):
        m = re.match(pattern, text)
        if m:
            return make(*(float(g.replace(",", "")) for g in m.groups()))
    return None


def audit_text(text: str) -> list[str]:
    """Problems of every claims table in a printed text."""
    return [p for table in parse_tables(text) for row in table for p in audit_row(row)]


def notebook_text(nb: dict) -> str:
    """The printed text of an executed notebook, cell by cell (a cell's stream chunks joined as printed)."""
    out = []
    for cell in nb.get("cells", []):
        parts = []
        for o in cell.get("outputs", []):
            if any(mime.startswith("image/") for mime in o.get("data", {})):
                continue  # a figure: its text/plain is "<Figure size ...>", which would read as a table's row
            text = o.get("text") if o.get("output_type") == "stream" else o.get("data", {}).get("text/plain")
            parts.append("".join(text) if isinstance(text, list) else text or "")
        out.append("".join(parts))
    return "\n\n".join(out)  # a table ends with its cell


def audit_notebook(nb: dict) -> tuple[int, list[str]]:
    """(rows read, problems) of every claims table an executed notebook (nbformat JSON) printed."""
    text = notebook_text(nb)
    return sum(len(t) for t in parse_tables(text)), audit_text(text)


def main(paths: list[str]) -> int:
    """Audit every executed notebook named or found below the folders named; one line per notebook."""
    notebooks = []
    for p in map(Path, paths):
        if not p.exists():
            print(f"dlo.claims_audit: {p}: no such notebook or folder", file=sys.stderr)
            return 2
        notebooks += sorted(p.rglob("*.ipynb")) if p.is_dir() else [p]
    bad = 0
    for nb_path in notebooks:
        rows, problems = audit_notebook(json.loads(nb_path.read_text()))
        bad += bool(problems)
        print(f"{nb_path}: {rows} claims rows, {len(problems) or 'no'} problem(s)")
        for problem in problems:
            print(f"  {problem}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
