"""`dlo grade SUBMITTED_DIR`: nbgrader autograde of every student and day, a CSV and feedback HTML.

Layout read: SUBMITTED_DIR/<student>/<day>/<day>.ipynb (never modified: submissions are copied).
Everything nbgrader writes lives under OUT/course (a scratch course root whose gradebook is built
from solutions/ by generate_assignment, so locked test cells and hidden tests come from the
instructors' notebook even when a student edited them). Each (student, day) is autograded by its
own nbgrader child process: a student whose code raises, hangs (cell timeout) or kills its kernel
(see `execute.ResilientExecute`) loses points, and the others are graded all the same.
Outputs: OUT/scores.csv (one row per student and day), OUT/cells.csv (one row per test cell),
OUT/feedback/<student>/<day>.html, and the score table on stdout.
"""

from __future__ import annotations

import csv
import json
import shutil
from datetime import datetime
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

from dlo.harness.days import list_days
from dlo.harness.nbgrader_cli import generate_assignments, nbgrader
from dlo.tables import format_table

CONFIG = '''from nbgrader.converters.autograde import Autograde
from nbgrader.preprocessors import Execute
from dlo.harness.execute import ResilientExecute

c = get_config()
# nbgrader's own pipeline, with Execute swapped for one that survives a dying kernel.
c.Autograde.autograde_preprocessors = [
    ResilientExecute if p is Execute else p
    for p in Autograde.class_traits()["autograde_preprocessors"].default()]
c.Execute.timeout = {cell_timeout}
c.Execute.interrupt_on_timeout = True
'''


