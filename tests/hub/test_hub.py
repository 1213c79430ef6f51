"""Students on the course's JupyterHub (issue 38), run by .ci/hub-step against a real hub: PAM logins, a SLURM job
each, JupyterLab within a minute with nbgrader's student tools only, a terminal in the course's environment, homes
kept apart, the server on the node's address, and a job that dies failing the spawn in seconds."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.browser.test_lab import click_menu, wait_for
from tests.harness.conftest import REPO

from .conftest import HUB_URL, jobs, listening, log_in

pytestmark = pytest.mark.hub

DAY = "day1_optimizers"
STUDENTS = ("dlohub-a", "dlohub-b")
BROKEN = "dlohub-c"  # the hub's config gives this student's job a command that does not exist
LAB_WITHIN = 60  # s from the login's submit to JupyterLab's menu bar (the issue measured 20-26 s)
FAIL_WITHIN = 60  # s for a dead job to fail the spawn (batchspawner alone waited start_timeout: 600 s)
TIMES = Path(os.environ.get("DLO_HUB_TIMES", "/dev/null"))


def fetch_status(driver, path: str) -> int:
    """The HTTP status of a GET of `path` from the page, with the student's cookies."""
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"fetch({path!r}, {{redirect: 'manual'}}).then(r => done(r.status)).catch(e => done(-1));")


@pytest.mark.parametrize("student", STUDENTS)
def test_a_student_logs_in_and_gets_jupyterlab_on_a_job_of_their_own(browser, passwords, student, shots):
    submitted = log_in(browser, student, passwords[student])
    wait_for(browser, f"location.pathname.startsWith('/user/{student}/lab')"
                      " && document.querySelector('.lm-MenuBar-content')", timeout=LAB_WITHIN,
             what=f"JupyterLab for {student} within {LAB_WITHIN} s of the login")
    seconds = time.monotonic() - submitted
    with TIMES.open("a") as f:
        f.write(f"{student}: login to JupyterLab {seconds:.1f} s\n")
    browser.save_screenshot(str(shots / f"hub-{student}-lab.png"))
    mine = [j for j in jobs() if j["user"] == student]
    assert [j["state"] for j in mine] == ["RUNNING"], mine  # one job, the student's own

    # nbgrader's student side only: the Assignment List opens; the formgrader and Create Assignment are absent
    menu = browser.execute_script(
        "return [...document.querySelectorAll('.lm-MenuBar-itemLabel')].map(e => e.innerText);")
    assert "Nbgrader" in menu, menu
    click_menu(browser, "Nbgrader", "Assignment List")
    wait_for(browser, "[...document.querySelectorAll('.lm-TabBar-tab')].some(t => /Assignment/.test(t.innerText))",
             what="the Assignment List's tab")
    tabs = browser.execute_script("return [...document.querySelectorAll('.lm-TabBar-tab')].map(t => t.innerText);")
    assert not any("Create Assignment" in t for t in tabs), tabs
    assert fetch_status(browser, f"/user/{student}/formgrader") == 404
    assert fetch_status(browser, f"/user/{student}/create_assignment") in (404, 405)


def test_each_student_has_a_job_and_the_servers_listen_on_the_nodes_address():
    running = {j["user"]: j for j in jobs() if j["state"] == "RUNNING"}
    assert set(STUDENTS) <= set(running), running
    assert len({running[s]["id"] for s in STUDENTS}) == len(STUDENTS)
    for student in STUDENTS:
        addresses = listening(student)
        assert addresses, f"no listening socket of {student}'s server"
        # the test nodes' NodeAddr is 127.0.0.1; 0.0.0.0, * or [::] would be every interface of the node
        assert all(a.startswith("127.0.0.1:") for a in addresses), (student, addresses)


def test_a_notebook_has_validate_and_a_terminal_has_the_course_and_not_anothers_home(browser, passwords, shots):
    student, other = STUDENTS
    home = Path(os.path.expanduser(f"~{student}"))
    notebook = home / f"{DAY}.ipynb"  # the student's copy of a released day, as the README has them make
    shutil.copy(REPO / "course" / DAY / f"{DAY}.ipynb", notebook)
    shutil.chown(notebook, student, student)
    out = home / "hub-terminal-check.txt"
    out.unlink(missing_ok=True)
    log_in(browser, student, passwords[student])
    wait_for(browser, f"location.pathname.startsWith('/user/{student}/lab')", what="JupyterLab")
    browser.get(f"{HUB_URL}/user/{student}/lab/tree/{DAY}.ipynb?reset")  # ?reset: not the last test's tabs
    wait_for(browser, "[...document.querySelectorAll('.lm-DockPanel .jp-Toolbar *')]"
                      ".some(b => b.textContent.trim() === 'Validate')", what="the notebook's Validate button")
    browser.save_screenshot(str(shots / "hub-notebook.png"))

    click_menu(browser, "File", "New")
    wait_for(browser, "[...document.querySelectorAll('.lm-Menu-item')].find(e => e.innerText.trim() === 'Terminal')",
             what="File > New > Terminal").click()
    area = wait_for(browser, "document.querySelector('.jp-Terminal .xterm-helper-textarea')", what="a terminal")
    time.sleep(3)  # the shell's prompt
    area.send_keys(f"{{ id -un; command -v dlo nbgrader jupyter; ls ~{other}; echo ls-exit=$?;"
                   f" ls $DLO_CHECKOUT/course; }} > {out.name}.part 2>&1; mv {out.name}.part {out.name}\n")
    end = time.monotonic() + 60
    while not out.exists() and time.monotonic() < end:
        time.sleep(1)
    browser.save_screenshot(str(shots / "hub-terminal.png"))
    assert out.exists(), "the terminal's command did not run within 60 s"
    lines = out.read_text().splitlines()
    assert lines[0] == student, lines
    found = {Path(p).name: Path(p) for p in lines[1:4]}
    assert set(found) == {"dlo", "nbgrader", "jupyter"}, lines  # all three on the terminal's PATH
    assert "Permission denied" in out.read_text() and "ls-exit=2" in lines, lines
    assert DAY in lines, lines  # the README's `cp -r $DLO_CHECKOUT/course/DAY ~/` finds the released days


def test_a_job_that_dies_at_once_fails_the_spawn_within_seconds(browser, passwords, shots):
    submitted = log_in(browser, BROKEN, passwords[BROKEN])
    try:
        wait_for(browser, "/ended before JupyterLab started/.test(document.body.innerText)", timeout=FAIL_WITHIN,
                 what=f"the spawn's failure within {FAIL_WITHIN} s")
    except TimeoutError as e:
        raise AssertionError(f"{e}; the queue: {jobs()}") from None
    seconds = time.monotonic() - submitted
    with TIMES.open("a") as f:
        f.write(f"{BROKEN} (job dies at once): spawn failed {seconds:.1f} s after the login\n")
    browser.save_screenshot(str(shots / "hub-dead-job.png"))
    text = browser.execute_script("return document.body.innerText;")
    assert "jupyterhub_slurmspawner_" in text, text  # the job's log named
    assert not [j for j in jobs() if j["user"] == BROKEN]
