"""The local half of `dlo.distributed.launch`: start N fresh worker interpreters, watch them, and
leave nothing behind (see launch.py for the design). Nothing here is public API.

The ranks of a launch are forked by one fresh interpreter that has imported torch and dlo once
(`_worker.zygote`), rather than each importing them again: a rank's start costs a fork instead of 1 to
2 CPU seconds. The zygote has run no torch operation and never touched CUDA, so forking it is safe on GPU
nodes too; DLO_RANK_START=exec starts each rank as its own interpreter, as before (and is what happens
when the zygote cannot start the ranks).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

from dlo import pickling


class RankError(RuntimeError):
    """A rank raised, was killed by a signal, or exited without a result."""

    def __init__(self, message, rank, exitcode=None, remote_traceback="", pids=(), port=None):
        super().__init__(message)
        self.rank, self.exitcode, self.remote_traceback = rank, exitcode, remote_traceback
        self.pids, self.port = list(pids), port


JOIN_TIMEOUT = 60.0  # seconds the ranks get to start and rendezvous, whatever `timeout` says


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STALL = 10.0  # seconds without output or heartbeat after which a running rank counts as stuck
# After the first failure, how long to keep watching before naming a culprit: a rank killed by a
# signal takes its peers down with "connection closed" errors, and the peer's error file can land
# before the parent has polled the dead rank. Blame goes to the cause only if both are seen.
SETTLE = 1.0


def _worker_env(r, world_size, port, workdir):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
               WORLD_SIZE=str(world_size), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world_size),
               PYTHONUNBUFFERED="1", DLO_HEARTBEAT_FILE=os.path.join(workdir, f"heartbeat-{r}"))
    # N ranks that each use every core oversubscribe the CPU (torchrun does the same split).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rendezvous is local; skip hostname lookup
    return env


def _pump(pipe, prefix, tail, lock, last_output, r):
    """Copy a worker pipe line by line to sys.stdout (what Jupyter shows), keeping a short tail and
    the time of the rank's last line."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        tail.append(line)
        last_output[r] = time.monotonic()
        with lock:
            sys.stdout.write(f"{prefix}{line}\n")
            sys.stdout.flush()
    pipe.close()


def _kill(procs):
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the whole session: the rank and anything it started
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone (and its id may have been reused)
    for p in procs:
        p.wait()


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return cloudpickle.load(f)


def _watch(procs, workdir, timeout):
    """Poll the ranks until all succeed, one fails, or time runs out; returns an outcome tuple.

    The clock starts twice: first for all ranks to join the process group (interpreter start,
    torch import, rendezvous; at least JOIN_TIMEOUT seconds, as a cold torch import on a busy node
    can be slow), then `timeout` for fn itself.
    """
    n = len(procs)
    outcome, ready, joined = [None] * n, [False] * n, False
    start, first_failure = time.monotonic(), None
    while True:
        failed = []
        # exit codes first: a rank that has exited wrote its result file before, so the two agree
        codes = [p.poll() for p in procs]
        for r, code in enumerate(codes):
            ready[r] = ready[r] or os.path.exists(os.path.join(workdir, f"ready-{r}"))
            if outcome[r] is None:
                outcome[r] = _load(os.path.join(workdir, f"result-{r}.pkl"))
            if outcome[r] is not None and outcome[r][0] == "error":
                failed.append((1, outcome[r][2], r, code, outcome[r][1]))
            elif code is not None and outcome[r] is None:
                failed.append((0, time.time(), r, code, None))
            elif code is not None and code != 0:  # fn returned, the final barrier failed
                failed.append((2, time.time(), r, code, None))
        if all(o is not None and o[0] == "ok" for o in outcome):
            # Every fn returned and its result is on disk: that is the answer. A rank that then
            # aborts in interpreter teardown (gloo threads: "terminate called without an active
            # exception") must not turn a finished run into a failure.
            return ("ok", [o[1] for o in outcome])
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if failed and (time.monotonic() - first_failure >= SETTLE or None not in codes):
            # Blame the cause, not the ranks that then lost their peers: a rank dead without a
            # word (signal, os._exit) first, then the earliest exception, then the final barrier.
            prio, _, r, code, remote_tb = min(failed)
            return ("failed", prio, r, code, remote_tb)
        if all(ready) and not joined:
            start, joined = time.monotonic(), True
        elapsed = time.monotonic() - start
        if elapsed > (timeout if joined else max(timeout, JOIN_TIMEOUT)):
            finished = [r for r in range(n) if outcome[r] is not None]
            joined_ranks = [r for r in range(n) if ready[r]]
            return ("timeout", joined, finished if joined else joined_ranks, elapsed)
        time.sleep(0.05)


