# The course on a site's JupyterHub that spawns on SLURM: batchspawner's SlurmSpawner with the course's
# environment and student settings. For the hub's administrator: add these lines to jupyterhub_config.py
# (or `load_subconfig("/path/to/checkout/slurm/jupyterhub_config.py")` there, then override site settings
# such as c.SlurmSpawner.req_partition), with DLO_CHECKOUT (and DLO_ENV) in the hub's environment: no
# tracked file to edit.
#
# Needs, beside the course's own environment (the checkout's .venv or the conda env `dlo`, slurm/env.sh):
# `pip install "batchspawner>=1.3,<2" jupyterhub` into the hub's environment, and both (the hub's version of
# `jupyterhub`) where the job finds them: the single-user server runs `python -m batchspawner.singleuser` with
# the course's python. Either install them into the course's environment, or (the course's .venv kept to the
# lock) set DLO_SINGLEUSER_ENV to a venv without pip that holds only them, made on top of the course's: a venv of
# the same Python whose site-packages has a .pth line naming the course's site-packages, and
# `pip --python <it>/bin/python install -c <the lock> jupyterhub batchspawner` (pip sees the course's packages
# and adds only what is missing). The job puts its site-packages on PYTHONPATH and its bin/ last on PATH: the
# server, kernels and terminals stay the course's python (its Jupyter paths, JupyterLab, nbgrader), with the
# two packages and their few dependencies added. .ci/hub-step builds one that way. Neither is in requirements/
# (only a hub needs them). batchspawner runs sbatch/squeue/scancel as the student with `sudo -E -u <student>`
# (its exec_prefix): the hub's host needs sudo and that rule. The jobs reach the hub's API from the nodes: set
# c.JupyterHub.hub_bind_url (or hub_ip/hub_connect_ip) to an address they reach (the default is 127.0.0.1).
#
# What a student gets: a job of its own on a GPU node (req_gres below: one GPU, common for a class),
# JupyterLab started by the hub in the course's environment, with `dlo setup student --user` applied first
# (Validate with the course's timeout, no instructor tools), the same as slurm/jupyter.sbatch without the
# SSH tunnel; the server listens on the node's address (SLURM's NodeAddr), not on every interface; a terminal
# is a plain (not login) shell, so that it keeps the course's PATH (a login shell reads /etc/profile, which
# resets it); a job that ends before its server answers fails the spawn at the next check (seconds), with the
# job's log named, instead of after start_timeout. Tested for real by .ci/hub-step (JupyterHub, PAM logins
# of students, the test SLURM of slurm/testing/, tests/hub) and by rendering the job script
# (tests/slurm/test_jupyterhub_config.py).
#
# GPUs each day wants at the full profile (one rank per GPU: the full presets' world_size, dlo.presets):
#   1: day1_optimizers day2_mixed_precision day3_checkpointing day8_quantization_pruning day9_inference
#   1: day11_learning_faster
#   4: day4_ddp day6_pipeline
#   8: day5_fsdp day7_tensor_parallel day10_context_experts
# One GPU runs Days 1-3 and 8 at their size; on fewer GPUs than a day's ranks, Days 4-7 and 10 run their
# multi-rank parts on CPU ranks at the tiny sizes and their single-GPU parts on the GPU (the notebook prints what runs
# where). req_gres = "gpu:4" runs Days 4 and 6 at their size, "gpu:8" every day.

import asyncio  # noqa: E402 - JupyterHub's loader runs this file as code
import os  # noqa: E402

from batchspawner import SlurmSpawner  # noqa: E402 - the hub's environment has it (see above)
from traitlets import Float  # noqa: E402

# Set in the hub's environment (or edit here): the course's checkout, readable by every student, and its
# environment as slurm/env.sh reads it (a venv path, a conda env name, or "" for the checkout's .venv);
# DLO_SINGLEUSER_ENV: a venv with batchspawner and jupyterhub on top of the course's ("": they are in the course's).
DLO_CHECKOUT = os.environ.get("DLO_CHECKOUT", "/path/to/checkout")
DLO_ENV = os.environ.get("DLO_ENV", "")
DLO_SINGLEUSER_ENV = os.environ.get("DLO_SINGLEUSER_ENV", "")


class CourseSlurmSpawner(SlurmSpawner):
    """batchspawner's SlurmSpawner whose start also watches the job. batchspawner stops polling once the job
    is RUNNING and waits for the server to report its port; a job that died at once (a missing command, a
    broken environment) kept the student at "Cluster job running... waiting to connect" for the whole
    start_timeout (issue 38). Here the job is checked every job_check_interval seconds until the server
    answers, and a job that ended fails the spawn, naming its log."""

    job_check_interval = Float(2.0, help="Seconds between checks that the server's job still runs").tag(config=True)

    async def start(self):
        starting = asyncio.ensure_future(super().start())
        try:
            while True:
                done, _ = await asyncio.wait([starting], timeout=self.job_check_interval)
                if done:
                    return starting.result()
                job_id = self.job_id
                if job_id and await self.poll() is not None:  # poll: None while the job is pending or running
                    log = os.path.join(self.req_homedir, f"jupyterhub_slurmspawner_{job_id}.log")
                    raise RuntimeError(f"the server's job {job_id} ended before JupyterLab started; its log: {log}"
                                       f"{_log_tail(log)}")
        finally:
            starting.cancel()  # a failed or timed-out (cancelled) start leaves no batchspawner wait behind


