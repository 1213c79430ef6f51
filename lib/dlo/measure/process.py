"""A process's memory as the kernel counts it, read from /proc by any process that may read it.

Every other memory meter of `dlo.measure` lives in the process it measures (dispatch modes, saved-tensor
hooks, walks of live tensors): code running there can find it and change what it counted. The kernel's
counters of a process cannot be changed from inside it, and another process can read them:

- `VmRSS`, the pages the process has resident now, and `VmHWM`, the most it ever had ("high water mark"),
  which `/proc/PID/clear_refs` ("5") resets to the current `VmRSS`. Only a process allowed to write that
  file can reset it: the process itself while it is dumpable, or root. A grading sandbox's processes are
  not dumpable (`dlo.reaper.undumpable`), so the student's code there cannot reset its own mark.
- `cutime + cstime` of `/proc/PID/stat`: the CPU time of the children it waited for, and the processes
  still below it (zombies included): work moved into another process, whose memory `VmHWM` does not hold.

`snapshot(pid, reset=True)` reads them (resetting the mark first where it may); `growth(before, after)` is
the most the process held while what ran between the two snapshots ran, above what it held at the first.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

from dlo.reaper import descendants, stat_fields

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


@dataclass(frozen=True)
class Snapshot:
    """One process's counters at one moment (bytes; `child_ticks` in clock ticks)."""

    rss: int
    hwm: int
    child_ticks: int  # CPU time of the children it waited for (cutime + cstime)
    below: int  # processes below it, zombies included
    reset: bool  # whether `hwm` was reset to `rss` just before this was read


def status(pid: int) -> dict[str, str]:
    """/proc/PID/status as {key: the text after its colon} (OSError if it cannot be read)."""
    with open(f"/proc/{pid}/status") as f:
        return {key: value.strip() for key, _, value in (line.partition(":") for line in f)}


def status_bytes(fields: dict[str, str], key: str) -> int:
    """A size of `status(pid)` in bytes (the kernel writes kB); KeyError where the kernel has no such line."""
    return int(fields[key].split()[0]) * 1024


def _child_ticks(pid: int) -> int:
    fields = stat_fields(pid)
    return int(fields[13]) + int(fields[14])  # cutime, cstime: fields 16 and 17 of proc(5)


def _reset(pid: int) -> bool:
    """The high water mark set to the current RSS, where this process may (see the module's docstring)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    return False


def snapshot(pid: int, reset: bool = False) -> Snapshot | None:
    """The kernel's counters of `pid` (None if it cannot be read: gone, or no /proc)."""
    try:
        was_reset = _reset(pid) if reset else False
        now = status(pid)
        return Snapshot(status_bytes(now, "VmRSS"), status_bytes(now, "VmHWM"), _child_ticks(pid),
                        len(descendants(pid, zombies=True)), was_reset)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def growth(before: Snapshot, after: Snapshot) -> tuple[int, bool]:
    """(the most the process held between the two snapshots above what it held at `before`, whether that is
    exact). `VmHWM` is a lifetime maximum: where `before` did not reset it and it did not rise, the peak
    between the snapshots is only known to be at most the old mark, which the first number then is."""
    return max(0, after.hwm - before.rss), before.reset or after.hwm > before.hwm


def steady_malloc(threshold: int = 1 << 17) -> bool:
    """Make glibc's malloc give every block of `threshold` bytes or more its own pages, returned at free
    (`mallopt(M_MMAP_THRESHOLD)`, which also stops glibc raising that threshold to the largest block freed so
    far), so that resident memory follows the bytes alive: otherwise a few MiB blocks freed and made again stay
    in the heap and grow `VmRSS` by tens of MiB beside them (measured, Day 1's accumulation). It can only lower
    what the kernel counts for honest code; it hides nothing. It costs a fresh mapping per large block (an
    element-wise op on 1 MiB: 2.6x slower), so set it just before what is counted. False without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) == 1
    return False


def own_pid_in(pid_ns_pid: int, under: int) -> int | None:
    """The pid, as this process sees it, of the process below `under` whose pid in its own PID namespace is
    `pid_ns_pid` (`NSpid` of /proc/PID/status: its pid in each namespace, outermost first); None if none."""
    for pid in descendants(under):
        with contextlib.suppress(OSError):
            if status(pid).get("NSpid", "").split()[-1:] == [str(pid_ns_pid)]:
                return pid
    return None
