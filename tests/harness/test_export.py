"""`dlo export`: scores.csv into the files Canvas's and Moodle's gradebook imports read.

The expected layouts are the ones those systems document and read: Canvas's gradebook import takes its own
export's layout (Student, ID, SIS User ID, SIS Login ID, Section, then assignments; a second row labelled
"Points Possible"; an existing assignment's header "name (id)"); Moodle's CSV import takes any header row
and maps one column to a user field (username, ID number or email address) and the others to grade items.
"""

from __future__ import annotations

import csv

import pytest

from dlo.cli import main
from dlo.harness.results import SCORE_COLUMNS, write_csv

DAYS = {"day1_optimizers": 16.0, "day2_mixed_precision": 12.0}


def _grading(tmp_path, rows):
    grading = tmp_path / "grading"
    grading.mkdir()
    full = [{"student": s, "day": d, "score": sc, "max_score": DAYS[d], "status": st, "sandbox": "bwrap"}
            for s, d, sc, st in rows]
    write_csv(grading / "scores.csv", full, SCORE_COLUMNS)
    return grading


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _read(path):
    with path.open(newline="") as f:
        return list(csv.reader(f))


@pytest.fixture
def grading(tmp_path):
    d1, d2 = DAYS
    return _grading(tmp_path, [("ada", d1, 16.0, "graded"), ("ada", d2, 9.5, "graded"),
                               ("bob", d1, 0.0, "no submission"), ("bob", d2, 12.0, "graded"),
                               ("eve", d1, 3.0, "graded"), ("eve", d2, 0.0, "graded")])


def test_canvas_file_has_canvas_columns_points_row_and_keeps_existing_assignment_ids(tmp_path, grading, capsys):
    roster = _write(tmp_path / "canvas.csv", [
        "\ufeffStudent,ID,SIS User ID,SIS Login ID,Section,day1_optimizers (4711),Current Score",
        "    Points Possible,,,,,16.00,(read only)",
        '"Lovelace, Ada",101,U1,ada,DLO-1,,',
        '"Builder, Bob",102,U2,bob,DLO-1,,',
        '"Noether, Emmy",103,U3,emmy,DLO-1,,',
        '"Student, Test",999,,,DLO-1,,'])
    out = tmp_path / "to_canvas.csv"
    assert main(["export", str(grading), "--to", "canvas", "--roster", str(roster), "--out", str(out)]) == 0
    table = _read(out)
    assert table[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "day1_optimizers (4711)",
                        "day2_mixed_precision"]
    assert table[1] == ["    Points Possible", "", "", "", "", "16.0", "12.0"]
    assert table[2] == ["Lovelace, Ada", "101", "U1", "ada", "DLO-1", "16.0", "9.5"]
    assert table[3] == ["Builder, Bob", "102", "U2", "bob", "DLO-1", "0.0", "12.0"]
    assert table[4] == ["Noether, Emmy", "103", "U3", "emmy", "DLO-1", "", ""]
    assert table[5][:1] == ["Student, Test"] and table[5][-2:] == ["", ""]
    err = capsys.readouterr().err.splitlines()
    assert all(line.startswith("dlo export: ") for line in err)
    said = "\n".join(err)
    assert "eve has scores but is not in the roster" in said  # never dropped silently
    assert "emmy is in the roster but has no scores" in said
    assert "bob: day1_optimizers scored 0.0 (no submission)" in said
    assert "'Student, Test'" in said


def test_moodle_file_keeps_the_user_fields_moodle_maps_from(tmp_path, grading, capsys):
    roster = _write(tmp_path / "moodle.csv", [
        "First name,Last name,ID number,Institution,Department,Email address,Username",
        "Ada,Lovelace,S1,Uni,CS,ada@uni.edu,ada", "Eve,Ng,S3,Uni,CS,eve@uni.edu,eve",
        "Bob,B,S2,Uni,CS,bob@uni.edu,bob"])
    out = tmp_path / "to_moodle.csv"
    assert main(["export", str(grading), "--to", "moodle", "--roster", str(roster), "--out", str(out)]) == 0
    table = _read(out)
    assert table[0] == ["First name", "Last name", "ID number", "Email address", "Username", "day1_optimizers",
                        "day2_mixed_precision"]
    assert table[1] == ["Ada", "Lovelace", "S1", "ada@uni.edu", "ada", "16.0", "9.5"]
    assert table[2][-2:] == ["3.0", "0.0"] and len(table) == 4  # no Points Possible row for Moodle
    assert "not in the roster" not in capsys.readouterr().err


@pytest.mark.parametrize("case, message", [
    ("no-key", "no column 'SIS Login ID'"),
    ("twice", "names ada more than once"),
    ("exists", "exists: give a new file"),
    ("no-scores", "has no scores.csv"),
])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(tmp_path, grading, capsys, case, message):
    header = "Student,ID,SIS User ID,SIS Login ID,Section"
    lines = {"no-key": ["Student,ID,SIS User ID,Login,Section", '"A",1,U1,ada,S'],
             "twice": [header, '"A",1,U1,ada,S', '"A2",2,U2,ada,S']}.get(case, [header, '"A",1,U1,ada,S'])
    roster = _write(tmp_path / "roster.csv", lines)
    out = tmp_path / "out.csv"
    if case == "exists":
        out.write_text("the instructor's own file\n")
    folder = tmp_path if case == "no-scores" else grading
    rc = main(["export", str(folder), "--to", "canvas", "--roster", str(roster), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert (out.read_text() == "the instructor's own file\n") if case == "exists" else not out.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_moodle_roster_needs_a_column_moodle_matches_users_by(tmp_path, grading, capsys):
    roster = _write(tmp_path / "r.csv", ["First name,Last name,login", "Ada,L,ada"])
    rc = main(["export", str(grading), "--to", "moodle", "--roster", str(roster), "--key", "login",
               "--out", str(tmp_path / "o.csv")])
    assert rc == 2 and "Username, ID number, Email address" in capsys.readouterr().err
