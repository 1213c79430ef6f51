"""The sandboxed runner: where the student's code runs while `dlo grade` checks it.

    python -I -m dlo.grading.jail_runner     (inside bubblewrap; requests on stdin, replies on stdout, output on stderr)

It imports torch and dlo once, then serves one session per `@check` call: it forks a child
(`dlo.grading.jail_session.Session`) that first
blocks the check's forbidden references (`dlo.grading.forbid.forbidden`), then loads the student's
captured objects (cloudpickle: only here, in the sandbox) when a request first names them, and
serves requests until the check closes the session:

- `call`: a student object called with the check's inputs; the reply has the result (a handle number
  for anything that is not plain data) and the state of the arguments after the call (tensor values,
  `.grad`s, module parameters and buffers), which the trusted side copies back in place;
- `getattr`: an attribute of a student object (the same reply);
- `run`: a trusted worker (a module-level function of dlo.checks) with the student's objects among its
  arguments; plain data only comes back;
- `stub`: whether a student object is the release's untouched stub (`api.is_stub`), answered by
  a grandchild that loads the objects and exits, its descendants killed before the reply;
- `ranks`: the same worker on N ranks (`dlo.distributed.launch`: the ranks are this child's children,
  inside the sandbox too). The child holds every rank's part of the case, so it runs no student code
  for this request: the captured objects travel to the ranks unloaded and each rank loads them
  after taking its own part and sealing (`ranks.load_captures`); a session whose child has already
  run the student's code cannot start ranks.

No other process of the jail may read the runner's memory or take its descriptors (`dlo.reaper.undumpable`): the
runner forwards every request, and a session's child holds the ranks' request, every rank's part in it;
the jail's processes are all one user, who may otherwise read another's /proc/PID/mem or take its
channel with pidfd_getfd. Forks inherit this (the sessions' children, the stub probe); the ranks, started
by exec, do not, and hold their own part only.

Processes the student's code leaves behind end with the session: the runner and each session's
child are subreapers (orphans stay their descendants), and the runner kills whatever is left below
it once the session's child has exited, and waits for it (a zombie counts against the job's process limit,
`dlo.grading.limits`), before it serves the next session.

Trusted callables among the inputs (`Callback`) are called back over the channel. The parent
never runs student code: it forwards frames between the trusted side and the child, and reports the
child's end (`ended`, with its exit code) - a student function that calls os._exit or crashes fails
its own check, and the next session forks a fresh child. Output of the student's code goes to stderr,
which the grader opened on its log (outside the runner's scratch).
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys

import cloudpickle

from dlo import reaper
from dlo.grading import forbid, wire
from dlo.grading.jail_session import Session


def main(argv: list[str]) -> int:
    # before any request arrives: every rank's part passes through here (forks inherit it, exec does not)
    reaper.undumpable("the runner would be open to the ranks")
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # the student's output joins stderr: the grader's log, opened by the grader, never by name here
    import torch  # noqa: F401 - warm: every session's fork starts with torch and the checks imported

    # torch imports torch._dynamo at a process's first optimizer (1.1 CPU s): once here, not in every session
    # that makes one (Day 2's checks: ~8 CPU s a submission), nor in the ranks' fork server at its first launch
    import torch._dynamo  # noqa: F401

    import dlo.checks  # noqa: F401
    from dlo.distributed.launch import start_fork_server

    # the ranks' fork server, a fork of this process before any student code can run (it has only
    # imported: no torch operation, no thread): each check's launches fork from it, torch imported once
    # per submission and not once per launch, at no cost for a day without ranks; undumpable as this
    # process; spared between sessions, not what it forked; DTensor imported there at the first launch,
    # which each launch's zygote (0.5 CPU s) and each rank (0.4) imported otherwise (torch._dynamo: above)
    server = start_fork_server(fork=True, preload_all=True)
    gc.freeze()  # what was imported stays out of the sessions' collections: not traversed, its pages not copied
    reaper.subreaper(True)  # what a session's code leaves running stays findable, and ends with it (serve)
    wire.write_frame(proto_out, wire.encode({"kind": "ready", "pid": os.getpid()}))
    while True:
        try:
            req = cloudpickle.loads(wire.read_frame(proto_in))
        except wire.ChannelClosed:
            return 0
        if not isinstance(req, dict) or req.get("op") != "open":
            continue  # a frame for a session that has already ended
        with contextlib.suppress(Exception):  # the child reports a name it cannot resolve
            # here, once: each fork then finds the modules imported, the aliases, the code to burn and
            # the operators to refuse found (`forbid.plan`), and the grader's functions listed
            forbid.plan(tuple(req.get("forbid", ())), req.get("exercise", "check"), req.get("hint", ""))
            forbid.protected()
        serve(req, proto_in, proto_out, server)


def serve(req: dict, proto_in: int, proto_out: int, server: int | None = None) -> None:
    """Fork the session's child and forward frames until it ends; then report how it ended."""
    parent_sock, child_sock = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        parent_sock.close()
        os.close(proto_in)
        os.close(proto_out)
        try:
            Session(child_sock.fileno(), req).serve()
        finally:
            os._exit(0)
    child_sock.close()
    sock = parent_sock.fileno()
    pidfd = os.pidfd_open(pid)  # readable once the child has exited (Linux >= 5.3)
    try:
        _forward(proto_in, proto_out, sock, pidfd, pid)
    finally:
        os.close(pidfd)
        parent_sock.close()
        reaper.kill_tree(os.getpid(), include_root=False, spare=server)  # daemons of the session's code: none
        # may wait for the next check's shards
        reaper.reap_orphans(spare=server)  # their zombies would count against the job's process limit


def _forward(proto_in: int, proto_out: int, sock: int, pidfd: int, pid: int) -> None:
    child_open = True
    while True:
        ready, _, _ = select.select([proto_in, pidfd] + ([sock] if child_open else []), [], [])
        if proto_in in ready:
            try:
                frame = wire.read_frame(proto_in)
            except wire.ChannelClosed:  # the grader went away: so does the session
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise SystemExit(0) from None
            try:
                wire.write_frame(sock, frame)
            except OSError:
                pass  # the child is gone; its end is reported below
        if sock in ready and child_open:
            try:
                wire.write_frame(proto_out, wire.read_frame(sock))
            except wire.ChannelClosed:
                child_open = False
        if pidfd in ready:
            if child_open:
                _drain(sock, proto_out)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            wire.write_frame(proto_out, wire.encode({"kind": "ended", "code": code}))
            return


def _drain(sock: int, proto_out: int) -> None:
    """Forward the complete frames a child wrote before it exited (a partial one is dropped)."""
    os.set_blocking(sock, False)
    data = b""
    try:
        while chunk := os.read(sock, 1 << 20):
            data += chunk
    except BlockingIOError:
        pass
    while len(data) >= wire.FRAME.size:
        (n,) = wire.FRAME.unpack(data[:wire.FRAME.size])
        if len(data) < wire.FRAME.size + n:
            break
        wire.write_frame(proto_out, data[wire.FRAME.size:wire.FRAME.size + n])
        data = data[wire.FRAME.size + n:]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
