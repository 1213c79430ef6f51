"""A similarity report beside `dlo grade`'s scores: code that looks copied, for an instructor to read.

What is compared (`dlo.harness.authored`): for each exercise (an nbgrader solution cell) of every graded
submission, the code the student wrote for it wherever it is - the exercise cell, the cells the student
added whose definitions it uses, text it decodes and runs (`exec` of base64/zlib..., marked
"obfuscated") - against the same exercise of every other student, the instructors' solution, and the
library references its checks forbid (`@check(forbid=...)` of the `dlo.checks.<module>.check_<name>`
calls of the test cells after it). How (`dlo.harness.winnowing`): MOSS's winnowing over Python tokens,
names as one symbol, attribute names kept, every k-gram of the released notebook's code (the stubs, the
instructors' cells) boilerplate; a pair's similarity is the larger of its two shares (A's fingerprints
found in B, B's in A). And what the checks ran (`dlo.harness.bytecode`): digests of the code objects the
kernel sent them, compared with the classmates' and with the references' own code objects; a clone of a
reference (its code object, `__code__`, named in the source or found in the bytecode) is the reference.

When a pair is flagged: short, API-driven exercises cannot tell copying from solving (independent
solutions of `dtensor_plan` score 0.76-0.86 with the instructors' solution; 14 of 22 cells of Days 1-4
had some at 0.5 or more), so a fixed threshold accuses honest work. The class is the calibration: per
exercise and per kind of comparison (classmates, solution, library), the class's similarities give a
median and a spread (`spread`: 1.4826 x the median absolute deviation, never less than the classmates'
pairs' nor MIN_SPREAD), and a comparison is flagged when it stands out: Z spreads above the median, or,
where the class is too scattered for that, near-identical (NEAR) while the class's median is more than
GAP below it; and never under the kind's floor (THRESHOLD with a classmate or the solution: above the
0.63 that independent solutions reached, below the 0.83 of disguised copies; LIBRARY_COPIED with a
library reference: above the solutions' own 0.875). With fewer than MIN_CLASS students in an exercise
there is no spread: only NEAR is flagged. An exercise whose median is within GAP of identical flags
nothing it cannot tell (the page says so). A clone of a reference, found in the source or the
bytecode, and obfuscated code are flagged whatever the class does. tests/harness/
test_similarity_calibration.py measures the rule on independent solutions (similarity_variants.py).

OUT/similarity.csv lists every comparison at LISTED or more, and every flag, flagged first then most
similar first; OUT/similarity.html (`similarity_page`) shows each exercise's spread and cutoffs, then
the first MAX_SHOWN pairs side by side with the matching code marked. The report never changes a score,
and a failure in it never fails the grading.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import statistics
import threading
from pathlib import Path

from dlo.errors import warn
from dlo.harness import bytecode
from dlo.harness.authored import Submission, cell_source, defined_names, nbgrader_meta, notebook_cells
from dlo.harness.results import write_csv
from dlo.harness.similarity_page import page
from dlo.harness.winnowing import Code, share

THRESHOLD = 0.75  # floor with a classmate or the solution: independent work <= 0.63, disguised copies >= 0.83
# (tests/harness/test_similarity_calibration.py); issue 26's 0.5 flagged 13 of 35 independent solutions
LIBRARY_COPIED = 0.9  # floor with a library reference: above the solutions' own 0.875
LIBRARY_LISTED = LISTED = 0.5  # listed from here, flagged or not
MIN_CLASS, Z, MIN_SPREAD, NEAR, GAP = 5, 3.0, 0.05, 0.95, 0.25
FLOORS = {"student": THRESHOLD, "solution": THRESHOLD, "library": LIBRARY_COPIED}
MATCHES = {"student": "similar to a classmate", "solution": "similar to the instructors' solution",
           "library": "likely copied from dlo"}
CLONE = "a clone of dlo's code"
RESEMBLES = "resembles the reference"  # a library match under its cutoff: no flag
WITHIN = "within the class's spread"  # a classmate or solution match under its cutoff: no flag
MIN_FINGERPRINTS = 4
COLUMNS = ["similarity", "day", "cell", "student", "other", "kind", "match", "flagged", "cutoff", "tokens", "bytecode",
           "student_in_other", "other_in_student", "fingerprints", "obfuscated"]
CHECK_CALL = re.compile(r"\bdlo\.checks\.(\w+)\.(check_\w+)")


# ----------------------------------------------------------------------------- what is compared

def cells_of(path: Path) -> dict[str, str]:
    """{grade_id: source} of a notebook's code solution cells; {} when it cannot be read."""
    out = {}
    for cell in notebook_cells(path):
        meta = nbgrader_meta(cell)
        if meta.get("solution") and cell.get("cell_type") == "code" and meta.get("grade_id"):
            out.setdefault(str(meta["grade_id"]), cell_source(cell))
    return out