def find_submissions(submitted: Path, days: list[str]) -> tuple[list[tuple[str, str]], list[dict]]:
    """(student, day) pairs with a notebook to grade, and rows for what cannot be graded."""
    if not submitted.is_dir():
        raise SystemExit(f"{submitted} is not a folder (expected SUBMITTED_DIR/<student>/<day>/<day>.ipynb)")
    found, bad = [], []
    for student_dir in sorted(p for p in submitted.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for day_dir in sorted(p for p in student_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            student, day = student_dir.name, day_dir.name
            nb = day_dir / f"{day}.ipynb"
            if day not in days:
                print(f"warning: {day_dir} is not a day of this course ({', '.join(days)}); skipped")
            elif not nb.is_file():
                bad.append({"student": student, "day": day, "status": f"missing {nb.name}"})
            elif not _is_json(nb):
                bad.append({"student": student, "day": day, "status": f"{nb.name} is not a readable notebook"})
            else:
                found.append((student, day))
    if not found and not bad:
        raise SystemExit(f"no submissions found in {submitted} (expected <student>/<day>/<day>.ipynb)")
    return found, bad


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def autograde_one(course: Path, submitted: Path, student: str, day: str, profile: str,
                  notebook_timeout: float) -> str:
    dest = course / "submitted" / student / day
    shutil.copytree(submitted / student / day, dest, dirs_exist_ok=True)
    env = {"DLO_PROFILE": profile, "DLO_GRADING": "1"}
    args = ["autograde", day, f"--student={student}", "--force"]
    try:
        proc = nbgrader(args, course, env=env, timeout=notebook_timeout)
    except TimeoutError:
        return f"error: autograde took over {notebook_timeout:.0f} s"
    if proc.returncode != 0:
        (course / f"autograde_{student}_{day}.log").write_text(proc.stdout + proc.stderr)
        return f"error: autograde failed (see {course.name}/autograde_{student}_{day}.log)"
    return "graded"


def feedback_day(course: Path, day: str) -> bool:
    """nbgrader generate_feedback for every graded student of `day` at once; False when it fails.

    A failure leaves the scores valid, so grading goes on: it is printed and logged, and that day's
    feedback (possibly partial or stale) is not copied out."""
    proc = nbgrader(["generate_feedback", day, "--force"], course)
    if proc.returncode == 0:
        return True
    log = f"generate_feedback_{day}.log"
    (course / log).write_text(proc.stdout + proc.stderr)
    print(f"error: generate_feedback {day} failed (see {course.name}/{log}); no feedback copied for {day}",
          flush=True)
    return False


def collect(course: Path, pairs: list[tuple[str, str, str]]) -> tuple[list[dict], list[dict]]:
    rows, cells = [], []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student, day, status in pairs:
            max_score = gb.find_assignment(day).max_score
            try:
                sub = gb.find_submission(day, student)
            except MissingEntry:
                sub = None
            graded = sub is not None and status == "graded"
            score = sub.score if graded else 0.0
            rows.append({"student": student, "day": day, "score": score, "max_score": max_score, "status": status})
            for nb in (sub.notebooks if graded else []):
                for g in sorted(nb.grades, key=lambda g: g.name):
                    cells.append({"student": student, "day": day, "cell": g.name, "score": g.score,
                                  "max_score": g.max_score})
    return rows, cells


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def main(root: Path, submitted: str, out: str | None, profile: str, cell_timeout: float,
         notebook_timeout: float, require_full: bool) -> int:
    days = list_days(root)
    submitted_dir = Path(submitted).resolve()
    out_dir = Path(out or Path("runs") / f"grade-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    course = out_dir / "course"
    if course.exists():
        shutil.rmtree(course)
    course.mkdir(parents=True)
    config = CONFIG.format(cell_timeout=int(cell_timeout))
    _load_config(config)  # nbgrader only logs a broken config file and goes on without it
    (course / "nbgrader_config.py").write_text(config)
    found, bad = find_submissions(submitted_dir, days)
    generate_assignments(root / "solutions", sorted({d for _, d in found} | {r["day"] for r in bad}), course)

    graded = []
    for i, (student, day) in enumerate(found, 1):
        print(f"[{i}/{len(found)}] autograding {student} / {day} ...", flush=True)
        graded.append((student, day, autograde_one(course, submitted_dir, student, day, profile, notebook_timeout)))
    ok_pairs = {(s, d) for s, d, status in graded if status == "graded"}
    fed = {day for day in sorted({d for _, d in ok_pairs}) if feedback_day(course, day)}
    rows, cells = collect(course, graded + [(r["student"], r["day"], r["status"]) for r in bad])
    _copy_feedback(course, out_dir / "feedback", {(s, d) for s, d in ok_pairs if d in fed})

    write_csv(out_dir / "scores.csv", rows, ["student", "day", "score", "max_score", "status"])
    write_csv(out_dir / "cells.csv", cells, ["student", "day", "cell", "score", "max_score"])
    print()
    print(format_table(rows))
    print(f"\nscores: {out_dir / 'scores.csv'}\nper cell: {out_dir / 'cells.csv'}\nfeedback: {out_dir / 'feedback'}")
    no_feedback = sorted({d for _, d in ok_pairs} - fed)
    if no_feedback:
        print(f"no feedback for {', '.join(no_feedback)}: generate_feedback failed (logs in {course})")
    if require_full and not all(r["max_score"] > 0 and r["score"] == r["max_score"] for r in rows):
        print("not every submission has full marks (--require-full)")
        return 1
    return 0


def _load_config(text: str):
    from traitlets.config import Config

    c = Config()
    exec(compile(text, "nbgrader_config.py", "exec"), {"get_config": lambda: c})
    return c


def _copy_feedback(course: Path, dest: Path, pairs: set[tuple[str, str]]) -> None:
    """Copy feedback/<student>/<day>/*.html of the given (student, day) pairs only: a failed autograde
    or generate_feedback may leave an older or partial file there."""
    for html in sorted((course / "feedback").glob("*/*/*.html")):
        student, day = html.parent.parent.name, html.parent.name
        if (student, day) not in pairs:
            continue
        target = dest / student / f"{day}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(html, target)
