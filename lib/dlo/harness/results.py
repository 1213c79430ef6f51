"""What `dlo grade` keeps of each graded submission, the two CSVs, and one gradebook from many.

Every finished submission leaves a record, OUT/results/<student>/<day>.json, written last and
atomically: a submission with a record is graded and finished (a resumed run skips it), one without
is graded again from scratch. The CSVs are built from the records alone, sorted by student, day and
cell, so they are the same bytes whatever the number of jobs, the order in which submissions
finished, or how the students were split into shards.

nbgrader's gradebook is SQLite: one writer at a time: each submission is graded into its own
copy of the course's template gradebook, and `merge_gradebooks` joins them afterwards, in one
process (rows matched by assignment, notebook and cell names, so parts generated separately join).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sqlite3
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

NO_SUBMISSION = "no submission"
SCORE_COLUMNS = ["student", "day", "score", "max_score", "status", "sandbox"]
CELL_COLUMNS = ["student", "day", "cell", "score", "max_score"]


# ----------------------------------------------------------------------------- records

def record_path(out: Path, student: str, day: str) -> Path:
    return out / "results" / student / f"{day}.json"


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a resumed run) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def graded(db: Path, day: str, student: str) -> tuple[float, dict] | None:
    """(score, {test cell: score}) of one submission in its gradebook, None when it has none."""
    with Gradebook(f"sqlite:///{db}") as gb:
        try:
            sub = gb.find_submission(day, student)
        except MissingEntry:
            return None
        return sub.score, {g.name: g.score for nb in sub.notebooks for g in nb.grades}


def templates(db: Path, days: list[str]) -> dict:
    """{day: (max score, [(test cell, max score)] sorted by name)} from the course's gradebook."""
    with Gradebook(f"sqlite:///{db}") as gb:
        return {d: (gb.find_assignment(d).max_score,
                    sorted((g.name, g.max_score) for nb in gb.find_assignment(d).notebooks for g in nb.grade_cells))
                for d in days}


# ----------------------------------------------------------------------------- tables

def tables(status: dict, records: dict, template: dict, sandbox: str) -> tuple[list[dict], list[dict]]:
    """The rows of scores.csv and cells.csv: a row per (student, day) of `status`, graded ones from
    their record, the others 0 with the reason as status."""
    rows, cells = [], []
    for (student, day), state in sorted(status.items()):
        max_score, grade_cells = template[day]
        rec = records.get((student, day))
        by_cell = rec["cells"] if rec else {}
        rows.append({"student": student, "day": day, "score": float(rec["score"]) if rec else 0.0,
                     "max_score": max_score, "status": rec["status"] if rec else state,
                     "sandbox": rec["sandbox"] if rec else sandbox})
        cells += [{"student": student, "day": day, "cell": name, "score": float(by_cell.get(name, 0.0)),
                   "max_score": cell_max} for name, cell_max in grade_cells]
    return rows, cells


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def copy_feedback(course: Path, dest: Path, student: str, day: str) -> None:
    html = course / "feedback" / student / day / f"{day}.html"
    if html.is_file():
        target = dest / student / f"{day}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(html, target)


# ----------------------------------------------------------------------------- one gradebook from many

def merge_gradebooks(dest: Path, base: Path, sources: list[Path]) -> None:
    """dest = base (a gradebook: the course's assignments, maybe submissions) plus the submissions of
    every source; ValueError when a source grades an assignment, notebook or cell that base lacks
    (another course version) or a submission that is already there (it would count twice)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(base, tmp)
    con = sqlite3.connect(tmp)
    try:
        for src in sources:
            _merge_one(con, src)
        con.commit()
    except BaseException:
        con.close()
        tmp.unlink(missing_ok=True)
        raise
    con.close()
    os.replace(tmp, dest)


def _names(con, db: str) -> tuple[dict, dict, dict]:
    """id -> name keys of assignments, notebooks and cells in database `db` ("main" or "s")."""
    assignments = dict(con.execute(f"SELECT id, name FROM {db}.assignment"))
    notebooks = {i: (assignments[a], n)
                 for i, n, a in con.execute(f"SELECT id, name, assignment_id FROM {db}.notebook")}
    cells = {i: (notebooks[nb], n, t)
             for i, n, nb, t in con.execute(f"SELECT id, name, notebook_id, type FROM {db}.base_cell")}
    return assignments, notebooks, cells


def _mapping(src: dict, dest: dict, what: str, where: Path) -> dict:
    inverse = {v: k for k, v in dest.items()}
    missing = sorted(str(v) for v in src.values() if v not in inverse)
    if missing:
        raise ValueError(f"{where}: {what} {', '.join(missing[:3])} not in the merged gradebook "
                         f"(another course version?)")
    return {k: inverse[v] for k, v in src.items()}


def _merge_one(con, src: Path) -> None:
    con.execute("ATTACH DATABASE ? AS s", (str(src),))
    try:
        maps = [_mapping(s, d, what, src) for s, d, what in
                zip(_names(con, "s"), _names(con, "main"), ("assignment", "notebook", "cell"))]
        amap, nmap, cmap = maps
        con.execute("INSERT OR IGNORE INTO main.student (id, first_name, last_name, email, lms_user_id) "
                    "SELECT id, first_name, last_name, email, lms_user_id FROM s.student")
        for sid, aid, student, ts, ext in list(con.execute(
                "SELECT id, assignment_id, student_id, timestamp, extension FROM s.submitted_assignment")):
            if con.execute("SELECT 1 FROM main.submitted_assignment WHERE assignment_id=? AND student_id=?",
                           (amap[aid], student)).fetchone():
                day = dict(con.execute("SELECT id, name FROM s.assignment"))[aid]
                raise ValueError(f"{src}: {student}'s submission of {day} is already in the merged gradebook "
                                 f"(graded twice?)")
            con.execute("INSERT INTO main.submitted_assignment (id, assignment_id, student_id, timestamp, extension) "
                        "VALUES (?, ?, ?, ?, ?)", (sid, amap[aid], student, ts, ext))
        for row in list(con.execute("SELECT id, assignment_id, notebook_id, flagged, late_submission_penalty "
                                    "FROM s.submitted_notebook")):
            con.execute("INSERT INTO main.submitted_notebook (id, assignment_id, notebook_id, flagged, "
                        "late_submission_penalty) VALUES (?, ?, ?, ?, ?)", (row[0], row[1], nmap[row[2]], *row[3:]))
        for row in list(con.execute("SELECT id, notebook_id, cell_id, auto_score, manual_score, extra_credit, "
                                    "needs_manual_grade FROM s.grade")):
            con.execute("INSERT INTO main.grade (id, notebook_id, cell_id, auto_score, manual_score, extra_credit, "
                        "needs_manual_grade) VALUES (?, ?, ?, ?, ?, ?, ?)", (*row[:2], cmap[row[2]], *row[3:]))
        for row in list(con.execute("SELECT id, notebook_id, cell_id, auto_comment, manual_comment FROM s.comment")):
            con.execute("INSERT INTO main.comment (id, notebook_id, cell_id, auto_comment, manual_comment) "
                        "VALUES (?, ?, ?, ?, ?)", (*row[:2], cmap[row[2]], *row[3:]))
    finally:
        con.commit()  # DETACH needs no open transaction; a failed merge's file is deleted by the caller
        con.execute("DETACH DATABASE s")