def exercises(instructors: Path) -> dict[str, list[str]]:
    """{grade_id of a solution cell: the dlo.checks calls of the test cells after it, up to the next one}."""
    out: dict[str, list[str]] = {}
    current = None
    for cell in json.loads(instructors.read_text())["cells"]:  # the instructors': an error here stops the report
        meta = nbgrader_meta(cell)
        if meta.get("solution") and cell.get("cell_type") == "code":
            current = meta.get("grade_id")
            out.setdefault(current, [])
        elif meta.get("grade") and current is not None:
            out[current] += [f"dlo.checks.{m}.{f}" for m, f in CHECK_CALL.findall(cell_source(cell))]
    return out


def library_objects(checks: list[str]) -> dict[str, object]:
    """{dotted name: object} of the dlo functions and classes the checks forbid (the references the
    exercise is graded against); names that cannot be imported are left out."""
    return dict(_library_objects(tuple(checks)))


@functools.cache  # the same for every report of a course: found once per process (`prepare`)
def _library_objects(checks: tuple[str, ...]) -> dict[str, object]:
    from dlo.grading.forbid import resolve

    names: list[str] = []
    for call in dict.fromkeys(checks):
        module, func = call.rsplit(".", 1)
        try:
            forbid = getattr(importlib.import_module(module), func).forbid
        except Exception:  # noqa: BLE001 - a check that moved: no reference, the report says so
            continue
        names += [n for n in forbid if n.startswith("dlo.") and not n.startswith("dlo.checks.")]
    out: dict[str, object] = {}
    for name in dict.fromkeys(names):
        try:
            owner, attr = resolve(name)
            out.update({f"{owner.__name__}.{a}": v for a, v in sorted(vars(owner).items())
                        if not a.startswith("_") and callable(v) and getattr(v, "__module__", None) == owner.__name__}
                       if attr == "*" else {name: getattr(owner, attr)})
        except Exception:  # noqa: BLE001
            continue
    return out


_SOURCES: dict[int, tuple[object, str]] = {}  # id -> (the object, kept alive so that its id stays its own; source)


def _source_of(obj) -> str:
    if id(obj) not in _SOURCES:
        try:
            source = inspect.getsource(inspect.unwrap(obj))
        except (TypeError, OSError):
            source = ""  # a builtin or a C function: no source to compare with
        _SOURCES[id(obj)] = (obj, source)
    return _SOURCES[id(obj)][1]


def prepare(days: list[str], instructors: Path) -> threading.Thread:
    """Import and read the library references the report compares with (their modules import torch: some
    2 CPU s), in a thread: `dlo grade` starts it once no submission waits for a slot, so that it runs on a
    core the last ones leave idle, not after them. Whatever fails here is met again, and said, by the report."""
    def warm() -> None:
        for day in days:
            try:
                for checks in exercises(instructors / day / f"{day}.ipynb").values():
                    for obj in library_objects(checks).values():
                        _source_of(obj)
            except Exception:  # noqa: BLE001 - see the docstring
                continue

    thread = threading.Thread(target=warm, name="dlo-similarity-prepare", daemon=True)
    thread.start()
    return thread


def library_references(checks: list[str]) -> dict[str, str]:
    """{dotted name: source} of `library_objects` (a builtin or a C function has none: left out)."""
    return {n: src for n, o in library_objects(checks).items() if (src := _source_of(o))}


def _same_object(name: str, obj) -> bool:
    """Whether a dotted name a student's code clones is `obj` (a reference under another of its names)."""
    from dlo.grading.forbid import resolve

    if not name.startswith("dlo."):
        return False
    try:
        owner, attr = resolve(name)
        return inspect.unwrap(getattr(owner, attr)) is inspect.unwrap(obj)
    except Exception:  # noqa: BLE001 - not a name of the library: no clone of it
        return False


# ----------------------------------------------------------------------------- the rule

def spread(values: list[float]) -> float:
    """How far apart a class's similarities are: 1.4826 x their median absolute deviation (the standard
    deviation, for normal data, that a few copies cannot inflate), at least MIN_SPREAD."""
    median = statistics.median(values)
    return max(1.4826 * statistics.median(abs(v - median) for v in values), MIN_SPREAD)