def _heartbeat(workdir, r):
    """(text, monotonic time) of rank r's last `heartbeat(...)`, or None."""
    path = os.path.join(workdir, f"heartbeat-{r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return None
    return text, time.monotonic() - age


def _rank_state(r, workdir, last_output, tails):
    """What a running rank last said (heartbeat, else its last output line) and how long ago it was
    active (the newer of the two), as a phrase for the timeout message; and that age in seconds."""
    beat = _heartbeat(workdir, r)
    times = [t for t in (last_output.get(r), beat[1] if beat else None) if t is not None]
    age = time.monotonic() - max(times) if times else math.inf
    said = f"its last heartbeat: {beat[0]!r}" if beat else (
        f"its last output: {tails[r][-1]!r}" if tails[r] else "no output and no heartbeat")
    return f"rank {r} ({said}; last active {age:.1f} s ago)", age


def _error(outcome, tails, pids, port, timeout, workdir=None, last_output=None):
    """Turn a non-ok outcome from `_watch` into the exception the caller sees."""
    if outcome[0] == "timeout":
        _, joined, good, elapsed = outcome
        others = [r for r in range(len(pids)) if r not in good]
        if joined:
            states = [_rank_state(r, workdir, last_output or {}, tails) for r in others]
            detail = "; ".join(s for s, _ in states)
            stall = min(STALL, timeout / 2)  # a short timeout: judge activity on a shorter window
            if states and min(age for _, age in states) < stall:
                why = ("they are still making progress: the work needs longer than the timeout "
                       "(raise `timeout=`)")
            else:
                why = f"no rank was active for {stall:.3g} s or more: a collective mismatch or deadlock?"
            msg = (f"ranks {others} still running after {elapsed:.1f} s (timeout={timeout}; ranks {good} "
                   f"finished): {why}. {detail}")
        else:
            msg = (f"ranks {others} had not joined the process group after {elapsed:.1f} s (joined: {good}): "
                   f"stuck at import, or the rendezvous on 127.0.0.1:{port} is blocked?")
        err = TimeoutError(msg)
        err.ranks, err.pids, err.port = others, list(pids), port
        return err
    _, prio, r, code, remote_tb = outcome
    if remote_tb is not None:
        msg = f"rank {r} raised an exception; its traceback:\n{remote_tb}"
    else:
        how = (f"was killed by signal {signal.Signals(-code).name} (exit code {code})" if code < 0
               else f"returned, then failed in the final barrier (exit code {code})" if prio == 2
               else f"exited with code {code} without returning a result")
        last = "\n".join(tails[r]) or "(no output)"
        msg = f"rank {r} {how}; its last output lines:\n{last}"
    return RankError(msg, r, exitcode=code, remote_traceback=remote_tb or "", pids=pids, port=port)


RANK_START_ENV = "DLO_RANK_START"
# What the ranks would import after unpickling their function (the checks' workers pull in every day's
# checks, DTensor and with it torch._dynamo: ~2 CPU seconds a rank): imported by the zygote instead, once,
# when the launching process has imported them itself (a sealed kernel's placeholder for dlo.checks is not).
PRELOAD = ("torch.distributed.tensor", "torch._dynamo", "dlo.checks")


class _Zygote:
    """The process that forks a launch's ranks (`_worker.zygote`), and what it reports of them."""

    def __init__(self, world_size, port, workdir):
        envs = [_worker_env(r, world_size, port, workdir) for r in range(world_size)]
        preload = [m for m in PRELOAD if getattr(sys.modules.get(m), "__file__", None)]
        with open(os.path.join(workdir, "ranks.pkl"), "wb") as f:
            pickle.dump((envs, preload), f)
        pipes = [os.pipe() for _ in range(2 * world_size)]
        writes = [w for _, w in pipes]
        self.reads, self.world_size, self.handed = [r for r, _ in pipes], world_size, False
        try:
            # -P (here and for each rank below): the working directory is not put on sys.path, so a module
            # planted there (by code run earlier in that folder, e.g. a graded student's) cannot run before
            # the worker takes its shard
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
        return [_Forked(self, r, self.pids[r], self.reads[2 * r], self.reads[2 * r + 1])
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
        _kill([self.proc])


class _Forked:
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


def _start(world_size, port, workdir) -> tuple[list, _Zygote | None]:
    """The ranks, forked by a zygote (and the zygote), else each a fresh interpreter (and None)."""
    if os.environ.get(RANK_START_ENV) != "exec":
        zygote = _Zygote(world_size, port, workdir)
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
                                          env=_worker_env(r, world_size, port, workdir), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    except BaseException:
        _kill(procs)
        raise
    return procs, None


def spawn(fn, world_size, backend, timeout, args, kwargs) -> list:
    """Run fn on world_size fresh `dlo.distributed._worker` processes; their results by rank."""
    workdir = tempfile.mkdtemp(prefix="dlo-launch-")
    with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
        # sys.path travels as plain pickle: the worker needs it before it can unpickle fn
        pickle.dump((list(sys.path), backend, pickling.dumps((fn, args, kwargs))), f)
    port, procs, zygote, readers, lock = _free_port(), [], None, [], threading.Lock()
    tails = [collections.deque(maxlen=20) for _ in range(world_size)]
    last_output: dict[int, float] = {}
    try:
        procs, zygote = _start(world_size, port, workdir)
        for r, p in enumerate(procs):
            for pipe in (p.stdout, p.stderr):
                t = threading.Thread(target=_pump, args=(pipe, f"[rank {r}] ", tails[r], lock, last_output, r),
                                     daemon=True)
                t.start()
                readers.append(t)
        outcome = _watch(procs, workdir, timeout)
        # read the heartbeats before the ranks die and the folder goes
        error = None if outcome[0] == "ok" else _error(outcome, tails, [p.pid for p in procs], port, timeout,
                                                        workdir, last_output)
    finally:  # success, failure, timeout or KeyboardInterrupt: leave no rank behind
        _kill(procs)
        if zygote is not None:
            zygote.kill()
        for t in readers:
            t.join(timeout=5.0)
        shutil.rmtree(workdir, ignore_errors=True)
    if error is None:
        return outcome[1]
    raise error
