"""slurm/jupyterhub_config.py: a valid JupyterHub config whose SlurmSpawner job script, rendered the way
batchspawner renders it (jinja2), is a bash script asking for the course's resources, and whose prologue
really activates the course's environment and applies the student settings (run here in a fresh home).
No hub runs: these tests need no SLURM and are part of make test."""

import os
import subprocess
import sys
from pathlib import Path

import jinja2
from traitlets.config import Config

from tests.harness.conftest import REPO

PROFILE = REPO / "slurm" / "jupyterhub_config.py"


def _load(checkout: Path, env: str) -> Config:
    source = PROFILE.read_text().replace('"/path/to/checkout"', repr(str(checkout)), 1)
    source = source.replace('DLO_ENV = ""', f"DLO_ENV = {env!r}", 1)
    c = Config()
    exec(compile(source, str(PROFILE), "exec"), {"get_config": lambda: c})  # as JupyterHub's loader does
    return c


def _render(c: Config) -> str:
    s = c.SlurmSpawner
    return jinja2.Template(s.batch_script).render(
        homedir="/home/student", keepvars="ALL", partition=s.req_partition, runtime=s.req_runtime,
        memory=s.req_memory, gres=s.req_gres, nprocs=s.req_nprocs, prologue=s.req_prologue, srun="srun",
        cmd="batchspawner-singleuser jupyterhub-singleuser", epilogue="")


def test_the_job_script_asks_for_the_course_resources_and_is_bash(tmp_path):
    c = _load(REPO, "")
    assert c.JupyterHub.spawner_class == "batchspawner.SlurmSpawner"
    script = _render(c)
    for line in ("#SBATCH --gres=gpu:1", "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00",
                 "#SBATCH --job-name=dlo-jupyterhub", "source slurm/env.sh", "dlo setup student --user",
                 "srun batchspawner-singleuser jupyterhub-singleuser"):
        assert line in script, line
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)


def test_the_prologue_activates_the_course_and_sets_up_a_student(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    prologue = _load(REPO, str(Path(sys.prefix))).SlurmSpawner.req_prologue
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER"))}
    env.update(HOME=str(home))
    proc = subprocess.run(["bash", "-c", f"set -euo pipefail\n{prologue}\ncommand -v jupyter; pwd"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jupyter, cwd = proc.stdout.strip().splitlines()[-2:]
    assert Path(jupyter).parent == Path(sys.prefix) / "bin" and cwd == str(home)
    assert (home / ".jupyter" / "nbgrader_config.py").exists()  # dlo setup student --user wrote its settings
