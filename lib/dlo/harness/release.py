"""`dlo release` and `dlo check`: student notebooks generated from the instructors' ones.

Release runs nbgrader's generate_assignment (solutions/ -> course/) in a scratch course root, so no
gradebook or stray folder is left in the checkout, then copies the generated day folders in place.
It refuses (listing the files, writing nothing) when solutions/ has uncommitted changes (a release is
made from committed notebooks) or when it would overwrite or delete a file of course/ that git cannot
give back (modified, untracked, or outside a git checkout), unless --force.
Check regenerates into a scratch folder and compares, and lints the solutions notebooks.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat

from dlo.harness.days import list_days, notebook_path, strays
from dlo.harness.nbgrader_cli import generate_assignments
from dlo.harness.setup import comparable_metadata
from dlo.registry import PARAMETERS  # what every parameters cell declares: what dlo.setup resolves


def release(root: Path, force: bool = False) -> int:
    days = list_days(root)
    with tempfile.TemporaryDirectory() as tmp:
        released = generate_assignments(root / "solutions", days, Path(tmp))
        problems = [] if force else release_problems(root, days, released)
        for p in problems:
            print(f"dlo release: {p}")
        if problems:
            print("dlo release: nothing was written (rerun with --force to release anyway)")
            return 1
        for day in days:
            dest = root / "course" / day
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(released / day, dest)
            print(f"released {day} -> {dest.relative_to(root)}")
    return 0


def release_problems(root: Path, days: list[str], released: Path) -> list[str]:
    """Why releasing now would lose work: uncommitted solutions, course files git cannot restore."""
    git = _git_state(root)
    problems = []
    if git is not None and git["dirty"].get("solutions"):
        files = git["dirty"]["solutions"]
        problems.append(f"solutions/ has uncommitted changes ({_listing(files)}): commit them first, a release "
                        f"is made from committed notebooks")
    lost = []
    for day in days:
        dest = root / "course" / day
        for f in sorted(p for p in dest.rglob("*") if p.is_file() or p.is_symlink()) if dest.is_dir() else []:
            new = released / day / f.relative_to(dest)
            if new.is_file() and _same(f, new):
                continue  # the release writes it unchanged
            rel = str(f.relative_to(root))
            if git is not None and rel in git["tracked"] and rel not in git["dirty"].get("course", []):
                continue  # committed: git gives it back
            lost.append(rel)
    if lost:
        why = "modified or untracked" if git is not None else "not in a git checkout"
        problems.append(f"course/ has changes of its own that a release would overwrite or delete ({why}): "
                        f"{_listing(lost)}; commit or move them first")
    return problems


def _listing(files: list[str]) -> str:
    return ", ".join(files[:8]) + (f", ... ({len(files)} files)" if len(files) > 8 else "")


def _comparable(path: Path) -> dict:
    """A notebook as JSON, its metadata without what depends on the releasing Python's patch version."""
    nb = json.loads(path.read_text())
    nb["metadata"] = comparable_metadata(nb.get("metadata", {}))
    return nb


def _same(a: Path, b: Path) -> bool:
    if a.suffix == ".ipynb":
        try:
            return _comparable(a) == _comparable(b)
        except (OSError, ValueError):
            return False
    return a.read_bytes() == b.read_bytes()


def _git_state(root: Path) -> dict | None:
    """{"tracked": paths under course/, "dirty": {"solutions"|"course": [paths]}} relative to root, or
    None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    top = git("rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return None
    prefix = Path(top.stdout.strip()).resolve()
    rel = lambda p: str((prefix / p).resolve().relative_to(root.resolve()))  # noqa: E731
    status = git("status", "--porcelain=v1", "--untracked-files=all", "--", "solutions", "course")
    dirty: dict[str, list[str]] = {}
    for line in status.stdout.splitlines():
        path = rel(line[3:].split(" -> ")[-1].strip('"'))
        dirty.setdefault(path.split("/")[0], []).append(path)
    tracked = git("ls-files", "--full-name", "--", "course").stdout.splitlines()
    return {"tracked": {rel(p) for p in tracked}, "dirty": dirty}


def check(root: Path) -> int:
    problems = []
    days = list_days(root)
    if not days:
        problems.append(f"no day notebooks under {root / 'solutions'}")
    for day in days:
        problems += lint_solution(notebook_path(root, day))
    for nb_path in [nb for folder in ("course", "solutions") for day in days
                    for nb in sorted((root / folder / day).glob("*.ipynb"))]:
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
            elif _comparable(want) != _comparable(have):
                problems.append(f"{have} differs from what `dlo release` generates from solutions/: run `dlo release`")
    problems += [f"course/{d} is not a day of dlo.registry: remove it" for d in strays(root, "course")]
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
    missing = [n for n in PARAMETERS if n not in names]
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
