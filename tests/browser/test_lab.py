"""The course as a student and an instructor meet it: JupyterLab in headless Chromium (`pytest -m browser`).

Student: a copy of Day 1 outside the checkout, `dlo setup student`; the notebook renders (markdown, an
exercise cell), the instructor's tools are absent, Validate fails on the untouched notebook naming the
exercises and passes on a solved copy. Instructor: `dlo setup instructor`, JupyterLab in a course root,
the formgrader opens with its exchange. Validate runs with DLO_SMOKE=1 (the tiny profile's sizes, the
fewest steps) to keep the test within minutes on 2 cores; `nbgrader validate` at the tiny profile is
the README's check. Screenshots: $DLO_SCREENSHOTS.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from dlo.harness.setup import kernel_metadata, normalise_metadata

from .conftest import REPO, copy_day

pytestmark = pytest.mark.browser

DAY = "day1_optimizers"
EXERCISES = ("sgd_momentum_step", "adamw_step", "lamb_step")  # named by the test cells that fail
VALIDATE_TIMEOUT = 900  # s: the whole notebook runs, next to other work on 2 cores
UI_TIMEOUT = 120  # s: JupyterLab's first page load compiles nothing, but 2 busy cores are slow
RELEASED_NORMALISED = all(
    json.loads((REPO / "course" / DAY / f"{DAY}.ipynb").read_text())["metadata"].get(k) == v
    for k, v in kernel_metadata().items())


def wait_for(driver, script: str, timeout: float = UI_TIMEOUT, what: str = ""):
    """Poll a JavaScript expression until it is truthy; returns its value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(f"return ({script});")
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"{what or script} not seen in {timeout} s")


def open_notebook(driver, lab, name: str):
    driver.get(lab.url(f"lab/tree/{name}"))
    wait_for(driver, "document.querySelectorAll('.jp-Notebook .jp-Cell').length > 20", what="the notebook's cells")
    wait_for(driver, "document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status')"
                     " === 'idle'", what="an idle kernel")
    time.sleep(2)  # the kernel's metadata lands in the model right after it is idle


def becomes_dirty(driver, within: float = 30) -> bool:
    """Whether the open notebook's tab shows the modified mark within `within` seconds (JupyterLab writes the
    kernel's metadata into the notebook some time after the kernel is ready; later still on busy cores)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if driver.execute_script("return document.querySelector('.lm-DockPanel .jp-mod-dirty') !== null;"):
            return True
        time.sleep(1)
    return False


def validate(driver) -> str:
    """Click the notebook toolbar's Validate and return the text of the result dialog."""
    buttons = driver.execute_script(  # the innermost element labelled Validate in the notebook's toolbar
        "return [...document.querySelectorAll('.lm-DockPanel .jp-Toolbar *')]"
        ".filter(b => b.textContent.trim() === 'Validate' && ![...b.children].some(c => c.textContent.trim())"
        " && b.getBoundingClientRect().width > 0);")  # the visible notebook's, not a background tab's
    assert buttons, "no Validate button in the notebook toolbar"
    buttons[0].click()
    text = wait_for(driver, "[...document.querySelectorAll('.jp-Dialog')].map(d => d.innerText)"
                            ".find(t => /Validation Results|Validation failed|Success/.test(t))",
                    timeout=VALIDATE_TIMEOUT, what="Validate's result")
    return text


def click_menu(driver, menu: str, item: str):
    """Open a menu of JupyterLab's menu bar and click one of its items (by their labels)."""
    for css, label in ((".lm-MenuBar-item", menu), (".lm-Menu-item", item)):
        found = wait_for(driver, f"[...document.querySelectorAll('{css}')]"
                                 f".find(e => e.innerText.trim() === {label!r})", what=f"{label!r} in the menus")
        found.click()
        time.sleep(1)


def close_dialog(driver):
    driver.execute_script("document.querySelector('.jp-Dialog .jp-mod-accept, .jp-Dialog button')?.click();")


def solved_copy(course_nb: Path, dest: Path) -> Path:
    """The released notebook with the solutions' code in its exercise cells: what a student who solved
    it hands in (nbgrader's checksums of the locked cells untouched)."""
    nb = nbformat.read(course_nb, as_version=4)
    solution_nb = nbformat.read(REPO / "solutions" / DAY / f"{DAY}.ipynb", as_version=4)
    reference = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution_nb.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    markers = ("### BEGIN SOLUTION", "### END SOLUTION")
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and meta.get("grade_id") in reference:
            lines = reference[meta["grade_id"]].splitlines()
            cell.source = "\n".join(line for line in lines if line.strip() not in markers)
    nbformat.write(nb, dest)
    return dest


