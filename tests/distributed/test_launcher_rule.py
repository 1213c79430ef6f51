"""Finding 1 and 2 of issue 32: under srun or torchrun every rank takes its backend and device by one job-wide
rule (`dlo.distributed.placement`), in `init_from_env` (what `launch` and `launch_slurm`'s ranks call) and in
`dlo.config` (the job's world and GPUs, not this node's). torch.cuda and the process group are mocked: no GPU,
no rank started (the ranks of a real job: tests/slurm/test_placement_job.py)."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

from dlo.distributed import current as rank_side  # init_from_env and rank_device: the rank side of launch
from tests.distributed.jobs import FakeStore, srun_task, torchrun_rank

# ------------------------------------------------------------------------------- init_from_env follows the rule

def _init_as(monkeypatch, env: dict, gpus: int, backend=None):
    """init_from_env in `env` with `gpus` CUDA devices visible; (backend, device index) it started with."""
    for k in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK",
                                                     "CUDA_VISIBLE"))]:
        monkeypatch.delenv(k)
    for k, v in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    started, chosen = {}, []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: started.update(backend=backend))
    own = f"dlo/placement/{env.get('RANK', env.get('SLURM_PROCID'))}"

    class Agreeing(FakeStore):
        """Every other rank reached what this one did (the rule is job-wide: the tests above)."""

        def get(self, key):
            return self.data.get(key, self.data[own])

    monkeypatch.setattr(dist, "rendezvous", lambda *a, **kw: iter([(Agreeing(), 0, 0)]), raising=False)
    monkeypatch.setattr(rank_side, "rank_device", lambda: None)
    rank_side.init_from_env(backend)
    return started["backend"], (chosen[-1] if chosen else None)


def test_init_from_env_under_srun_with_a_gpu_per_task_gives_every_rank_nccl_on_cuda0(monkeypatch):
    got = [_init_as(monkeypatch, srun_task(r, 2, 2, str(r % 2), node_gpus=2), 1) for r in range(4)]
    assert got == [("nccl", 0)] * 4


def test_init_from_env_refuses_a_half_gpu_node_on_every_rank(monkeypatch):
    for r in range(2):
        with pytest.raises(ValueError, match="some ranks would have a GPU and others not"):
            _init_as(monkeypatch, srun_task(r, 1, 2, "0", node_gpus=1), 1)


# ------------------------------------------------------------------------------- dlo.config under a launcher

@pytest.fixture
def eight_rank_job(monkeypatch):
    """Rank 5 of torchrun on two 4-GPU nodes."""
    for k, v in torchrun_rank(5, 2, 4).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_resolve_world_takes_the_jobs_world_and_gpus(eight_rank_job):
    from dlo.config import resolve_world

    preset = types.SimpleNamespace(world_size=4)
    assert resolve_world(8, preset, torch.device("cuda")) == (8, "nccl")  # not refused for this node's 4 GPUs
    assert resolve_world(0, preset, torch.device("cuda")) == (8, "nccl")  # the job's 8, not the preset's 4
    assert resolve_world(0, preset, torch.device("cpu")) == (8, "gloo")
    with pytest.raises(ValueError, match="world_size=4 but torchrun started 8 ranks"):
        resolve_world(4, preset, torch.device("cuda"))


def test_pick_backend_under_a_launcher_is_the_jobs_rule(eight_rank_job, monkeypatch):
    from dlo.config import pick_backend

    assert pick_backend(8) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # 4 ranks a node on 2 GPUs
    with pytest.raises(ValueError, match="some ranks would have a GPU and others not"):
        pick_backend(8)
