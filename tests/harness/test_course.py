"""The real course, every day of `dlo.registry.DAYS` (the folders of solutions/): it releases, runs, and
grades honestly.

Whole notebooks run here on the tiny profile's smoke version (DLO_SMOKE=1: the tiny sizes with the
fewest steps, seeds and sweep points the experiments run with; the checks in the test cells are the
same whatever the profile), each day twice: the autograder executes the untouched student notebook
as `dlo grade` does by default (0 on every test cell, every cell up to the last graded one run, the
experiments after it left out with a note) and the instructors' solution with --full-notebook (full
marks, raising nowhere, the experiments included, and every claims table it prints passing
`dlo.claims_audit`: the executed run's verdicts checked against their evidence). For two days, the
default and --full-notebook gradings of the solution, the release and a half-solved notebook give
the same CSVs (`-m solutions`). The solutions' grading is marked `solutions`: its own CI step
(`pytest -m solutions`), as it doubles the minutes of `make test`, which keeps the untouched half;
the tiny profile at its real step counts is `make run` (papermill, each notebook graded once it has run: full
marks required).

Each day is a test class, so that pytest-xdist (--dist loadscope: a class per worker at a time) runs
several days at once; tests/conftest.py starts them first, as they are the longest. The untouched
releases of the selected days are graded together, as one class of one `dlo grade` run (two at a time,
as a class is graded), once for the session: the first worker to need it grades them, the other waits
for its result (one grading's setup and its warm process instead of eleven: ~80 CPU s of make test).
"""

from __future__ import annotations

import shutil

import nbformat
import pytest
from filelock import FileLock

from dlo.claims_audit import audit_notebook
from dlo.harness import graded as graded_cells
from dlo.registry import DAYS
from tests.harness.conftest import REPO, dlo, read_csv

pytestmark = [pytest.mark.course, pytest.mark.slow]


def test_the_course_has_days():
    assert "day1_optimizers" in DAYS


def test_dlo_check_passes():
    assert "ok" in dlo("check", root=REPO).stdout


def submit(submitted, student: str, day: str, folder: str) -> None:
    """The day's notebook of `folder` ("solutions" or "course") as `student`'s submission under `submitted`."""
    dest = submitted / student / day
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / folder / day / f"{day}.ipynb", dest / f"{day}.ipynb")


def grade_day(tmp, day: str, student: str, *options: str):
    """One grading run of a day: the untouched student notebook ("untouched") or the instructors'
    solution ("solution"), as a class's only submission."""
    submit(tmp / "submitted", student, day, "solutions" if student == "solution" else "course")
    return grade(tmp / "submitted", tmp / "grading", *options)


def grade(submitted, out, *options: str):
    dlo("grade", str(submitted), "--out", str(out), "--profile", "tiny", *options, root=REPO, timeout=800,
        env={"DLO_SMOKE": "1"})
    return out


def half_solved(day: str, dest) -> None:
    """The release with the first half of its exercises solved (the solutions' cells, by grade_id)."""
    nb = nbformat.read(REPO / "course" / day / f"{day}.ipynb", as_version=4)
    source = nbformat.read(REPO / "solutions" / day / f"{day}.ipynb", as_version=4)
    solved = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
              if c.metadata.get("nbgrader", {}).get("solution")}
    for gid in list(solved)[:(len(solved) + 1) // 2]:
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)
        cell.source = solved[gid]
    dest.parent.mkdir(parents=True)
    nbformat.write(nb, dest)


@pytest.mark.solutions
@pytest.mark.parametrize("day", ["day3_checkpointing", "day7_tensor_parallel"])
def test_grading_what_is_graded_gives_the_scores_of_the_full_run(tmp_path, day):
    sub = tmp_path / "submitted"
    for student, folder in (("solution", "solutions"), ("release", "course")):
        submit(sub, student, day, folder)
    half_solved(day, sub / "half" / day / f"{day}.ipynb")
    fast, full = grade(sub, tmp_path / "graded"), grade(sub, tmp_path / "full", "--full-notebook")
    for name in ("scores.csv", "cells.csv"):
        assert (fast / name).read_bytes() == (full / name).read_bytes(), name
    scores = {r["student"]: float(r["score"]) for r in read_csv(fast / "scores.csv")}
    assert scores["release"] == 0 < scores["half"] < scores["solution"]


def _autograded(graded, student, day):
    """The autograded notebook, read by nbformat: each cell's source one string (JSON may split it in lines)."""
    return nbformat.read(graded / "course" / "autograded" / student / day / f"{day}.ipynb", as_version=4)


@pytest.fixture(scope="session")
def untouched_graded(request, tmp_path_factory, worker_id):
    """The untouched release of every day this session selected, graded in one `dlo grade` run as one
    student's submissions; once for all xdist workers (their shared temporary folder holds it, under a lock)."""
    days = sorted({item.cls.day for item in request.session.items if item.cls and issubclass(item.cls, _Day)})
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # pytest-N/: this session's, every worker's
    out = shared / "untouched-graded"
    with FileLock(str(shared / "untouched-graded.lock")):
        if not (out / "scores.csv").is_file():
            for day in days:
                submit(shared / "untouched-submitted", "untouched", day, "course")
            shutil.rmtree(out, ignore_errors=True)  # a worker's failed attempt: graded again
            grade(shared / "untouched-submitted", out)
    return out


class _Day:
    """The tests of one day; `day` is set by the subclass made for it below."""

    day = ""

    @pytest.mark.solutions
    def test_solution_scores_full_marks_and_runs_without_error(self, tmp_path):
        graded = grade_day(tmp_path, self.day, "solution", "--full-notebook")
        row = next(r for r in read_csv(graded / "scores.csv") if r["student"] == "solution")
        assert row["status"] == "graded" and float(row["max_score"]) > 0
        assert float(row["score"]) == float(row["max_score"])
        nb = _autograded(graded, "solution", self.day)
        errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{self.day}: {errors[0]['ename']}: {errors[0]['evalue']}"
        # every claims table it printed: each verdict follows from the evidence it shows (dlo.claims_audit)
        rows, problems = audit_notebook(nb)
        assert rows and not problems, f"{self.day}: {rows} claims rows, problems: {problems}"

    def test_untouched_notebook_scores_zero_on_every_cell_and_runs_to_the_end(self, untouched_graded):
        graded = untouched_graded
        cells = [r for r in read_csv(graded / "cells.csv") if r["student"] == "untouched" and r["day"] == self.day]
        assert cells and all(float(r["score"]) == 0 for r in cells), cells
        nb = _autograded(graded, "untouched", self.day)
        last = graded_cells.last_graded_index(nb)
        plain = [(i, c) for i, c in enumerate(nb["cells"])
                 if c["cell_type"] == "code" and c["source"].strip() and not c["metadata"].get("nbgrader")]
        assert all(c.get("execution_count") for i, c in plain if i < last), "the grader skipped a cell it grades after"
        assert all("Not run by the grader" in str(c["outputs"]) for i, c in plain if i > last)
        # Only the exercises and their tests may fail: experiments use dlo's implementations.
        failing = [c["source"][:80] for _, c in plain if any(o["output_type"] == "error" for o in c.get("outputs", []))]
        assert not failing, f"cells outside the exercises fail without a solution: {failing}"


for _day in DAYS:  # TestDay1Optimizers, ...: one class, hence one xdist scope, per day
    _name = "Test" + "".join(part.capitalize() for part in _day.split("_"))
    globals()[_name] = type(_name, (_Day,), {"day": _day})
