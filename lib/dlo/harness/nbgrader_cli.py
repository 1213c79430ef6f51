"""Calling nbgrader in a course root of our own (a child process, so a failure stays contained): around
autograde, the release's grading metadata put back, the code the checks received digested, and what the
instructor will open made unable to run script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import nbformat

from dlo.grading import files
from dlo.grading.jail import spec_from_env
from dlo.harness import bytecode, restore, sanitize
from dlo.harness.setup import normalise_metadata
from dlo.harness.warm import GRADER, WarmProcess, run_child, serve
from dlo.reaper import kill_tagged, kill_tree

_LIVE: set[subprocess.Popen | WarmProcess] = set()  # children running now (from any thread), for kill_children()
_LOCK = threading.Lock()
_STOPPED = threading.Event()  # set by kill_children(): a child started afterwards is killed at once
MARK_ENV = "DLO_GRADE_CHILD"  # a token of each child's, inherited by what it starts (`reaper.tagged`)
LEFT_GRACE = 2.0  # seconds a child's pipes may stay open after it ended before what holds them is killed


def autograde_and_feedback(course_root: Path, db: Path, day: str, student: str, *, env: dict | None = None,
                           timeout: float | None = None) -> subprocess.CompletedProcess:
    """nbgrader's autograde then generate_feedback of one submission, in one child process (one start of
    Python and nbgrader instead of two). Exit status 0: graded (feedback may still have failed: see the
    html); 3: autograde failed. Its logs are on stdout/stderr."""
    cmd = [sys.executable, "-m", "dlo.harness.nbgrader_cli", str(course_root), str(db), day, student]
    return child(cmd, course_root, env=env, timeout=timeout, what="autograde", warm=True)


def base_env() -> dict:
    """The children's environment: this one, with this interpreter's folder first on PATH (nbgrader shells
    out to `alembic`, which lives beside it: a venv not on PATH)."""
    return {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}


def prestart_warm() -> None:
    """Start the warm process now, in the background: its imports (some 3 CPU s) run on another core
    beside what this process does first (the release's generate_assignment), not after it."""
    threading.Thread(target=GRADER.start, args=(base_env(),), name="dlo-warm-start", daemon=True).start()


def stop_warm() -> None:
    """No more submissions: the warm process ends while this one writes its tables and reports."""
    GRADER.stop()


def child(cmd: list[str], cwd: Path, *, env: dict | None = None, timeout: float | None = None,
          what: str = "", warm: bool = False) -> subprocess.CompletedProcess:
    """`cmd` (python -m dlo.harness.nbgrader_cli ARGS) in a child; `warm`: forked from the warm process
    (`dlo.harness.warm`) when there is one, the same process less its interpreter's start and imports."""
    # Own session, so a signal to dlo's group does not reach it; on timeout or a stop its whole tree (nbgrader
    # and the kernels it started) is killed. Its mark goes with everything it starts: once it has ended, what
    # it left (its parent killed, a kernel outlives it in its own session, re-parented) is found and killed.
    base = base_env()
    token = uuid.uuid4().hex
    mark, env = f"{MARK_ENV}={token}", {**base, **(env or {}), MARK_ENV: token}
    proc = warm and GRADER.spawn(cmd[3:], cwd, base, env)  # the arguments after -m ...nbgrader_cli
    if not proc:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    with _LOCK:
        _LIVE.add(proc)
        if _STOPPED.is_set():
            _killpg(proc)
    try:
        out, err = _communicate(proc, timeout, mark)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        _killpg(proc)
        kill_tagged(mark)  # what left its tree holds its pipes too
        proc.communicate()
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise TimeoutError(f"{what} ran over {timeout} s") from None
    finally:
        with _LOCK:
            _LIVE.discard(proc)
        kill_tagged(mark)  # it has ended: nothing of it runs on
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _communicate(proc: subprocess.Popen | WarmProcess, timeout: float | None, mark: str) -> tuple[str, str]:
    """`proc.communicate(timeout)`, except that once `proc` has ended, whatever still holds its stdout or
    stderr LEFT_GRACE seconds later (what it started, carrying its `mark`) is killed, not waited for."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ended = None
    while True:
        step = min(1.0, LEFT_GRACE) if deadline is None else max(0.0, min(1.0, LEFT_GRACE, deadline - time.monotonic()))
        try:
            return proc.communicate(timeout=step)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout) from None
            if proc.poll() is not None:
                ended = ended or time.monotonic()
                if time.monotonic() - ended >= LEFT_GRACE:
                    kill_tagged(mark)


def _killpg(proc: subprocess.Popen | WarmProcess) -> None:
    """The child with everything below it: nbgrader's kernels run in sessions of their own."""
    if proc.returncode is None:  # not yet reaped: its pid is still its own
        kill_tree(proc.pid)


def kill_children() -> None:
    """Kill every child started by `child` that still runs, with its kernels, and any started later
    in this process (Ctrl-C in `dlo grade`)."""
    with _LOCK:
        _STOPPED.set()
        live = list(_LIVE)
    for proc in live:
        _killpg(proc)


def generate_assignments(solutions: Path, days: list[str], course_root: Path, db: Path | None = None) -> Path:
    """Run generate_assignment for `days` from `solutions` inside course_root (one nbgrader process
    for all of them), the gradebook at `db` (default course_root/gradebook.db); the release dir.

    course_root/source links to nothing: the day folders are copied, so nbgrader may write freely.
    """
    source = course_root / "source"
    for day in days:
        shutil.copytree(solutions / day, source / day, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*files.NOT_SUBMITTED))
    db = db or course_root / "gradebook.db"
    proc = child([sys.executable, "-m", "dlo.harness.nbgrader_cli", "generate", str(course_root), str(db), *days],
                 course_root, what="generate_assignment")
    if proc.returncode != 0:
        raise SystemExit(f"nbgrader generate_assignment failed:\n{proc.stdout}\n{proc.stderr}")
    release = course_root / "release"
    for day in days:  # the kernel metadata JupyterLab writes on open: a fresh notebook is not "modified"
        for path in sorted((release / day).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            if normalise_metadata(nb):
                nbformat.write(nb, path)
    return release


def _alembic_head() -> str:
    """The gradebook schema's newest revision, read in this process. nbgrader asks `alembic heads` in
    a child Python (2-3 s: a fresh interpreter importing SQLAlchemy) each time it creates a gradebook;
    the answer is the same file read here."""
    import nbgrader
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(Path(nbgrader.__file__).parent / "alembic")).get_current_head()