def cutoff(kind: str, values: list[float], students: int, pairs: float = MIN_SPREAD
           ) -> tuple[float, float | None, float | None]:
    """(similarity at which a comparison of `kind` is flagged, the class's median, the spread used) from
    the class's similarities of that kind in one exercise, `students` compared; `pairs`: the spread of the
    classmates' pairs (the most values: a kind's own spread is never taken smaller). A comparison stands
    out Z spreads above the median; in a class too scattered for that, near-identical code (NEAR) still
    does, unless the class's median is within GAP of identical (an exercise that cannot tell)."""
    if students < MIN_CLASS or not values:
        return max(FLOORS[kind], NEAR), None, None
    median, wide = statistics.median(values), max(spread(values), pairs)
    cut = min(median + Z * wide, max(NEAR, median + GAP))
    return round(max(FLOORS[kind], cut), 3), round(median, 3), round(wide, 3)


def match(kind: str, similarity: float, cut: float | None = None, exact: bool = False) -> tuple[str, int]:
    """(what a comparison of `kind` at `similarity` is, 1 if flagged); ("", 0) when it is not listed.
    `cut`: the exercise's cutoff (default: the kind's floor); `exact`: a clone of a reference."""
    if exact:
        return CLONE, 1
    if similarity >= (FLOORS[kind] if cut is None else cut):
        return MATCHES[kind], 1
    if similarity >= LISTED:
        return (RESEMBLES if kind == "library" else WITHIN), 0
    return "", 0


def _bytecode_share(a: dict, b: dict) -> float:
    """The larger share of either side's code (bytes of bytecode) found whole in the other."""
    common = sum(s for d, s in a.items() if d in b)
    return max(common / sum(a.values()) if a else 0.0, common / sum(b.values()) if b else 0.0)


def _row(day, cell, a, b, kind, code_a: Code, code_b: Code, bc: float = 0.0, cut: float | None = None,
         exact: bool = False, obfuscated=()) -> dict:
    a_in_b, b_in_a = share(code_a, code_b), share(code_b, code_a)
    tokens = round(max(a_in_b, b_in_a), 3)
    similarity = 1.0 if exact else round(max(tokens, bc), 3)
    what, flagged = match(kind, similarity, cut, exact)
    return {"similarity": similarity, "day": day, "cell": cell, "student": a, "other": b, "kind": kind,
            "match": what, "flagged": flagged, "cutoff": FLOORS[kind] if cut is None else cut, "tokens": tokens,
            "bytecode": round(bc, 3), "student_in_other": round(a_in_b, 3), "other_in_student": round(b_in_a, 3),
            "fingerprints": len(code_a.fingerprints & code_b.all_grams), "obfuscated": "; ".join(obfuscated)}


# ----------------------------------------------------------------------------- the report

def compare(days: list[str], instructors: Path, release: Path, submissions: dict[tuple[str, str], Path]
            ) -> tuple[list[dict], dict, dict]:
    """(rows listed, flagged first, then most similar first; {(day, cell): {owner: Code}} for the page;
    {(day, cell): {"refs": library names ([]: none mapped, None: not looked up), "students": n,
    "cutoffs": {kind: (cutoff, median, spread)}}})."""
    rows, snippets, info = [], {}, {}
    for day in days:
        theirs, released = instructors / day / f"{day}.ipynb", release / day / f"{day}.ipynb"
        solution, stubs = cells_of(theirs), cells_of(released)
        release_code = {cell_source(c) for c in notebook_cells(released) if c.get("cell_type") == "code"}
        boiler = frozenset(g for src in release_code for g in Code.of(src).all_grams)
        students = {s: Submission(p, release_code) for (s, d), p in sorted(submissions.items()) if d == day}
        for cell, checks in exercises(theirs).items():
            names = defined_names(stubs.get(cell, ""))
            found = {s: st.exercise(cell, names) for s, st in students.items()}
            rows += _exercise(day, cell, checks, found, Code.of(solution.get(cell, ""), boiler), boiler, snippets, info)
        for s, st in students.items():  # obfuscated code no exercise uses: still said
            why = sorted({w for p in st.program.parts if id(p) not in st.attributed
                          for w in p.obfuscated})
            if why:
                rows.append(_obfuscated(day, "(other cells)", s, why))
    rows.sort(key=lambda r: (-r["flagged"], -r["similarity"], r["day"], r["cell"], r["student"], r["other"]))
    return rows, snippets, info


