"""The README's student set-up works word for word: its commands run in a fresh home, from the
checkout, as a new student would type them (only JupyterLab's server is not started: a stand-in
`jupyter lab` checks that the notebook it was asked to open is there).

The environment's Jupyter settings (.venv/etc/jupyter, where `dlo setup student` writes) are the
test suite's own: the commands run in a private mount namespace in which a copy of that folder is
mounted over it, so nothing the README's commands write reaches the other tests. Needs root (CI and
this project's machines run as root) and `unshare`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.conftest import REPO

JUPYTER_STANDIN = r'''
jupyter() {  # JupyterLab's server is not started here: check what it was asked to open
    if [ "$1" = lab ]; then [ -f "$2" ] && echo "LAB OPENS $PWD/$2"; return; fi
    command jupyter "$@"
}
'''


def readme_block(heading: str) -> str:
    """The first ```bash block after `heading` in README.md."""
    text = (REPO / "README.md").read_text()
    after = text[text.index(heading):]
    return re.search(r"```bash\n(.*?)```", after, flags=re.S).group(1)


def test_the_student_block_is_what_this_test_runs():
    block = readme_block("## Students: working through a day")
    assert "make venv" in block and "dlo setup student" in block and "mkdir -p ~/dlo" in block
    assert "/path/to" not in block, "the README's commands must run as written"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a private mount namespace")
def test_the_student_setup_runs_word_for_word(tmp_path):
    venv_cfg = Path(sys.prefix) / "etc" / "jupyter"
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("the README's commands use the checkout's .venv; this suite runs in another environment")
    if subprocess.run(["make", "-q", "venv"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("the checkout's .venv is older than its lock: run make venv first (this test never rebuilds it)")
    private_cfg = tmp_path / "venv-etc-jupyter"
    if venv_cfg.exists():
        shutil.copytree(venv_cfg, private_cfg, symlinks=True)
    else:
        private_cfg.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    script = "\n".join([
        "set -euo pipefail",
        f"mkdir -p {venv_cfg} && mount --bind {private_cfg} {venv_cfg}",
        JUPYTER_STANDIN,
        f"cd {REPO}",
        readme_block("## Students: working through a day"),
    ])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER", "PYTHON"))}
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env.update(HOME=str(home), PATH=path)  # a new shell: the venv not activated yet
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    notebook = home / "dlo" / "day1_optimizers" / "day1_optimizers.ipynb"
    assert f"LAB OPENS {notebook}" in proc.stdout, proc.stdout[-3000:]
    assert (private_cfg / "nbgrader_config.py").exists(), "dlo setup student wrote nothing"
    assert not (home / "dlo" / "day1_optimizers.ipynb").exists()