def _api(course_root: str, db: str):
    """nbgrader's API on course_root with its nbgrader_config.py (if any) and the gradebook `db`."""
    import nbgrader.api
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    config = Config()
    if (Path(course_root) / "nbgrader_config.py").is_file():
        config = PyFileConfigLoader("nbgrader_config.py", path=course_root).load_config()
    config.CourseDirectory.root = course_root
    config.CourseDirectory.db_url = f"sqlite:///{db}"
    config.Application.log_level = "WARN"
    nbgrader.api.get_alembic_version = _alembic_head  # what Gradebook() calls for a new gradebook
    return NbGraderAPI(CourseDirectory(config=config), config=config)


def _generate(course_root: str, db: str, *days: str) -> int:
    """The child of `generate_assignments`."""
    api = _api(course_root, db)
    for day in days:
        done = api.generate_assignment(day, force=True, create=True)
        if not done["success"]:
            print(f"{day}:", done.get("log", ""), done.get("error", ""), sep="\n", file=sys.stderr)
            return 3
    return 0


def _main(course_root: str, db: str, day: str, student: str) -> int:
    """The child of `autograde_and_feedback`: nbgrader's API with the course root's nbgrader_config.py.
    Before nbgrader: the release's grading metadata put back (`restore`). After: the code objects the
    checks received, as digests (`bytecode`); the autograded notebook and the feedback made unable to run
    script (`sanitize`)."""
    root = Path(course_root)
    instructors = {p.name: nbformat.read(p, as_version=4) for p in sorted((root / "source" / day).glob("*.ipynb"))}
    notes = _restore(root / "submitted" / student / day, instructors)
    api = _api(course_root, db)
    graded = api.autograde(day, student, force=True, create=True)
    if not graded["success"]:
        print(graded.get("log", ""), graded.get("error", ""), *notes, sep="\n", file=sys.stderr)
        return 3
    autograded = root / "autograded" / student / day
    try:
        _bytecode(autograded)
    except OSError as exc:  # evidence for the similarity report only: never a reason to fail the grading
        print(f"no bytecode digests: {exc}", file=sys.stderr)
    _sanitize(autograded, instructors)
    fed = api.generate_feedback(day, student, force=True)
    if not fed["success"]:
        print("generate_feedback failed:", fed.get("log", ""), fed.get("error", ""), sep="\n", file=sys.stderr)
    for page in sorted((root / "feedback" / student / day).glob("*.html")):
        _rewrite(page, sanitize.lock_html(page.read_text()))
    return 0


