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
  must say "by construction" or "planned" (`dlo.estimates.formula`).

Every verdict must be one of `dlo.claims.VERDICTS` (a "not measurable here" may carry its reason).
The solutions CI step (tests/harness/test_course.py) runs `audit_notebook` on every day's executed
solution notebook (the smoke version), and `make run` on the tiny profile's own run:

    python -m dlo.claims_audit NOTEBOOK_OR_FOLDER ...   (exit 1 with each problem, 2 for a bad path)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from dlo.claims import EVIDENCE, NOT_MEASURABLE, VERDICTS
from dlo.estimates import FORMULA, MIN_SAMPLES, UNPAIRED

HEADER = ("claim", "tested as", "evidence", "verdict")  # the columns that mark a claims table
_TEST_SET = re.compile(r"\btest (images|examples|set|accuracy|accuracies)\b")  # a "how" naming a shared test set
_SETUP = re.compile(r"(\d+) rank\(s\) x (\d+) thread\(s\)( \+ kernel)? on (\d+) cores")


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
    if v not in EVIDENCE or basis == "exact":
        return []
    if basis == FORMULA:
        return [f"{name!r}: {v} on a value computed by a formula (circular): by construction or planned"]
    m = re.match(r"(\d+) (\w[\w ]*?)(?:,|$)", basis)
    if not m:
        return [f"{name!r}: {v} without a stated basis (evidence column {basis!r})"]
    n, what = int(m.group(1)), m.group(2)
    problems = [f"{name!r}: {v} from {n} {what} (< {MIN_SAMPLES})"] if n < MIN_SAMPLES else []
    shared = what == "test examples" or _TEST_SET.search(row.get("how", ""))
    if shared and UNPAIRED in basis.split(", "):
        problems.append(f"{name!r}: {v} from an unpaired comparison on a shared test set (pair by seed or per example)")
    if what == "timings":
        setup = _SETUP.search(basis)
        if not setup:
            problems.append(f"{name!r}: {v} on timings never checked against the hardware (dlo.claims.timed)")
        else:
            world_size, threads, kernel, cores = setup.groups()
            if int(world_size) * int(threads) + bool(kernel) > int(cores):
                problems.append(f"{name!r}: {v} on timings of {setup.group(0)}")
    return problems


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
