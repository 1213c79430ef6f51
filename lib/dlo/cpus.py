"""How many CPU cores this process may use, and how many threads a notebook's torch should run.

A login node, a shared JupyterHub node or a SLURM job gives a process fewer cores than the machine has, in
three ways that `os.cpu_count()` sees none of: an affinity mask (SLURM's task binding, `taskset`), a CPU
quota of its cgroup (a container's or a job's `cpu.max`: so many microseconds per period, on any core),
and SLURM's `--cpus-per-task` where the site binds no task. `usable_cores` is the smallest of them.

torch's intra-op threads spin-wait for work. On a machine whose cores are busy (the grader's other jobs,
a classmate's notebook), a thread that spins steals the core another process needs, and a small model's
step gets many times slower: one SmallCNN batch-32 step on a 2-core machine kept busy by other work took
484-608 ms with 2 threads and 42-60 ms with 1 (issue 38; Day 3 measured the same on its tiny profile). So
`notebook_threads` gives the tiny CPU profile one thread, whatever the machine, unless the job said
otherwise (OMP_NUM_THREADS: `dlo run`/`dlo grade` set each notebook's share), and bigger runs their usable
cores.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SHARE_ENV = "DLO_CORES"  # `dlo run --jobs N` / `dlo grade --jobs N`: the cores one of N notebooks may count on
CGROUP = Path("/sys/fs/cgroup")


def affinity_cores() -> int:
    """The cores of this process's affinity mask (a SLURM allocation's CPUs, not the node's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def quota_cores(root: Path = CGROUP, self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The cores a CPU quota of this process's cgroup allows (rounded up), None without a quota. cgroup v2:
    `cpu.max` "quota period" ("max" for none) in the process's own cgroup; v1: cpu.cfs_quota_us (-1: none)
    over cpu.cfs_period_us, in the cpu controller's hierarchy."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2
            return _ratio(root / rel / "cpu.max", None)
        if "cpu" in controllers.split(","):  # v1
            for base in (root / "cpu", root / "cpu,cpuacct"):
                found = _ratio(base / rel / "cpu.cfs_quota_us", base / rel / "cpu.cfs_period_us")
                if found is not None:
                    return found
    return None


def _ratio(quota_file: Path, period_file: Path | None) -> int | None:
    try:
        words = quota_file.read_text().split()
        period = float(period_file.read_text()) if period_file else float(words[1])
    except (OSError, IndexError, ValueError):
        return None
    if not words or words[0] in ("max", "-1") or period <= 0:
        return None
    return max(1, math.ceil(float(words[0]) / period))


def usable_cores() -> int:
    """The fewest of: the affinity mask, the cgroup's CPU quota, SLURM's cpus-per-task."""
    limits = [affinity_cores(), quota_cores()]
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        limits.append(int(slurm))
    return min(n for n in limits if n)


def cpu_cores() -> int:
    """The usable cores, or this process's share of them when notebooks run side by side (DLO_CORES): a
    timing taken beside another notebook is judged against the share, not against cores the other one is
    using."""
    n = usable_cores()
    share = os.environ.get(SHARE_ENV, "")
    return min(n, int(share)) if share.isdigit() and int(share) > 0 else n


def notebook_threads(profile: str, device_type: str) -> int:
    """torch's intra-op threads for a notebook: what the job gave (OMP_NUM_THREADS), else one on the tiny
    CPU profile (its models gain nothing from a second thread, and spinning ones slow a busy machine
    down many times over), else the usable cores (or this notebook's share of them)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return min(int(given), cpu_cores())
    if device_type == "cpu" and profile == "tiny":
        return 1
    return cpu_cores()
