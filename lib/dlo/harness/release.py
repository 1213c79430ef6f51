"""`dlo release` and `dlo check`: student notebooks generated from the instructors' ones.

Release runs nbgrader's generate_assignment (solutions/ -> course/) in a scratch course root, so no
gradebook or stray folder is left in the checkout, then copies the generated day folders in place.
Check regenerates into a scratch folder and compares, and lints the solutions notebooks.
"""

from __future__ import annotations

import ast
import json
import shutil
import tempfile
from pathlib import Path

import nbformat

from dlo.harness.days import list_days, notebook_path
from dlo.harness.nbgrader_cli import generate_assignments

REQUIRED_PARAMETERS = ("profile", "device", "seed", "max_steps", "world_size", "data_dir", "log_dir")


def release(root: Path) -> int:
    days = list_days(root)
    with tempfile.TemporaryDirectory() as tmp:
        released = generate_assignments(root / "solutions", days, Path(tmp))
        for day in days:
            dest = root / "course" / day
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(released / day, dest)
            print(f"released {day} -> {dest.relative_to(root)}")
    return 0


def check(root: Path) -> int:
    problems = []
    days = list_days(root)
    if not days:
        problems.append(f"no day notebooks under {root / 'solutions'}")
    for day in days:
        problems += lint_solution(notebook_path(root, day))
    for nb_path in sorted((root / "course").glob("*/*.ipynb")) + sorted((root / "solutions").glob("*/*.ipynb")):
        problems += check_no_outputs(nb_path)
    problems += check_release_up_to_date(root, days)
    for p in problems:
        print(f"dlo check: {p}")
    if not problems:
        print(f"dlo check: ok ({len(days)} day(s): {', '.join(days)})")
    return 1 if problems else 0


def check_no_outputs(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c.get("outputs") or c.get("execution_count")]
    return [f"{path}: cells {dirty} have outputs or execution counts (clear them before committing)"] if dirty else []


def check_release_up_to_date(root: Path, days: list[str]) -> list[str]:
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        released = generate_assignments(root / "solutions", days, Path(tmp))
        for day in days:
            want, have = released / day / f"{day}.ipynb", notebook_path(root, day, "course")
            if not have.exists():
                problems.append(f"{have} is missing: run `dlo release`")
            elif json.loads(want.read_text()) != json.loads(have.read_text()):
                problems.append(f"{have} differs from what `dlo release` generates from solutions/: run `dlo release`")
    extra = sorted(set(list_days(root, "course")) - set(days))
    problems += [f"course/{d} has no solutions/{d}: remove it or add the source" for d in extra]
    return problems


def lint_solution(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    problems = [f"{path}: {p}" for p in lint_parameters(nb)]
    problems += [f"{path}: {p}" for p in lint_nbgrader(nb)]
    return problems


def lint_parameters(nb) -> list[str]:
    """The parameters cell: first or second code cell, tagged, flat annotated scalar literals."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        return [f"needs exactly one code cell tagged 'parameters' (found {len(tagged)})"]
    if tagged[0] > 1:
        return ["the parameters cell must be the first code cell after the imports"]
    problems, names = [], []
    for node in ast.parse(code[tagged[0]].source).body:
        ok = (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and isinstance(node.value, ast.Constant) and type(node.value.value) in (int, float, str, bool))
        if not ok:
            problems.append(f"parameters cell line {node.lineno}: only `name: type = literal` is allowed")
        else:
            names.append(node.target.id)
    missing = [n for n in REQUIRED_PARAMETERS if n not in names]
    if missing:
        problems.append(f"parameters cell lacks {missing}")
    return problems


def lint_nbgrader(nb) -> list[str]:
    problems, ids, points = [], set(), 0
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader")
        if not meta:
            continue
        gid = meta.get("grade_id")
        if not gid or gid in ids:
            problems.append(f"cell {i}: missing or duplicate grade_id {gid!r}")
        ids.add(gid)
        if meta.get("solution") and cell.cell_type == "code" and "### BEGIN SOLUTION" not in cell.source:
            problems.append(f"cell {i} ({gid}): solution cell without ### BEGIN SOLUTION / ### END SOLUTION")
        if meta.get("grade"):
            if not meta.get("locked") or not meta.get("points"):
                problems.append(f"cell {i} ({gid}): a graded test cell must be locked and worth points")
            points += meta.get("points") or 0
    if points == 0:
        problems.append("no autograded test cell with points (nbgrader metadata missing?)")
    return problems
