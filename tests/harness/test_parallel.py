"""Grading a class (issue 15) on the toy course: --jobs and --shard/--merge give the bytes of a
one-at-a-time run, a killed worker is retried once then marked, an interrupted run resumes without
grading anything twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness.conftest import DAY, POINTS, dlo, read_csv, sandbox_flags, toy_days
from tests.harness.test_toy_course import ADD, _replace, _student

TOTAL = sum(POINTS.values())
pytestmark = pytest.mark.slow


def _class(toy_root, sub: Path, names=("blank", "half", "sol")) -> None:
    edits = {"blank": lambda c: None, "half": _replace("add", ADD), "sol": lambda c: None}
    for name in names:
        _student(toy_root, sub, "solution" if name == "sol" else name, edits[name])
        if name == "sol":
            (sub / "solution").rename(sub / "sol")
            events = sub / "sol" / DAY / "runs" / "adamw" / "events.out.tfevents.1.host"  # the student's TensorBoard
            events.parent.mkdir(parents=True)
            events.write_bytes(b"\0" * 64)
    (sub / "vacant").mkdir()  # a student without the day: a row, "no submission"


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _submissions(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as con:
        return sorted(con.execute("SELECT s.student_id, a.name FROM submitted_assignment s "
                                  "JOIN assignment a ON a.id = s.assignment_id"))


@pytest.mark.scale
def test_jobs_and_shards_give_the_bytes_of_one_at_a_time(toy_root, tmp_path):
    """--jobs 2 on the whole class, and --jobs 1 in two shards merged: the same CSV and feedback bytes."""
    sub = tmp_path / "sub"
    _class(toy_root, sub, names=("blank", "sol"))
    one, parts = tmp_path / "one", tmp_path / "parts"
    dlo("grade", str(sub), "--out", str(one), "--jobs", "2", root=toy_root)  # two at a time
    # one at a time, in two shards: students sorted blank, sol, vacant; shard 1/2 gets blank and vacant
    dlo("grade", str(sub), "--out", str(parts), "--shard", "1/2", "--jobs", "1", root=toy_root)
    refused = dlo("grade", "--merge", str(parts), root=toy_root, check=False)
    assert refused.returncode == 1 and "missing: part-2-of-2" in refused.stderr
    dlo("grade", str(sub), "--out", str(parts), "--shard", "2/2", "--jobs", "1", root=toy_root)

    manifest = parts / "part-2-of-2" / "grading.json"
    real = manifest.read_text()
    manifest.write_text(json.dumps({**json.loads(real), "course_version": "0123456789ab"}))
    refused = dlo("grade", "--merge", str(parts), root=toy_root, check=False)
    assert refused.returncode == 1 and "different course versions" in refused.stderr
    assert "part-2-of-2: version 0123456789ab" in refused.stderr and not (parts / "scores.csv").exists()
    manifest.write_text(real)
    dlo("grade", "--merge", str(parts), root=toy_root)

    for name in ("scores.csv", "cells.csv", "similarity.csv", "similarity.html"):  # the report: across the parts
        assert (parts / name).read_bytes() == (one / name).read_bytes(), name
    assert _files(parts / "feedback") == _files(one / "feedback")
    scores = {r["student"]: (float(r["score"]), r["status"]) for r in read_csv(one / "scores.csv")}
    assert scores == {"blank": (0, "graded"), "sol": (TOTAL, "graded"), "vacant": (0, "no submission")}
    graded = [("blank", DAY), ("sol", DAY)]
    assert _submissions(one / "course" / "gradebook.db") == graded == _submissions(parts / "gradebook.db")
    assert not list(one.rglob("runs"))  # the submissions' TensorBoard folders are not copied


def _nbgrader_children(student: str, out: Path) -> list[int]:
    """The per-submission grading processes of `student` in the grading run writing to `out` (python -m
    dlo.harness.nbgrader_cli OUT/work/... STUDENT, or a fork of the warm `nbgrader_cli --warm` working in
    OUT/work/STUDENT/...): other tests grade students of the same names at the same time, on the other
    xdist worker."""
    under, folder = str(out).encode(), str(out / "work" / student) + os.sep
    pids = []
    for entry in os.listdir("/proc"):
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(f"/proc/{entry}/cwd") + os.sep if b"--warm" in args else ""
        except OSError:
            continue
        if b"dlo.harness.nbgrader_cli" in args and (cwd.startswith(folder) or (args[-2:-1] == [student.encode()]
                                                    and any(a.startswith(under) for a in args))):
            pids.append(int(entry))
    return pids


class Killer(threading.Thread):
    """Kills the first `times` grading processes of `student` that appear (as the OOM killer would)."""

    def __init__(self, student: str, out: Path, times: int):
        super().__init__(daemon=True)
        self.student, self.out, self.times, self.killed, self.done = student, out, times, set(), threading.Event()

    def run(self):
        while not self.done.is_set() and len(self.killed) < self.times:
            for pid in _nbgrader_children(self.student, self.out):
                if pid not in self.killed:
                    time.sleep(0.5)  # let it start working
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.add(pid)
            time.sleep(0.1)


def _grade(toy_root, sub, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dlo.cli", "--root", str(toy_root), "grade", str(sub), "--out",
                             str(out), "--jobs", "1", *extra, *sandbox_flags()], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DLO_PROFILE": "tiny", **toy_days(toy_root)})


@pytest.mark.scale
def test_killed_workers_and_interrupts_cost_only_their_submission(toy_root, tmp_path):
    sub, out = tmp_path / "sub", tmp_path / "g"
    _class(toy_root, sub, names=("blank", "sol"))
    record = out / "results" / "blank" / f"{DAY}.json"

    # Run 1: blank's worker is killed once (retried, graded); then SIGTERM (a job's time limit) during sol.
    killer = Killer("blank", out, 1)
    killer.start()
    proc = _grade(toy_root, sub, out)
    while not record.exists() and proc.poll() is None:
        time.sleep(0.2)
    while not _nbgrader_children("sol", out) and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130 and "trying once more" in log and "run the same command again" in log, log
    first = json.loads(record.read_text())
    assert first["status"] == "graded" and first["attempts"] == 2
    assert not _nbgrader_children("sol", out)  # the interrupted worker went with the run

    # Run 2 resumes (blank kept); sol's worker is killed twice: marked, and the run goes on.
    killer = Killer("sol", out, 2)
    killer.start()
    proc = _grade(toy_root, sub, out)
    log = proc.communicate(timeout=600)[0]
    killer.done.set()
    assert proc.returncode == 0, log
    assert "1 submission(s) already graded, 1 to go" in log
    scores = {r["student"]: r for r in read_csv(out / "scores.csv")}
    assert "killed by SIGKILL, twice" in scores["sol"]["status"] and float(scores["sol"]["score"]) == 0
    assert json.loads(record.read_text()) == first  # not graded again

    # Run 3 grades what was marked, and only that; nothing is counted twice.
    proc = _grade(toy_root, sub, out)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "1 submission(s) already graded, 1 to go" in log, log
    scores = {r["student"]: (float(r["score"]), r["status"]) for r in read_csv(out / "scores.csv")}
    assert scores == {"blank": (0, "graded"), "sol": (TOTAL, "graded"), "vacant": (0, "no submission")}
    assert len(read_csv(out / "cells.csv")) == 3 * len(POINTS)
    assert _submissions(out / "course" / "gradebook.db") == [("blank", DAY), ("sol", DAY)]
