"""The local half of `dlo.distributed.launch`: start N fresh worker interpreters, watch them, and
leave nothing behind (see launch.py for the design). Nothing here is public API.

How the ranks are started (forked by a zygote, or each its own interpreter) is `_ranks`; here they
are watched (output copied, heartbeats read, exit codes and result files polled) and a failure or a
timeout is turned into the one exception that names its cause.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import cloudpickle

from dlo import pickling
from dlo.distributed._ranks import JOIN_TIMEOUT, kill_groups, start_ranks


class RankError(RuntimeError):
    """A rank raised, was killed by a signal, or exited without a result."""

    def __init__(self, message, rank, exitcode=None, remote_traceback="", pids=(), port=None):
        super().__init__(message)
        self.rank, self.exitcode, self.remote_traceback = rank, exitcode, remote_traceback
        self.pids, self.port = list(pids), port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STALL = 10.0  # seconds without output or heartbeat after which a running rank counts as stuck
# After the first failure, how long to keep watching before naming a culprit: a rank killed by a
# signal takes its peers down with "connection closed" errors, and the peer's error file can land
# before the parent has polled the dead rank. Blame goes to the cause only if both are seen.
SETTLE = 1.0


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
        procs, zygote = start_ranks(world_size, port, workdir)
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
        kill_groups(procs)
        if zygote is not None:
            zygote.kill()
        for t in readers:
            t.join(timeout=5.0)
        shutil.rmtree(workdir, ignore_errors=True)
    if error is None:
        return outcome[1]
    raise error
