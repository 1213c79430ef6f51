"""A similarity report beside `dlo grade`'s scores: code that looks copied, for an instructor to read.

Every exercise cell (an nbgrader solution cell, matched by its grade_id) of every graded submission is
compared with the same cell of every other student, with the instructors' solution, and with the
library's reference implementations the exercise is graded against: the `dlo.*` names its checks
forbid (`@check(forbid=...)`, read from the `dlo.checks.<module>.check_<name>` calls of the test
cells that follow it), since the library the students install holds them. An exercise whose checks
name no `dlo` reference (plain asserts) is compared with the students and the solution only, and the
report says so.

The comparison is MOSS's winnowing over Python tokens (`dlo.harness.winnowing`): names become one
symbol (renaming every variable changes nothing), attribute names after a dot stay (the API a solution
calls is its substance), every match of K + W - 1 tokens or more is seen. Every k-gram of the released stub
(the function signature, `raise NotImplementedError()`) is boilerplate and never counts, so
untouched notebooks never look copied from each other. The share of A's fingerprints found anywhere
in B is "A in B"; a pair's similarity is the larger of the two shares (with the library too: a copy
padded with dead lines lowers the student's share, not the reference's share found in it). A cell
with fewer than MIN_FINGERPRINTS of its own is left out (one line of code is the same in every
correct answer).

Thresholds, calibrated (tests/harness/similarity_snippets.py, test_similarity.py). Exercise cells
written independently of the library and the solution (six exercises) score at most 0.39 against every
library reference of their exercise and the solution (AdamW: 0.07). The library's references copied
with comments and docstrings dropped, every name changed and independent lines reordered score
0.925-1.0 (1.0 verbatim), 0.63-0.87 with a dead line after each line. The instructors' solution cells
score up to 0.875 against their references (46 cells with a reference: 26 at 0.5 or more, Day 3's
training_state 0.875), because they were written from them: a student whose correct answer resembles
the library as much as the solution does is no copier. So a match is judged by what it is with:

- a classmate or the instructors' solution: flagged at THRESHOLD (0.5), between independent work
  (<= 0.39) and a disguised copy (a student's copy of the solution is caught here, by the solution);
- a library reference: flagged at LIBRARY_COPIED (0.9, "likely copied from dlo": above every solution
  cell, 0.875, below every disguised copy, 0.925); from LIBRARY_LISTED (0.5) up, listed without a flag
  ("resembles the reference"): the padded copies (0.63-0.87) are there, beside the solutions' own
  scores, for the instructor to read.

OUT/similarity.csv lists every comparison listed (flagged ones first, then most similar first) with its
`match` (`MATCHES`) and `flagged`;
OUT/similarity.html shows the first MAX_SHOWN of them with the two snippets side by side and the
matching code marked. The report never changes a score, and a failure in it never fails the grading.
"""

from __future__ import annotations

import html
import importlib
import inspect
import json
import re
from pathlib import Path

from dlo.errors import warn
from dlo.harness.results import write_csv
from dlo.harness.winnowing import Code, K, W, share

THRESHOLD = 0.5  # with a classmate or the solution: between independent work (<= 0.39) and a disguised copy
LIBRARY_COPIED = 0.9  # with a library reference: above the solutions' 0.875, below disguised copies' 0.925
LIBRARY_LISTED = 0.5  # with a library reference: listed, not flagged (the solutions score 0.5-0.875)
MATCHES = {"student": "similar to a classmate", "solution": "similar to the instructors' solution",
           "library": "likely copied from dlo"}
RESEMBLES = "resembles the reference"  # a library match under LIBRARY_COPIED: no flag
MIN_FINGERPRINTS = 4
MAX_SHOWN = 200
MAX_SNIPPET = 20000  # characters of a snippet shown (a pasted megabyte stays in the CSV only)
COLUMNS = ["similarity", "day", "cell", "student", "other", "kind", "match", "flagged", "student_in_other",
           "other_in_student", "fingerprints"]
CHECK_CALL = re.compile(r"\bdlo\.checks\.(\w+)\.(check_\w+)")


# ----------------------------------------------------------------------------- what is compared

