"""slurm/grade.sbatch as an array of 2 over a small class of the toy course, then the merge as an
afterok dependency job: the merged scores.csv, cells.csv and feedback are the bytes of one local `dlo grade`."""

import re
from pathlib import Path

import pytest

from tests.harness.conftest import DAY, dlo, edit_cells, toy_days

pytestmark = pytest.mark.slurm


def _class(root: Path, sub: Path) -> None:
    """blank (the release untouched), sol (the solution), vacant (no day): shard 1/2 gets blank and vacant."""
    for name, folder in (("blank", "course"), ("sol", "solutions")):
        edit_cells(root / folder / DAY / f"{DAY}.ipynb", sub / name / DAY / f"{DAY}.ipynb", lambda c: None)
    (sub / "vacant").mkdir()


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_array_of_two_then_merge_gives_the_bytes_of_one_local_grade(slurm, toy_template, tmp_path):
    sub, parts, one = tmp_path / "sub", tmp_path / "parts", tmp_path / "one"
    _class(toy_template, sub)
    env = {"DLO_ROOT": str(toy_template), "DLO_PROFILE": "tiny", **toy_days(toy_template)}
    small = ("--cpus-per-task=1", "--mem=1G", "--gres=gpu:1")  # the template's 16 cores and 64G are a real node's
    array = slurm.sbatch("--array=1-2", *small, f"--output={tmp_path}/grade-%a.out", "slurm/grade.sbatch",
                         str(sub), str(parts), "--jobs", "1", env=env)
    merge = slurm.sbatch(f"--dependency=afterok:{array}", *small, f"--output={tmp_path}/merge.out",
                         "slurm/grade.sbatch", "--merge", str(parts), env=env)
    dlo("grade", str(sub), "--out", str(one), "--jobs", "1", root=toy_template)  # meanwhile, here
    tasks = slurm.wait(array, tasks=2)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("grade-*.out")))
    assert [t["JobState"] for t in tasks] == ["COMPLETED", "COMPLETED"], logs
    assert "shard 1/2" in logs and "shard 2/2" in logs
    assert len(re.findall(r", GPUs \d$", logs, re.M)) == 2  # each task its GPU
    [state] = slurm.wait(merge)
    assert state["JobState"] == "COMPLETED", (tmp_path / "merge.out").read_text()

    for name in ("scores.csv", "cells.csv"):
        assert (parts / name).read_bytes() == (one / name).read_bytes(), name
    assert _files(parts / "feedback") == _files(one / "feedback")
    assert {p.name for p in parts.iterdir()} >= {"part-1-of-2", "part-2-of-2"}
    assert "sol," in (one / "scores.csv").read_text()  # graded, not an empty table on both sides
