"""Fixtures for the harness tests: a toy course (one short day) built in a temp folder.

Its three exercises cover both kinds of test cell: plain asserts on a function's result (add, norm)
and a real `dlo.checks` check (`check_adamw_step`: a `@check` with forbidden references and in-place
updates that must come back from the sandbox).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parents[2]
DAY = "toy"

PARAMETERS = '''profile: str = "auto"  # tiny | full | auto
device: str = "auto"
seed: int = 0
max_steps: int = 0
world_size: int = 1
data_dir: str = ""
log_dir: str = "runs/toy"
'''


def _solution(gid: str, source: str):
    return new_code_cell(source, metadata={"nbgrader": {
        "grade": False, "grade_id": gid, "locked": False, "schema_version": 3, "solution": True, "task": False}})


def _test(gid: str, source: str, points: int):
    return new_code_cell(source, metadata={"nbgrader": {
        "grade": True, "grade_id": gid, "locked": True, "points": points, "schema_version": 3,
        "solution": False, "task": False}})


ADAMW = """def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=1e-2):
    ### BEGIN SOLUTION
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(lr * (exp_avg / (1 - beta1 ** step)) / ((exp_avg_sq / (1 - beta2 ** step)).sqrt() + eps))
    ### END SOLUTION"""
POINTS = {"add_test": 2, "norm_test": 3, "adamw_test": 2}


def toy_notebook():
    cells = [
        new_markdown_cell("# Toy day\nThree exercises, used by the harness tests."),
        new_code_cell("import math\n\nimport torch\n\nimport dlo\nimport dlo.checks.day1"),
        new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
        new_code_cell("import os\nprint('profile', profile, 'seed', seed, 'headless', os.environ.get('DLO_HEADLESS'))"),
        _solution("add", "def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION"),
        _test("add_test", "assert add(2, 3) == 5\n### BEGIN HIDDEN TESTS\nassert add(-1, 1) == 0\n"
                          "### END HIDDEN TESTS", 2),
        _solution("norm", "def norm(x, y):\n    ### BEGIN SOLUTION\n    return math.hypot(x, y)\n"
                          "    ### END SOLUTION"),
        _test("norm_test", "assert abs(norm(3, 4) - 5) < 1e-12\n### BEGIN HIDDEN TESTS\n"
                           "assert abs(norm(5, 12) - 13) < 1e-12\n### END HIDDEN TESTS", 3),
        _solution("adamw", ADAMW),
        _test("adamw_test", "dlo.checks.day1.check_adamw_step(adamw_step, seed=0, trials=2)\n### BEGIN HIDDEN TESTS\n"
                            "dlo.checks.day1.check_adamw_step(adamw_step, seed=1, trials=2)\n### END HIDDEN TESTS", 2),
        new_code_cell("result = sum(range(10))\nprint('experiment', result)"),
    ]
    return new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})


def dlo(*args: str, root: Path, check: bool = True, timeout: float = 600, cwd: Path | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the `dlo` command as a user would (a child process), in `cwd` (default: the course root),
    with `env` added to the environment. `dlo grade` gets --no-sandbox where bubblewrap cannot run here.
    A root other than this checkout is a toy course: its day is named in $DLO_DAYS (`dlo.registry.names`)."""
    if args[:1] == ("grade",) and "--merge" not in args:
        args = (*args, *sandbox_flags())
    proc = subprocess.run([sys.executable, "-m", "dlo.cli", "--root", str(root), *args], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "DLO_PROFILE": "tiny", **toy_days(root), **(env or {})},
                          cwd=cwd or root)
    if check and proc.returncode != 0:
        raise AssertionError(f"dlo {' '.join(args)} -> rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def toy_days(root: Path, *days: str) -> dict[str, str]:
    """The environment naming a toy course's days (`DAY` unless given) for `dlo` at `root`; {} for this checkout."""
    return {} if Path(root).resolve() == REPO else {"DLO_DAYS": " ".join(days or (DAY,))}


def sandbox_flags() -> list[str]:
    """[] where `dlo grade` can confine student code here, else ["--no-sandbox"] (it refuses otherwise)."""
    from dlo.grading.jail import probe

    return [] if probe() == "bwrap" else ["--no-sandbox"]


@pytest.fixture(scope="session")
def toy_template(tmp_path_factory) -> Path:
    """A released toy course, built once (nbgrader takes seconds to start)."""
    root = tmp_path_factory.mktemp("template") / "toycourse"
    nb_path = root / "solutions" / DAY / f"{DAY}.ipynb"
    nb_path.parent.mkdir(parents=True)
    nbformat.write(toy_notebook(), nb_path)
    dlo("release", root=root)
    return root


@pytest.fixture
def toy_root(toy_template, tmp_path) -> Path:
    """A fresh copy of the released toy course that a test may change."""
    return Path(shutil.copytree(toy_template, tmp_path / "toycourse"))


def edit_cells(path: Path, dest: Path, edit) -> Path:
    """Copy a notebook to dest, applying edit(cell) to every cell (a student's changes)."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        edit(cell)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(nb))
    return dest


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def read_csv(path: Path) -> list[dict]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def unreachable_by_others(path: Path) -> str | None:
    """Why another Unix user cannot reach `path` (a folder above it without the x bit for others, as
    `mktemp -d` makes), or None. /root is left out: the tests that run as another user mount a 0755
    tmpfs over it themselves."""
    for folder in [path, *path.parents]:
        if folder == Path("/root") or folder == Path("/"):
            continue
        if not folder.stat().st_mode & 0o001:
            return f"{folder} is closed to other users (mode {folder.stat().st_mode & 0o777:o})"
    return None
