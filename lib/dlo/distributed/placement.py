"""Where each rank of a job runs: one rule for its rank, local rank, world size, node, CUDA device and
process-group backend, the same on every rank of the job.

Under a launcher the processes exist before any of them runs Python. torchrun gives each process
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (its node); srun gives each task of a step
SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID and SLURM_STEP_TASKS_PER_NODE, and
makes GPUs visible either per node (`--gres=gpu:N`: every task of a node sees the node's N, local rank
r takes the r-th) or per task (`--gpus-per-task=1`: each task sees only its own, as cuda:0). A backend
that each rank picks from what it alone sees differs between ranks under per-task binding (rank 0 would
take NCCL, the others gloo) and the job hangs in its first collective. `place` decides from what
describes the whole job (the most ranks on a node, the GPUs SLURM gave each node, the per-task binding),
so every rank reaches the same backend, and a job where some ranks would have a GPU and others not is
refused on every rank with one line (`PlacementError`); `agree` checks through the rendezvous store that
the ranks did agree (nodes that differ, which no rank can see alone) before any process group starts.

Pure functions of the environment and of the CUDA device count this process sees (`cuda_count()`; the
tests, and jobs of the SLURM test cluster where torch sees no CUDA, pass their own). GPUs are named as
CUDA_VISIBLE_DEVICES names them (integers, GPU-UUIDs, MIG ids): a share of the GPUs is a slice of those
entries (`visible_gpus`, `gpu_share`), never a list of logical indices, which would name other jobs' GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Placement", "PlacementError", "JobRank", "agree", "cuda_count", "from_env", "gpu_share", "launched",
           "place", "ranks", "tasks_per_node", "visible_count", "visible_gpus"]


class PlacementError(ValueError):
    """The job's ranks cannot all be placed alike; the message says why and what to ask for instead."""


@dataclass(frozen=True)
class JobRank:
    """What the launcher says about this process: its rank among `world_size`, and on its node."""

    launcher: str  # "torchrun" or "srun"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node
    node: int
    most_local: int  # the most ranks on any node of the job (an uneven srun step: "3,1")


@dataclass(frozen=True)
class Placement(JobRank):
    """A rank's place: its `JobRank`, its CUDA device (an index in this process's numbering, None on the
    CPU), that device as CUDA_VISIBLE_DEVICES names it, and the backend, the same on every rank."""

    device: int | None
    gpu: str | None
    backend: str


# ------------------------------------------------------------------------------- the launcher's ranks

def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name, "").strip()
    if not text:
        if default is None:
            raise PlacementError(f"{name} is not set, but the launcher's other variables are")
        return default
    try:
        return int(text)
    except ValueError:
        raise PlacementError(f"{name}={text!r} is not an integer") from None


def tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not found:
            raise PlacementError(f"tasks per node {text!r} is not SLURM's N(xM),... form")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts


def ranks(env: Mapping[str, str]) -> JobRank | None:
    """This process's ranks as torchrun (RANK and WORLD_SIZE set) or srun (a task of a step: SLURM_STEP_ID
    set) started it; None outside both. A job's batch script is no step: SLURM_PROCID=0 and SLURM_NTASKS
    there describe the allocation, not processes that exist."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        rank = _int(env, "RANK")
        found = JobRank("torchrun", rank, world, _int(env, "LOCAL_RANK", 0), local_world,
                      _int(env, "GROUP_RANK", rank // max(1, local_world)), local_world)
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        node = _int(env, "SLURM_NODEID", 0)
        counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
        if not counts:  # a bare environment: --ntasks-per-node, else every task on one node
            counts = [_int(env, "SLURM_NTASKS_PER_NODE", world)]
        local_world = counts[node] if node < len(counts) else max(counts)
        found = JobRank("srun", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), local_world, node,
                      max(counts))
    else:
        return None
    if not (0 <= found.rank < found.world_size and 0 <= found.local_rank < found.local_world_size):
        raise PlacementError(f"{found.launcher} says rank {found.rank} of {found.world_size}, local rank "
                             f"{found.local_rank} of {found.local_world_size}: not a rank of this job")
    return found


def launched(env: Mapping[str, str]) -> JobRank | None:
    """The ranks of a multi-process launch, where `dlo.distributed.launch` runs fn on this rank only (and
    `dlo.config` takes the job's world size); None elsewhere, a single srun task included (a JupyterHub
    server spawned with srun, `srun --pty`): there `launch` spawns its ranks locally, as on a laptop."""
    found = ranks(env)
    if found is None or (found.launcher == "srun" and found.world_size == 1):
        return None
    return found


# ------------------------------------------------------------------------------- GPUs as named

def visible_gpus(env: Mapping[str, str], count: int | None = None) -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (its first `count` entries when given: CUDA
    stops at an entry it cannot use), or "0" .. "count-1" when it is unset. SLURM's NoDevFiles: none."""
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return [str(i) for i in range(count or 0)]
    names = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "NoDevFiles"]
    return names if count is None else names[:count]


