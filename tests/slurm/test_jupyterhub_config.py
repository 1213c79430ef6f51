"""slurm/jupyterhub_config.py: a valid JupyterHub config whose SlurmSpawner job script, rendered the way
batchspawner renders it (jinja2), is a bash script asking for the course's resources, and whose prologue
really activates the course's environment and applies the student settings (run here in a fresh home).
No hub runs: these tests need no SLURM and are part of make test."""

import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from traitlets.config import Config

from tests.harness.conftest import REPO
from tests.hub.profile import PROFILE, run_profile


def _load(checkout: Path, env: str) -> Config:
    source = PROFILE.read_text().replace('"/path/to/checkout"', repr(str(checkout)), 1)
    source = source.replace('os.environ.get("DLO_ENV", "")', repr(env), 1)
    return run_profile(source)[0]


def _render(c: Config) -> str:
    s = c.SlurmSpawner
    return jinja2.Template(s.batch_script).render(
        homedir="/home/student", keepvars="ALL", partition=s.req_partition, runtime=s.req_runtime,
        memory=s.req_memory, gres=s.req_gres, nprocs=s.req_nprocs, prologue=s.req_prologue, srun=s.req_srun,
        cmd="batchspawner-singleuser jupyterhub-singleuser", epilogue="")


def test_a_site_sets_the_checkout_in_the_hubs_environment_not_in_a_tracked_file(monkeypatch):
    monkeypatch.setenv("DLO_CHECKOUT", "/srv/dlo")
    monkeypatch.setenv("DLO_ENV", "dlo")
    c, _ = run_profile()
    assert "cd /srv/dlo\n" in c.SlurmSpawner.req_prologue and "DLO_ENV='dlo'" in c.SlurmSpawner.req_prologue


def test_the_job_script_asks_for_the_course_resources_and_is_bash(tmp_path):
    c = _load(REPO, "")
    assert c.JupyterHub.spawner_class.__name__ == "CourseSlurmSpawner"
    script = _render(c)
    for line in ("#SBATCH --gres=gpu:1", "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00",
                 "#SBATCH --job-name=dlo-jupyterhub", "source slurm/env.sh", "dlo setup student --user",
                 "srun --export=ALL batchspawner-singleuser jupyterhub-singleuser"):
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


# What JupyterHub 6 passes as batchspawner's {{keepvars}}: the spawner's environment's names (its env_keep and
# the JUPYTERHUB_* variables), PATH not among them.
HUB6_KEEPVARS = ("JUPYTERHUB_API_TOKEN,JPY_API_TOKEN,JUPYTERHUB_CLIENT_ID,JUPYTERHUB_HOST,"
                 "JUPYTERHUB_OAUTH_CALLBACK_URL,"
                 "JUPYTERHUB_USER,JUPYTERHUB_SERVER_NAME,JUPYTERHUB_API_URL,JUPYTERHUB_ACTIVITY_URL,"
                 "JUPYTERHUB_BASE_URL,JUPYTERHUB_SERVICE_PREFIX,JUPYTERHUB_SERVICE_URL,LANG,LC_ALL")


@pytest.mark.slurm
def test_the_server_step_gets_the_course_environment_on_a_real_slurm(slurm, tmp_path):
    """Tried on a real hub (issue 38), the job died at once: `execve(): batchspawner-singleuser: No such file or
    directory`. sbatch's --export={{keepvars}} (no PATH) became srun's default (SLURM_EXPORT_ENV), so the
    step lost the PATH the prologue had set. Here the job script as the hub renders it, keepvars without PATH,
    runs on the test cluster with a command that only the course's environment has."""
    c = _load(REPO, str(Path(sys.prefix)))
    s = c.SlurmSpawner
    home = tmp_path / "home"
    home.mkdir()
    script = jinja2.Template(s.batch_script).render(
        homedir=str(home), keepvars=HUB6_KEEPVARS, gres="gpu:1", prologue=s.req_prologue,
        srun=s.req_srun, cmd="dlo --help", epilogue="")  # the test nodes have no "gpu" partition, 64G or 8 CPUs
    (tmp_path / "job.sh").write_text(script)
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER"))}
    env.update(HOME=str(home), PATH="/usr/bin:/bin", LANG="C.UTF-8")
    job = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job.sh")], capture_output=True, text=True,
                         env=env, cwd=home, timeout=60)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    slurm.submitted.append(job_id)
    [state] = slurm.wait(job_id, timeout=300)
    log = (home / f"jupyterhub_slurmspawner_{job_id}.log").read_text()
    assert state["JobState"] == "COMPLETED", log
    assert "usage: dlo" in log and "jupyterhub-singleuser ended gracefully" in log, log