def cells_of(path: Path) -> dict[str, str]:
    """{grade_id: source} of a notebook's code solution cells; {} when it cannot be read."""
    try:
        nb = json.loads(path.read_text())
        cells = nb["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out = {}
    for cell in cells if isinstance(cells, list) else []:
        meta = cell.get("metadata", {}).get("nbgrader", {}) if isinstance(cell, dict) else {}
        if isinstance(meta, dict) and meta.get("solution") and cell.get("cell_type") == "code" and meta.get("grade_id"):
            src = cell.get("source", "")
            out.setdefault(str(meta["grade_id"]), "".join(src) if isinstance(src, list) else str(src))
    return out


def exercises(instructors: Path) -> dict[str, list[str]]:
    """{grade_id of a solution cell: the dlo.checks calls of the test cells after it, up to the next one}."""
    nb = json.loads(instructors.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        src = "".join(cell.get("source", ""))
        if meta.get("solution") and cell.get("cell_type") == "code":
            current = meta.get("grade_id")
            out.setdefault(current, [])
        elif meta.get("grade") and current is not None:
            out[current] += [f"dlo.checks.{m}.{f}" for m, f in CHECK_CALL.findall(src)]
    return out


def library_references(checks: list[str]) -> dict[str, str]:
    """{dotted name: source} of the dlo functions and classes the checks forbid (the references the
    exercise is graded against); names that cannot be imported or read are left out."""
    from dlo.grading.forbid import resolve

    names: list[str] = []
    for call in dict.fromkeys(checks):
        module, func = call.rsplit(".", 1)
        try:
            forbid = getattr(importlib.import_module(module), func).forbid
        except Exception:  # noqa: BLE001 - a check that moved: no reference, the report says so
            continue
        names += [n for n in forbid if n.startswith("dlo.") and not n.startswith("dlo.checks.")]
    sources: dict[str, str] = {}
    for name in dict.fromkeys(names):
        try:
            owner, attr = resolve(name)
            targets = ([(f"{owner.__name__}.{a}", v) for a, v in sorted(vars(owner).items())
                        if not a.startswith("_") and callable(v) and getattr(v, "__module__", None) == owner.__name__]
                       if attr == "*" else [(name, getattr(owner, attr))])
        except Exception:  # noqa: BLE001
            continue
        for dotted, obj in targets:
            try:
                sources.setdefault(dotted, inspect.getsource(inspect.unwrap(obj)))
            except (TypeError, OSError):
                continue  # a builtin or a C function: no source to compare with
    return sources


# ----------------------------------------------------------------------------- the report

def compare(days: list[str], instructors: Path, release: Path, submissions: dict[tuple[str, str], Path]
            ) -> tuple[list[dict], dict, dict]:
    """(rows listed (`listed`), flagged first, then most similar first; {(day, cell): Code by owner} for the page;
    {(day, cell): [library names], [] when none is mapped, None when no cell needed them})."""
    rows, snippets, mapped = [], {}, {}
    for day in days:
        theirs = instructors / day / f"{day}.ipynb"
        solution, stub = cells_of(theirs), cells_of(release / day / f"{day}.ipynb")
        students = {s: cells_of(p) for (s, d), p in sorted(submissions.items()) if d == day}
        for cell, checks in exercises(theirs).items():
            boiler = frozenset(Code.of(stub.get(cell, "")).all_grams)
            codes = {s: Code.of(cells[cell], boiler) for s, cells in students.items() if cell in cells}
            codes = {s: c for s, c in codes.items() if len(c.fingerprints) >= MIN_FINGERPRINTS}
            others = {"solutions": ("solution", Code.of(solution.get(cell, ""), boiler))}
            refs = library_references(checks) if codes else {}  # nothing to compare: no import of the checks
            mapped[(day, cell)] = sorted(refs) if codes else None
            others.update({name: ("library", Code.of(src, boiler)) for name, src in refs.items()})
            snippets[(day, cell)] = {**{s: c for s, c in codes.items()}, **{n: c for n, (_, c) in others.items()}}
            names = sorted(codes)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    rows.append(_row(day, cell, a, b, "student", codes[a], codes[b]))
                for other, (kind, code) in others.items():
                    if code.fingerprints or kind == "library":
                        rows.append(_row(day, cell, a, other, kind, codes[a], code))
    rows = [r for r in rows if r["match"]]
    rows.sort(key=lambda r: (-r["flagged"], -r["similarity"], r["day"], r["cell"], r["student"], r["other"]))
    return rows, snippets, mapped


def match(kind: str, similarity: float) -> tuple[str, int]:
    """(what a comparison of `kind` at `similarity` is, 1 if flagged); ("", 0) when it is not listed."""
    if kind != "library":
        return (MATCHES[kind], 1) if similarity >= THRESHOLD else ("", 0)
    if similarity >= LIBRARY_COPIED:
        return MATCHES[kind], 1
    return (RESEMBLES, 0) if similarity >= LIBRARY_LISTED else ("", 0)


def _row(day, cell, a, b, kind, code_a: Code, code_b: Code) -> dict:
    a_in_b, b_in_a = share(code_a, code_b), share(code_b, code_a)
    similarity = round(max(a_in_b, b_in_a), 3)
    what, flagged = match(kind, similarity)
    return {"similarity": similarity, "day": day, "cell": cell, "student": a, "other": b, "kind": kind,
            "match": what, "flagged": flagged, "student_in_other": round(a_in_b, 3),
            "other_in_student": round(b_in_a, 3), "fingerprints": len(code_a.fingerprints & code_b.all_grams)}


def write_report(out: Path, days: list[str], instructors: Path, release: Path,
                 submissions: dict[tuple[str, str], Path]) -> list[dict] | None:
    """out/similarity.csv and out/similarity.html; the rows, or None (a warning on stderr, nothing
    else changed) when the report could not be made."""
    try:
        rows, snippets, mapped = compare(days, instructors, release, submissions)
        write_csv(out / "similarity.csv", rows, COLUMNS)
        tmp = out / "similarity.html.tmp"
        tmp.write_text(page(rows, snippets, mapped, len(submissions)))
        tmp.replace(out / "similarity.html")
    except Exception as exc:  # noqa: BLE001 - the scores are written; the report is an aside
        warn("grade", f"no similarity report ({type(exc).__name__}: {exc})")
        return None
    return rows


def _marked(code: Code, other: Code) -> str:
    """code.source, HTML-escaped, the tokens of its k-grams that occur in `other` (boilerplate aside) in <mark>."""
    hits = [False] * len(code.tokens)
    common = code.own & other.own
    for i, h in enumerate(code.grams):
        if h in common:
            hits[i:i + K] = [True] * K
    text, pos, out = code.source[:MAX_SNIPPET], 0, []
    i = 0
    while i < len(code.tokens):
        if not hits[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(code.tokens) and hits[j + 1]:
            j += 1
        start, end = code.tokens[i][1], code.tokens[j][2]
        if start >= len(text):
            break
        out += [html.escape(text[pos:start]), "<mark>", html.escape(text[start:end]), "</mark>"]
        pos, i = min(end, len(text)), j + 1
    out.append(html.escape(text[pos:]))
    return "".join(out) + ("\n... (cut)" if len(code.source) > MAX_SNIPPET else "")


STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{padding:2px 8px;
border-bottom:1px solid #ddd;text-align:left}.pair{display:flex;gap:1em}.pair>div{flex:1;min-width:0}
pre{background:#f6f6f6;padding:.5em;overflow-x:auto;font-size:85%}mark{background:#ffd54f}h3{margin-top:2em}
.flag{color:#b00020}.plain{color:#555}"""


def _references(names: list[str] | None) -> str:
    if names is None:
        return f"not looked up: no submission has {MIN_FINGERPRINTS} fingerprints of its own in this cell"
    if not names:
        return "none mapped: its checks name no dlo reference (compared with the students and the solution)"
    return html.escape(", ".join(names))


def page(rows: list[dict], snippets: dict, mapped: dict, submissions: int) -> str:
    e = html.escape
    head = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Similarity</title><style>{STYLE}</style>"
            f"</head><body><h1>Similarity of the exercise cells</h1><p>{submissions} submission(s) compared: each "
            f"exercise cell with the same cell of every other student, the instructors' solution and the library "
            f"references of its checks; winnowed fingerprints of {K} tokens (window {W}); names count as one "
            f"symbol, the released stub never counts. Flagged: similarity &ge; {THRESHOLD} with a classmate or "
            f"the solution, &ge; {LIBRARY_COPIED} with a library reference ({sum(r['flagged'] for r in rows)}); "
            f"listed without a flag: {LIBRARY_LISTED} to {LIBRARY_COPIED} with a library reference ({e(RESEMBLES)}: "
            f"the instructors' own solutions score that high). {len(rows)} listed, flagged first, then most "
            f"similar first{f', the first {MAX_SHOWN} shown (all in similarity.csv)' if len(rows) > MAX_SHOWN else ''}."
            f" A high score is a reason to read the two cells, not a verdict; it never changes a score.</p>")
    refs = "".join(f"<tr><td>{e(d)}</td><td>{e(c)}</td><td>{_references(n)}</td></tr>"
                   for (d, c), n in sorted(mapped.items()))
    body = [head, "<h2>Exercises and their library references</h2><table><tr><th>day</th><th>cell</th>"
            f"<th>library reference</th></tr>{refs}</table>", "<h2>Pairs</h2>"]
    if not rows:
        body.append("<p>No pair listed.</p>")
    for r in rows[:MAX_SHOWN]:
        a, b = snippets[(r["day"], r["cell"])][r["student"]], snippets[(r["day"], r["cell"])][r["other"]]
        other = {"student": r["other"], "solution": "the instructors' solution"}.get(r["kind"], f"library {r['other']}")
        body.append(
            f"<h3 class='{'flag' if r['flagged'] else 'plain'}'>{r['similarity']:.2f} &middot; {e(r['match'])} "
            f"&middot; {e(r['day'])} / {e(r['cell'])}: {e(r['student'])} and {e(other)}</h3>"
            f"<p>{r['student_in_other']:.0%} of {e(r['student'])}'s fingerprints are in the other, "
            f"{r['other_in_student']:.0%} the other way ({r['fingerprints']} shared).</p><div class='pair'>"
            f"<div><b>{e(r['student'])}</b><pre>{_marked(a, b)}</pre></div>"
            f"<div><b>{e(other)}</b><pre>{_marked(b, a)}</pre></div></div>")
    body.append("</body></html>\n")
    return "\n".join(body)
