"""The real course, every day of `dlo.registry.DAYS` (the folders of solutions/): it releases, runs, and
grades honestly.

Whole notebooks run here on the tiny profile's smoke version (DLO_SMOKE=1: the tiny sizes with the
fewest steps, seeds and sweep points the experiments run with; the checks in the test cells are the
same whatever the profile), each day twice: the autograder executes the untouched student notebook
(0 on every test cell, and still running every experiment to the end) and the instructors' solution
(full marks, raising nowhere, and every claims table it prints passing `dlo.claims_audit`: the
executed run's verdicts checked against their evidence). The solutions' grading is marked
`solutions`: its own CI step (`pytest -m solutions`), as it doubles the minutes of `make test`,
which keeps the untouched half; the tiny profile at its real step counts is `make run` (papermill,
then grading: full marks required).

Each day is a test class with its own grading runs, so that pytest-xdist (--dist loadscope: a class
per worker at a time) grades several days at once; tests/conftest.py starts them first, as they are
the longest.
"""

from __future__ import annotations

import json
import shutil

import pytest

from dlo.claims_audit import audit_notebook
from dlo.registry import DAYS
from tests.harness.conftest import REPO, dlo, read_csv

pytestmark = [pytest.mark.course, pytest.mark.slow]


def test_the_course_has_days():
    assert "day1_optimizers" in DAYS


def test_dlo_check_passes():
    assert "ok" in dlo("check", root=REPO).stdout


def grade_day(tmp, day: str, student: str):
    """One grading run of a day: the untouched student notebook ("untouched") or the instructors'
    solution ("solution"), as a class's only submission."""
    folder = "solutions" if student == "solution" else "course"
    dest = tmp / "submitted" / student / day
    dest.mkdir(parents=True)
    shutil.copyfile(REPO / folder / day / f"{day}.ipynb", dest / f"{day}.ipynb")
    out = tmp / "grading"
    dlo("grade", str(tmp / "submitted"), "--out", str(out), "--profile", "tiny", root=REPO, timeout=800,
        env={"DLO_SMOKE": "1"})
    return out


def _autograded(graded, student, day):
    return json.loads((graded / "course" / "autograded" / student / day / f"{day}.ipynb").read_text())


class _Day:
    """The tests of one day; `day` is set by the subclass made for it below."""

    day = ""

    @pytest.fixture(scope="class")
    def graded(self, tmp_path_factory):
        return grade_day(tmp_path_factory.mktemp(self.day), self.day, "untouched")

    @pytest.mark.solutions
    def test_solution_scores_full_marks_and_runs_without_error(self, tmp_path):
        graded = grade_day(tmp_path, self.day, "solution")
        row = next(r for r in read_csv(graded / "scores.csv") if r["student"] == "solution")
        assert row["status"] == "graded" and float(row["max_score"]) > 0
        assert float(row["score"]) == float(row["max_score"])
        nb = _autograded(graded, "solution", self.day)
        errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{self.day}: {errors[0]['ename']}: {errors[0]['evalue']}"
        # every claims table it printed: each verdict follows from the evidence it shows (dlo.claims_audit)
        rows, problems = audit_notebook(nb)
        assert rows and not problems, f"{self.day}: {rows} claims rows, problems: {problems}"

    def test_untouched_notebook_scores_zero_on_every_cell_and_runs_to_the_end(self, graded):
        cells = [r for r in read_csv(graded / "cells.csv") if r["student"] == "untouched"]
        assert cells and all(float(r["score"]) == 0 for r in cells), cells
        nb = _autograded(graded, "untouched", self.day)
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert code[-1].get("execution_count"), "the grader did not reach the last cell"
        # Only the exercises and their tests may fail: experiments use dlo's implementations.
        failing = [c["source"][:80] for c in code if any(o["output_type"] == "error" for o in c.get("outputs", []))
                   and not c["metadata"].get("nbgrader")]
        assert not failing, f"cells outside the exercises fail without a solution: {failing}"


for _day in DAYS:  # TestDay1Optimizers, ...: one class, hence one xdist scope, per day
    _name = "Test" + "".join(part.capitalize() for part in _day.split("_"))
    globals()[_name] = type(_name, (_Day,), {"day": _day})