def _log_tail(path: str, lines: int = 5) -> str:
    """The last lines of the job's log when the hub may read it (it runs as root on most sites), else ""."""
    try:
        with open(path, errors="replace") as f:
            return "\n" + "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _singleuser_env(venv: str) -> str:
    """The prologue's lines that add DLO_SINGLEUSER_ENV's packages to the course's python ("" without one)."""
    if not venv:
        return ""
    return (f'export PYTHONPATH="$(echo {venv}/lib/python3.*/site-packages)${{PYTHONPATH:+:$PYTHONPATH}}"'
            f' PATH="$PATH:{venv}/bin"')


c = get_config()  # noqa: F821 - JupyterHub's config loader defines get_config

c.JupyterHub.spawner_class = CourseSlurmSpawner
c.SlurmSpawner.req_partition = "gpu"
c.SlurmSpawner.req_runtime = "04:00:00"
c.SlurmSpawner.req_nprocs = "8"
c.SlurmSpawner.req_memory = "64G"
c.SlurmSpawner.req_gres = "gpu:1"
c.SlurmSpawner.start_timeout = 600  # a GPU node may take a while to come free; a dead job fails at once (above)
# The server's step gets the whole environment the prologue made (the course's PATH): sbatch's
# --export={{keepvars}} below, JupyterHub's list without PATH, would otherwise be srun's default too
# (SLURM_EXPORT_ENV), and the step could not find batchspawner-singleuser.
c.SlurmSpawner.req_srun = "srun --export=ALL"
# batchspawner's wrapper in the course's python, whichever environment holds it: with DLO_SINGLEUSER_ENV its own
# script would start that venv's python, whose Jupyter paths (JupyterLab, its extensions) are not the course's
# ("No default url found": JupyterLab missing, issue 38's hub run).
c.SlurmSpawner.batchspawner_singleuser_cmd = "python -m batchspawner.singleuser"
# A terminal is the student's shell without -l: jupyter_server makes it a login shell when the server has no
# tty, and a login shell's /etc/profile resets PATH (no jupyter, nbgrader or dlo in the terminal, issue 38).
# ${SHELL:-/bin/bash} is expanded by the job script's bash (the spawner passes SHELL).
c.SlurmSpawner.args = ["--ServerApp.terminado_settings=shell_command=${SHELL:-/bin/bash}"]
c.SlurmSpawner.req_prologue = f"""\
cd {DLO_CHECKOUT}
export DLO_CHECKOUT={DLO_CHECKOUT!r} DLO_ENV={DLO_ENV!r} JUPYTER_PREFER_ENV_PATH=0
source slurm/env.sh
{_singleuser_env(DLO_SINGLEUSER_ENV)}
dlo setup student --user
cd "$HOME"
"""
# The job script is batchspawner's own (its default SlurmSpawner.batch_script), with a job name of the
# course's so that `squeue` says what runs, and the server's address: the hub asks it to listen on 0.0.0.0
# (batchspawner's `ip`, as the node is not known at submission), every interface of the node; here it is
# the node's address as SLURM knows it (NodeAddr), where the hub reaches it.
c.SlurmSpawner.batch_script = """#!/bin/bash
#SBATCH --output={{homedir}}/jupyterhub_slurmspawner_%j.log
#SBATCH --job-name=dlo-jupyterhub
#SBATCH --chdir={{homedir}}
#SBATCH --export={{keepvars}}
#SBATCH --get-user-env=L
{% if partition  %}#SBATCH --partition={{partition}}
{% endif %}{% if runtime    %}#SBATCH --time={{runtime}}
{% endif %}{% if memory     %}#SBATCH --mem={{memory}}
{% endif %}{% if gres       %}#SBATCH --gres={{gres}}
{% endif %}{% if nprocs     %}#SBATCH --cpus-per-task={{nprocs}}
{% endif %}
set -euo pipefail

trap 'echo SIGTERM received' TERM
node_addr=$(scontrol -o show node "${SLURMD_NODENAME:-}" 2>/dev/null \\
    | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p') || true
service_url=${JUPYTERHUB_SERVICE_URL:-}
export JUPYTERHUB_SERVICE_URL=${service_url/\\/\\/0.0.0.0:/\\/\\/${node_addr:-0.0.0.0}:}
{{prologue}}
{% if srun %}{{srun}} {% endif %}{{cmd}}
echo "jupyterhub-singleuser ended gracefully"
{{epilogue}}
"""
