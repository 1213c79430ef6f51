"""The harness on a toy course: release/check, run, and grading that a student's code cannot bend.

The big grading test builds one submission per attack a student may try (issue 9), grades them in one
`dlo grade` call beside the honest solution and the blank release, and checks each score.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess

import pytest

from dlo.grading.jail import probe
from tests.harness.conftest import ADAMW, DAY, POINTS, REPO, dlo, edit_cells, grade_id, read_csv, sandbox_flags

TOTAL = sum(POINTS.values())


def test_release_strips_solutions_and_hidden_tests(toy_root):
    student = (toy_root / "course" / DAY / f"{DAY}.ipynb").read_text()
    assert "raise NotImplementedError()" in student
    assert "return a + b" not in student and "hypot" not in student and "addcmul_" not in student
    assert "HIDDEN TESTS" not in student and "add(-1, 1)" not in student and "seed=1, trials=2" not in student
    assert "assert add(2, 3) == 5" in student  # visible tests stay


def test_check_passes_then_catches_drift_and_outputs(toy_root):
    assert "ok" in dlo("check", root=toy_root).stdout
    src = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    nb = json.loads(src.read_text())
    nb["cells"][3]["source"] = "print('changed')"
    src.write_text(json.dumps(nb))
    proc = dlo("check", root=toy_root, check=False)
    assert proc.returncode == 1 and "differs from what `dlo release` generates" in proc.stdout
    dlo("release", "--force", root=toy_root)  # not a git checkout: overwriting course/ needs --force
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
    assert any("profile tiny seed 7 headless 1" in "".join(o.get("text", "")) for c in executed["cells"]
               for o in c.get("outputs", []))  # DLO_HEADLESS=1: text progress bars in saved notebooks
    bad_day = dlo("run", "nope", root=toy_root, check=False)
    assert bad_day.returncode != 0 and "unknown day(s) nope" in bad_day.stderr and DAY in bad_day.stderr
    bad_param = dlo("run", DAY, "-p", "lr", "1", root=toy_root, check=False)
    assert bad_param.returncode != 0 and "no parameter 'lr'" in bad_param.stderr


def test_run_fails_when_a_cell_raises(toy_root, tmp_path):
    proc = dlo("run", DAY, "--notebooks", "course", "--out", str(tmp_path / "o"), root=toy_root, check=False)
    assert proc.returncode == 1 and "failed" in proc.stdout


# ----------------------------------------------------------------------------- students

def _student(toy_root, submitted, name, edit):
    src = toy_root / ("solutions" if name == "solution" else "course") / DAY / f"{DAY}.ipynb"
    edit_cells(src, submitted / name / DAY / f"{DAY}.ipynb", edit)


def _replace(gid, source):
    def edit(cell):
        if grade_id(cell) == gid:
            cell["source"] = source
    return edit


def _chain(*edits):
    def edit(cell):
        for e in edits:
            e(cell)
    return edit


ADD = "def add(a, b):\n    return a + b"
NORM = "def norm(x, y):\n    return (x * x + y * y) ** 0.5"
ADAMW_OWN = ADAMW.replace("    ### BEGIN SOLUTION\n", "").replace("\n    ### END SOLUTION", "")
SOLVE_ALL = _chain(_replace("add", ADD), _replace("norm", NORM), _replace("adamw", ADAMW_OWN))

# Each attack is a cell a student submits (issue 9's table). Blank answers elsewhere: any point is a leak.
PATCHER = '''import builtins, types
import dlo.grading.compare as compare, dlo.checks.day1 as day1
day1.check_adamw_step = lambda *a, **k: None            # the check the test cell calls
compare.assert_close = lambda *a, **k: None
builtins.AssertionError = type("Quiet", (Exception,), {})
dlo = types.SimpleNamespace(checks=types.SimpleNamespace(day1=day1))   # and the name the cell uses

def add(a, b):
    raise NotImplementedError()
'''
SNOOP_KERNEL = '''import json
def _steal(paths):
    for p in paths:
        try:
            with open(p) as f:
                text = f.read()
            print("read", p, "ok")
        except Exception as exc:
            print("read", p, type(exc).__name__)
            continue
        if p.endswith(".ipynb"):
            for c in json.loads(text)["cells"]:
                src = "".join(c["source"])
                if c["cell_type"] == "code" and src.startswith("def "):
                    exec(src, globals())
_steal({paths!r})
'''
SNOOP_RUNNER = '''import math
def norm(x, y):
    try:
        open({gradebook!r}, "rb").read()  # read only where the grader's files are in view
    except OSError:
        return -1.0
    return math.hypot(x, y)'''
STACK_READER = '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, **hp):
    import inspect
    for info in inspect.stack():
        loc = info.frame.f_locals
        if "opt" in loc and "ref" in loc:  # the checker's torch optimizer and its parameter
            st = loc["opt"].state[loc["ref"]]
            param.copy_(loc["ref"].detach()); exp_avg.copy_(st["exp_avg"]); exp_avg_sq.copy_(st["exp_avg_sq"])
            return
    raise RuntimeError("no checker state on the stack")'''
EVIL = '''import os
class Liar:
    """Equal to anything, smaller than anything; unpickling it runs a command."""
    def __init__(self, marker):
        self.marker = marker
    def __reduce__(self):  # the command runs wherever this is unpickled, except in the grader's runner
        return (os.system, ('[ -z "$DLO_SANDBOX_TAG" ] && touch ' + self.marker,))
    def __call__(self, *a, **k):
        return Liar(self.marker + "-result")
    def __eq__(self, other):
        return True
    __lt__ = __eq__
    def __sub__(self, other):
        return self
    def __abs__(self):
        return self
add = Liar({marker!r})'''
EVIL_NORM = "def norm(x, y):\n    return Liar({marker!r})"
FORBIDDEN = '''import dlo.optim.reference
def adamw_step(param, grad, exp_avg, exp_avg_sq, step, **hp):
    dlo.optim.reference.adamw_step(param, grad, exp_avg, exp_avg_sq, step, **hp)'''
NOISY_NORM = '''import sys, warnings
def norm(x, y):
    print("norm: thinking", file=sys.stderr)
    warnings.warn("norm: a warning")
    return (x * x + y * y) ** 0.5
print("defined norm", file=sys.stderr)'''
NOISY_ADAMW = "import sys\n" + ADAMW_OWN.replace(
    "    param.mul_(", "    print('adamw', file=sys.stderr)\n    param.mul_(", 1)
SIGINT_HANG = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
EXIT_IN_CHECK = "import os\ndef norm(x, y):\n    os._exit(3)"
# An honest mistake: the feedback must point at the student's cell and line, not at "<dynamic-code>".
RAISING_NORM = "def norm(x, y):\n    z = x * y\n    raise ValueError('norm fails here')"


def build_submissions(toy_root, submitted, out, markers) -> dict[str, float]:
    """Every case of issue 9 as a submission folder; returns the score each must get."""
    gradebook = str(out / "course" / "template.db")  # the gradebook while grading runs
    steal = [str(toy_root / "solutions" / DAY / f"{DAY}.ipynb"), str(out / "course" / "source" / DAY / f"{DAY}.ipynb"),
             gradebook, str(submitted / "solution" / DAY / f"{DAY}.ipynb"),
             str(REPO / "solutions" / "day1_optimizers" / "day1_optimizers.ipynb")]
    # Attacks on different cells share a notebook (fewer kernels to start); scores are checked per cell.
    students = {
        "solution": (lambda c: None, TOTAL),
        "untouched": (lambda c: None, 0),
        # edited the locked test cells so they pass, and patched the checks and the name the cell calls
        "tamperer": (_chain(*(_replace(g, "pass") for g in POINTS), _replace("add", PATCHER)), 0),
        # read the grader's files from the kernel (add) and from a function a check calls (norm); the stack (adamw)
        "snooper": (_chain(_replace("add", SNOOP_KERNEL.format(paths=steal)),
                           _replace("norm", SNOOP_RUNNER.format(gradebook=gradebook)),
                           _replace("adamw", STACK_READER)), 0),
        # objects that equal anything and run code when unpickled; the library's own reference (adamw)
        "evil": (_chain(_replace("add", EVIL.format(marker=str(markers / "add"))),
                        _replace("norm", EVIL_NORM.format(marker=str(markers / "norm"))),
                        _replace("adamw", FORBIDDEN)), 0),
        # a cell that ignores SIGINT and hangs (add); correct answers that write to stderr (norm, adamw)
        "hanger": (_chain(SOLVE_ALL, _replace("add", SIGINT_HANG), _replace("norm", NOISY_NORM),
                          _replace("adamw", NOISY_ADAMW)), TOTAL - POINTS["add_test"]),
        # a cell that kills its kernel (add); a function that kills the check's process (norm)
        "killer": (_chain(SOLVE_ALL, _replace("add", "import os\nos._exit(1)"), _replace("norm", EXIT_IN_CHECK)),
                   POINTS["adamw_test"]),
        "raiser": (_chain(SOLVE_ALL, _replace("norm", RAISING_NORM)), TOTAL - POINTS["norm_test"]),
    }
    for name, (edit, _) in students.items():
        _student(toy_root, submitted, name, edit)
    (submitted / "ghost" / DAY).mkdir(parents=True)  # the day's folder without its notebook
    (submitted / "empty" / DAY).mkdir(parents=True)
    (submitted / "empty" / DAY / f"{DAY}.ipynb").write_bytes(b"")  # 0 bytes
    (submitted / "nocells" / DAY).mkdir(parents=True)
    (submitted / "nocells" / DAY / f"{DAY}.ipynb").write_text(json.dumps(
        {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (submitted / "vacant").mkdir()  # a student folder without the day
    return {**{n: s for n, (_, s) in students.items()}, "ghost": 0, "empty": 0, "nocells": 0, "vacant": 0}


def _autograded(out, student):
    return json.loads((out / "course" / "autograded" / student / DAY / f"{DAY}.ipynb").read_text())


def _outputs(out, student, gid):
    return next(c for c in _autograded(out, student)["cells"] if grade_id(c) == gid).get("outputs", [])


@pytest.mark.slow
@pytest.mark.trust  # a hostile class's evidence, ~90 CPU s: its own CI step, pytest -m trust
def test_grade_holds_against_every_attack(toy_root, tmp_path):
    submitted, out, markers = tmp_path / "submitted", tmp_path / "grading", tmp_path / "markers"
    markers.mkdir()
    want = build_submissions(toy_root, submitted, out, markers)
    sandbox = probe() if not sandbox_flags() else "none (--no-sandbox)"
    if sandbox != "bwrap":  # unconfined, the snooper reads the solutions (and the grader says so in the CSV)
        want["snooper"] = POINTS["add_test"] + POINTS["norm_test"]
    before = sorted((p, p.read_bytes()) for p in submitted.rglob("*.ipynb"))

    proc = dlo("grade", str(submitted), "--out", str(out), "--cell-timeout", "20", root=toy_root, check=False,
               timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {r["student"]: r for r in read_csv(out / "scores.csv")}
    assert {s: float(r["score"]) for s, r in scores.items()} == want, proc.stdout
    assert all(float(r["max_score"]) == TOTAL for r in scores.values())
    assert {s for s, r in scores.items() if r["status"] == "no submission"} == {"ghost", "empty", "nocells", "vacant"}
    assert {r["sandbox"] for r in scores.values()} == {sandbox}
    cells = {(r["student"], r["cell"]): float(r["score"]) for r in read_csv(out / "cells.csv")}
    assert len(cells) == len(want) * len(POINTS)  # a row per student, day and test cell
    assert cells[("hanger", "add_test")] == 0 and cells[("hanger", "norm_test")] == POINTS["norm_test"]
    assert cells[("killer", "norm_test")] == 0 and cells[("killer", "adamw_test")] == POINTS["adamw_test"]

    # Why each attack failed, as the feedback says it.
    adamw_errors = {s: " ".join(o.get("evalue", "") for o in _outputs(out, s, "adamw_test"))
                    for s in ("evil", "snooper")}
    assert "off limits" in adamw_errors["evil"] and "no checker state on the stack" in adamw_errors["snooper"]
    assert "ended in the middle of the check" in str(_outputs(out, "killer", "norm_test"))
    raised = "".join(o.get("evalue", "") + "".join(o.get("traceback", []))
                     for o in _outputs(out, "raiser", "norm_test"))
    assert re.search(r'"Cell In\[\d+\]", line 3, in norm', raised), raised
    assert "raise ValueError('norm fails here')" in raised
    assert "<dynamic-code>" not in raised
    assert "did not stop when interrupted" in str(next(
        c for c in _autograded(out, "hanger")["cells"] if grade_id(c) == "add")["outputs"])
    assert "adamw_step: ok (2 trials, seed=1)" in str(_outputs(out, "hanger", "adamw_test"))
    assert not any(o["output_type"] == "stream" and o["name"] == "stderr"
                   for gid in POINTS for o in _outputs(out, "hanger", gid))
    assert not list(markers.iterdir()), "a student object was unpickled outside the sandboxed runner"
    if sandbox == "bwrap":  # the kernel could not read the solutions, the gradebook, the other submissions
        snoop = "".join(t for c in _autograded(out, "snooper")["cells"] if grade_id(c) == "add" for o in c["outputs"]
                        for t in o.get("text", ""))
        assert snoop.count("read ") == 5 and " ok" not in snoop, snoop

    for student in ("solution", "untouched", "hanger", "snooper"):  # feedback: results, never hidden tests
        text = html.unescape(re.sub(r"<[^>]+>", "", (out / "feedback" / student / f"{DAY}.html").read_text()))
        assert "add(-1, 1)" not in text and "norm(5, 12)" not in text and "seed=1, trials=2" not in text
        assert "HIDDEN TESTS" not in text and "assert add(2, 3) == 5" in text
    assert sorted((p, p.read_bytes()) for p in submitted.rglob("*.ipynb")) == before  # submissions untouched
    assert not (out / "work" / "snooper" / DAY / "capture").exists()  # pickles of student objects not kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grading", "markers", "submitted", "toycourse"]  # only --out


@pytest.mark.slow
@pytest.mark.scale
def test_grade_twice_gives_identical_csvs_and_require_full(toy_root, tmp_path):
    one = tmp_path / "one"
    _student(toy_root, one, "student", SOLVE_ALL)  # correct, own words
    (one / "ghost" / DAY).mkdir(parents=True)  # no submission: 0, so --require-full fails
    out = tmp_path / "g"
    runs = []
    for again in ((), ("--regrade",)):  # the second run grades everything again in the first one's folder
        proc = dlo("grade", str(one), "--out", str(out), "--require-full", *again, root=toy_root, check=False,
                   timeout=900)
        assert proc.returncode == 1 and "not every submission has full marks" in proc.stdout, proc.stdout + proc.stderr
        runs.append(((out / "scores.csv").read_bytes(), (out / "cells.csv").read_bytes()))
    assert runs[0] == runs[1]
    scores = {r["student"]: (float(r["score"]), r["status"]) for r in read_csv(out / "scores.csv")}
    assert scores == {"student": (TOTAL, "graded"), "ghost": (0, "no submission")}
    assert (out / "feedback" / "student" / f"{DAY}.html").is_file()
    graded_nb = (out / "course" / "autograded" / "student" / DAY / f"{DAY}.ipynb").read_text()
    assert "headless 1" in graded_nb  # the grader's kernels draw text progress bars too


# ----------------------------------------------------------------------------- refusals: nothing written, nothing lost

def test_grade_rejects_a_missing_folder_and_leaves_nothing(toy_root, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = dlo("grade", str(tmp_path / "nothing"), root=toy_root, check=False, cwd=cwd)
    assert proc.returncode != 0 and "is not a folder" in proc.stderr
    assert not list(cwd.iterdir())  # no runs/grade-* in the working directory


def _one_submission(toy_root, tmp_path):
    sub = tmp_path / "sub"
    _student(toy_root, sub, "ann", lambda c: None)
    return sub


@pytest.mark.parametrize("where", ["cwd", "foreign", "inside"])
def test_grade_refuses_an_out_it_did_not_make(toy_root, tmp_path, where):
    sub = _one_submission(toy_root, tmp_path)
    repo = tmp_path / "repo"  # `--out .` from a checkout: its tracked course/ must survive
    (repo / "course").mkdir(parents=True)
    (repo / "course" / "day.ipynb").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    target = {"cwd": ".", "foreign": str(tmp_path / "notes"), "inside": str(sub / "grading")}[where]
    before = sorted((str(p), p.is_file() and p.read_bytes()) for p in tmp_path.rglob("*"))
    proc = dlo("grade", str(sub), "--out", target, root=toy_root, check=False, cwd=repo)
    assert proc.returncode != 0
    assert ("must not contain" if where == "inside" else "not empty and not an earlier") in proc.stderr
    assert sorted((str(p), p.is_file() and p.read_bytes()) for p in tmp_path.rglob("*")) == before


def test_grade_refuses_its_own_output_with_a_stranger_in_it(toy_root, tmp_path):
    from dlo.harness.outdir import OwnedDir

    out = tmp_path / "g"
    owned = OwnedDir(out)
    owned.check()
    owned.claim()
    (out / "scores.csv").write_text("old")
    owned.record()
    (out / "my-notes.txt").write_text("keep me")  # an instructor's file dropped into an earlier output
    proc = dlo("grade", str(_one_submission(toy_root, tmp_path)), "--out", str(out), root=toy_root, check=False)
    assert proc.returncode != 0 and "did not write there: my-notes.txt" in proc.stderr
    assert (out / "my-notes.txt").read_text() == "keep me" and (out / "scores.csv").read_text() == "old"


# ----------------------------------------------------------------------------- release

def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def test_release_refuses_to_lose_work(toy_root):
    _git(toy_root, "init", "-q")
    _git(toy_root, "add", "-A")
    _git(toy_root, "commit", "-qm", "toy")
    assert "released" in dlo("release", root=toy_root).stdout  # clean: fine
    course_nb = toy_root / "course" / DAY / f"{DAY}.ipynb"
    hand = course_nb.read_text().replace("Toy day", "Toy day (edited by hand)")
    course_nb.write_text(hand)
    (toy_root / "course" / DAY / "notes.txt").write_text("untracked")
    proc = dlo("release", root=toy_root, check=False)
    assert proc.returncode == 1 and f"course/{DAY}/{DAY}.ipynb" in proc.stdout
    assert f"course/{DAY}/notes.txt" in proc.stdout
    assert course_nb.read_text() == hand and (toy_root / "course" / DAY / "notes.txt").exists()  # nothing written
    _git(toy_root, "checkout", "--", "course")
    (toy_root / "course" / DAY / "notes.txt").unlink()
    src = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    src.write_text(src.read_text().replace("Toy day", "Toy day, uncommitted"))
    proc = dlo("release", root=toy_root, check=False)
    assert proc.returncode == 1 and "solutions/ has uncommitted changes" in proc.stdout
    assert f"solutions/{DAY}" in proc.stdout
    assert "uncommitted" not in course_nb.read_text()
    assert "released" in dlo("release", "--force", root=toy_root).stdout
    assert "uncommitted" in course_nb.read_text()
