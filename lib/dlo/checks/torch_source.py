"""The names of torch's functions and classes that a check forbids, read from this torch's sources.

Private helpers that do an exercise's work come and go between torch releases, and a forbidden name that does not
resolve stops the check: each is named only where this torch's source of its module defines it. Read from the
source, not imported: DTensor costs a second at every import of the checks (the grader resolves them when it blocks).
Shared by Days 4, 7 and 10 (a module of no day's: its bytes are in every day's `course_version`).
"""

from __future__ import annotations

import os
import re

import torch


def torch_defined(module: str, names: tuple[str, ...] = (), star: bool = True,
                  private: bool = False) -> tuple[str, ...]:
    """`module.name` for each of `names` that this torch's source of `module` defines at top level (with `private`,
    every private function and class it defines too), and with `star` "module.*" (its public names; "module.**" for
    a package)."""
    path = os.path.join(torch.__path__[0], *module.split(".")[1:])
    package = os.path.isdir(path)
    try:
        with open(os.path.join(path, "__init__.py") if package else path + ".py") as f:
            text = f.read()
    except OSError:
        return ()
    # "module.*" / "**" block public names only: the private classes that do the work are named one by one
    found = re.findall(r"^(?:class|def) (_[A-Za-z0-9]\w*)\b", text, re.M) if private else []
    found += [n for n in names if re.search(rf"^(?:class|def) {n}\b", text, re.M)]
    found = tuple(f"{module}.{n}" for n in dict.fromkeys(found))
    if package or not star:
        return found + ((f"{module}.**",) if star else ())
    # "module.*" of a module that defines no public name (2.13's _attention re-exports) stands for nothing
    return found + ((f"{module}.*",) if re.search(r"^(?:class|def) [A-Za-z]", text, re.M) else ())
