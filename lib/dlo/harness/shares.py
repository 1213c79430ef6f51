"""Each `dlo grade` job's share of the machine: how many jobs run at once (the cores, the memory, one
per GPU), each one's limits (`dlo.grading.limits`, from its share of the memory available and of the
cores), and each slot's environment (its cores' thread count, its GPUs)."""

from __future__ import annotations

import os

from dlo.cpus import SHARE_ENV
from dlo.errors import warn
from dlo.grading import limits
from dlo.harness.schedule import cores

MEM_PER_JOB_GIB = 3.0  # a grading process, the student's kernel and the checks' runner, each with torch


def memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / 2 ** 20
    except (OSError, KeyError, ValueError):
        return MEM_PER_JOB_GIB


def gpus(profile: str) -> int:
    from dlo import nvidia

    if profile == "tiny" or not nvidia.present():  # no driver: no GPU, and torch is not imported to say so
        return 0
    from dlo.distributed.placement import cuda_count

    return cuda_count()


def default_jobs(profile: str) -> int:
    """As many as the cores and the memory allow; on GPUs, one per GPU."""
    n = max(1, min(cores(), int(memory_gib() // MEM_PER_JOB_GIB)))
    return min(n, gpus(profile)) if gpus(profile) else n


def job_limits(jobs: int, given: dict | None = None) -> limits.Limits:
    """Each of `jobs` jobs' limits: `given` ({name: value} from the command line), the rest from the job's
    share of the memory available now and of the cores; a share under what a day takes is warned about."""
    lim, warnings = limits.for_jobs(jobs, int(memory_gib() * limits.GIB), max(1, cores() // jobs), given)
    for line in warnings:
        warn("grade", line)
    return lim


def slot_env(slot: int, jobs: int, profile: str) -> dict:
    """Environment of the worker in `slot`: its share of the cores (no oversubscription: N kernels
    each spinning all cores' threads slow each other down) and of the GPUs, named as this process's
    CUDA_VISIBLE_DEVICES names them (a job given GPUs 4-7 hands out 4,5 and 6,7, never 0,1: other jobs')."""
    env = {SHARE_ENV: str(max(1, cores() // jobs))} if jobs > 1 else {}  # what its timings may count on
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, cores() // jobs))
    n = gpus(profile) if jobs > 1 else 0
    if n:
        from dlo.distributed.placement import gpu_share, visible_gpus

        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_share(visible_gpus(os.environ, n), slot, jobs))
    return env
