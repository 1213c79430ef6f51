"""nbgrader's Validate, made to run what `dlo grade` runs: every cell up to the last graded one.

A day's experiments come after its exercises and take most of its time (minutes on the tiny profile, far
more on a busy shared node); they cannot change a score (`dlo.harness.graded`), so `dlo grade` leaves them
out, and Validate, which tells a student whether their exercises pass, leaves them out too: each such cell
gets a note instead of outputs. The experiments are the notebook's own run: Run All in JupyterLab, or
`dlo run DAY`.

nbgrader's Validator takes its preprocessors from a list that is not configurable, so the student's
nbgrader_config.py (written by `dlo setup student`) calls `install()`, which makes that list's default
this Execute in place of nbgrader's; the server re-reads the file at each Validate, and `install` is
idempotent.
"""

from __future__ import annotations

from nbformat.v4 import new_output
from nbgrader.preprocessors import CheckCellMetadata, ClearOutput, Execute

from dlo.harness import graded

NOTE = ("**Not run by Validate**: this cell comes after the last graded cell, so it cannot change any score "
        "(the grader leaves it out too). Run All (or `dlo run DAY`) runs the day's experiments.")


class GradedOnlyExecute(Execute):
    """nbgrader's Execute that leaves out the code cells after the last graded cell, each with a note."""

    def preprocess(self, nb, resources=None, km=None):
        self._last = graded.last_graded_index(nb)
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        if graded.skipped(cell, index, self._last):
            cell.outputs = [new_output("display_data", data={"text/markdown": NOTE,
                                                             "text/plain": NOTE.replace("**", "")})]
            cell.execution_count = None
            return cell, resources
        return super().preprocess_cell(cell, resources, index)


def install() -> None:
    """Validate's preprocessors: nbgrader's three, with GradedOnlyExecute for Execute."""
    from nbgrader.validator import Validator

    Validator.class_traits()["preprocessors"].default_value = [CheckCellMetadata, ClearOutput, GradedOnlyExecute]
