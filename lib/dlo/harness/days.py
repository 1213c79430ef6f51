"""Where the course lives on disk and which days it has.

A day is a folder `solutions/<day>/` holding `<day>.ipynb` (nbgrader's source notebook); the student
version is generated into `course/<day>/<day>.ipynb` by `dlo release`.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlo.errors import BadInput


def repo_root() -> Path:
    """The course checkout: $DLO_ROOT if set, else the folder that holds lib/dlo (editable install)."""
    env = os.environ.get("DLO_ROOT")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parents[3]


def list_days(root: Path, notebooks: str = "solutions") -> list[str]:
    base = root / notebooks
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / f"{p.name}.ipynb").is_file())


def notebook_path(root: Path, day: str, notebooks: str = "solutions") -> Path:
    return root / notebooks / day / f"{day}.ipynb"


def select_days(root: Path, days: list[str], all_days: bool, notebooks: str = "solutions") -> list[str]:
    """Validate the days asked for; an unknown day is a BadInput that lists the known ones."""
    known = list_days(root, notebooks)
    if all_days or not days:
        if not known:
            raise BadInput(f"no day notebooks found under {root / notebooks}")
        return known
    unknown = [d for d in days if d not in known]
    if unknown:
        raise BadInput(f"unknown day(s) {', '.join(unknown)}; the days are: {', '.join(known) or '(none)'}")
    return days
