"""nbgrader's own tools on `dlo grade`'s output, and the class's nbgrader exchange.

After grading, OUT/course is a whole nbgrader course root: source/ and release/ (from solutions/),
submitted/ (a copy of every submission that was graded: regular files only, never a link),
autograded/, feedback/ and gradebook.db. The formgrader started there lists every submission with its
scores, `nbgrader export` there writes every student's scores, and `nbgrader release_feedback DAY`
there hands the feedback to the students through the exchange: the timestamp.txt and
submission_secret.txt that `nbgrader submit` writes and `nbgrader collect` brings along stay beside
each submission and its feedback, which is what `nbgrader fetch_feedback` matches on.

OUT/course/nbgrader_config.py names the class's exchange: the course id and exchange folder that
nbgrader sees outside any course root (`dlo setup instructor --exchange DIR --course-id ID` writes
them into the environment's settings), when both are set and the folder is there to write to.
Otherwise the exchange is off there (`NoExchange`): nbgrader's tools neither look for one nor log a
CRITICAL about a missing folder, and the formgrader says release and collect are not available.

The exchange's folders (`prepare`, from `dlo setup`) follow nbgrader's own permission model
(release_assignment.py, release_feedback.py, not groupshared), with the sticky bit on the two folders
everyone writes to: the root 1777 (nbgrader's documentation), the course and its outbound 0755, inbound
3733 (students create entries, cannot list it, and cannot remove or rename another's: sticky; setgid, so
a submission takes the instructor's group), feedback 0711 (files named by a hash of the submission's
secret). `Submit` (every role's setting) then opens the student's submission folder to that group
only: nbgrader leaves it 0777, protected by its random name alone. A folder dlo created holds
an empty `.dlo-created` (dot names: nbgrader's globs skip them); only such a folder's mode is ever fixed,
any other differing one (an older dlo's too: it left no mark) is one line of warning. nbgrader's
groupshared mode (other modes, the admins' business) is not covered.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from nbgrader.exchange.abc import ExchangeList
from nbgrader.exchange.default.submit import ExchangeSubmit

from dlo.grading import files


class NoExchange(ExchangeList):
    """nbgrader's exchange listing for a course root without an exchange: nothing to list, nothing to check."""

    def start(self):
        return []

    def list_files(self):
        return []

    def remove_files(self):
        return []


def class_exchange() -> tuple[str, str] | None:
    """(course id, exchange folder) as nbgrader reads them from the Jupyter config path (this
    environment's settings, the user's, the system's; not a course root's), or None when either is
    unset or the folder is not one this user can write to."""
    from jupyter_core.paths import jupyter_config_path
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange.default import Exchange
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    config = Config()
    for folder in reversed(jupyter_config_path()):  # the first folder of the path has the last word
        if (Path(folder) / "nbgrader_config.py").is_file():
            try:
                config.merge(PyFileConfigLoader("nbgrader_config.py", path=folder).load_config())
            except Exception:  # noqa: BLE001 - a broken settings file: nbgrader itself only logs it too
                continue
    course_id = CourseDirectory(config=config).course_id
    root = Exchange(config=config).root
    if not course_id or not os.path.isdir(root) or not os.access(root, os.W_OK | os.X_OK):
        return None
    return course_id, str(Path(root).resolve())


def config_block(exchange: tuple[str, str] | None) -> str:
    """The lines of OUT/course/nbgrader_config.py that name the class's exchange, or turn it off."""
    if exchange is None:
        return ('# No class exchange (none set up with `dlo setup instructor --exchange DIR --course-id ID`, or its\n'
                '# folder is missing): nbgrader\'s tools in this folder do not look for one.\n'
                'c.CourseDirectory.course_id = ""\n'
                'c.ExchangeFactory.list = "dlo.harness.exchange.NoExchange"\n')
    course_id, root = exchange
    return ('# The class\'s nbgrader exchange (`dlo setup instructor --exchange DIR --course-id ID`): the formgrader\n'
            '# and `nbgrader release_feedback DAY` in this folder hand feedback to the students through it.\n'
            f'c.CourseDirectory.course_id = {course_id!r}\n'
            f'c.Exchange.root = {root!r}\n')


