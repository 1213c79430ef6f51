"""The nbgrader process's warm start: its imports paid once per `dlo grade`, not once per submission.

Each submission is graded by `python -m dlo.harness.nbgrader_cli ROOT DB DAY STUDENT` (autograde and
feedback, the trusted checks). Of its 5 to 9 CPU seconds, 3 or so went to starting Python and importing
nbgrader (its server extensions), SQLAlchemy, torch and the checks. `GRADER` (a `WarmStart`) starts one
*warm* process on first use (`python -m dlo.harness.nbgrader_cli --warm FD`, `serve` below) that imports
them once, runs nothing, and forks a child per request that becomes today's process: its own session,
the request's stdout and stderr (pipes passed as descriptors), folder, environment and argv, a secret of
its own (`dlo.grading.api.new_secret`, `_fresh_state`), then `nbgrader_cli`'s entry point and a normal
interpreter exit (atexit handlers run as they did).

The warm process only imports: a request is parsed by the forked child, never by it, and no student
file is ever opened there (nbgrader's gradebook is opened in the child). It is fork-safe by check, not
by hope: after its imports it must be single-threaded (/proc/self/task), else it refuses to serve and
grading falls back to exec. numpy's OpenBLAS would start a thread server at import, so the warm process
starts with OPENBLAS_NUM_THREADS=1 (numpy's BLAS in the grading process is single-threaded; torch's is
its own, its thread count set in each child); torch's pools start at a first parallel operation, which
it never runs; CUDA is never touched.

The reply: "pid N" then "exit CODE" (Popen's returncode: -SIGNAL when killed) on a pipe sent with the
request, written by the warm process, which reaps the child (the pool cannot waitpid a process it did
not start); a report that ends with no exit (the warm process died) reads as SIGKILL, which the pool
retries once. `WarmProcess` is what `nbgrader_cli.child` uses of a Popen. DLO_GRADE_START=exec (or a
warm process that cannot start, or one gone) keeps today's path: a fresh interpreter per submission.

Why not one fork server shared with `dlo.distributed._forkserver`: what the two would share is the
socketpair, send_fds and the "ready" line (some 25 lines); the rest differs. The ranks' server forks
zygotes that write their own report (their pid, then their ranks'), ignores SIGCHLD, is started inside
the jail's runner, made undumpable and spared between checks; this one passes stdout/stderr, an
environment and argv, and reaps and reports each child's exit status. A generic module between them
would make both harder to follow. One file (~310 lines): both ends of one protocol, read together.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

START_ENV = "DLO_GRADE_START"  # "warm" (default) or "exec": a fresh interpreter per submission
START_TIMEOUT = 120.0  # seconds for the warm process's imports on a loaded machine
# what every per-submission process imports (the checks' references and the sandbox's trusted side)
# (torch._dynamo: torch imports it at the first optimizer a process makes, 1.4 CPU s, which a check's
# reference makes in every submission otherwise)
PRELOAD = ("sqlalchemy", "alembic.script", "nbgrader.apps.api", "nbgrader.converters", "nbgrader.preprocessors",
           "nbconvert.exporters", "jupyter_client.manager", "torch", "torch._dynamo", "dlo.harness.execute",
           "dlo.grading.trusted", "dlo.grading.remote", "dlo.checks", "dlo.harness.feedback_html")

COMMAND = [sys.executable, "-m", "dlo.harness.nbgrader_cli", "--warm"]  # + the socket's fd


def enabled() -> bool:
    return os.environ.get(START_ENV, "warm") != "exec" and hasattr(socket, "send_fds") and hasattr(os, "pidfd_open")


# ----------------------------------------------------------------------------- the pool's side

class WarmStart:
    """A warm process, started on first use (`command` + the socket's fd); `spawn` forks a child of it."""

    def __init__(self, command: list[str]):
        self.command, self.proc, self.failed = command, None, False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def start(self, env: dict) -> subprocess.Popen | None:
        """The warm process (started now with `env` if need be), None when there is none (or it was stopped)."""
        with self._lock:
            if self.proc is None and not self.failed and enabled():
                self._start(env)
            return None if self._sock is None else self.proc

    def _start(self, env: dict) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([*self.command, str(theirs.fileno())], env={**env, "OPENBLAS_NUM_THREADS": "1"},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError:
            ours.close()
            self.failed = True
            return
        finally:
            theirs.close()
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        if not ready or proc.stdout.readline() != b"ready\n":  # refused (threads), an import failed, too slow
            proc.kill()
            proc.wait()
            ours.close()
            self.failed = True
            return
        self.proc, self._sock = proc, ours

    def spawn(self, argv: list[str], cwd, base: dict, env: dict) -> WarmProcess | None:
        """The command's child with `argv` in `cwd` with `env`, forked from the warm process (started with
        `base` on first use); None when there is none: then start a fresh interpreter."""
        if self.start(base) is None:
            return None
        out, err, report = os.pipe(), os.pipe(), os.pipe()
        try:
            msg = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()
            with self._lock:
                socket.send_fds(self._sock, [msg], [report[1], out[1], err[1]])
        except OSError:  # the warm process is gone (killed): every later child starts a fresh interpreter
            for fd in (*out, *err, *report):
                os.close(fd)
            self.failed = True
            return None
        for fd in (out[1], err[1], report[1]):
            os.close(fd)
        first = _readline(report[0]).split()
        if len(first) != 2 or first[0] != b"pid":
            for fd in (out[0], err[0], report[0]):
                os.close(fd)
            return None
        return WarmProcess(argv, int(first[1]), out[0], err[0], report[0])

    def stop(self) -> None:
        """Tell the warm process to end (it reads the socket's end and exits), without waiting for it: what
        this process does next overlaps its exit; no child is forked from it any more."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self.failed = True  # a later spawn execs a fresh interpreter

    def close(self) -> None:
        """End the warm process and wait for it; its running children live on."""
        self.stop()
        with self._lock:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.proc.stdout.close()


GRADER = WarmStart(COMMAND)  # this process's: `nbgrader_cli.child(..., warm=True)` forks from it


def _readline(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


class WarmProcess:
    """What `nbgrader_cli.child` uses of a Popen: pid, returncode, communicate(timeout) (text), poll()."""

    def __init__(self, args, pid: int, out: int, err: int, report: int):
        self.args, self.pid, self.returncode = args, pid, None
        self._read: dict[int, list[bytes]] = {out: [], err: [], report: []}  # everything read so far
        self._open, self._out, self._err, self._report = {out, err, report}, out, err, report

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to their end and the exit status from the report, within `timeout`
        (subprocess.TimeoutExpired; called again, it goes on where it stopped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            ready, _, _ = select.select(sorted(self._open), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                self._read[fd].append(chunk)
                if not chunk:
                    self._open.discard(fd)
                    os.close(fd)
        self.poll()
        return tuple(b"".join(self._read[fd]).decode(errors="replace") for fd in (self._out, self._err))

    def poll(self) -> int | None:
        """The exit status, once the warm process has reported it (read by `communicate`); None before.
        The child may have ended while something it started still holds its stdout."""
        if self.returncode is None and self._report not in self._open:
            words = b"".join(self._read[self._report]).split()  # b"pid N" was read by spawn
            self.returncode = int(words[1]) if len(words) == 2 and words[0] == b"exit" else -signal.SIGKILL
        return self.returncode


# ----------------------------------------------------------------------------- the warm process

def serve(sock_fd: int, preload: tuple[str, ...] = PRELOAD) -> list[str] | None:
    """Import `preload`, then fork a child per request on `sock_fd` (JSON {"argv", "cwd", "env"}; the report,
    stdout and stderr pipes as passed descriptors) and report its pid and exit status. Returns in each
    child only, set up as a fresh process (`_become`), with its argv for nbgrader_cli; None when the pool
    closes its end, or when this process is not single-threaded after its imports (then it never serves)."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    if "dlo.harness.feedback_html" in preload:  # the feedback page's templates compiled once, for every child
        try:
            sys.modules["dlo.harness.feedback_html"].warm()
        except Exception as exc:  # each child compiles them then, as it did
            print(f"feedback templates not compiled ahead: {exc!r}", file=sys.stderr)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1 or threading.active_count() != 1:  # a fork would copy a lock some thread holds
        print(f"warm start refused: {len(threads)} threads after the imports", file=sys.stderr)
        return None
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():  # unusable in a fork
        print("warm start refused: CUDA was initialised by the imports", file=sys.stderr)
        return None
    gc.freeze()  # what was imported stays out of the children's collections: not traversed, its pages not copied
    sock = socket.socket(fileno=sock_fd)
    os.write(1, b"ready\n")
    live: dict[int, tuple[int, int]] = {}  # pidfd: (pid, report pipe) of each running child
    while True:
        ready, _, _ = select.select([sock, *live], [], [])
        for fd in ready:
            if fd is not sock:
                _reap(*live.pop(fd))
                os.close(fd)
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return None
            if len(fds) != 3:  # not a request: nothing is forked
                for passed in fds:
                    os.close(passed)
                continue
            pid = os.fork()
            if pid == 0:
                return _become(msg, *fds, sock, live)
            os.close(fds[1])
            os.close(fds[2])
            live[os.pidfd_open(pid)] = (pid, fds[0])
            _say(fds[0], f"pid {pid}")


def _reap(pid: int, report: int) -> None:
    _, status = os.waitpid(pid, 0)
    _say(report, f"exit {os.waitstatus_to_exitcode(status)}")
    os.close(report)


def _say(fd: int, line: str) -> None:
    try:
        os.write(fd, line.encode() + b"\n")
    except OSError:  # the pool stopped listening (it was stopped): the child is reaped all the same
        pass


def _become(msg: bytes, report: int, out: int, err: int, sock, live: dict) -> list[str]:
    """In the fork: nothing of the warm process's other children, a session of its own, the request's
    pipes, folder and environment, a secret of its own; the request's argv. Never returns into `serve`'s
    loop on a failure."""
    try:
        sock.close()
        for pidfd, (_, other) in live.items():
            os.close(pidfd)
            os.close(other)
        os.close(report)
        os.setsid()
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        req = json.loads(msg)
        if sys.path and sys.path[0] == os.getcwd():  # `python -m` put its folder first: the request's, as today
            sys.path[0] = str(req["cwd"])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _fresh_state()
        return [str(a) for a in req["argv"]]
    except BaseException:  # noqa: BLE001 - reported as a process that could not start
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def run_child(fn, *args) -> None:
    """In a forked child: `fn(*args)` as a script's body, its int (or SystemExit's code) the exit status,
    then the interpreter's exit (non-daemon threads joined, atexit handlers run, stdio flushed) less its
    modules torn down: that drops a reference to every object the warm process made, copying each page
    of its heap into this child (1.1 CPU s of a child's 1.2 measured)."""
    try:
        code = fn(*args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as an interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter runs at exit (CPython's, no public name)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


def _fresh_state() -> None:
    """What a fresh interpreter draws at start and a fork would share with its siblings: the grading
    secret, numpy's global generator (Python's `random` reseeds itself at fork, tempfile's names too);
    torch's thread count, which libgomp read from the warm process's environment."""
    from dlo.grading.api import new_secret

    new_secret()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


atexit.register(GRADER.close)  # the warm process ends with this one
