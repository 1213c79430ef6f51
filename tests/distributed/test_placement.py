"""dlo.distributed.placement: one rule places every rank of a job (rank, local rank, node, device, backend),
the same backend on every rank, from the environments srun and torchrun give (as SLURM 22.05 sets them on the
test cluster: slurm/testing/cluster.sh) and the CUDA device count; the ranks' agreement through the store.
`init_from_env` and `dlo.config` under a launcher: test_launcher_rule.py."""

from __future__ import annotations

import threading
import types

import pytest

from dlo.distributed import placement
from dlo.distributed.placement import PlacementError, agree, from_env, launched, ranks
from tests.distributed.jobs import FakeStore, srun_task, torchrun_rank


def _all(envs, count, backend=None):
    return [from_env(e, count(e) if callable(count) else count, backend) for e in envs]


# ------------------------------------------------------------------------------- the rule, rank by rank

def test_two_nodes_one_gpu_per_task_every_rank_nccl_on_its_own_gpu():
    # srun -N2 --ntasks-per-node=2 --gpus-per-task=1: each task sees only its GPU (CUDA_VISIBLE_DEVICES=0 or 1)
    envs = [srun_task(r, 2, 2, str(r % 2), node_gpus=2, SLURM_GPUS_PER_TASK="1") for r in range(4)]
    got = _all(envs, 1)
    assert [p.backend for p in got] == ["nccl"] * 4  # the old rule: rank 0 nccl, the others gloo (a hang)
    assert [(p.rank, p.local_rank, p.node, p.world_size, p.device, p.gpu) for p in got] == [
        (0, 0, 0, 4, 0, "0"), (1, 1, 0, 4, 0, "1"), (2, 0, 1, 4, 0, "0"), (3, 1, 1, 4, 0, "1")]


def test_two_nodes_gpus_per_node_local_rank_takes_its_gpu():
    # srun -N2 --ntasks-per-node=2 --gres=gpu:2 on a job given GPUs 4 and 5 of each node
    envs = [srun_task(r, 2, 2, "4,5", node_gpus=2) for r in range(4)]
    got = _all(envs, 2)
    assert [(p.backend, p.device, p.gpu, p.local_world_size) for p in got] == [
        ("nccl", 0, "4", 2), ("nccl", 1, "5", 2), ("nccl", 0, "4", 2), ("nccl", 1, "5", 2)]


def test_a_step_with_fewer_gpus_than_its_job_counts_the_steps():
    # sbatch --gres=gpu:4, then `srun --gres=gpu:2`: SLURM_GPUS_ON_NODE is the step's 2, SLURM_JOB_GPUS the job's 4
    envs = [srun_task(r, 1, 2, "0,1", node_gpus=2, SLURM_JOB_GPUS="0,1,2,3") for r in range(2)]
    assert [(p.device, p.gpu) for p in _all(envs, 2)] == [(0, "0"), (1, "1")]  # per node, not two tasks on cuda:0


