"""One grading job's memory, watched: its sandboxed processes added up a few times a second, the largest
stopped when the sum passes the job's limit (`dlo.grading.limits`).

RLIMIT_DATA bounds each process; a submission that forks (ranks, a pool of workers, processes up to the
process limit) could still hold that much in each. So the grading process watches its job while it grades
the notebook: every `every` seconds it reads the resident anonymous pages (RssAnon of /proc/PID/status: a
counter, no page walk) of every process below it, which are the sandboxes' (the kernel's and the runner's
bwrap, and all they started: their PID namespaces keep orphans below them). A fork's pages that it still
shares with its parent count in both there, so a sum over the limit is measured again as each process's
proportional share (Pss_Anon of smaps_rollup: the shared pages split), and only that sum decides (found
under it, not measured again for `recheck` seconds: a page walk of every process of a job that forked a
hundred times is not free, and RLIMIT_DATA bounds each process meanwhile). Over the
limit, the process holding the most is killed (SIGKILL), as the kernel's OOM killer would, but inside this
job, and the event is kept: the executor names the limit in the feedback of the cell that was running
(`limits.name_limits`). The job's tmpfs pages are bounded by their size instead (bwrap's --size).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

from dlo import reaper
from dlo.grading.limits import size_text
from dlo.measure.process import status, status_bytes


@dataclass(frozen=True)
class Event:
    """A process stopped over the memory limit."""

    at: float  # time.monotonic()
    pid: int
    what: str  # "your kernel (2.1 GiB)"
    total: int  # bytes the job held


class JobWatch:
    """`with JobWatch(limit):` watches the processes below this one (or below `root`)."""

    def __init__(self, limit: int, root: int | None = None, every: float = 0.2, recheck: float = 1.0):
        self.limit, self.root, self.every, self.recheck = limit, root or os.getpid(), every, recheck
        self.events: list[Event] = []
        self._under_until = 0.0  # the proportional shares were under the limit: trusted until then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlo-job-watch", daemon=True)

    def __enter__(self) -> JobWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join()
        return False

    def since(self, start: float) -> list[Event]:
        """The processes stopped from `start` (time.monotonic()) on."""
        return [e for e in list(self.events) if e.at >= start]

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def check(self) -> Event | None:
        """One look: the event when a process had to be stopped, else None."""
        pids = reaper.descendants(self.root)
        if sum(_rss_anon(p) for p in pids) <= self.limit or time.monotonic() < self._under_until:
            return None
        held = {p: _pss_anon(p) for p in pids}
        total = sum(held.values())
        if total <= self.limit:
            self._under_until = time.monotonic() + self.recheck
            return None
        victim = max(held, key=held.get)
        what = f"{_what(victim)} ({size_text(held[victim])})"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
        event = Event(time.monotonic(), victim, what, total)
        self.events.append(event)
        _wait_gone(victim)  # its pages are freed before the next look counts them again
        return event


def _rss_anon(pid: int) -> int:
    """The process's resident anonymous pages, in bytes (0 if gone)."""
    try:
        return status_bytes(status(pid), "RssAnon")
    except (OSError, KeyError, ValueError, IndexError):
        return 0


def _pss_anon(pid: int) -> int:
    """The process's proportional share of its anonymous pages, in bytes (RssAnon where smaps_rollup
    cannot be read or has no Pss_Anon: kernels before 5.10)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _rss_anon(pid)


def _what(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        cmd = b""
    return "your kernel" if b"ipykernel" in cmd else "a process running your code"


def _wait_gone(pid: int, timeout: float = 2.0) -> None:
    """Until `pid` has exited (a zombie holds no memory) or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if reaper.stat_fields(pid)[0] in ("Z", "X"):
                return
        except (OSError, IndexError):
            return
        time.sleep(0.02)