def news_off(lab):
    """Throwaway user settings: no "get notified about Jupyter news?" toast over the screenshots, and every
    cell in the page (JupyterLab otherwise renders only the cells near the view, so the test could not
    find an exercise cell further down)."""
    for plugin, values in (("apputils-extension/notification", {"fetchNews": "false"}),
                           ("notebook-extension/tracker", {"windowingMode": "none"})):
        settings = Path(lab.env["JUPYTER_CONFIG_DIR"], "lab", "user-settings", "@jupyterlab")
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture
def student_day(tmp_path) -> Path:
    return copy_day(DAY, tmp_path / "student")


def test_student_sees_the_notebook_and_validate_only(start_lab, browser, student_day, shots):
    lab = start_lab("student", student_day, env={"DLO_SMOKE": "1"})
    news_off(lab)
    solved_copy(student_day / f"{DAY}.ipynb", student_day / "solved.ipynb")
    assert lab.get("formgrader") == 404, "the formgrader is served to a student"

    open_notebook(browser, lab, f"{DAY}.ipynb")
    page = browser.execute_script("return document.querySelector('.jp-Notebook').innerText;")
    assert "Day 1" in browser.execute_script(
        "return document.querySelector('.jp-Notebook .jp-MarkdownOutput h1')?.innerText || '';")
    assert "YOUR CODE HERE" in page and "def sgd_momentum_step" in page, "the first exercise cell did not render"
    tabs = browser.execute_script("return [...document.querySelectorAll('.lm-TabBar-tab')]"
                                  ".map(t => (t.title || t.innerText).trim());")
    assert not any("Create Assignment" in t for t in tabs), tabs
    menu = browser.execute_script(
        "return [...document.querySelectorAll('.lm-MenuBar-itemLabel')].map(e => e.innerText);")
    assert "Nbgrader" in menu, menu  # the assignment list stays
    browser.execute_script("[...document.querySelectorAll('.jp-CodeCell')].find(c => c.innerText.includes("
                           "'def sgd_momentum_step')).scrollIntoView({block: 'center'});")
    time.sleep(1)
    browser.save_screenshot(str(shots / "student-notebook.png"))

    failed = validate(browser)
    browser.save_screenshot(str(shots / "student-validate-untouched.png"))
    assert "Timeout" not in failed and "timed out" not in failed, failed
    assert "failed" in failed.lower(), failed
    named = [name for name in EXERCISES if name in failed]
    assert named, f"the failure names none of {EXERCISES}: {failed[:500]}"
    close_dialog(browser)

    open_notebook(browser, lab, "solved.ipynb")
    passed = validate(browser)
    browser.save_screenshot(str(shots / "student-validate-solved.png"))
    assert "Success! Your notebook passes all the tests" in passed, passed[:2000]


@pytest.mark.xfail(not RELEASED_NORMALISED, strict=True,
                   reason="course/ was released on another Python patch version than this kernel's: JupyterLab "
                          "rewrites language_info.version on open (dlo release writes the releasing interpreter's)")
def test_released_notebook_opens_unmodified(start_lab, browser, student_day):
    lab = start_lab("student", student_day)
    news_off(lab)
    open_notebook(browser, lab, f"{DAY}.ipynb")
    assert not becomes_dirty(browser), "the notebook shows as modified right after it opens"


def test_normalised_metadata_opens_unmodified(start_lab, browser, student_day):
    nb = nbformat.read(student_day / f"{DAY}.ipynb", as_version=4)
    normalise_metadata(nb)
    nbformat.write(nb, student_day / "normalised.ipynb")
    lab = start_lab("student", student_day)
    news_off(lab)
    open_notebook(browser, lab, "normalised.ipynb")
    assert not becomes_dirty(browser), "modified on open although its kernel metadata is what JupyterLab writes"


def test_instructor_gets_the_formgrader(start_lab, browser, tmp_path, shots):
    root = tmp_path / "course-root"  # a course root laid out as the checkout: solutions/ -> course/
    shutil.copytree(REPO / "solutions" / DAY, root / "solutions" / DAY)
    shutil.copy(REPO / "nbgrader_config.py", root / "nbgrader_config.py")
    lab = start_lab("instructor", root)
    news_off(lab)
    assert lab.get("formgrader") == 200
    browser.get(lab.url("lab"))
    wait_for(browser, "document.querySelector('.lm-MenuBar-content')", what="JupyterLab's menu bar")
    tabs = browser.execute_script("return [...document.querySelectorAll('.lm-TabBar-tab')]"
                                  ".map(t => (t.title || t.innerText).trim());")
    assert any("Create Assignment" in t for t in tabs), tabs
    click_menu(browser, "Nbgrader", "Formgrader")
    text = wait_for(browser, "[...document.querySelectorAll('iframe')].map(f => f.contentDocument?.body?.innerText"
                             f" || '').find(t => t.includes('{DAY}'))", what="the formgrader listing the day")
    browser.save_screenshot(str(shots / "instructor-formgrader.png"))
    assert "exchange" not in text.lower() or "does not exist" not in text.lower(), text[:1000]