def publish(course: Path, submitted: Path, keys: list[tuple[str, str]], students: list[str]) -> None:
    """Make the graded course root whole for nbgrader's tools: course/submitted/<student>/<day>/, the
    files of each submission in `keys` (as graded: runs/ and caches left out; regular files only:
    links to a file or a folder, sockets, fifos and devices are skipped, never followed or opened),
    and every student in the gradebook (one with no submission scores 0 in `nbgrader export`)."""
    from nbgrader.api import Gradebook

    dest = course / "submitted"
    shutil.rmtree(dest, ignore_errors=True)
    for student, day in keys:
        files.copy_tree(submitted / student / day, dest / student / day, ignore=files.NOT_SUBMITTED)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in students:
            gb.update_or_create_student(student)


ROOT_MODE = 0o1777
COURSE_MODES = {".": 0o755, "outbound": 0o755, "inbound": 0o3733, "feedback": 0o711}  # under root/<course id>
SUBMISSION_MODE = 0o770  # a submission's folder: its student and the instructor's group (inbound's) only
CREATED = ".dlo-created"


def created_by_dlo(folder: Path) -> bool:
    """Whether dlo made `folder`: its marker is there and belongs to the folder's owner, who is this user
    (a marker someone else placed in a folder they can write to proves nothing)."""
    try:
        owner, marker = folder.stat().st_uid, (folder / CREATED).lstat()
    except OSError:
        return False
    return stat.S_ISREG(marker.st_mode) and marker.st_uid == owner == os.geteuid()


def ensure(folder: Path, mode: int) -> str:
    """Make `folder` with `mode` (marked as dlo's), or fix the mode of one dlo made; one line saying
    what happened, "warning: ..." for a differing mode of a folder dlo did not make (left alone)."""
    if not folder.is_dir():
        folder.mkdir(parents=True)
        (folder / CREATED).touch(mode=0o644)
        os.chmod(folder, mode)  # mkdir's mode passes through the umask and drops the sticky and setgid bits
        return f"created   {folder} ({mode:04o})"
    old = stat.S_IMODE(folder.stat().st_mode)
    if old == mode:
        return f"exists    {folder} ({mode:04o})"
    if created_by_dlo(folder):
        os.chmod(folder, mode)
        return f"fixed     {folder} ({old:04o} -> {mode:04o})"
    return (f"warning: {folder} has mode {old:04o}, not {mode:04o} (nbgrader's, sticky where everyone writes); "
            f"left alone (dlo did not create it): its owner can run `chmod {mode:04o} {folder}`")


def prepare(root: Path, course_id: str | None) -> list[str]:
    """The exchange root and, with a course id, the course's folders (for the instructor: nbgrader's
    release refuses course folders that are not its user's own). One line per folder."""
    lines = [ensure(root, ROOT_MODE)]
    if course_id:
        lines += [ensure((root / course_id / sub), mode) for sub, mode in COURSE_MODES.items()]
    return lines


class Submit(ExchangeSubmit):
    """nbgrader's submit, then the submission's folder closed to other students: nbgrader leaves it 0777
    (its random name hides it; anyone who learns the name could read, empty or change it). The folder is
    the gate (its files keep nbgrader's 0644: those written after copytree's copystat cleared the
    folder's setgid bit have the student's group, which the student cannot change). Closed only where
    the folder took inbound's group (setgid inbound, as nbgrader and `prepare` make it), so the
    instructor, of that group, still collects and removes it."""

    def copy_files(self):
        super().copy_files()
        dest = os.path.join(self.inbound_path, self.assignment_filename)
        if os.stat(dest).st_gid == os.stat(self.inbound_path).st_gid != os.getegid():
            os.chmod(dest, SUBMISSION_MODE)
