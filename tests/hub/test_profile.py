"""The JupyterHub profile's own code without a hub (part of make test): its spawner fails the spawn of a job that
ended, its job script points the server at the node's address, its terminals keep the course's PATH. The real
hub's run of all three is tests/hub/test_hub.py (.ci/hub-step)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest

from tests.harness.conftest import REPO

from .profile import StandInSlurmSpawner, run_profile


def _spawner(**kw):
    _, namespace = run_profile()
    spawner = namespace["CourseSlurmSpawner"](**kw)
    spawner.job_check_interval = 0.05
    return spawner


def test_a_job_that_ended_fails_the_spawn_at_the_next_check_naming_its_log():
    """batchspawner waits for the port until start_timeout (600 s in the profile) with the job already dead."""
    spawner = _spawner(alive_polls=2)
    begun = time.monotonic()
    with pytest.raises(RuntimeError, match=r"job 42 ended before JupyterLab started; its log: "
                                           r"/home/student/jupyterhub_slurmspawner_42\.log"):
        asyncio.run(asyncio.wait_for(spawner.start(), timeout=30))
    assert time.monotonic() - begun < 5 and spawner.cancelled  # batchspawner's own wait was stopped


def test_a_job_that_runs_starts_as_batchspawner_starts_it():
    spawner = _spawner(starts_in=0.3)
    assert asyncio.run(spawner.start()) == ("10.0.0.7", 8888)
    assert spawner.polls >= 2 and not spawner.cancelled


def test_the_profile_spawns_with_its_spawner_and_keeps_site_settings_on_slurmspawner():
    c, namespace = run_profile()
    assert c.JupyterHub.spawner_class is namespace["CourseSlurmSpawner"]
    assert issubclass(namespace["CourseSlurmSpawner"], StandInSlurmSpawner)


def _script_head(tmp_path, node_addr: str | None) -> str:
    """The job script up to the prologue, run with a fake scontrol; what JUPYTERHUB_SERVICE_URL became."""
    c, _ = run_profile()
    script = jinja2.Template(c.SlurmSpawner.batch_script).render(
        homedir=str(tmp_path), keepvars="ALL", prologue='echo "$JUPYTERHUB_SERVICE_URL"; exit 0', cmd="false")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text("#!/bin/sh\n" + (f'echo "NodeName=$4 Arch=x86_64 NodeAddr={node_addr} NodeHostName=$4"\n'
                                     if node_addr else "exit 1\n"))
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURMD_NODENAME": "n7",
           "JUPYTERHUB_SERVICE_URL": "http://0.0.0.0:0/user/ada/"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_server_listens_on_the_nodes_address_not_every_interface(tmp_path):
    """The hub submits with ip 0.0.0.0 (the node is not known yet): the server listened on every interface."""
    assert _script_head(tmp_path, "10.1.2.3") == "http://10.1.2.3:0/user/ada/"


def test_without_slurms_answer_the_server_keeps_the_hubs_address(tmp_path):
    assert _script_head(tmp_path, None) == "http://0.0.0.0:0/user/ada/"


def test_a_terminal_is_the_students_shell_without_login():
    """jupyter_server adds -l when it has no tty: /etc/profile then reset PATH (no dlo in the hub's terminal)."""
    c, _ = run_profile()
    assert c.SlurmSpawner.args == ["--ServerApp.terminado_settings=shell_command=${SHELL:-/bin/bash}"]


def test_a_singleuser_env_adds_its_packages_to_the_courses_python(tmp_path, monkeypatch):
    """batchspawner and jupyterhub from a venv layered on the course's (DLO_SINGLEUSER_ENV): the hub's run found
    JupyterLab missing ("No default url found") when its own python ran the server with its own Jupyter paths."""
    overlay = tmp_path / "singleuser"
    (overlay / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (overlay / "lib" / "python3.11" / "site-packages" / "dlo_hub_probe.py").write_text("")
    (overlay / "bin").mkdir()
    monkeypatch.setenv("DLO_CHECKOUT", str(REPO))
    monkeypatch.setenv("DLO_ENV", sys.prefix)
    monkeypatch.setenv("DLO_SINGLEUSER_ENV", str(overlay))
    c, _ = run_profile()
    assert c.SlurmSpawner.batchspawner_singleuser_cmd == "python -m batchspawner.singleuser"
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER", "DLO_", "PYTHON"))}
    env.update(HOME=str(home))
    done = subprocess.run(["bash", "-c", f"set -euo pipefail\n{c.SlurmSpawner.req_prologue}\n"
                                         "command -v python; python -c 'import dlo_hub_probe'; echo $PATH; "
                                         "echo $DLO_CHECKOUT"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    python, path, checkout = done.stdout.strip().splitlines()[-3:]
    assert Path(python).parent == Path(sys.prefix) / "bin"  # the course's python, the overlay's packages
    assert path.endswith(f":{overlay}/bin") and checkout == str(REPO)


def test_a_start_cancelled_by_the_hubs_timeout_stops_batchspawners_wait():
    spawner = _spawner()  # the job runs, the server never answers: the hub's start_timeout cancels the start

    async def timed_out():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(spawner.start(), timeout=0.3)
        await asyncio.sleep(0.05)  # the inner start's cancellation runs
        return spawner.cancelled  # asked here: asyncio.run would cancel a leftover task on its way out

    assert asyncio.run(timed_out())
