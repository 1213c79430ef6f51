"""The rank side of `dlo.distributed`: what a running rank asks about itself (`rank`, `world_size`,
`rank_device`, `is_main`), says while it works (`heartbeat`), and how it joins its job's process group
(`init_from_env`) and returns its result (`dumps`). Both the launcher (`dlo.distributed.launch`) and each
rank it starts (`dlo.distributed._worker`) import it; it imports neither, so the launcher sits above its
workers. `dlo.distributed` exports the public names.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed as dist

from dlo import pickling
from dlo.distributed import placement

__all__ = ["dumps", "heartbeat", "init_from_env", "is_main", "rank", "rank_device", "world_size"]

# ---------------------------------------------------------------------------------- small helpers

def rank() -> int:
    """This process's rank, 0 when no process group is initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks, 1 when no process group is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_device() -> torch.device:
    """This rank's device: its current GPU under NCCL (which binds each rank to one GPU), else the CPU
    (gloo, or no process group)."""
    if dist.is_available() and dist.is_initialized() and "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def heartbeat(text: str) -> None:
    """Say what this rank is doing or waiting on ("recv activation of micro-batch 3 from rank 0").

    Under `launch`, a timeout names each unfinished rank with its last heartbeat and how long ago
    it came, and tells a rank that is still making progress from one stuck in a collective.
    Cheap (one small file write); a no-op outside `launch`."""
    path = os.environ.get("DLO_HEARTBEAT_FILE")
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def is_main() -> bool:
    """True on rank 0 (and when not distributed): the rank that logs, saves and prints."""
    return rank() == 0


def dumps(obj) -> bytes:
    """cloudpickle `obj` (with its code's file names and source lines: `dlo.pickling`), moving CUDA
    tensors to CPU so any process can load the result."""
    buf = io.BytesIO()
    _CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _rebuild(t):
    return t


class _CpuPickler(pickling.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            cpu = obj.detach().cpu()  # detach: torch refuses to pickle non-leaf tensors
            if isinstance(obj, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
            return _rebuild, (cpu,)
        return super().reducer_override(obj)


# ----------------------------------------------------------------- torchrun / srun (no spawning)

def init_from_env(backend=None) -> torch.device:
    """Initialise the default process group from torchrun's or srun's environment (an srun task alone
    included); the device this rank should use. Does nothing when a process group already exists.

    Rank, device and backend come from one rule for every rank of the job (`placement.place`): backend
    None is NCCL when every rank has its own GPU (per node: local rank r takes cuda:r; per task, as
    `--gpus-per-task=1` binds them: cuda:0), gloo when none has one, and refused on every rank when only
    some would (PlacementError, one line). The ranks compare their outcome through the rendezvous store
    before the group starts (`placement.agree`), so a job never hangs on backends that differ.
    """
    if dist.is_initialized():
        return rank_device()
    job = placement.ranks(os.environ)
    if job is None:
        raise RuntimeError("init_from_env: neither RANK/WORLD_SIZE (torchrun) nor SLURM_PROCID/SLURM_STEP_ID "
                           "(an srun task) is set; start the script with torchrun or srun, or call launch(fn, n) "
                           "to spawn n local ranks")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {' and '.join(missing)} not set. Under srun the sbatch script must "
                           "export them, e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | "
                           "head -n 1) and MASTER_PORT=29500")
    store, _, _ = next(dist.rendezvous("env://", job.rank, job.world_size))  # the store init_method would make
    where = placement.agree(store, job, lambda: placement.place(job, os.environ, placement.cuda_count(), backend))
    if where.device is not None:
        torch.cuda.set_device(where.device)  # before init: NCCL binds each rank to its own GPU
    dist.init_process_group(where.backend, store=store, rank=job.rank, world_size=job.world_size)
    return rank_device()  # cuda:device under NCCL (set_device above), else the CPU
