"""A real JupyterLab (this environment's) in headless Chromium, per role, on a throwaway copy of a course day.

Nothing outside a temporary folder is touched: `dlo setup ROLE --config-dir` writes the role's settings
into a fresh JUPYTER_CONFIG_DIR (the user level, read before this environment's), and JupyterLab's data,
runtime and workspace folders are temporary too. Chromium and chromedriver are Debian's
(`apt-get install chromium chromium-driver`); Selenium is the `browser` extra (`pip install -e .[browser]`).
Without them the tests skip, saying why; under CI=true they fail instead.
Screenshots go to $DLO_SCREENSHOTS (default: a temporary folder, printed).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("DLO_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DLO_CHROMEDRIVER", "/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOKEN = "dlo-browser-test"
START_TIMEOUT = 180  # s: JupyterLab's first start on 2 busy cores


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} not found: apt-get install -y chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed: pip install -e .[browser]"
    return None


def pytest_runtest_setup(item):
    """A browser test without its browser is skipped, except in CI (CI=true), where it fails: a required
    step that runs nothing must not pass green."""
    if item.get_closest_marker("browser") is None:
        return
    why = _missing()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the browser step cannot run: {why}", pytrace=False)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def shots() -> Path:
    folder = Path(os.environ.get("DLO_SCREENSHOTS") or tempfile.mkdtemp(prefix="dlo-screenshots-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {folder}")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server for one role, serving `folder`."""

    def __init__(self, role: str, folder: Path, scratch: Path, env: dict | None = None):
        self.folder, self.port = folder, _free_port()
        cfg = scratch / "jupyter-config"
        subprocess.run([str(BIN / "dlo"), "setup", role, "--config-dir", str(cfg)], check=True,
                       capture_output=True, text=True)
        # JUPYTER_PREFER_ENV_PATH=0: in a venv, jupyter reads the environment's settings before the user's;
        # the throwaway user-level folder must come first here (a real `dlo setup` writes the environment's).
        self.env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg), "JUPYTER_PREFER_ENV_PATH": "0",
                    "JUPYTER_DATA_DIR": str(scratch / "data"),
                    "JUPYTER_RUNTIME_DIR": str(scratch / "runtime"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    **(env or {})}
        self.log = open(scratch / f"lab-{role}.log", "w")
        cmd = [str(BIN / "jupyter"), "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={folder}",
               f"--LabApp.workspaces_dir={scratch / 'workspaces'}", "--ServerApp.open_browser=False"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")  # CI containers run as root
        self.proc = subprocess.Popen(cmd, cwd=folder, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait()

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={TOKEN}"

    def get(self, path: str) -> int:
        try:
            return urllib.request.urlopen(self.url(path), timeout=30).status
        except urllib.error.HTTPError as e:
            return e.code

    def _wait(self):
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if self.get("api/status") == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"jupyter lab did not answer in {START_TIMEOUT} s; see {self.log.name}")

    def stop(self):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the kernels it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def start_lab(tmp_path):
    labs = []

    def start(role: str, folder: Path, env: dict | None = None) -> Lab:
        scratch = tmp_path / f"lab-{role}-{len(labs)}"
        scratch.mkdir()
        labs.append(Lab(role, folder, scratch, env))
        return labs[-1]

    yield start
    for lab in labs:
        lab.stop()


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,900", f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def copy_day(day: str, dest: Path) -> Path:
    """A student's copy of a released day folder, outside the checkout."""
    return Path(shutil.copytree(REPO / "course" / day, dest / day))
