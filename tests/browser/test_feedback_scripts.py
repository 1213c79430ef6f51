"""Feedback that runs nothing (issue 33), seen in Chromium (`pytest -m browser`): a student whose
notebook displays a <script>, an <img onerror>, Javascript, an SVG with a script and a markdown cell
with raw HTML is graded by `dlo grade`; the feedback the student and instructor open, and the
formgrader's view of the submission (served from the instructor's JupyterLab, where a script could use
Jupyter's API as the instructor), show the student's text and images and run none of it."""

from __future__ import annotations

import json
import time

import pytest

from tests.harness.conftest import DAY, dlo, edit_cells, grade_id, toy_days, toy_notebook
from tests.harness.test_feedback import NOTES_MD, SCRIPTS, SOLVED, _added

from .test_lab import wait_for

pytestmark = pytest.mark.browser
PWNED = "window.__pwned === undefined && (window.top === window || window.top.__pwned === undefined)"


@pytest.fixture
def graded(tmp_path):
    """A toy course, one submission with scripts in its outputs, graded."""
    import nbformat

    root = tmp_path / "toycourse"
    (root / "solutions" / DAY).mkdir(parents=True)
    nbformat.write(toy_notebook(), root / "solutions" / DAY / f"{DAY}.ipynb")
    dlo("release", root=root)

    def solve(cell):
        if grade_id(cell) in SOLVED:
            cell["source"] = SOLVED[grade_id(cell)]
    path = edit_cells(root / "course" / DAY / f"{DAY}.ipynb", tmp_path / "sub" / "mallory" / DAY / f"{DAY}.ipynb",
                      solve)
    nb = json.loads(path.read_text())
    at = next(i for i, c in enumerate(nb["cells"]) if grade_id(c) == "add") + 1
    nb["cells"][at:at] = [_added(SCRIPTS), _added(NOTES_MD, "markdown", "md")]
    path.write_text(json.dumps(nb))
    out = tmp_path / "grading"
    dlo("grade", str(tmp_path / "sub"), "--out", str(out), "--jobs", "1", root=root, timeout=900, cwd=tmp_path)
    return root, out


def _ran_nothing(browser, what: str) -> str:
    time.sleep(3)  # onload, onerror and MathJax's start have had their chance
    assert browser.execute_script(f"return {PWNED};"), f"{what}: a script of the student's ran"
    return browser.execute_script("return document.body.innerText;")


def test_feedback_and_formgrader_run_no_script_of_the_student(graded, start_lab, browser, shots):
    root, out = graded
    browser.get((out / "feedback" / "mallory" / f"{DAY}.html").as_uri())
    text = _ran_nothing(browser, "the feedback")
    assert "hello from mallory" in text and "plain text stays" in text and "My notes" in text
    assert browser.execute_script("return [...document.images].some(i => i.src.startsWith('data:image/svg+xml'));")
    browser.save_screenshot(str(shots / "feedback-scripts.png"))

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'course' / 'gradebook.db'}") as gb:
        submission = gb.find_submission_notebook(DAY, DAY, "mallory").id
    lab = start_lab("instructor", out / "course", env=toy_days(root))
    browser.get(lab.url(f"formgrader/submissions/{submission}/"))
    wait_for(browser, "document.body.innerText.includes('hello from mallory')", what="the submission's outputs")
    _ran_nothing(browser, "the formgrader")
    browser.save_screenshot(str(shots / "formgrader-scripts.png"))
