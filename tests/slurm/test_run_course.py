"""slurm/run_course.sbatch on one day (the toy course's) at the tiny profile, submitted with a GPU as a GPU node's
job asks for one (`--gres`): the job's executed notebook and score table are what `make run`'s two commands
give here."""

import json
import re
from pathlib import Path

import pytest

from tests.harness.conftest import DAY, dlo, toy_days

pytestmark = pytest.mark.slurm


def _outputs(notebook: Path) -> list:
    """Every code cell's source and text outputs (not timings or execution metadata)."""
    cells = json.loads(notebook.read_text())["cells"]
    return [(c["source"], [o.get("text") or o.get("data", {}).get("text/plain") for o in c.get("outputs", [])])
            for c in cells if c["cell_type"] == "code"]


def test_one_day_at_tiny_comes_out_as_from_make_run(slurm, toy_template, tmp_path):
    job_out, here = tmp_path / "job", tmp_path / "here"
    log = tmp_path / "course.out"
    env = {"DLO_ROOT": str(toy_template), "PROFILE": "tiny", "OUT": str(job_out), **toy_days(toy_template)}
    job = slurm.sbatch("--gres=gpu:1", f"--output={log}", "slurm/run_course.sbatch", DAY, env=env)
    # what `make run` does, at tiny and for this day only
    dlo("run", DAY, "--profile", "tiny", "--out", str(here / "submitted" / "reference"), root=toy_template)
    dlo("grade", str(here / "submitted"), "--out", str(here / "grading"), "--profile", "tiny", "--require-full",
        root=toy_template)
    [state] = slurm.wait(job)
    assert state["JobState"] == "COMPLETED", log.read_text()
    assert re.search(r", GPUs \d$", log.read_text(), re.M)  # SLURM gave the job a GPU (slurm/env.sh says which)

    nb = Path("submitted", "reference", DAY, f"{DAY}.ipynb")
    assert _outputs(job_out / nb) == _outputs(here / nb)
    assert "experiment 45" in str(_outputs(job_out / nb))  # the notebook ran to its last cell
    for name in ("scores.csv", "cells.csv"):
        assert (job_out / "grading" / name).read_bytes() == (here / "grading" / name).read_bytes(), name
