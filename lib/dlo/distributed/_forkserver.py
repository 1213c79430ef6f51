"""The launching process's fork server (`_worker.fork_server`): one interpreter that imports torch and
dlo once and forks a zygote for every later launch, so that a process launching ranks many times (a
notebook's experiments, the grader's runner serving one check after another) pays the import once, not
once per launch (1 to 2 CPU seconds each; Day 7's graded checks launch 13 times).

`zygote_process(workdir)` asks it for a launch's zygote and returns a Popen-like handle of it, or None
when there is no server (DLO_RANK_START=zygote or exec, no Unix fd passing, the server gone): the
launcher then starts a zygote of its own, as before. The server ends when this process closes its end
(at exit, then waits for it: the ranks' CPU time counts in `time` of the command); a forked child (the
grader's sessions) shares it. Nothing here is public API.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

from dlo import reaper

_LOCK = threading.Lock()
_SERVER: dict = {}  # "proc", "sock": the running server; "failed": it could not start or went away
START_TIMEOUT = 60.0  # seconds for the server's imports
CLOSE_TIMEOUT = 5.0  # seconds the launcher waits at its exit for the server to end


def enabled() -> bool:
    return os.environ.get("DLO_RANK_START", "server") == "server" and hasattr(socket, "send_fds")


def start(command: list[str], preload: list[str], env: dict) -> subprocess.Popen | None:
    """Start this process's server now (the grader's runner does, before any student code can run), or
    return the one running; None when it cannot start."""
    with _LOCK:
        if "proc" in _SERVER or "failed" in _SERVER or not enabled():
            return _SERVER.get("proc")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            closed = "dumpable" if reaper.dumpable() else "undumpable"  # as closed as this process
            proc = subprocess.Popen([*command, "--server", str(theirs.fileno()), closed, *preload], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, pass_fds=[theirs.fileno()],
                                    start_new_session=True)
        except OSError:
            ours.close()
            _SERVER["failed"] = True
            return None
        finally:
            theirs.close()
        if not _ready(proc):
            proc.kill()
            proc.wait()
            ours.close()
            _SERVER["failed"] = True
            return None
        _SERVER.update(proc=proc, sock=ours)
        return proc


def _ready(proc: subprocess.Popen) -> bool:
    line, done = [], threading.Event()

    def read():
        line.append(proc.stdout.readline())
        done.set()

    threading.Thread(target=read, daemon=True).start()
    return done.wait(START_TIMEOUT) and line[0] == b"ready\n"


def fork_here(preload: list[str]) -> int | None:
    """This process's server as a fork of this process, which must have only imported (no torch
    operation, no thread, no CUDA: the grader's runner before its first session), so that the server
    costs a fork and not another interpreter's imports; it keeps stdin, stdout and stderr (stdin made
    empty) and closes every other descriptor (the runner's channels). Its pid, or None (threads running:
    not safe to fork)."""
    import threading as _threading

    from dlo.distributed import _worker

    with _LOCK:
        if "proc" in _SERVER or "failed" in _SERVER or not enabled() or _threading.active_count() > 1:
            return pid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child = os.fork()
        if child == 0:
            try:
                ours.close()
                keep = theirs.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                _worker.warm([m for m in preload if not m.startswith("+")])  # imported here already, as a rule
                theirs.send(b"ready")  # only now: the runner's descriptors are closed here
                _worker.serve_forks(theirs, preload)
            finally:
                os._exit(0)
        theirs.close()
        ours.settimeout(START_TIMEOUT)
        try:
            ready = ours.recv(16) == b"ready"
        except OSError:
            ready = False
        ours.settimeout(None)
        if not ready:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            ours.close()
            _SERVER["failed"] = True
            return None
        _SERVER.update(proc=_Child(child), sock=ours)
        return child


class _Child:
    """A server forked here: what `pid` and the tests use of a Popen."""

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.01)


def pid() -> int | None:
    """The server's pid, None when there is none (the grader's runner spares it between sessions)."""
    proc = _SERVER.get("proc")
    return proc.pid if proc is not None else None


def zygote_process(command, preload, env, workdir: str, rank_fds: list[int]) -> ServedZygote | None:
    """A zygote forked by the server for this launch (its ranks' pipes passed to it), or None."""
    if start(command, preload, env) is None:
        return None
    read, write = os.pipe()
    try:
        msg = json.dumps({"workdir": workdir, "cwd": os.getcwd()}).encode()
        with _LOCK:
            socket.send_fds(_SERVER["sock"], [msg], [write, *rank_fds])
    except OSError:  # the server is gone (killed by code it outlived, or at exit): start zygotes again
        os.close(read)
        _SERVER["failed"] = True
        return None
    finally:
        os.close(write)
    report = os.fdopen(read, "rb")
    first = report.readline().split()
    if len(first) != 2 or first[0] != b"pid":
        report.close()
        return None
    return ServedZygote(int(first[1]), report)


def disown() -> None:
    """Close this process's end of the server's socket, and start no server again, without ending the one
    running (the process this one was forked from holds its own end): where a student's code is about to run
    (the grader's session child, its stub probe) no launch is asked for again, and the server forks ranks that
    have none of the grader's blocks yet, so it must not hear from that code. A later launch here falls back to
    a fresh interpreter, which the grader's filter refuses there (`dlo.grading.noexec`)."""
    with _LOCK:
        sock = _SERVER.pop("sock", None)
        _SERVER.pop("proc", None)
        _SERVER["failed"] = True
    if sock is not None:
        sock.close()


class ServedZygote:
    """What the launcher uses of a zygote's Popen: pid, stdout (its report) and wait (until the report's
    end: the zygote is the server's child, reaped there)."""

    def __init__(self, pid: int, report):
        self.pid, self.stdout, self.returncode = pid, report, None

    def wait(self, timeout: float | None = None) -> int:
        # kill_groups has SIGKILLed its session (the server reaps it); the report ends with it, as its
        # ranks do not hold it
        self.returncode = 0
        return 0


def _close() -> None:
    sock = _SERVER.pop("sock", None)
    if sock is not None:
        sock.close()  # the server reads the end and exits
        # waited for (briefly: it only reaps its last zygotes), so that its CPU time and its ranks' reach
        # this process's getrusage(RUSAGE_CHILDREN) and `time` of the command; an orphan's is lost with it
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError, OSError):
            _SERVER["proc"].wait(timeout=CLOSE_TIMEOUT)


import atexit  # noqa: E402 - registered last: the server ends with this process

atexit.register(_close)
