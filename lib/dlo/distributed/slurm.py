"""Run a notebook function on `nodes x ranks_per_node` ranks of a SLURM allocation, from the cell:

    from dlo.distributed.slurm import launch_slurm
    results = launch_slurm(ddp_step, nodes=2, ranks_per_node=4, sbatch=["--gres=gpu:4", "--time=0:20:00"])

The same function `dlo.distributed.launch(fn, n)` runs on local ranks: it is shipped by value (cloudpickle,
with its cell's file name and lines: `dlo.pickling`) through a folder every node sees (default
~/.dlo/slurm/<time>-<id>; the home is shared on clusters), and each srun task runs it as one rank of
`dlo.distributed._worker`, the process `launch` spawns locally. The results come back as a list indexed
by rank; a rank that raised comes back as RankError with its traceback (the student's line in it). While
it waits the cell shows the job's state (queued and why, running and where); interrupting the cell or
`timeout` cancels the job. Needs sbatch/squeue/scancel on this machine, as on a login or compute node.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import cloudpickle

from dlo import pickling
from dlo.distributed.launch import RankError

__all__ = ["RankError", "launch_slurm"]

# Each srun task is one rank, placed by the rule of every launcher (dlo.distributed.placement) from SLURM's
# own variables: rank, local rank, node, GPU (per node or per task) and backend. The store is on the first
# node's address.
JOB = """#!/bin/bash
set -euo pipefail
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
srun --kill-on-bad-exit=1 {python} -m dlo.distributed._worker {folder}
"""


def _check(fn, nodes: int, ranks_per_node: int) -> None:
    if not callable(fn):
        raise TypeError(f"launch_slurm: fn must be callable, got {type(fn).__name__}")
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"launch_slurm: {name} must be a positive int, got {value!r}")


def _submit(folder: Path, nodes: int, ranks_per_node: int, sbatch: list[str]) -> str:
    script = folder / "job.sh"
    script.write_text(JOB.format(python=sys.executable, folder=folder))
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={ranks_per_node}",
           "--job-name=dlo-launch", f"--output={folder}/job.out", *sbatch, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"launch_slurm: sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def _state(job: str) -> str | None:
    """'PENDING (Priority)', 'RUNNING n[1-2]', ...; None once the job has left the queue."""
    done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %R"], capture_output=True, text=True, timeout=60)
    line = done.stdout.strip()
    return line or None


def _wait(job: str, timeout: float, poll: float) -> None:
    """Show each change of the job's state until it leaves the queue; TimeoutError after `timeout` s."""
    start, shown = time.monotonic(), None
    while (state := _state(job)) is not None:
        if state != shown:
            print(f"job {job}: {state} ({time.monotonic() - start:.0f} s)", flush=True)
            shown = state
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"launch_slurm: job {job} still {state} after {timeout:g} s; cancelled")
        time.sleep(poll)


def _load(path: Path):
    """A rank's ("ok", value) or ("error", traceback, time), or None when it wrote none."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        return cloudpickle.load(f)


def _results(folder: Path, job: str, world_size: int) -> list:
    """Every rank's value; else the first rank that raised (its peers were then killed by srun and
    left no result: they are not the cause), else the first without a result."""
    records = [_load(folder / f"result-{r}.pkl") for r in range(world_size)]
    for r, record in enumerate(records):
        if record is not None and record[0] == "error":
            raise RankError(f"rank {r} of job {job} raised:\n{record[1]}", r, remote_traceback=record[1])
    for r, record in enumerate(records):
        if record is None:
            log = folder / "job.out"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RankError(f"rank {r} of job {job} ended without a result (killed, or the job did not start); "
                            f"{log}:\n{tail}", r)
    return [record[1] for record in records]


def launch_slurm(fn, nodes: int, *args, ranks_per_node: int = 1, sbatch: list[str] | None = None,
                 backend: str | None = None, timeout: float | None = None, folder: str | Path | None = None,
                 poll: float = 2.0, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `nodes x ranks_per_node` ranks of a new SLURM job; the per-rank return
    values as a list indexed by rank. `sbatch`: more sbatch options (partition, --gres, --time). backend
    None: NCCL when every rank has its own GPU (`--gres=gpu:N` with N = ranks_per_node, or
    `--gpus-per-task=1`), gloo when none has one, and every rank fails with the reason when only some have
    (`dlo.distributed.placement`). Raises RankError when a rank fails, TimeoutError after
    `timeout` seconds (None: no limit); both, and KeyboardInterrupt, cancel the job."""
    _check(fn, nodes, ranks_per_node)
    folder = Path(folder) if folder else Path.home() / ".dlo" / "slurm" / f"{time.strftime('%Y%m%d-%H%M%S')}-" \
                                                                          f"{uuid.uuid4().hex[:6]}"
    folder.mkdir(parents=True, exist_ok=False)
    with (folder / "payload.pkl").open("wb") as f:  # the layout dlo.distributed._worker reads
        pickle.dump((list(sys.path), backend, pickling.dumps((fn, args, kwargs))), f)
    job = _submit(folder, nodes, ranks_per_node, list(sbatch or []))
    print(f"job {job}: {nodes} node(s) x {ranks_per_node} rank(s), files in {folder}", flush=True)
    try:
        _wait(job, math.inf if timeout is None else float(timeout), poll)
    except BaseException:  # KeyboardInterrupt included: a job left running would hold the nodes
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
        print(f"job {job}: cancelled", file=sys.stderr, flush=True)
        raise
    return _results(folder, job, nodes * ranks_per_node)