def _obfuscated(day, cell, student, why) -> dict:
    return {**{c: "" for c in COLUMNS}, "similarity": 0.0, "day": day, "cell": cell, "student": student,
            "other": "(its own code)", "kind": "obfuscated", "match": "obfuscated: " + "; ".join(why), "flagged": 1,
            "obfuscated": "; ".join(why)}


def _exercise(day, cell, checks, found: dict, solution: Code, boiler, snippets: dict, info: dict) -> list[dict]:
    """The rows of one exercise: every comparison, then the class's cutoffs applied to them."""
    codes = {s: Code.of(f[0], boiler) for s, f in found.items()}
    counted = {s for s, c in codes.items() if len(c.fingerprints) >= MIN_FINGERPRINTS}
    active = sorted(s for s, f in found.items() if s in counted or any(f[1:]))
    refs = library_objects(checks) if active else {}  # nothing to compare: no import of the checks
    sources = {n: src for n, o in refs.items() if (src := _source_of(o))}
    ref_codes = {n: Code.of(sources.get(n, ""), boiler) for n in refs}
    ref_digests = {n: {d: s for d, s in bytecode.of_function(o).items() if s >= bytecode.MIN_SIZE}
                   for n, o in refs.items()}
    comps = []  # (kind, student, other, their codes, bytecode share, exact)
    for i, a in enumerate(active):
        for b in active[i + 1:]:
            if {a, b} <= counted or (found[a][3] and found[b][3]):
                comps.append(("student", a, b, codes[a], codes[b], _bytecode_share(found[a][3], found[b][3]), False))
        if a in counted and solution.fingerprints:
            comps.append(("solution", a, "solutions", codes[a], solution, 0.0, False))
        for n, obj in refs.items():
            mine = found[a][3]
            whole = sum(s for d, s in ref_digests[n].items() if d in mine) / sum(ref_digests[n].values()) \
                if ref_digests[n] else 0.0
            exact = whole == 1.0 or any(c == n or _same_object(c, obj) for c in found[a][2] | found[a][4])
            if a in counted or exact or whole:
                comps.append(("library", a, n, codes[a], ref_codes[n], whole, exact))
    values: dict[str, list[float]] = {"student": [], "solution": [], "library": []}
    best: dict[str, float] = {}
    for kind, a, _, ca, cb, bc, _ in comps:
        sim = max(share(ca, cb), share(cb, ca), bc)
        if kind == "library":
            best[a] = max(best.get(a, 0.0), sim)
        else:
            values[kind].append(sim)
    values["library"] = list(best.values())
    pairs = spread(values["student"]) if values["student"] else MIN_SPREAD
    cuts = {k: cutoff(k, v, len(counted), pairs) for k, v in values.items()}
    info[(day, cell)] = {"refs": sorted(refs) if active else None, "students": len(counted), "cutoffs": cuts}
    snippets[(day, cell)] = {**codes, "solutions": solution, **ref_codes}
    rows = [_row(day, cell, a, b, kind, ca, cb, bc, cuts[kind][0], exact,
                 sorted({*found[a][1], *(found[b][1] if kind == "student" else ())}))
            for kind, a, b, ca, cb, bc, exact in comps]
    rows += [_obfuscated(day, cell, s, found[s][1]) for s in active if found[s][1]]
    return [r for r in rows if r["match"]]


def write_report(out: Path, days: list[str], instructors: Path, release: Path,
                 submissions: dict[tuple[str, str], Path]) -> list[dict] | None:
    """out/similarity.csv and out/similarity.html; the rows, or None (a warning on stderr, nothing
    else changed) when the report could not be made."""
    try:
        rows, snippets, info = compare(days, instructors, release, submissions)
        write_csv(out / "similarity.csv", rows, COLUMNS)
        tmp = out / "similarity.html.tmp"
        rule = {"Z": Z, "MIN_CLASS": MIN_CLASS, "NEAR": NEAR, "GAP": GAP, "LISTED": LISTED, "CLONE": CLONE,
                "WITHIN": WITHIN, "RESEMBLES": RESEMBLES, "THRESHOLD": THRESHOLD, "LIBRARY_COPIED": LIBRARY_COPIED}
        tmp.write_text(page(rows, snippets, info, len(submissions), rule))
        tmp.replace(out / "similarity.html")
    except Exception as exc:  # noqa: BLE001 - the scores are written; the report is an aside
        warn("grade", f"no similarity report ({type(exc).__name__}: {exc})")
        return None
    return rows
