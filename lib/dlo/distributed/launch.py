"""Run a function on N ranks from a notebook cell: `launch(fn, world_size, *args, **kwargs)`.

Design. A notebook is one long-lived process that has already imported torch, started its thread
pools and maybe touched CUDA, so forking it is unsafe (a forked CUDA context is dead, forked
thread pools can deadlock). Each rank is therefore forked from a fresh interpreter that has only
imported torch and dlo (a zygote, `dlo.distributed._worker`: forked for each launch by a fork server
that the first launch starts, so the import is paid once per process, not per launch or per rank; with
DLO_RANK_START=zygote a fresh zygote per launch), or is one itself with DLO_RANK_START=exec. A
fresh interpreter cannot import a function that lives in the notebook's `__main__`, which is why the
usual `multiprocessing.spawn` route fails for notebook-defined functions; cloudpickle instead
serialises such functions (and closures, lambdas, classes from `__main__`) by value. The payload
goes through a temp file, together with the parent's `sys.path`, so functions from the student's own
modules resolve in the workers too.

Rendezvous is PyTorch's env:// method on 127.0.0.1 with a port the parent finds free by binding
port 0. Every rank writes a result file (its pickled return value, or its traceback text) and the
parent polls the processes: a rank that reports an exception, dies from a signal or exits without
a result is a failure, and all rank process groups are killed at once (each worker runs in its own
session, so `os.killpg` also takes its children), because the surviving ranks would otherwise wait
forever in their next collective. The same cleanup runs for a timeout and for KeyboardInterrupt.

Under torchrun or srun the processes already exist: `launch` then only initialises the process
group from the environment, runs `fn` on this rank and all-gathers the results, so the same cell
code scales from a laptop to several nodes.
"""

from __future__ import annotations

import atexit
import math
import os

import cloudpickle
import torch.distributed as dist

from dlo.config import pick_backend
from dlo.distributed import _forkserver, _ranks, placement
from dlo.distributed._spawn import RankError, spawn
from dlo.distributed.current import dumps, init_from_env

__all__ = ["RankError", "disown_fork_server", "launch", "start_fork_server"]

def _run_here(fn, world_size, backend, args, kwargs):
    """fn on this rank of a torchrun/srun job; every rank returns the gathered results."""
    if dist.is_initialized() and backend is not None and dist.get_backend() != backend:
        # the job's one default group stays what the first launch made: fn would run on it regardless
        # (CPU tensors on NCCL fail deep inside a collective): refused here, before fn starts
        raise ValueError(f"launch(..., backend={backend!r}): this job's process group is already "
                         f"{dist.get_backend()!r} (made by an earlier launch) and a job has one; launch with "
                         f"backend={dist.get_backend()!r} or None, or run this part in a job of its own")
    owned = not dist.is_initialized()
    init_from_env(backend)
    blob = dumps(fn(*args, **kwargs))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, blob)  # bytes: the CPU move already happened in dumps
    if owned:  # keep the group for the rest of the script (is_main() etc.), but close it at exit:
        atexit.register(_destroy)  # one left open can abort the interpreter ("terminate called...")
    return [cloudpickle.loads(b) for b in gathered]


def _destroy():
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------- the entry point (spawning: _spawn.py, _ranks.py)

def start_fork_server(fork: bool = False, preload_all: bool = False) -> int | None:
    """Start the process that forks this process's later launches (torch imported once, not per launch;
    `launch` starts it at its first call otherwise); its pid, None when ranks start another way
    (DLO_RANK_START=zygote: a fresh interpreter forks each launch's ranks; exec: each rank its own).
    `fork`: the server is a fork of this process, at no import cost, which is safe only while this
    process has run no torch operation, started no thread and touched no CUDA (else a fresh interpreter
    is started). `preload_all`: the rest of `_ranks.PRELOAD` (DTensor, torch._dynamo,
    torch.distributed.optim, dlo.checks) is imported by the server at its first launch (a fixed list: no
    request names it) when this process has not imported it: each launch's zygote imported DTensor
    (0.5 CPU s) and each rank torch._dynamo at the first torch function that turns it off (an
    optimizer's step, an op under the checks' dispatch modes: 0.4), measured on Day 7. The grader's
    runner forks it right after its imports, before any student code runs, and spares it between
    checks."""
    return _ranks.start_fork_server(fork, preload_all)


def disown_fork_server() -> None:
    """This process gives up its fork server (`_forkserver.disown`): a process about to run code that must not
    start ranks without the grader's blocks (the grader's session child, once a student's object loads)."""
    _forkserver.disown()


def launch(fn, world_size, *args, backend=None, timeout=300.0, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks with torch.distributed ready; return the
    per-rank return values as a list indexed by rank.

    Locally this spawns `world_size` fresh processes (backend None: "nccl" when there is a GPU per
    rank, else "gloo"). Under torchrun/srun (more than one task: a single srun task, such as a Jupyter
    server, spawns locally) it runs fn on this rank only, placed by `init_from_env`'s rule, and every rank
    gets the gathered list. Raises RankError when a rank fails, TimeoutError when fn runs longer than
    `timeout` seconds (None: no limit).
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    job = placement.launched(os.environ)
    if job is not None:
        if job.world_size != world_size:
            raise ValueError(f"launch(fn, {world_size}) but {job.launcher} started {job.world_size} processes "
                             f"(WORLD_SIZE/SLURM_NTASKS={job.world_size}); make them agree")
        return _run_here(fn, world_size, backend, args, kwargs)
    timeout = math.inf if timeout is None else float(timeout)
    return spawn(fn, world_size, pick_backend(world_size, backend), timeout, args, kwargs)

