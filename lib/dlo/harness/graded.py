"""What of a notebook `dlo grade` runs: every cell up to the last graded one, not the experiments after it.

A notebook's score is the sum of its graded cells' (nbgrader's `grade` cells; `solution` and `task`
cells are what they grade), and a graded cell's result depends only on the cells run before it: the
kernel runs cells in order, a test cell's checks see the objects as they are when it is reached
(`dlo.harness.execute`), and a lost kernel is rebuilt by replaying the cells before the one it was lost
in. So the code cells after the last graded cell cannot change any score, and grading leaves them out:
each gets, instead of its outputs, a note saying that it was not run and how to run it
(`dlo grade --full-notebook`). That rule needs no guess about what an experiment is nor about what a
cell depends on; every cell before the last graded one (experiments between two exercises included)
runs as the student wrote it. The course puts its experiments after the exercises ("Experiments"),
which is where most of a day's CPU time goes (bench/cell_cpu.py).

The last graded cell is found in the notebook as it is executed, after nbgrader has put back the
instructors' test cells: a cell counts when its nbgrader metadata marks it graded, a solution or a
task, or when its grade_id is one of the instructors' test cells (whatever a student did to it).
"""

from __future__ import annotations

from nbformat.notebooknode import NotebookNode
from nbformat.v4 import new_output

NOTE = ("**Not run by the grader**: this cell comes after the last graded cell, so it cannot change any "
        "score. Run the notebook yourself to see its output (instructors: `dlo grade --full-notebook` runs "
        "every cell).")


def is_graded(cell, tests=()) -> bool:
    """True for a cell that is graded, or holds what a graded cell checks (solution, task)."""
    meta = cell.get("metadata", {}).get("nbgrader") or {}
    return bool(meta.get("grade") or meta.get("solution") or meta.get("task") or
                (meta.get("grade_id") is not None and meta.get("grade_id") in tests))


def last_graded_index(nb, tests=()) -> int:
    """Index of the notebook's last graded cell (`is_graded`); -1 when it has none."""
    return max((i for i, cell in enumerate(nb["cells"]) if is_graded(cell, tests)), default=-1)


def skipped(cell, index: int, last: int) -> bool:
    """True for a code cell that grading does not run: one after the last graded cell."""
    return cell.get("cell_type") == "code" and index > last


def skipped_output() -> NotebookNode:
    """The output a skipped cell gets in the autograded notebook and the feedback."""
    return new_output("display_data", data={"text/markdown": NOTE, "text/plain": NOTE.replace("**", "")})
