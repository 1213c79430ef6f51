"""`dlo export`: a `dlo grade` output's scores as a file an LMS gradebook imports (Canvas, Moodle).

The instructor gives a roster CSV that says who each nbgrader student is in the LMS; each student of
scores.csv is matched through one of its columns (`--key`), and the file written has one row per roster
student and one column per day:

- **Canvas** ("Import" in the Gradebook): Canvas's own gradebook export is the roster. The file keeps its
  five identity columns (Student, ID, SIS User ID, SIS Login ID, Section), then a column per day, and
  the "Points Possible" row Canvas puts second. A day whose assignment already exists in the roster keeps
  that column's header, "name (assignment id)", so Canvas updates it instead of creating a new one.
  Default key: "SIS Login ID" (the university login, which is the nbgrader id on a cluster).
- **Moodle** (Grade administration > Import > CSV file): any header row; the import form maps one column
  to a user field (email address, username or ID number) and each other column to a grade item. The file
  keeps the roster's user-field columns that Moodle maps from, then a column per day. Default key:
  "Username".

Nobody is dropped silently: a student with scores but not in the roster, a roster student without scores
(left blank: an LMS import leaves a blank cell unchanged) and a score that is not "graded" (no submission,
a failed run: 0 in the file, as in the gradebook) are each named on stderr. The output file is new: an
existing file is never overwritten.
"""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

from dlo.errors import BadInput
from dlo.harness.results import read_csv

CANVAS_IDENTITY = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
CANVAS_POINTS = "Points Possible"  # the label of Canvas's second row (exported with leading spaces)
MOODLE_NAMES = ["First name", "Last name"]  # shown in the import's preview
MOODLE_MATCH = ["Username", "ID number", "Email address"]  # the user fields Moodle's import maps a column to
DEFAULT_KEY = {"canvas": "SIS Login ID", "moodle": "Username"}


def read_roster(path: Path, lms: str, key: str) -> tuple[list[str], list[dict]]:
    """(header, student rows) of the roster, checked: the key column and what the LMS matches on."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # Excel writes a byte-order mark
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadInput(f"cannot read the roster {path}: {exc}") from None
    need = [key] + (CANVAS_IDENTITY if lms == "canvas" else [])
    missing = [c for c in need if c not in header]
    if missing:
        raise BadInput(f"the roster {path} has no column {', '.join(map(repr, missing))} (its header: "
                       f"{', '.join(header) or 'none'}); --key names the column of nbgrader ids")
    if lms == "moodle" and not any(c in header for c in MOODLE_MATCH):
        raise BadInput(f"the roster {path} has none of the columns Moodle matches users by "
                       f"({', '.join(MOODLE_MATCH)})")
    rows = [r for r in rows if r.get(header[0], "").strip() != CANVAS_POINTS]
    keys = [r[key].strip() for r in rows if r[key].strip()]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise BadInput(f"the roster {path} names {', '.join(twice)} more than once in {key!r}")
    return header, rows


def read_scores(grading: Path) -> tuple[dict, dict]:
    """({(student, day): row of scores.csv}, {day: max score}) of a `dlo grade` output folder."""
    scores = grading / "scores.csv"
    if not scores.is_file():
        raise BadInput(f"{grading} has no scores.csv: give the folder `dlo grade --out` wrote")
    rows = read_csv(scores)
    return {(r["student"], r["day"]): r for r in rows}, {r["day"]: r["max_score"] for r in rows}


def day_columns(days: list[str], header: list[str]) -> dict[str, str]:
    """The column of each day: the roster's own "day (id)" column where Canvas already has one."""
    existing = {m.group(1): h for h in header if (m := re.fullmatch(r"(.+?) \(\d+\)", h))}
    return {d: existing.get(d, d) for d in days}


def export(grading: Path, lms: str, roster: Path, out: Path, key: str | None = None) -> int:
    key = key or DEFAULT_KEY[lms]
    if out.exists():
        raise BadInput(f"{out} exists: give a new file (nothing is overwritten)")
    if not out.parent.is_dir():
        raise BadInput(f"{out.parent} is not a folder")
    header, students = read_roster(roster, lms, key)
    scores, max_scores = read_scores(grading)
    days = sorted(max_scores)
    columns = day_columns(days, header)
    identity = CANVAS_IDENTITY if lms == "canvas" else [c for c in header if c in MOODLE_NAMES + MOODLE_MATCH]
    table = [[*identity, *columns.values()]]
    if lms == "canvas":
        table.append(["    " + CANVAS_POINTS, *[""] * (len(identity) - 1), *(max_scores[d] for d in days)])
    known = set()
    for person in students:
        sid = person[key].strip()
        known.add(sid)
        if not sid:  # Canvas's "Test Student" has no login
            _say(f"roster row {person.get(header[0], '?')!r} has no {key!r}: its cells left blank")
        elif not any((sid, d) in scores for d in days):
            _say(f"{sid} is in the roster but has no scores: its cells left blank")
        cells = []
        for day in days:
            row = scores.get((sid, day))
            if row is not None and row["status"] != "graded":
                _say(f"{sid}: {day} scored {row['score']} ({row['status']})")
            cells.append("" if row is None else row["score"])
        table.append([person.get(c, "") for c in identity] + cells)
    for sid in sorted({s for s, _ in scores} - known):
        _say(f"{sid} has scores but is not in the roster ({key!r}): not in {out.name}")
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(table)
    try:
        os.link(tmp, out)  # never onto a file made meanwhile
    finally:
        tmp.unlink()
    print(f"{out}: {len(students)} students x {len(days)} days for {lms.capitalize()}")
    return 0


def _say(text: str) -> None:
    print(f"dlo export: {text}", file=sys.stderr, flush=True)
