"""From a notebook's flat parameters to a ready `Run`: profile, device, preset, seeds, log folder.

A notebook's parameters cell holds plain scalars (papermill overrides them). `profile="auto"`
defers to the DLO_PROFILE environment variable, which is how nbgrader's autograder (which cannot
inject parameters) picks a scale, and otherwise to the hardware: `full` with a GPU, `tiny` without.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROFILES = ("tiny", "full")


def resolve_profile(profile: str = "auto") -> str:
    if profile == "auto":
        profile = os.environ.get("DLO_PROFILE", "auto")
    if profile == "auto":
        profile = "full" if torch.cuda.is_available() else "tiny"
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)} or 'auto'")
    return profile


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        device = os.environ.get("DLO_DEVICE", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device here")
    return dev


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_world(world_size: int, preset: Any, device: torch.device) -> tuple[int, str]:
    """(ranks, backend) of a day's experiments, the same rule on every day.

    world_size > 0 is taken as asked; 0 means the preset's `ranks` (1 on single-process days). On a
    GPU device every rank needs its own GPU (NCCL); with fewer GPUs than asked for, a 0 request
    shrinks to the GPU count and an explicit one is refused. On the CPU the ranks use gloo.
    """
    if world_size < 0:
        raise ValueError(f"world_size must be >= 0 (0: the preset's), got {world_size}")
    wanted = world_size or int(getattr(preset, "ranks", 1))
    if device.type != "cuda":
        return wanted, "gloo"
    gpus = torch.cuda.device_count()
    if wanted > gpus:
        if world_size:
            raise ValueError(f"world_size={world_size} needs one GPU per rank, but {gpus} are visible; "
                             f"ask for fewer ranks, or device='cpu' to run gloo ranks on the CPU")
        wanted = gpus
    return wanted, "nccl"


@dataclass
class Run:
    """What a notebook needs after its parameters cell: resolved scale, device, world and folders.

    `world` and `backend` are the ranks and process-group backend of the day's distributed work
    (`dlo.distributed.launch(fn, run.world, backend=run.backend)`); `mesh(...)` builds a DeviceMesh
    inside a rank.
    """

    day: str
    profile: str
    device: torch.device
    seed: int
    world_size: int
    data_dir: Path | None
    log_dir: Path
    preset: Any
    world: int = 1
    backend: str = "gloo"

    def mesh(self, shape: tuple[int, ...] | int | None = None, names: tuple[str, ...] | None = None):
        """A DeviceMesh over the ranks of the current process group (call it inside a rank):
        `run.mesh()` is 1-D over every rank, `run.mesh((2, 2), ("dp", "tp"))` a 2-D one."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("Run.mesh: no process group here; call it inside dlo.distributed.launch")
        shape = (dist.get_world_size(),) if shape is None else ((shape,) if isinstance(shape, int) else tuple(shape))
        kind = "cuda" if "nccl" in dist.get_backend() else "cpu"
        return init_device_mesh(kind, shape, mesh_dim_names=names)

    def writer(self, name: str):
        """A TensorBoard SummaryWriter logging under log_dir/name (`dlo.tb.writer`)."""
        from dlo.tb import writer

        return writer(self.log_dir, name)

    def __str__(self) -> str:
        data = self.data_dir or "synthetic"
        return (f"{self.day}: profile={self.profile} device={self.device} seed={self.seed} "
                f"world={self.world} ({self.backend}) data={data} logs={self.log_dir}\n  {self.preset}")


def smoke_requested() -> bool:
    """True when the harness asked for a smoke run (`dlo run --smoke` sets DLO_SMOKE=1): the profile's
    model sizes, with step counts, data sizes and sweep lengths cut to the minimum by `preset.smoke()`."""
    return os.environ.get("DLO_SMOKE", "") == "1"


def get_preset(day: str, profile: str, max_steps: int = 0, smoke: bool | None = None, **overrides: Any) -> Any:
    """The day's preset for `profile`: its `smoke()` version when a smoke run is asked for (`smoke`,
    default: DLO_SMOKE), `max_steps` > 0 applied through `with_max_steps` where the preset has it
    (which carries the settings that depend on the step count: warmup, interrupt point, ...), then
    `overrides`; finally `validate()`, whose ValueError says in one line what does not fit."""
    from dlo.presets import PRESETS

    if day not in PRESETS:
        raise ValueError(f"no presets for day {day!r}; known days: {', '.join(sorted(PRESETS))}")
    if profile not in PRESETS[day]:
        raise ValueError(f"{day} has no profile {profile!r}; choose one of {', '.join(PRESETS[day])}")
    preset = PRESETS[day][profile]
    if (smoke_requested() if smoke is None else smoke) and hasattr(preset, "smoke"):
        preset = preset.smoke()
    if max_steps < 0:
        raise ValueError(f"max_steps must be >= 0 (0: the preset's), got {max_steps}")
    if max_steps > 0:
        if hasattr(preset, "with_max_steps"):
            preset = preset.with_max_steps(max_steps)
        else:
            overrides["max_steps"] = max_steps
    unknown = set(overrides) - {f.name for f in dataclasses.fields(preset)}
    if unknown:
        raise ValueError(f"{type(preset).__name__} has no field(s) {sorted(unknown)}")
    preset = dataclasses.replace(preset, **overrides)
    if hasattr(preset, "validate"):
        preset.validate()
    return preset


def check_parameters(day: str, profile: str = "auto", device: str = "auto", max_steps: int = 0, world_size: int = 0,
                     data_dir: str = "", smoke: bool | None = None) -> None:
    """What `setup` resolves, without doing any work: ValueError (one line) when the parameters do not
    fit the day (an unknown profile or device, a step count below what the preset needs, more ranks
    than GPUs, a data_dir that is not a folder). `dlo run` calls it before a kernel starts."""
    if data_dir and not Path(data_dir).is_dir():
        raise ValueError(f"data_dir={data_dir!r} is not a folder; leave it empty for synthetic data")
    profile = resolve_profile(profile)
    preset = get_preset(day, profile, max_steps, smoke=smoke)
    resolve_world(world_size, preset, resolve_device(device))


def setup(day: str, profile: str = "auto", device: str = "auto", seed: int = 0, max_steps: int = 0,
          world_size: int = 0, data_dir: str = "", log_dir: str = "", **overrides: Any) -> Run:
    """Resolve a notebook's parameters into a `Run`, seed every RNG and print a summary line."""
    profile = resolve_profile(profile)
    dev = resolve_device(device)
    if data_dir and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data_dir={data_dir!r} is not a folder; leave it empty for synthetic data")
    preset = get_preset(day, profile, max_steps, **overrides)
    world, backend = resolve_world(world_size, preset, dev)
    run = Run(day=day, profile=profile, device=dev, seed=seed, world_size=world_size,
              data_dir=Path(data_dir) if data_dir else None,
              log_dir=Path(log_dir or "runs"),  # beside the notebook: <day>/runs/<configuration>, no day twice
              preset=preset, world=world, backend=backend)
    run.log_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    print(run)
    return run
