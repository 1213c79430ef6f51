"""The placement rule on a real two-node SLURM with GRES gpu (slurm/testing/cluster.sh: 4 GPUs a node as SLURM
sees them): a 2-node x 2-task job checks what each rank resolves (rank, local rank, node, device, GPU,
backend, world size) with one GPU per task (`--gpus-per-task=1`: each task sees only its own), with GPUs per
node (`--gres=gpu:2`: local rank r takes the r-th), and with too few GPUs for the tasks of a node
(`--gres=gpu:1`: every rank fails with the same line); and launch_slurm's ranks run under it."""

import json
import os

import pytest
import torch.distributed as dist

from dlo.distributed.placement import from_env, visible_count
from dlo.distributed.slurm import launch_slurm

pytestmark = pytest.mark.slurm
TWO_BY_TWO = ("--nodes=2", "--ntasks-per-node=2")


def _submit(slurm, tmp_path, name: str, *gpus: str) -> tuple[str, object]:
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / f"{name}.sh"
    script.write_text(f"#!/bin/bash\nset -euo pipefail\nsource slurm/env.sh\nsrun python tests/slurm/where.py {out}\n")
    return slurm.sbatch(*TWO_BY_TWO, *gpus, f"--output={tmp_path}/{name}.out", str(script)), out


def _ranks(slurm, tmp_path, job: str, out) -> list[dict]:
    [state] = slurm.wait(job)
    assert state["JobState"] == "COMPLETED", (tmp_path / f"{out.name}.out").read_text()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]


def _fields(rank: dict) -> tuple:
    return (rank["rank"], rank["local_rank"], rank["node"], rank["host"], rank["device"], rank["gpu"],
            rank["backend"], rank["world_size"])


def test_a_two_by_two_job_places_every_rank_alike(slurm, tmp_path):
    jobs = {"task": _submit(slurm, tmp_path, "task", "--gpus-per-task=1"),
            "node": _submit(slurm, tmp_path, "node", "--gres=gpu:2"),
            "short": _submit(slurm, tmp_path, "short", "--gres=gpu:1")}
    per_task = _ranks(slurm, tmp_path, *jobs["task"])
    assert [r["cuda_visible_devices"] for r in per_task] == ["0", "1", "0", "1"]  # SLURM bound one GPU per task
    assert [_fields(r) for r in per_task] == [
        (0, 0, 0, "n1", 0, "0", "nccl", 4), (1, 1, 0, "n1", 0, "1", "nccl", 4),
        (2, 0, 1, "n2", 0, "0", "nccl", 4), (3, 1, 1, "n2", 0, "1", "nccl", 4)]
    per_node = _ranks(slurm, tmp_path, *jobs["node"])
    assert {r["cuda_visible_devices"] for r in per_node} == {"0,1"}  # every task sees its node's two
    assert [_fields(r) for r in per_node] == [
        (0, 0, 0, "n1", 0, "0", "nccl", 4), (1, 1, 0, "n1", 1, "1", "nccl", 4),
        (2, 0, 1, "n2", 0, "0", "nccl", 4), (3, 1, 1, "n2", 1, "1", "nccl", 4)]
    short = _ranks(slurm, tmp_path, *jobs["short"])
    errors = {r.get("error") for r in short}
    assert len(errors) == 1 and "some ranks would have a GPU and others not" in errors.pop()


def _where():
    found = from_env(os.environ, visible_count(os.environ) or 0, "gloo")  # torch sees no CUDA: gloo ranks
    return dist.get_rank(), dist.get_backend(), found.rank, found.local_rank, found.node, \
        os.environ["CUDA_VISIBLE_DEVICES"]


def test_launch_slurm_ranks_with_a_gpu_per_task(slurm, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    got = launch_slurm(_where, 2, ranks_per_node=2, sbatch=["--gpus-per-task=1"], folder=tmp_path / "job", poll=0.5)
    assert got == [(0, "gloo", 0, 0, 0, "0"), (1, "gloo", 1, 1, 0, "1"), (2, "gloo", 2, 0, 1, "0"),
                   (3, "gloo", 3, 1, 1, "1")]
