"""CI's required steps fail when they run nothing (not marked `browser`: part of make test, seconds).

A browser test without its browser skips on a workstation but fails under CI=true (conftest.py), and
`.ci/required-step` fails a step whose pytest ran no test or skipped one, so the browser, smoke and
solutions steps of `.ci/run` cannot pass green having tested nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import REPO

STEP = REPO / ".ci" / "required-step"
MISSING = "/nonexistent/chromium"


def browser_step(**env) -> subprocess.CompletedProcess:
    """`pytest -m browser tests/browser` as .ci/run starts it, with a chromium that is not there."""
    base = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "browser", "tests/browser", "-p", "no:cacheprovider"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**base, "DLO_CHROMIUM": MISSING, **env})


@pytest.mark.slow
def test_a_missing_browser_skips_here_and_fails_in_ci():
    here = browser_step()
    assert here.returncode == 0 and "SKIPPED" in here.stdout and f"{MISSING} not found" in here.stdout, here.stdout
    ci = browser_step(CI="true")
    assert ci.returncode == 1, ci.stdout
    assert f"CI=true and the browser step cannot run: {MISSING} not found" in ci.stdout and "SKIPPED" not in ci.stdout


@pytest.mark.parametrize("output,status,fails,says", [
    ("4 passed", 0, False, None),
    ("SKIPPED [4] tests/browser/conftest.py:53: no chromium\n4 skipped", 0, True, "required step skipped tests"),
    ("no tests ran", 5, True, "required step ran no test"),
    ("1 failed", 1, True, None),
])
def test_a_required_step_fails_when_it_ran_nothing(output, status, fails, says):
    proc = subprocess.run([str(STEP), "demo step", "sh", "-c", f"printf '%s\\n' '{output}'; exit {status}"],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode != 0) is fails and output.splitlines()[-1] in proc.stdout, proc
    assert (says is None and proc.stderr == "") or f"demo step: {says}" in proc.stderr, proc.stderr
