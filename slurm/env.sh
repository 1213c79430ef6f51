# Sourced by every slurm/*.sbatch template (they are submitted from the repository root): activates the
# course's Python environment, named by one variable that sbatch passes on from the submitting shell:
#   DLO_ENV=/path/to/.venv     a virtual environment (the README's `make venv` builds ./.venv)
#   DLO_ENV=dlo                a conda environment name (`conda env create -f environment.yml`)
#   unset                      ./.venv when there is one, else the conda environment `dlo`
# It fails with one line, before any work, when the environment is not there or has no `dlo`.
DLO_ENV=${DLO_ENV:-}
if [ -z "$DLO_ENV" ]; then
    if [ -f .venv/bin/activate ]; then DLO_ENV=$PWD/.venv; else DLO_ENV=dlo; fi
fi
if [ -f "$DLO_ENV/bin/activate" ]; then
    # shellcheck disable=SC1091
    source "$DLO_ENV/bin/activate"
elif [[ "$DLO_ENV" == */* ]]; then
    echo "slurm/env.sh: DLO_ENV=$DLO_ENV is a path but has no bin/activate (a venv: make venv)" >&2; exit 2
elif command -v conda >/dev/null 2>&1; then
    # shellcheck disable=SC1091
    source "$(conda info --base)/etc/profile.d/conda.sh"
    conda activate "$DLO_ENV" || { echo "slurm/env.sh: no conda environment '$DLO_ENV'" >&2; exit 2; }
else
    echo "slurm/env.sh: no ./.venv and no conda for DLO_ENV=$DLO_ENV; set DLO_ENV to a venv path" >&2; exit 2
fi
# A process killed by a signal (a C++ abort inside a collective or at exit, a segfault) prints every Python
# thread's stack to stderr, so the job's log says where a rank died, not only "Signal 6 (SIGABRT)".
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
command -v dlo >/dev/null || { echo "slurm/env.sh: $DLO_ENV has no dlo command (pip install -e .)" >&2; exit 2; }
echo "$(date) $(hostname) job ${SLURM_JOB_ID:-?}: environment $DLO_ENV ($(command -v python)), GPUs ${CUDA_VISIBLE_DEVICES:-none}"
