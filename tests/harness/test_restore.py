"""Broken grading metadata explained and graded anyway (issue 33): `dlo.harness.restore` on notebooks,
in milliseconds; tests/harness/test_feedback.py grades such a submission with `dlo grade`."""

from __future__ import annotations

import copy

from nbformat.v4 import new_code_cell

from dlo.harness import restore as R
from tests.harness.conftest import grade_id, toy_notebook


def _release():
    nb = toy_notebook()
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i}"
    return nb


def _by_id(nb):
    return {grade_id(c): c for c in nb.cells if grade_id(c)}


def test_an_untouched_submission_changes_nothing():
    release = _release()
    nb = copy.deepcopy(release)
    assert R.restore(nb, release) == []
    assert [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells] == \
        [c.metadata.get("nbgrader", {}).get("grade_id") for c in release.cells]


def test_changed_ids_and_flags_are_put_back_and_extra_points_refused():
    release = _release()
    nb = copy.deepcopy(release)
    cells = _by_id(nb)
    cells["norm_test"].metadata.nbgrader["grade_id"] = "norm_test_mine"  # a changed grade id: matched by cell id
    cells["add"].metadata.nbgrader.update(grade=True, points=100)  # a solution cell made a 100-point test
    cells["adamw_test"].id = "other"
    cells["adamw_test"].metadata.nbgrader["grade_id"] = "renamed"  # matched by its source
    del cells["norm"].metadata["nbgrader"]  # plain now: matched by cell id
    bonus = new_code_cell("pass", metadata={"nbgrader": {"grade": True, "grade_id": "bonus", "points": 100,
                                                          "locked": False, "solution": False, "schema_version": 3}})
    twin = copy.deepcopy(cells["add_test"])
    twin.id = "twin"
    quiet = new_code_cell("x = 1", metadata={"nbgrader": {"grade": False, "solution": False, "locked": False}})
    broken = new_code_cell("y = 2", metadata={"nbgrader": "junk"})
    nb.cells[6:6] = [bonus, twin, quiet, broken]
    notes = R.restore(nb, release)
    after = _by_id(nb)
    assert set(after) == {"add", "add_test", "norm", "norm_test", "adamw", "adamw_test"}
    for gid, cell in after.items():
        released = _by_id(release)[gid].metadata.nbgrader
        assert {k: v for k, v in cell.metadata.nbgrader.items() if k != "cell_type"} == released, gid
    assert "nbgrader" not in bonus.metadata and "nbgrader" not in twin.metadata
    assert "nbgrader" not in quiet.metadata and "nbgrader" not in broken.metadata
    text = "\n".join(notes)
    assert "(`norm_test_mine`): its grade id is not the release's (released: `norm_test`); put back" in text
    assert "(`renamed`): its grade id is not the release's (released: `adamw_test`)" in text
    assert "(`add`): grade `False` instead of `True`" not in text and "grade `True` instead of `False`" in text
    assert "its grading metadata was removed; put back as released, graded as `norm`" in text
    assert "(`bonus`), `100` points claimed: not a cell of the release; run as an ordinary cell, not graded, " \
           "its points refused" in text
    assert "(`add_test`), `2` points claimed: a second cell with this grade id" in text
    assert "cell 10 (" in text and "junk" not in text and len(notes) == 7  # the quiet cell claims nothing
    note = R.note_cell(notes, 5)
    assert note.source.startswith("**Grading metadata changed**") and note.source.count("\n- ") == 7


def test_names_in_the_note_carry_no_markup():
    release = _release()
    nb = copy.deepcopy(release)
    _by_id(nb)["add_test"].metadata.nbgrader.update(grade_id="<img src=x onerror=alert(1)>`", points="<b>9</b>")
    _by_id(release)  # untouched
    text = "\n".join(R.restore(nb, release))
    assert "<" not in text and "onerror=alert(1)`" not in text
