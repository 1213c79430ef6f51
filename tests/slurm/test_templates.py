"""What the slurm/ templates say and pass on, without SLURM (part of make test): the GPUs each day wants, as
run_course.sbatch, jupyter.sbatch and the JupyterHub profile print them, are the full presets' world sizes;
run_course.sbatch passes DATA_DIR to every day and WEIGHTS_DIR only to the days that declare weights_dir
(Days 5 and 8), with `dlo` replaced by a recorder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.registry import DAYS
from tests.harness.conftest import REPO

TEMPLATES = ("slurm/run_course.sbatch", "slurm/jupyter.sbatch", "slurm/jupyterhub_config.py")


def _wanted_by_presets() -> dict[str, int]:
    return {day: int(getattr(spec.presets["full"], "world_size", None) or 1) for day, spec in DAYS.items()}


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_gpus_each_day_wants_are_the_full_presets(template):
    text = (REPO / template).read_text()
    printed = {day: int(n) for n, days in re.findall(r"^#\s+(\d+): (day\w+(?: day\w+)*)$", text, re.M)
               for day in days.split()}
    assert printed == _wanted_by_presets()
    most = max(printed.values())
    full = re.findall(r"gpu:(\d+)\"? (?:runs )?every day|--gres=gpu:(\d+) slurm/run_course.sbatch +every day", text)
    assert full and {int(a or b) for a, b in full} == {most}, "the ask that runs every day at its size"


def _course_job(tmp_path: Path, *days: str, **env: str) -> list[str]:
    """run_course.sbatch DAYS with a `dlo` that records its arguments; the lines it recorded."""
    fake = tmp_path / "env"
    (fake / "bin").mkdir(parents=True)
    log = tmp_path / "dlo.log"
    (fake / "bin" / "activate").write_text(f'export PATH="{fake}/bin:{Path(sys.executable).parent}:$PATH"\n')
    (fake / "bin" / "dlo").write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    (fake / "bin" / "dlo").chmod(0o755)
    run_env = {**os.environ, "DLO_ENV": str(fake), "SLURM_JOB_ID": "7", "OUT": "out", **env}
    done = subprocess.run(["bash", "slurm/run_course.sbatch", *days], capture_output=True, text=True, cwd=REPO,
                          env=run_env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text().splitlines()


def test_weights_go_to_the_day_that_declares_them_data_to_every_day(tmp_path):
    calls = _course_job(tmp_path, "day1_optimizers", "day5_fsdp", DATA_DIR="/data", WEIGHTS_DIR="/weights")
    assert calls == [
        "run day1_optimizers --profile auto --out out/submitted/reference -p data_dir /data",
        "run day5_fsdp --profile auto --out out/submitted/reference -p data_dir /data -p weights_dir /weights",
        "grade out/submitted --out out/grading --profile auto --require-full"]
    every = _course_job(tmp_path / "all", WEIGHTS_DIR="/weights")
    declaring = [d for d, spec in DAYS.items() if "weights_dir" in spec.parameters]
    assert declaring == ["day5_fsdp", "day8_quantization_pruning"]  # Day 8: a released model's outliers
    assert every[0] == "run " + " ".join(d for d in DAYS if d not in declaring) + \
        " --profile auto --out out/submitted/reference"
    assert every[1] == ("run day5_fsdp day8_quantization_pruning --profile auto --out out/submitted/reference "
                        "-p weights_dir /weights")
    assert _course_job(tmp_path / "plain")[0] == "run --all --profile auto --out out/submitted/reference"