def test_torchrun_two_nodes_of_four():
    envs = [torchrun_rank(r, 2, 4) for r in range(8)]
    got = _all(envs, 4)
    assert [(p.launcher, p.node, p.device, p.backend) for p in got] == [
        ("torchrun", r // 4, r % 4, "nccl") for r in range(8)]
    assert {p.backend for p in _all(envs, 0)} == {"gloo"} and {p.device for p in _all(envs, 0)} == {None}
    assert [p.gpu for p in _all([torchrun_rank(r, 1, 2, CUDA_VISIBLE_DEVICES="GPU-a1,MIG-b2") for r in (0, 1)], 2)] \
        == ["GPU-a1", "MIG-b2"]


def test_a_one_task_jupyter_allocation_is_no_launcher():
    # the batch script of `sbatch --ntasks=4` (or a Jupyter job): SLURM_PROCID=0 and SLURM_NTASKS describe the
    # allocation, no srun step runs: `launch` spawns its ranks locally
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1"}
    assert ranks(batch) is None and launched(batch) is None and from_env(batch, 1) is None
    # a single srun task (JupyterHub's `srun batchspawner-singleuser`): a rank for init_from_env, no launcher
    alone = srun_task(0, 1, 1, "0", node_gpus=1)
    assert launched(alone) is None
    assert from_env(alone, 1) == placement.Placement("srun", 0, 1, 0, 1, 0, 1, device=0, gpu="0", backend="nccl")
    assert launched(torchrun_rank(0, 1, 1)) is not None  # torchrun with one process is still a launch


def test_some_ranks_with_a_gpu_and_others_without_fail_on_every_rank():
    # --gres=gpu:1 with 2 tasks per node: local rank 0 would have a GPU, local rank 1 not
    envs = [srun_task(r, 2, 2, "0", node_gpus=1) for r in range(4)]
    messages = set()
    for e in envs:
        with pytest.raises(PlacementError, match="some ranks would have a GPU and others not") as exc:
            from_env(e, 1)
        messages.add(str(exc.value))
    assert len(messages) == 1 and "\n" not in messages.pop()  # the same one line on every rank
    assert {p.backend for p in _all(envs, 1, "gloo")} == {"gloo"}  # CPU ranks asked for: fine
    # uneven tasks (3 on node 0, 1 on node 1) on 2 GPUs a node: the lone rank of node 1 fails too
    uneven = [dict(srun_task(r, 2, 2, "0,1", node_gpus=2), SLURM_STEP_TASKS_PER_NODE="3,1",
                   SLURM_LOCALID=str(min(r, 2) if r < 3 else 0), SLURM_NODEID=str(r // 3)) for r in range(4)]
    for e in uneven:
        with pytest.raises(PlacementError, match="3 rank"):
            from_env(e, 2)
    # per task, but tasks given overlapping GPUs (3 tasks see 1 each of a node's 2): refused
    with pytest.raises(PlacementError, match="would share them"):
        from_env(dict(srun_task(0, 1, 3, "0", node_gpus=2)), 1)


def test_nccl_asked_without_a_gpu_for_every_rank_is_refused_in_one_line():
    with pytest.raises(PlacementError, match=r"backend 'nccl' needs a GPU for every rank.*backend='gloo'"):
        from_env(torchrun_rank(1, 1, 2), 0, "nccl")
    p = from_env(srun_task(1, 1, 2, "", node_gpus=None), 0)  # a CPU job: gloo, no device
    assert (p.backend, p.device, p.gpu) == ("gloo", None, None)


def test_malformed_launcher_variables_are_named():
    with pytest.raises(PlacementError, match="WORLD_SIZE='two'"):
        ranks({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(PlacementError, match="rank 4 of 4"):
        ranks({"RANK": "4", "WORLD_SIZE": "4"})
    assert placement.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_visible_gpus_and_shares_keep_the_parents_names():
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == ["4", "5", "6", "7"]
    assert placement.visible_gpus({}, 2) == ["0", "1"] and placement.visible_count({}) is None
    assert placement.visible_count({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == 0
    gpus = ["GPU-aa", "GPU-bb", "MIG-cc"]
    assert [placement.gpu_share(gpus, s, 2) for s in (0, 1)] == [["GPU-aa"], ["GPU-bb", "MIG-cc"]]
    assert [placement.gpu_share(gpus[:1], s, 2) for s in (0, 1)] == [["GPU-aa"], ["GPU-aa"]]  # more jobs than GPUs


# ------------------------------------------------------------------------------- agreement through the store

def _agree_all(decisions):
    store, out = FakeStore(), {}
    jobs = [placement.JobRank("srun", r, len(decisions), 0, 1, r, 1) for r in range(len(decisions))]

    def rank(r):
        try:
            out[r] = agree(store, jobs[r], decisions[r])
        except PlacementError as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(decisions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return [out[r] for r in range(len(decisions))]


def _decided(backend):
    return lambda: types.SimpleNamespace(backend=backend)


def test_ranks_that_reach_different_backends_all_fail_naming_who_took_which():
    # nodes that differ (node 1's driver is broken: it sees no GPU): no rank can tell alone
    got = _agree_all([_decided("nccl"), _decided("gloo")])
    assert all(isinstance(g, PlacementError) for g in got)
    assert "gloo: ranks 1; nccl: ranks 0" in str(got[0]) and str(got[0]) == str(got[1])
    assert [g.backend for g in _agree_all([_decided("nccl")] * 3)] == ["nccl"] * 3


def test_a_rank_that_cannot_be_placed_fails_every_rank_with_its_reason():
    def refuse():
        raise PlacementError("2 rank(s) on a node, 1 GPU(s) visible to them")

    got = _agree_all([_decided("nccl"), refuse])
    assert str(got[0]) == "rank 1 cannot be placed: 2 rank(s) on a node, 1 GPU(s) visible to them"
    assert str(got[1]) == "2 rank(s) on a node, 1 GPU(s) visible to them"
