"""Calling nbgrader in a course root of our own (a child process, so a failure stays contained)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def nbgrader(args: list[str], course_root: Path, *, env: dict | None = None, timeout: float | None = None,
             quiet: bool = True) -> subprocess.CompletedProcess:
    """Run `nbgrader ARGS` with CourseDirectory.root = course_root and its db inside that root."""
    cmd = [sys.executable, "-m", "nbgrader", *args,
           f"--CourseDirectory.root={course_root}",
           f"--CourseDirectory.db_url=sqlite:///{course_root / 'gradebook.db'}"]
    if quiet:
        cmd.append("--log-level=WARN")
    # Own session: on timeout the whole tree (nbgrader and the kernels it started) is killed.
    # nbgrader shells out to `alembic`, which lives beside this interpreter (a venv not on PATH).
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    proc = subprocess.Popen(cmd, cwd=course_root, env={**os.environ, "PATH": path, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise TimeoutError(f"nbgrader {args[0]} ran over {timeout} s") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def generate_assignments(solutions: Path, days: list[str], course_root: Path) -> Path:
    """Run generate_assignment for `days` from `solutions` inside course_root; returns the release dir.

    course_root/source links to nothing: the day folders are copied, so nbgrader may write freely.
    """
    import shutil

    source = course_root / "source"
    for day in days:
        shutil.copytree(solutions / day, source / day, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "runs", "__pycache__"))
        proc = nbgrader(["generate_assignment", day, "--force"], course_root)
        if proc.returncode != 0:
            raise SystemExit(f"nbgrader generate_assignment {day} failed:\n{proc.stdout}\n{proc.stderr}")
    return course_root / "release"
