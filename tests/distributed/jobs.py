"""The environments launchers give their processes, as SLURM 22.05 sets them on the test cluster
(slurm/testing/cluster.sh) and torchrun does, and a rendezvous store for ranks played by threads."""

from __future__ import annotations

import threading


def srun_task(rank: int, nodes: int, per_node: int, visible: str, node_gpus: int | None, **more) -> dict:
    """One task of `srun -N nodes --ntasks-per-node per_node` as SLURM sets it (block distribution)."""
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
           "SLURM_NODEID": str(rank // per_node), "SLURM_NTASKS": str(nodes * per_node),
           "SLURM_STEP_NUM_TASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
           "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
           "CUDA_VISIBLE_DEVICES": visible, **more}
    if node_gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(node_gpus)
    return env


def torchrun_rank(rank: int, nodes: int, per_node: int, **more) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per_node), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), **more}


class FakeStore:
    """The rendezvous store's set/get/wait, shared by threads standing in for the ranks."""

    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, timeout=10), key
            return self.data[key]

    def wait(self, keys):
        for key in keys:
            self.get(key)
