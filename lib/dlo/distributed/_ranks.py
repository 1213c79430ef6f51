"""How `dlo.distributed._spawn` starts a launch's ranks: forked by a zygote, or each a fresh interpreter.

The ranks of a launch are forked by one fresh interpreter that has imported torch and dlo once
(`_worker.zygote`), rather than each importing them again: a rank's start costs a fork instead of 1 to
2 CPU seconds. The zygote has run no torch operation and never touched CUDA, so forking it is safe on GPU
nodes too; DLO_RANK_START=exec starts each rank as its own interpreter, as before (and is what happens
when the zygote cannot start the ranks). The zygote is forked by the launching process's fork server
(`_forkserver`: torch imported once per process, not per launch); DLO_RANK_START=zygote starts a fresh
one per launch instead. Every rank runs in a session of its own, so that
`kill_groups` ends it with everything it started. Nothing here is public API.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

from dlo.cpus import cpu_cores
from dlo.distributed import _forkserver

JOIN_TIMEOUT = 60.0  # seconds the ranks get to start and rendezvous, whatever `timeout` says


def rank_threads(world_size: int) -> int:
    """Each rank's share of the launching process's threads: its OMP_NUM_THREADS (what a job was given,
    e.g. `dlo grade --jobs` or SLURM's cpus-per-task) or else its usable cores, split over the ranks.
    Giving every rank the whole share oversubscribes the CPU, and OpenMP's spinning workers then burn
    it: a 2-rank Day 6 check took 12.3 CPU s with 2 threads a rank on 2 cores, 3.5 with 1 (torchrun
    splits the same way)."""
    share = cpu_cores()  # the affinity mask, or this notebook's share (DLO_CORES)
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        share = min(share, int(given))
    return max(1, share // world_size)


def worker_env(r, world_size, port, workdir):
    """Rank r's environment: the torch.distributed rendezvous variables, its heartbeat file, its share of the cores."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
               WORLD_SIZE=str(world_size), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world_size),
               PYTHONUNBUFFERED="1", DLO_HEARTBEAT_FILE=os.path.join(workdir, f"heartbeat-{r}"))
    env["OMP_NUM_THREADS"] = str(rank_threads(world_size))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rendezvous is local; skip hostname lookup
    return env


