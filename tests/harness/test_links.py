"""Nothing a student made is followed (issue 26): a submission's links and special files are neither
graded nor copied (they are named in the feedback), a notebook that is a link counts as not
submitted, and the grader's reads from the capture folder and its runner's log refuse links and fifos.

The first test grades a small class on the toy course (one student also looks for the checks in the
grading kernel, where `dlo.checks` is sealed), the rest take the pieces one by one.
"""

from __future__ import annotations

import html
import json
import os
import re
import socket
import threading
import time

import pytest

from dlo.grading import files, testcells
from dlo.harness.submissions import folder_hash, notebook_status
from tests.harness.conftest import DAY, POINTS, dlo, read_csv
from tests.harness.test_toy_course import _student

TOTAL = sum(POINTS.values())
PRINT_DATA = '''import os
for folder, dirs, names in os.walk("."):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(folder, d))]):
        path = os.path.join(folder, name)
        try:
            print(path, open(path, errors="replace").read())
        except OSError as exc:
            print(path, type(exc).__name__)'''


BENCH = '''import importlib
try:
    print("bench:", importlib.import_module("dlo.checks.day1").check_adamw_step)
except AttributeError as exc:
    print("bench:", exc)'''


def _grade_id_source(gid, source):
    def edit(cell):
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == gid:
            cell["source"] = source
    return edit


def _print_files(cell):
    if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "add":
        cell["source"] = PRINT_DATA


@pytest.mark.slow
def test_links_in_a_submission_are_never_followed(toy_root, tmp_path):
    submitted, out = tmp_path / "submitted", tmp_path / "grading"
    instructors = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    # a notebook that is a link to the instructors' (full marks when followed)
    (submitted / "linker" / DAY).mkdir(parents=True)
    (submitted / "linker" / DAY / f"{DAY}.ipynb").symlink_to(instructors)
    # the blank notebook beside a data file linked to the instructors' notebook (its hidden tests), a
    # linked folder, a fifo and a socket; one of its cells prints every file of its working folder
    _student(toy_root, submitted, "leaker", _print_files)
    day = submitted / "leaker" / DAY
    (day / "data.txt").symlink_to(instructors)
    (day / "sub").mkdir()
    (day / "sub" / "notes.txt").write_text("my own notes")
    (day / "sub" / "solutions").symlink_to(instructors.parent, target_is_directory=True)
    os.mkfifo(day / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(day / "sock"))
    # and a cell that looks for the checks in the grading kernel: sealed there from its first cell on
    _student(toy_root, submitted, "bencher", _grade_id_source("add", BENCH))

    proc = dlo("grade", str(submitted), "--out", str(out), "--cell-timeout", "30", root=toy_root, check=False,
               timeout=900, cwd=tmp_path)
    sock.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {r["student"]: r for r in read_csv(out / "scores.csv")}
    assert float(scores["linker"]["score"]) == 0
    assert scores["linker"]["status"] == f"not graded: {DAY}.ipynb is a symlink (only regular files are graded)"
    assert float(scores["leaker"]["score"]) == 0 and scores["leaker"]["status"] == "graded"

    feedback = html.unescape(re.sub(r"<[^>]+>", "", (out / "feedback" / "leaker" / f"{DAY}.html").read_text()))
    assert "add(-1, 1)" not in feedback and "HIDDEN TESTS" not in feedback and "return a + b" not in feedback
    assert "my own notes" in feedback  # the regular file in a real folder came along
    for skipped in ("data.txt (a symlink)", "pipe (a fifo)", "sock (a socket)", "sub/solutions (a symlink)"):
        assert skipped in feedback and skipped in proc.stdout, skipped
    bench = html.unescape(re.sub(r"<[^>]+>", "", (out / "feedback" / "bencher" / f"{DAY}.html").read_text()))
    assert "bench: dlo.checks.day1.check_adamw_step is the grader's" in bench, bench[-3000:]
    assert float(scores["bencher"]["score"]) == 0

    kept = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_symlink() or not (p.is_file() or p.is_dir())}
    assert not kept, kept  # nbgrader copied no link and no special file into the course's folders
    for folder in (out / "course" / "feedback" / "leaker", out / "course" / "autograded" / "leaker"):
        assert not [p for p in folder.rglob("*") if p.name in ("data.txt", "pipe", "sock", "solutions")]


# ----------------------------------------------------------------------------- the pieces

