# The course on a site's JupyterHub that spawns on SLURM: batchspawner's SlurmSpawner with the course's
# environment and student settings. For the hub's administrator: add these lines to jupyterhub_config.py
# (or `load_subconfig("/path/to/checkout/slurm/jupyterhub_config.py")` there), with DLO_CHECKOUT (and
# DLO_ENV) in the hub's environment: no tracked file to edit.
#
# Needs, beside the course's own environment (the checkout's .venv or the conda env `dlo`, slurm/env.sh):
# `pip install "batchspawner>=1.3,<2" jupyterhub` into the hub's environment, and `batchspawner` with the
# hub's version of `jupyterhub` into the course's environment (the single-user server runs there:
# batchspawner-singleuser). Neither is in requirements/ (only a hub needs them).
#
# What a student gets: a job of its own on a GPU node (req_gres below: one GPU, common for a class),
# JupyterLab started by the hub in the course's environment, with `dlo setup student --user` applied first
# (Validate with the course's timeout, no instructor tools), the same as slurm/jupyter.sbatch without the
# SSH tunnel. Tested by rendering the job script the way batchspawner does
# (tests/slurm/test_jupyterhub_config.py); a hub itself is not run.
#
# GPUs each day wants at the full profile (one rank per GPU: the full presets' world_size, dlo.presets):
#   1: day1_optimizers day2_mixed_precision day3_checkpointing day8_quantization_pruning day9_inference
#   1: day11_learning_faster
#   4: day4_ddp day6_pipeline
#   8: day5_fsdp day7_tensor_parallel day10_context_experts
# One GPU runs Days 1-3 and 8 at their size; on fewer GPUs than a day's ranks, Days 4-7 and 10 run their
# multi-rank parts on CPU ranks at the tiny sizes and their single-GPU parts on the GPU (the notebook prints what runs
# where). req_gres = "gpu:4" runs Days 4 and 6 at their size, "gpu:8" every day.

import os  # noqa: E402 - JupyterHub's loader runs this file as code

# Set in the hub's environment (or edit here): the course's checkout, readable by every student, and its
# environment as slurm/env.sh reads it (a venv path, a conda env name, or "" for the checkout's .venv).
DLO_CHECKOUT = os.environ.get("DLO_CHECKOUT", "/path/to/checkout")
DLO_ENV = os.environ.get("DLO_ENV", "")

c = get_config()  # noqa: F821 - JupyterHub's config loader defines get_config

c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.SlurmSpawner.req_partition = "gpu"
c.SlurmSpawner.req_runtime = "04:00:00"
c.SlurmSpawner.req_nprocs = "8"
c.SlurmSpawner.req_memory = "64G"
c.SlurmSpawner.req_gres = "gpu:1"
c.SlurmSpawner.start_timeout = 600  # a GPU node may take a while to come free
# The server's step gets the whole environment the prologue made (the course's PATH): sbatch's
# --export={{keepvars}} below, JupyterHub's list without PATH, would otherwise be srun's default too
# (SLURM_EXPORT_ENV), and the step could not find batchspawner-singleuser.
c.SlurmSpawner.req_srun = "srun --export=ALL"
c.SlurmSpawner.req_prologue = f"""\
cd {DLO_CHECKOUT}
export DLO_ENV={DLO_ENV!r} JUPYTER_PREFER_ENV_PATH=0
source slurm/env.sh
dlo setup student --user
cd "$HOME"
"""
# The job script is batchspawner's own (its default SlurmSpawner.batch_script), with a job name of the
# course's so that `squeue` says what runs.
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
{{prologue}}
{% if srun %}{{srun}} {% endif %}{{cmd}}
echo "jupyterhub-singleuser ended gracefully"
{{epilogue}}
"""
