"""What `dlo grade` reads before it writes anything: the submissions found and whether each can be
graded, what a submission is (its hash, for a resumed run), the --shard and --out arguments checked, and the
course version a score depends on. Read-only: nothing here writes, imports the checks or starts a process."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import nbformat

from dlo.errors import BadInput, warn
from dlo.grading import files
from dlo.harness.results import NO_SUBMISSION


def find_submissions(submitted: Path, days: list[str]) -> tuple[list[str], list[str], dict]:
    """(students, graded days, {(student, day): "ok" or why it cannot be graded}), read-only.

    A graded day is a course day that at least one student folder has; every student gets every
    graded day."""
    if not submitted.is_dir():
        raise BadInput(f"{submitted} is not a folder (expected SUBMITTED_DIR/<student>/<day>/<day>.ipynb)")
    students = sorted(p.name for p in submitted.iterdir() if p.is_dir() and not p.name.startswith("."))
    graded = set()
    for student in students:
        for d in sorted(p for p in (submitted / student).iterdir() if p.is_dir() and not p.name.startswith(".")):
            if d.name in days:
                graded.add(d.name)
            else:
                warn("grade", f"{d} is not a day of this course ({', '.join(days)}); skipped")
    if not graded:
        raise BadInput(f"no submissions found in {submitted} (expected <student>/<day>/<day>.ipynb with a day "
                         f"of this course: {', '.join(days)})")
    status = {(s, d): notebook_status(submitted / s / d / f"{d}.ipynb") for s in students for d in sorted(graded)}
    return students, sorted(graded), status


def notebook_status(nb: Path) -> str:
    """"ok", "no submission" (missing, 0 bytes, no cells) or why the notebook cannot be read. The day
    folder and the notebook are the student's: a link or a special file there is not followed (a
    notebook linked to the instructors' would otherwise be graded as the student's)."""
    try:
        text = files.read_file(nb.parent.parent, nb.parent.name, nb.name)
    except files.NotRegular as exc:
        return f"not graded: {exc.name} is {exc.what} (only regular files are graded)"
    except FileNotFoundError:
        return NO_SUBMISSION
    except OSError as exc:
        return f"{nb.name} cannot be read ({exc.strerror or exc})"
    if not text:
        return NO_SUBMISSION
    try:
        notebook = nbformat.reads(text.decode(), as_version=4)
    except Exception:  # noqa: BLE001 - JSON, encoding or nbformat errors alike
        return f"{nb.name} is not a readable notebook"
    return "ok" if notebook.get("cells") else NO_SUBMISSION


def check_paths(submitted: Path, out: Path) -> None:
    if out == submitted or submitted in out.parents or out in submitted.parents:
        raise BadInput(f"--out {out} and SUBMITTED_DIR {submitted} must not contain each other")


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise BadInput(f"--shard {text!r}: expected K/N with 1 <= K <= N (e.g. 2/8)")
    return int(m[1]), int(m[2])


def folder_hash(folder: Path) -> str:
    """What a submission is: its regular files' names and bytes (its runs/ and caches left out; links
    and special files by name only: they are never followed, nor graded)."""
    h = hashlib.sha256()
    try:
        for rel, fd, why in files.walk(folder, files.NOT_SUBMITTED):
            if fd is not None:
                h.update(rel.encode() + b"\0")
                while chunk := os.read(fd, files.CHUNK):
                    h.update(chunk)
                h.update(b"\0")
            elif why is not None:
                h.update(rel.encode() + b"\0" + why.encode() + b"\0")
    except OSError:
        pass  # a missing folder (or one that is a link): nothing of it is graded
    return h.hexdigest()[:16]


LIB = Path(__file__).resolve().parents[1]  # lib/dlo: its modules are read as files, never imported here


def checks_modules(names) -> list[Path]:
    """The files of the checks modules `dlo.checks.<name>` that test cells call, each with the siblings
    `<name>_*.py` it re-exports (`checks/day7.py` holds none of Day 7's checks itself), and the checks'
    shared modules (not a day's: `checks/saved.py`) with any of them."""
    checks = LIB / "checks"
    days = {p for name in names for p in [*checks.glob(f"{name}.py"), *checks.glob(f"{name}_*.py")]}
    return sorted(days | {p for p in checks.glob("*.py") if not p.name.startswith("day")} if days else set())


def course_version(root: Path, days: list[str]) -> str:
    """What a score depends on: the instructors' notebooks of the graded days, the checks modules
    they call (`checks_modules`), the grading runtime they run on (dlo.grading) and the engines their
    ranks run on (dlo.distributed). Read as files: importing dlo.checks would import every day's
    checks and torch, seconds of CPU for a hash."""
    h, used = hashlib.sha256(), {"__init__"}
    for day in days:
        h.update(day.encode() + folder_hash(root / "solutions" / day).encode())
        used.update(re.findall(r"dlo\.checks\.(\w+)", (root / "solutions" / day / f"{day}.ipynb").read_text()))
    for path in checks_modules(used):
        h.update(path.stem.encode() + path.read_bytes())
    for path in [*sorted((LIB / "grading").glob("*.py")), *sorted((LIB / "distributed").glob("*.py"))]:
        h.update(f"{path.parent.name}/{path.name}".encode() + path.read_bytes())
    return h.hexdigest()[:12]
