"""Where the course lives on disk and which days it has: the registry's (`dlo.registry.names`).

A day is a folder `solutions/<day>/` holding `<day>.ipynb` (nbgrader's source notebook); the student
version is generated into `course/<day>/<day>.ipynb` by `dlo release`. The folders on disk are checked
against the registry before any command works on them: a folder the registry does not name, or a
registry day without its notebook, is a one-line BadInput (a day added on disk only, or one deleted,
would otherwise be skipped or half-released without a word).
"""

from __future__ import annotations

import os
from pathlib import Path

from dlo.errors import BadInput
from dlo.registry import names


def repo_root() -> Path:
    """The course checkout: $DLO_ROOT if set, else the folder that holds lib/dlo (editable install)."""
    env = os.environ.get("DLO_ROOT")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parents[3]


def strays(root: Path, notebooks: str = "solutions") -> list[str]:
    """The folders under root/notebooks that are no day of the registry (hidden ones left out)."""
    base, known = root / notebooks, set(names())
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and p.name not in known) if base.is_dir() else []


def list_days(root: Path, notebooks: str = "solutions") -> list[str]:
    """The registry's days, in its order, once root/notebooks is checked to hold exactly them:
    BadInput (one line) naming a folder there that is no registry day, or a day whose notebook is missing."""
    stray = [f"{notebooks}/{d}" for d in strays(root, notebooks)]
    if stray:
        raise BadInput(f"{', '.join(stray)} {'is not a day' if len(stray) == 1 else 'are not days'} of dlo.registry "
                       f"(add a DaySpec there, or move the folder out of {notebooks}/)")
    days = names()
    missing = [d for d in days if not notebook_path(root, d, notebooks).is_file()]
    if missing:
        raise BadInput(f"{notebooks}/ under {root} lacks the notebook of {', '.join(missing)} (days of dlo.registry: "
                       f"expected {notebooks}/<day>/<day>.ipynb)")
    return days


def notebook_path(root: Path, day: str, notebooks: str = "solutions") -> Path:
    return root / notebooks / day / f"{day}.ipynb"


def select_days(root: Path, days: list[str], all_days: bool, notebooks: str = "solutions") -> list[str]:
    """Validate the days asked for; an unknown day is a BadInput that lists the known ones."""
    known = list_days(root, notebooks)
    if all_days or not days:
        if not known:
            raise BadInput("no days in this course (dlo.registry, or $DLO_DAYS for a course of one's own)")
        return known
    unknown = [d for d in days if d not in known]
    if unknown:
        raise BadInput(f"unknown day(s) {', '.join(unknown)}; the days are: {', '.join(known) or '(none)'}")
    return days