def kill_groups(procs):
    """SIGKILL each process's session (the rank and anything it started), then reap the processes."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the whole session: the rank and anything it started
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone (and its id may have been reused)
    for p in procs:
        p.wait()


RANK_START_ENV = "DLO_RANK_START"
# What the ranks would import after unpickling their function (the checks' workers pull in every day's
# checks, DTensor and with it torch._dynamo: ~2 CPU seconds a rank): imported by the zygote instead, once,
# when the launching process has imported them itself (a sealed kernel's placeholder for dlo.checks is not).
# torch.distributed.optim: each rank of a ZeRO check resolves its forbidden ZeroRedundancyOptimizer (0.2 s).
PRELOAD = ("torch.distributed.tensor", "torch._dynamo", "torch.distributed.optim", "dlo.checks")
# ... and what the ranks import because the launcher has imported something else: a check's ranks run the
# grader's TorchDispatchMode (`dlo.grading.ops`), and torch wraps every mode's __torch_dispatch__ in
# _disable_dynamo, which imports torch._dynamo at the first tensor operation: 1.5 CPU s in every rank of
# every check of a notebook whose kernel has not imported torch._dynamo itself
IMPLIED = {"torch._dynamo": "dlo.checks"}


def imported_preload(implied: bool = True) -> list[str]:
    """The modules of PRELOAD this process has imported, or (`implied`) whose importer (IMPLIED) it has."""
    def have(m):
        return getattr(sys.modules.get(m), "__file__", None) is not None
    return [m for m in PRELOAD if have(m) or (implied and m in IMPLIED and have(IMPLIED[m]))]


def start_fork_server(fork: bool = False, preload_all: bool = False) -> int | None:
    """This process's fork server started now (`fork`: as a fork of this process), with what this process
    has imported of `PRELOAD` (and, with `preload_all`, the rest of it at its first launch); its pid, None
    when there is none (DLO_RANK_START=zygote or exec, or it could not start)."""
    preload = imported_preload(implied=not preload_all)  # preload_all: what is not imported yet waits for a launch
    preload += [f"+{m}" for m in PRELOAD if preload_all and m not in preload]
    if fork:
        _forkserver.fork_here(preload)
    _forkserver.start(worker_command(), preload, dict(os.environ))
    return _forkserver.pid()


class Zygote:
    """The process that forks a launch's ranks (`_worker.zygote`), and what it reports of them."""

    def __init__(self, world_size, port, workdir):
        envs = [worker_env(r, world_size, port, workdir) for r in range(world_size)]
        preload = imported_preload()
        with open(os.path.join(workdir, "ranks.pkl"), "wb") as f:
            pickle.dump((envs, preload), f)
        pipes = [os.pipe() for _ in range(2 * world_size)]
        writes = [w for _, w in pipes]
        self.reads, self.world_size, self.handed = [r for r, _ in pipes], world_size, False
        try:
            # forked by this process's fork server when there is one, else a fresh interpreter
            self.proc = _forkserver.zygote_process(worker_command(), preload, dict(os.environ), workdir, writes)
            # -P (here and for each rank below): the working directory is not put on sys.path, so a module
            # planted there (by code run earlier in that folder, e.g. a graded student's) cannot run before
            # the worker takes its shard
            if self.proc is None:
                self.proc = subprocess.Popen([*worker_command(), "--zygote", workdir,
                                              *map(str, writes)], env=envs[0], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, pass_fds=writes, start_new_session=True)
        except BaseException:
            for fd in self.reads:
                os.close(fd)
            raise
        finally:
            for fd in writes:
                os.close(fd)
        self.pids, self.codes, self.started, self.ended = {}, {}, threading.Event(), threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        with self.proc.stdout:
            for line in self.proc.stdout:
                what, r, value = line.split()
                (self.pids if what == b"start" else self.codes)[int(r)] = int(value)
                if len(self.pids) == self.world_size:
                    self.started.set()
        self.ended.set()
        self.started.set()

    def ranks(self) -> list | None:
        """The ranks as Popen-like objects, or None when the zygote did not start them all in time."""
        self.started.wait(JOIN_TIMEOUT)
        if len(self.pids) < self.world_size:
            return None
        self.handed = True  # the pipes' read ends now belong to the ranks' objects
        return [ForkedRank(self, r, self.pids[r], self.reads[2 * r], self.reads[2 * r + 1])
                for r in range(self.world_size)]

    def code(self, r):
        """Rank r's exit code (as Popen's returncode), None while it runs; the zygote gone, -SIGKILL."""
        if r in self.codes or not self.ended.is_set():
            return self.codes.get(r)
        return -signal.SIGKILL

    def kill(self):
        """The zygote; when it did not hand its ranks over, those it started and their pipes too."""
        if not self.handed:
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            for fd in self.reads:
                os.close(fd)
        kill_groups([self.proc])


class ForkedRank:
    """A rank forked by the zygote: what `spawn` uses of a Popen (pid, poll, wait, stdout, stderr)."""

    def __init__(self, zygote, r, pid, out, err):
        self.zygote, self.r, self.pid, self.returncode = zygote, r, pid, None
        self.stdout, self.stderr = os.fdopen(out, "rb"), os.fdopen(err, "rb")

    def poll(self):
        if self.returncode is None:
            self.returncode = self.zygote.code(self.r)
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode


def worker_command() -> list[str]:
    """The worker's interpreter line, the zygote's and each rank's alike (-P: see the zygote's start)."""
    return [sys.executable, "-P", "-m", "dlo.distributed._worker"]


def start_ranks(world_size, port, workdir) -> tuple[list, Zygote | None]:
    """The ranks, forked by a zygote (and the zygote), else each a fresh interpreter (and None)."""
    if os.environ.get(RANK_START_ENV) != "exec":
        zygote = Zygote(world_size, port, workdir)
        try:
            ranks = zygote.ranks()
        except BaseException:
            zygote.kill()
            raise
        if ranks is not None:
            return ranks, zygote
        zygote.kill()
    procs = []
    try:
        for r in range(world_size):
            procs.append(subprocess.Popen([*worker_command(), workdir],
                                          env=worker_env(r, world_size, port, workdir), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    except BaseException:
        kill_groups(procs)
        raise
    return procs, None