@pytest.fixture
def tree(tmp_path):
    """A submission folder holding one of everything, and a secret outside it."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the answer")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("mine")
    (src / "sub" / "b.txt").write_text("mine too")
    (src / "link.txt").symlink_to(secret)
    (src / "dirlink").symlink_to(tmp_path, target_is_directory=True)
    (src / "runs").mkdir()
    (src / "runs" / "log").write_text("left behind")
    os.mkfifo(src / "fifo")
    return src


def test_copy_takes_regular_files_and_names_the_rest(tree, tmp_path):
    dest = tmp_path / "dest"
    skipped = files.copy_tree(tree, dest, ("runs",))
    assert skipped == ["dirlink (a symlink)", "fifo (a fifo)", "link.txt (a symlink)"]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["a.txt", "sub", "sub/b.txt"]
    assert (dest / "sub" / "b.txt").read_text() == "mine too"


def test_a_linked_or_special_notebook_is_not_graded(tmp_path, toy_root):
    day = tmp_path / "ann" / DAY
    day.mkdir(parents=True)
    nb = day / f"{DAY}.ipynb"
    nb.symlink_to(toy_root / "solutions" / DAY / f"{DAY}.ipynb")
    assert notebook_status(nb) == f"not graded: {DAY}.ipynb is a symlink (only regular files are graded)"
    nb.unlink()
    os.mkfifo(nb)  # opened non-blocking and refused: the grader does not wait for a writer
    assert notebook_status(nb) == f"not graded: {DAY}.ipynb is a fifo (only regular files are graded)"
    nb.unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / f"{DAY}.ipynb").write_bytes((toy_root / "course" / DAY / f"{DAY}.ipynb").read_bytes())
    day.rmdir()
    day.symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # the day's folder itself a link
    assert notebook_status(nb).startswith(f"not graded: {DAY} is a symlink")


def test_the_hash_of_a_submission_reads_no_link(tree, tmp_path):
    before = folder_hash(tree)
    (tmp_path / "secret.txt").write_text("another answer")
    assert folder_hash(tree) == before  # the link's target is not part of the submission


def test_capture_files_are_read_without_following(tmp_path):
    """The kernel writes the capture folder: a report or data file that is a link (to a file the
    grader could read) or a fifo (a reader waits forever) is refused, as is a cell folder that is a link."""
    from dlo.grading import wire

    capture = tmp_path / "capture"
    cell = capture / "cell1-1"
    cell.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "report.json").write_text(json.dumps({"x": "data"}))
    (outside / "x.data").write_bytes(wire.encode(42))
    # a link to a well-formed report and data: read, they would bind x = 42
    (cell / "report.json").symlink_to(outside / "report.json")
    (cell / "x.data").symlink_to(outside / "x.data")
    with pytest.raises(testcells.CaptureFailed, match="the kernel gave no answer"):
        testcells.bindings(["x"], cell, None)
    (cell / "report.json").unlink()
    (cell / "report.json").write_text(json.dumps({"x": "data"}))
    with pytest.raises(testcells.CaptureFailed, match="the kernel gave no answer"):
        testcells.bindings(["x"], cell, None)
    (cell / "x.data").unlink()
    os.mkfifo(cell / "x.data")
    done = []
    t = threading.Thread(target=lambda: done.append(_bind_or_error(cell)), daemon=True)
    t.start()
    t.join(10)
    assert done and "gave no answer" in done[0], "the grader blocked on a fifo"
    linked = capture / "cell2-1"
    linked.symlink_to(outside, target_is_directory=True)  # the whole cell folder swapped for a link
    with pytest.raises(testcells.CaptureFailed, match="the kernel gave no answer"):
        testcells.bindings(["x"], linked, None)
    (cell / "x.data").unlink()
    (cell / "x.data").write_bytes(wire.encode(42))
    assert testcells.bindings(["x"], cell, None) == {"x": 42}


def _bind_or_error(cell) -> str:
    try:
        return repr(testcells.bindings(["x"], cell, None))
    except testcells.CaptureFailed as exc:
        return str(exc)


def test_the_runner_log_is_opened_once_and_never_through_a_link(tmp_path):
    """A dead runner's log tail goes into feedback and the next runner appends to it: through the
    descriptor the grader opened, not by name (a link put in its place is neither read nor written)."""
    from dlo.grading.trusted import SandboxBackend

    secret = tmp_path / "secret.txt"
    secret.write_text("the instructors' notes")
    log = tmp_path / "runner.log"
    log.symlink_to(secret)
    with pytest.raises(files.NotRegular, match="a symlink"):
        SandboxBackend(log=log).log_fd()
    log.unlink()
    backend = SandboxBackend(log=log)
    fd = backend.log_fd()
    os.write(fd, b"first runner\n")
    log.unlink()
    log.symlink_to(secret)  # swapped by name after the grader opened it
    assert backend.log_fd() == fd
    os.write(fd, b"second runner\n")
    backend.close()
    assert secret.read_text() == "the instructors' notes"


def test_a_fifo_log_does_not_block(tmp_path):
    log = tmp_path / "runner.log"
    os.mkfifo(log)
    start = time.monotonic()
    with pytest.raises(files.NotRegular, match="a fifo"):
        files.open_log(log)
    assert time.monotonic() - start < 5
