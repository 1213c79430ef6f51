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
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nbgrader.exchange.abc import ExchangeList

from dlo.grading import files
from dlo.harness.nbgrader_cli import NOT_SUBMITTED


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
        files.copy_tree(submitted / student / day, dest / student / day, ignore=NOT_SUBMITTED)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in students:
            gb.update_or_create_student(student)