def visible_count(env: Mapping[str, str]) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES lets this process see; None when it is unset (all of the machine's)."""
    return None if env.get("CUDA_VISIBLE_DEVICES") is None else len(visible_gpus(env))


def gpu_share(gpus: list[str], slot: int, jobs: int) -> list[str]:
    """Slot `slot` of `jobs`'s share of `gpus` (names, as `visible_gpus` gives them): disjoint slices
    when there are at least as many GPUs as jobs, else one GPU each, taken in turn."""
    lo = slot * len(gpus) // jobs
    return gpus[lo:max(lo + 1, (slot + 1) * len(gpus) // jobs)]


def cuda_count() -> int:
    """The CUDA devices torch sees in this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------------------- the rule

def _node_gpus(env: Mapping[str, str], job: JobRank) -> int | None:
    """The GPUs SLURM gave the job on this node (the same on every node: --gres counts per node)."""
    if job.launcher != "srun":
        return None
    if env.get("SLURM_GPUS_ON_NODE", "").strip():
        return _int(env, "SLURM_GPUS_ON_NODE")
    listed = [g for g in env.get("SLURM_JOB_GPUS", "").split(",") if g.strip()]
    return len(listed) or None


def place(job: JobRank, env: Mapping[str, str], cuda_count: int, backend: str | None = None) -> Placement:
    """Rank `job`'s place, from job-wide facts only, so that every rank of the job reaches the same backend.

    Per-task binding (srun, each task sees fewer GPUs than SLURM gave its node, none of them shared): this
    rank's own GPU is cuda:0. Per-node visibility (torchrun, or srun with --gres): local rank r takes cuda:r,
    which every rank has when the node's GPUs are at least its most ranks on a node. backend None: NCCL
    when every rank has its GPU, gloo when none sees one; PlacementError (on every rank) when some would
    and others not, and for an NCCL backend asked for without a GPU for every rank. "gloo" puts every rank
    on the CPU."""
    node_gpus = _node_gpus(env, job)
    per_task = node_gpus is not None and 0 < cuda_count < node_gpus
    if per_task:
        every = cuda_count * job.most_local <= node_gpus
        why = (f"each of the {job.most_local} tasks of a node sees {cuda_count} of the node's {node_gpus} "
               f"GPU(s): they would share them")
    else:
        every = cuda_count >= job.most_local
        gave = f" (SLURM gave the node {node_gpus})" if node_gpus is not None else ""
        why = f"{job.most_local} rank(s) on a node, {cuda_count} GPU(s) visible to them{gave}"
    ask = ("--gres=gpu:N with N ranks per node, or --gpus-per-task=1" if job.launcher == "srun"
           else "torchrun --nproc_per_node=<GPUs per node>")
    fix = f"give every rank its own GPU ({ask}), or pass backend='gloo' for CPU ranks"
    if backend is None:
        if cuda_count and not every:
            raise PlacementError(f"{why}: some ranks would have a GPU and others not (a backend picked per rank "
                                 f"hangs the job); {fix}")
        backend = "nccl" if cuda_count else "gloo"
    elif "nccl" in backend and not (cuda_count and every):
        raise PlacementError(f"backend {backend!r} needs a GPU for every rank, but {why}; {fix}")
    device = (0 if per_task else job.local_rank) if "nccl" in backend else None
    names = visible_gpus(env, cuda_count)
    gpu = None if device is None else names[device] if device < len(names) else str(device)
    return Placement(**vars(job), device=device, gpu=gpu, backend=backend)


def from_env(env: Mapping[str, str], cuda_count: int, backend: str | None = None) -> Placement | None:
    """`place` of this process under torchrun or srun (a single srun task included); None outside both."""
    job = ranks(env)
    return None if job is None else place(job, env, cuda_count, backend)


def agree(store, job: JobRank, decide: Callable[[], Placement]) -> Placement:
    """`decide()` on every rank, then each rank's outcome through `store` (the rendezvous store: set, get,
    wait) before any process group exists: a rank that could not be placed fails every rank with its
    reason, and ranks that reached different backends (nodes that differ, which no rank sees alone) fail
    with who took which, instead of hanging in the first collective."""
    try:
        mine = decide()
        verdict = mine.backend
    except PlacementError as exc:
        mine, verdict = None, f"!{exc}"
    store.set(f"dlo/placement/{job.rank}", verdict)
    seen = [store.get(f"dlo/placement/{r}").decode() for r in range(job.world_size)]
    store.set(f"dlo/placement/read/{job.rank}", "1")
    if job.rank == 0:  # rank 0 hosts the store: it stays until every rank has read it
        store.wait([f"dlo/placement/read/{r}" for r in range(job.world_size)])
    failed = [(r, v[1:]) for r, v in enumerate(seen) if v.startswith("!")]
    if failed:
        r, why = failed[0]
        raise PlacementError(why if r == job.rank else f"rank {r} cannot be placed: {why}")
    if len(set(seen)) > 1:
        took = "; ".join(f"{b}: ranks {', '.join(str(r) for r, v in enumerate(seen) if v == b)}"
                         for b in sorted(set(seen)))
        raise PlacementError(f"the ranks reached different backends ({took}): their nodes see different GPUs; "
                             "give every node the same GPUs, or pass backend='gloo' for CPU ranks")
    return mine
