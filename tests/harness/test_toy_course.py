"""The harness on a toy course: release/check, run, and grading that survives bad students."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.harness.conftest import DAY, dlo, edit_cells, grade_id, read_csv


def test_release_strips_solutions_and_hidden_tests(toy_root):
    student = (toy_root / "course" / DAY / f"{DAY}.ipynb").read_text()
    assert "raise NotImplementedError()" in student
    assert "return a + b" not in student and "hypot" not in student
    assert "HIDDEN TESTS" not in student and "add(-1, 1)" not in student
    assert "assert add(2, 3) == 5" in student  # visible tests stay


def test_check_passes_then_catches_drift_and_outputs(toy_root):
    assert "ok" in dlo("check", root=toy_root).stdout
    src = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    nb = json.loads(src.read_text())
    nb["cells"][3]["source"] = "print('changed')"
    src.write_text(json.dumps(nb))
    proc = dlo("check", root=toy_root, check=False)
    assert proc.returncode == 1 and "differs from what `dlo release` generates" in proc.stdout
    dlo("release", root=toy_root)
    nb["cells"][3]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "changed\n"}]
    nb["cells"][3]["execution_count"] = 1
    src.write_text(json.dumps(nb))
    proc = dlo("check", root=toy_root, check=False)
    assert proc.returncode == 1 and "outputs or execution counts" in proc.stdout


def test_check_rejects_bad_parameters_cell(toy_root):
    src = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    nb = json.loads(src.read_text())
    nb["cells"][2]["source"] = "import os\nprofile = os.environ['X']\n"
    src.write_text(json.dumps(nb))
    proc = dlo("check", root=toy_root, check=False)
    assert proc.returncode == 1
    assert "only `name: type = literal`" in proc.stdout and "lacks" in proc.stdout


def test_run_reports_table_and_rejects_unknown_names(toy_root, tmp_path):
    out = tmp_path / "out"
    proc = dlo("run", DAY, "--profile", "tiny", "--out", str(out), "-p", "seed", "7", root=toy_root)
    assert f"{DAY}" in proc.stdout and "ok" in proc.stdout
    executed = json.loads((out / DAY / f"{DAY}.ipynb").read_text())
    assert any("profile tiny seed 7" in "".join(o.get("text", "")) for c in executed["cells"]
               for o in c.get("outputs", []))
    bad_day = dlo("run", "nope", root=toy_root, check=False)
    assert bad_day.returncode != 0 and "unknown day(s) nope" in bad_day.stderr and DAY in bad_day.stderr
    bad_param = dlo("run", DAY, "-p", "lr", "1", root=toy_root, check=False)
    assert bad_param.returncode != 0 and "no parameter 'lr'" in bad_param.stderr


def test_run_fails_when_a_cell_raises(toy_root, tmp_path):
    proc = dlo("run", DAY, "--notebooks", "course", "--out", str(tmp_path / "o"), root=toy_root, check=False)
    assert proc.returncode == 1 and "failed" in proc.stdout


def _student(toy_root, submitted, name, edit):
    src = toy_root / ("solutions" if name == "solution" else "course") / DAY / f"{DAY}.ipynb"
    edit_cells(src, submitted / name / DAY / f"{DAY}.ipynb", edit)


def _replace(gid, source):
    def edit(cell):
        if grade_id(cell) == gid:
            cell["source"] = source
    return edit


def _solve_all(cell):
    if grade_id(cell) == "add":
        cell["source"] = "def add(a, b):\n    return a + b"
    if grade_id(cell) == "norm":
        cell["source"] = "def norm(x, y):\n    return (x * x + y * y) ** 0.5"


def _chain(*edits):
    def edit(cell):
        for e in edits:
            e(cell)
    return edit


@pytest.mark.slow
def test_grade_scores_every_student_despite_raising_hanging_and_dying_code(toy_root, tmp_path):
    submitted = tmp_path / "submitted"
    _student(toy_root, submitted, "solution", lambda c: None)
    _student(toy_root, submitted, "untouched", lambda c: None)
    # Edited the locked test cells so they pass: graded with the original tests anyway.
    _student(toy_root, submitted, "tamperer", _chain(_replace("add_test", "pass"), _replace("norm_test", "pass")))
    _student(toy_root, submitted, "hanger", _chain(_solve_all, _replace(
        "add", "import time\nwhile True:\n    time.sleep(0.1)")))
    _student(toy_root, submitted, "killer", _chain(_solve_all, _replace("add", "import os\nos._exit(1)")))
    (submitted / "ghost" / DAY).mkdir(parents=True)  # a folder without its notebook
    before = sorted(p.read_bytes() for p in submitted.rglob("*.ipynb"))

    out = tmp_path / "grading"
    proc = dlo("grade", str(submitted), "--out", str(out), "--cell-timeout", "5", root=toy_root, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {r["student"]: r for r in read_csv(out / "scores.csv")}
    got = {s: float(r["score"]) for s, r in scores.items()}
    assert got == {"solution": 5, "untouched": 0, "tamperer": 0, "hanger": 3, "killer": 3, "ghost": 0}, proc.stdout
    assert all(float(r["max_score"]) == 5 for r in scores.values())
    assert scores["ghost"]["status"] == f"missing {DAY}.ipynb"
    cells = {(r["student"], r["cell"]): float(r["score"]) for r in read_csv(out / "cells.csv")}
    assert cells[("killer", "add_test")] == 0 and cells[("killer", "norm_test")] == 3
    assert (out / "feedback" / "solution" / f"{DAY}.html").is_file()
    assert sorted(p.read_bytes() for p in submitted.rglob("*.ipynb")) == before  # submissions untouched

    one = tmp_path / "one"  # a wrong answer beside a correct one: --require-full must fail
    _student(toy_root, one, "student", _solve_all)  # correct, own words
    _student(toy_root, one, "wrong", _chain(_solve_all, _replace("add", "def add(a, b):\n    return a - b")))
    strict = dlo("grade", str(one), "--out", str(tmp_path / "g2"), "--require-full", root=toy_root, check=False)
    assert strict.returncode == 1 and "not every submission has full marks" in strict.stdout
    strict_scores = {r["student"]: (float(r["score"]), r["status"]) for r in read_csv(tmp_path / "g2" / "scores.csv")}
    assert strict_scores == {"student": (5, "graded"), "wrong": (3, "graded")}, strict.stdout
    assert all((tmp_path / "g2" / "feedback" / s / f"{DAY}.html").is_file() for s in strict_scores)


def test_failed_feedback_is_logged_and_not_copied(tmp_path, monkeypatch, capsys):
    from dlo.harness import grade

    course = tmp_path / "course"
    for day in ("good", "bad"):
        (course / "feedback" / "ann" / day).mkdir(parents=True)
        (course / "feedback" / "ann" / day / f"{day}.html").write_text(day)
    monkeypatch.setattr(grade, "nbgrader", lambda args, root: subprocess.CompletedProcess(
        args, int(args[1] == "bad"), "out\n", "boom\n"))
    fed = {day for day in ("good", "bad") if grade.feedback_day(course, day)}
    assert fed == {"good"}
    assert "generate_feedback bad failed" in capsys.readouterr().out
    assert (course / "generate_feedback_bad.log").read_text() == "out\nboom\n"
    assert not (course / "generate_feedback_good.log").exists()
    grade._copy_feedback(course, tmp_path / "fb", {("ann", "good")})
    assert sorted(p.name for p in (tmp_path / "fb").rglob("*.html")) == ["good.html"]


def test_grade_rejects_a_missing_folder(toy_root, tmp_path):
    proc = dlo("grade", str(tmp_path / "nothing"), root=toy_root, check=False)
    assert proc.returncode != 0 and "is not a folder" in proc.stderr
