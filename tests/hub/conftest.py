"""The course on a real JupyterHub (`pytest -m hub`): .ci/hub-step starts JupyterHub with the shipped profile on
the test SLURM and makes the students, then runs these tests with DLO_HUB_URL (the hub), DLO_HUB_STUDENTS (a
root-only file of "name password" lines). Without a hub they skip; under CI=true
they fail instead (a step that ran nothing must not pass). The browser is tests/browser's headless chromium."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.browser.conftest import browser, shots  # noqa: F401 - headless chromium and screenshots, fixtures here too
from tests.browser.test_lab import wait_for

HUB_URL = os.environ.get("DLO_HUB_URL", "")
STUDENTS = os.environ.get("DLO_HUB_STUDENTS", "")


def pytest_runtest_setup(item):
    if item.get_closest_marker("hub") is None or (HUB_URL and STUDENTS):
        return
    why = "no hub (DLO_HUB_URL, DLO_HUB_STUDENTS): .ci/hub-step starts one and runs these tests"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def passwords() -> dict[str, str]:
    return dict(line.split() for line in Path(STUDENTS).read_text().splitlines() if line.strip())


def log_in(driver, name: str, password: str) -> float:
    """Log in at the hub's form; the monotonic time of the submit."""
    driver.get(f"{HUB_URL}/hub/login")
    wait_for(driver, "document.querySelector('#username_input')", timeout=60, what="the hub's login form")
    driver.find_element("id", "username_input").send_keys(name)
    driver.find_element("id", "password_input").send_keys(password)
    submitted = time.monotonic()
    driver.find_element("id", "login_submit").click()
    return submitted


def jobs() -> list[dict]:
    """The test cluster's queue: id, user, state, node (or why it waits) of every job."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %u %T %R"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    return [dict(zip(("id", "user", "state", "node"), line.split())) for line in out.splitlines() if line.strip()]


def listening(user: str) -> list[str]:
    """The local addresses (address:port) of every TCP socket that a process of `user` other than SLURM's own
    listens on: the server and its kernels (srun, run as the student, listens on every interface for its step's
    I/O: SLURM's business, not the course's)."""
    uid = pwd.getpwnam(user).pw_uid
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        procs = re.findall(r'\("([^"]+)",pid=(\d+)', line)
        if any(_uid(int(pid)) == uid and name not in ("srun", "slurmstepd") for name, pid in procs):
            found.append(line.split()[3])
    return found


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