def _rewrite(path: Path, text: str) -> None:
    """Replace a file nbgrader wrote (read-only: 0444 for autograded notebooks) keeping its mode."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def _restore(folder: Path, instructors: dict) -> list[str]:
    """The release's nbgrader metadata back in the submission's notebooks (the grader's scratch copy), each
    change said in a note at the top; the notes (also printed, for the log)."""
    out = []
    for name, theirs in instructors.items():
        path = folder / name
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:  # noqa: BLE001 - missing or unreadable: nbgrader says so itself
            continue
        notes = restore.restore(nb, theirs)
        if notes:
            nb.cells.insert(0, restore.note_cell(notes, nb.get("nbformat_minor", 0)))
            nbformat.write(nb, path)
            print(f"{name}: grading metadata put back:", *notes, sep="\n  ", file=sys.stderr)
        out += notes
    return out


def _bytecode(autograded: Path) -> None:
    """Digests of the code objects the kernel sent to the checks (its capture folder's pickles, read
    without unpickling them), for the similarity report: autograded/.../BYTECODE_FILE."""
    spec = spec_from_env()
    if spec is None or not spec.capture_dir.is_dir():
        return
    names: dict[str, dict] = {}
    budget = bytecode.MAX_READ  # what the kernel wrote is the student's: read so much and no more
    for folder in sorted(p.name for p in spec.capture_dir.iterdir() if p.is_dir() and not p.is_symlink()):
        for name in sorted(p.name for p in (spec.capture_dir / folder).iterdir() if p.name.endswith(".pkl")):
            try:
                blob = files.read_file(spec.capture_dir, folder, name, limit=min(budget, bytecode.MAX_PICKLE))
            except (OSError, ValueError):
                continue  # a link, a fifo or too large: the grader never reads it
            budget -= len(blob)
            found = bytecode.of_pickle(blob)
            entry = names.setdefault(name[:-4], {"digests": {}, "refs": []})
            entry["digests"].update(found["digests"])
            entry["refs"] = sorted(set(entry["refs"]) | set(found["refs"]))
    if names and autograded.is_dir():
        (autograded / bytecode.FILE).write_text(json.dumps(names, sort_keys=True))


def _sanitize(autograded: Path, instructors: dict) -> None:
    """The autograded notebooks (what the formgrader and the feedback render) made unable to run script."""
    trusted = {_text(c.source) for nb in instructors.values() for c in nb.cells if c.cell_type in ("markdown", "raw")}
    for path in sorted(autograded.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        try:
            removed = sanitize.notebook(nb, trusted)
        except Exception as exc:  # noqa: BLE001 - never leave what could not be checked: outputs dropped
            removed = [f"every output ({type(exc).__name__})"]
            for cell in nb.cells:
                cell.pop("attachments", None)
                if cell.cell_type == "code":
                    cell.outputs = [o for o in cell.outputs if o.get("output_type") in ("stream", "error")]
                elif _text(cell.source) not in trusted:
                    cell.source = sanitize.as_text(_text(cell.source))
            nb.metadata = {}
        _rewrite(path, nbformat.writes(nb))
        if removed:
            print(f"{path.name}: removed what could run script:", *removed[:20], sep="\n  ", file=sys.stderr)


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else str(source)


def main(argv: list[str]) -> int:
    return _generate(*argv[1:]) if argv[0] == "generate" else _main(*argv[:4])


if __name__ == "__main__":
    if sys.argv[1] == "--warm":  # the warm process: returns in each forked child, with that child's arguments
        sys.argv[1:] = serve(int(sys.argv[2])) or sys.exit(0)
        run_child(main, sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
