"""The two-node test cluster (slurm/testing/cluster.sh) for `pytest -m slurm`.

The session fixture `slurm` uses a cluster that is already up (the CI step .ci/slurm-step brings it up
and down around the run; by hand: `slurm/testing/cluster.sh up`). Without one the tests skip, except
under CI=true, where a missing cluster is a failure: a CI step that skipped everything would pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.conftest import toy_template  # noqa: F401 - the toy course, a fixture here too

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "testing" / "cluster.sh"
STATE_DIR = Path(os.environ.get("DLO_SLURM_DIR", "/tmp/dlo-slurm-test"))
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class Cluster:
    """Submit to the test cluster and wait for jobs. Jobs get this venv as DLO_ENV (slurm/env.sh) and
    run from the repository root, like a user who submits `sbatch slurm/X.sbatch` there."""

    def __init__(self, conf: Path):
        self.conf = conf
        self.env = dict(os.environ, SLURM_CONF=str(conf), DLO_ENV=str(Path(sys.prefix)), OMP_NUM_THREADS="1")
        self.submitted: list[str] = []  # cancelled after each test: a failed one leaves no job holding the nodes

    def run(self, *cmd: str, check: bool = True, env: dict | None = None) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **(env or {})}, cwd=REPO,
                              timeout=60)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done.stdout

    def sbatch(self, *args: str, env: dict | None = None) -> str:
        """sbatch --parsable ARGS... with `env` added to what the job inherits; the job id."""
        job = self.run("sbatch", "--parsable", *args, env=env).strip().split(";")[0]
        self.submitted.append(job)
        return job

    def jobs(self, job_id: str) -> list[dict]:
        """Every task of a job (an array has several) as scontrol shows it: JobState, ExitCode, Restarts..."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job_id: str, timeout: float = 900, tasks: int = 1) -> list[dict]:
        """Poll until all `tasks` tasks of the job have ended (a hang guard, not a speed check)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.jobs(job_id)
            if len(found) >= tasks and all(j.get("JobState") in ENDED for j in found):
                return found
            time.sleep(1)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} not ended after {timeout} s: {self.jobs(job_id)}")


def _cluster_up(conf: Path) -> str | None:
    """None when the cluster answers with both nodes, else why not."""
    if not conf.exists():
        return f"no test cluster ({conf} missing): run slurm/testing/cluster.sh up"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30,
                              env=dict(os.environ, SLURM_CONF=str(conf)))
    except FileNotFoundError:
        return "sinfo not found: apt-get install -y slurm-wlm munge, then slurm/testing/cluster.sh up"
    nodes = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    if done.returncode or set(nodes) != {"n1", "n2"}:
        return f"test cluster not answering (sinfo: {done.stdout.strip()} {done.stderr.strip()})"
    return None


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    conf = STATE_DIR / "slurm.conf"
    why = _cluster_up(conf)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {why}")
        pytest.skip(why)
    return Cluster(conf)


@pytest.fixture(autouse=True)
def _no_job_left(request):
    """After a test on the cluster, its jobs still queued or running are cancelled: one that failed before its
    own scancel would hold CPUs and GPUs the next tests wait for."""
    yield
    if "slurm" in request.fixturenames:
        cluster = request.getfixturevalue("slurm")
        if cluster.submitted:
            cluster.run("scancel", *cluster.submitted, check=False)
            cluster.submitted.clear()
