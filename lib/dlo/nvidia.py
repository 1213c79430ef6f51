"""What this machine's NVIDIA driver offers torch, asked without CUDA.

Whether an NVIDIA GPU is here is decided cheaply: the driver's files first (`DRIVER_FILES`: no process is
started on a machine without them, a laptop or a login node), then `nvidia-smi` for the driver version and
the GPUs this process may see (a job's cgroup can hide a node's GPUs from it). `unused_gpu` says in one line,
with the fix, why torch runs on the CPU although a GPU is here: a CPU build of torch (a `.venv` installed on a
login node), a driver older than torch's CUDA build needs, or torch's own reason. `dlo doctor` prints it as a
FIX line; `profile="auto"` warns with it before it runs the tiny profile (dlo.config.resolve_profile).
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Present wherever the NVIDIA kernel module is loaded (the first) or its devices are made (the second).
DRIVER_FILES = (Path("/proc/driver/nvidia/version"), Path("/dev/nvidiactl"))

# The CUDA version of the torch build that requirements/gpu.txt installs (PyPI's torch 2.13.0): what a CPU
# build of torch is told the CUDA lock would need (tests/test_nvidia.py checks it against gpu.txt's pins).
LOCKED_CUDA = "13.0"

# The oldest Linux driver that runs a CUDA major version's builds (CUDA's minor version compatibility), from
# NVIDIA's "CUDA Toolkit 11.x, 12.x, and 13.x Driver Version Ranges" (CUDA Compatibility, Table 1,
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html; the exact versions are
# in the CUDA Toolkit release notes' table of minimum drivers): 13.x needs >= 580, 12.x >= 525.60.13, 11.x
# >= 450.80.02. A driver older than that fails cuInit, and torch sees no GPU.
MIN_DRIVER = {13: "580", 12: "525.60.13", 11: "450.80.02"}


@dataclass(frozen=True)
class Driver:
    version: str            # as nvidia-smi prints it, e.g. "580.65.06"
    gpus: tuple[str, ...]   # the names of the GPUs nvidia-smi lists for this process


def present() -> bool:
    """Whether the NVIDIA driver's files are here (without them no process can use a GPU): a stat, nothing
    started or imported, so a caller can skip torch's import (1.5 CPU s) on a machine that has no GPU."""
    return any(path.exists() for path in DRIVER_FILES)


@functools.cache
def driver() -> Driver | None:
    """The NVIDIA driver and the GPUs `nvidia-smi` lists here, or None: no driver files (nothing is
    started then), no `nvidia-smi` on PATH, no answer within 20 s, or no GPU listed."""
    if not present():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [line.split(",", 1) for line in out.stdout.splitlines() if "," in line]
    if out.returncode != 0 or not rows:
        return None
    return Driver(rows[0][0].strip(), tuple(name.strip() for _, name in rows))


def version_tuple(version: str) -> tuple[int, ...]:
    """"580.65.06" -> (580, 65, 6); what is not a number ends it."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def min_driver(cuda: str) -> str | None:
    """The oldest driver that runs builds for CUDA `cuda` ("13.0"), or None for a CUDA major not in the table."""
    major = version_tuple(cuda)[:1]
    return MIN_DRIVER.get(major[0]) if major else None


def too_old(driver_version: str, cuda: str) -> str | None:
    """The minimum driver when `driver_version` is older than CUDA `cuda` needs, else None."""
    needed = min_driver(cuda)
    if needed is None or version_tuple(driver_version) >= version_tuple(needed):
        return None
    return needed


def gpus_hidden() -> bool:
    """CUDA_VISIBLE_DEVICES hides every GPU on purpose ("", "-1", SLURM's "NoDevFiles"): CUDA stops at the
    first entry that is neither an index nor a GPU-/MIG- UUID, and nvidia-smi does not read it."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return False
    first = value.split(",")[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


def torch_reason() -> str:
    """torch's own reason it sees no GPU: the first line of what torch.cuda.init() raises. Not for a
    notebook's process: a failed CUDA initialisation marks the processes it forks later as unable to use CUDA."""
    import torch

    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or AssertionError; the message is the point
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return "torch.cuda.init() succeeds now (it failed before in this process)"


def unused_gpu(ask_torch: bool = False) -> str | None:
    """Why torch runs on the CPU although nvidia-smi lists a GPU here, in one line with the fix; None when
    torch sees a GPU, when there is none, or when CUDA_VISIBLE_DEVICES hides them on purpose. `ask_torch`:
    include torch's own reason where it is neither of the two known causes (see `torch_reason`)."""
    import torch

    if torch.cuda.is_available() or gpus_hidden():
        return None
    found = driver()
    if found is None:
        return None
    here = f"nvidia-smi lists {len(found.gpus)} GPU(s) here ({found.gpus[0]}, driver {found.version})"
    cuda = torch.version.cuda
    if not cuda:
        needed = too_old(found.version, LOCKED_CUDA)
        then = (f"; its CUDA {LOCKED_CUDA} needs a driver >= {needed}: a node with a newer driver, or the "
                "admins to update it" if needed else "")
        return (f"torch {torch.__version__} is a CPU build but {here}: install torch's CUDA build in a new "
                f".venv (rm -rf .venv && make venv GPU=1, or environment.yml: requirements/gpu.txt){then}")
    needed = too_old(found.version, cuda)
    if needed:
        return (f"torch {torch.__version__} is built for CUDA {cuda}, which needs an NVIDIA driver >= {needed}, "
                f"but {here}: run on nodes with a newer driver, or ask the admins to update it")
    reason = torch_reason() if ask_torch else "`dlo doctor` prints torch's reason"
    return f"torch {torch.__version__} (CUDA {cuda}) sees no GPU although {here}: {reason}"
