"""Every process a `dlo` command started ends with it, however the command is stopped.

Killing one process group is not enough: papermill and nbgrader run in sessions of their own (so a
timeout can stop them), and jupyter_client starts each kernel in yet another session (so an interrupt
reaches only the kernel). Killing papermill's group used to leave its kernel running, re-parented to
init. So the command becomes a child subreaper (orphaned descendants are re-parented to it, not to
init, and stay findable), and a stop kills its whole tree of descendants, read from /proc, until none
is left (`kill_tree`); at its end, it waits for the orphans it was handed (`collect_orphans`), so their
CPU time counts where `time` looks. `stopping()` turns SIGTERM and SIGHUP into KeyboardInterrupt, as Ctrl-C is,
so the commands' own clean-up runs (the grading records kept, the status table printed).

The one place that reads process trees from /proc (`children`, `descendants`, `comm`) and kills them:
papermill's and nbgrader's trees here, and the grader's sandboxed runner (`dlo.grading.trusted`),
whose processes also carry a mark in their environment (`tagged`: a rank started without the
sandbox's PID namespace may leave the tree), and the kernel inside bubblewrap (`dlo.grading.jail`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name, from the state (field 3 of proc(5)) on; the name
    may hold spaces and parentheses, so they follow its last ")". OSError if the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _ppids(zombies: bool = False) -> dict[int, list[int]]:
    """{parent pid: [child pids]} of every live process (and zombie, if asked), from /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state, ppid = stat_fields(int(entry))[:2]
        except OSError:
            continue  # gone meanwhile
        if zombies or state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    return children


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`, lowest pid first."""
    return sorted(_ppids().get(pid, []))


def descendants(pid: int, zombies: bool = False) -> list[int]:
    """The live processes below `pid` (children, their children, ...), parents first; with `zombies`,
    also those that ended and were not waited for."""
    tree, out, todo = _ppids(zombies), [], [pid]
    while todo:
        kids = sorted(tree.get(todo.pop(0), []))
        out += kids
        todo += kids
    return out


def comm(pid: int) -> str:
    """The process's command name ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def tagged(mark: str) -> list[int]:
    """Processes (of this user; never this one) whose environment holds `mark` ("NAME=value")."""
    needle, pids = mark.encode() + b"\0", []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_tree(root: int | None, *, include_root: bool = True, mark: str | None = None, rounds: int = 100,
              spare: int | None = None) -> None:
    """SIGKILL `root` with its process group (unless include_root is False), every process below it
    and, given a `mark`, every process `tagged` with it; `spare` (a process below root) lives on, not
    what is below it. The tree is read before anything is killed, so a kernel in a session of its own
    goes with the papermill that started it; repeated until nothing is left (a process forked meanwhile
    is re-parented to a subreaper, or carries the mark)."""
    include_root = include_root and root is not None  # None: the tagged processes only
    for _ in range(rounds):
        pids = [p for p in (descendants(root) if root is not None else []) + (tagged(mark) if mark else [])
                if p != spare]
        if include_root and _alive(root):
            pids.insert(0, root)
        if include_root:  # the group root leads (start_new_session), members that left the tree included
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(root, signal.SIGKILL)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def kill_tagged(mark: str) -> None:
    """SIGKILL every process `tagged` with `mark` ("NAME=value"), until none is left."""
    kill_tree(None, mark=mark)


def reap_orphans(spare: int | None = None) -> None:
    """Wait for this process's children that have exited (a subreaper is handed its descendants' orphans,
    and nothing else waits for them), `spare` excepted: a zombie keeps its pid and counts against its
    user's process limit (RLIMIT_NPROC) until it is waited for."""
    for pid in _ppids(zombies=True).get(os.getpid(), []):
        if pid != spare:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def collect_orphans(timeout: float = 2.0) -> None:
    """At a command's end: wait for every child this subreaper still has (its descendants' orphans, e.g.
    a rank fork server that ends when its kernel has), up to `timeout` seconds for those still ending.
    A reaped orphan's CPU time joins this process's RUSAGE_CHILDREN, so `time dlo ...` (and `time make
    run`) count the ranks' and sandboxes' CPU; left for init, a zombie's CPU time is lost with it."""
    deadline = time.monotonic() + timeout
    while True:
        reap_orphans()
        if not _ppids(zombies=True).get(os.getpid()) or time.monotonic() > deadline:  # one that just ended too
            return
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or not); whether it was one. False where prctl is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
        return bool(was.value)
    except (OSError, AttributeError):
        return False


def undumpable(why: str = "") -> None:
    """This process and its forks closed to the other processes of its user (no capability needed): no
    /proc/PID/mem, no ptrace, no pidfd_getfd of its descriptors. Exec resets it. OSError if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_DUMPABLE, 0) failed{': ' + why if why else ''}")


def dumpable() -> bool:
    """Whether this process is open to the other processes of its user; True where prctl is missing."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0
    except (OSError, AttributeError):
        return True


@contextlib.contextmanager
def stopping() -> Iterator[list[int]]:
    """While inside: SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread (the first
    one only: the clean-up is not interrupted again), and orphans of this process's descendants stay
    its own. Yields the list of signals received."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        first = not received
        received.append(signum)
        if first:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    was = subreaper(True)
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        collect_orphans()
        subreaper(was)
