"""From a notebook's flat parameters to a ready `Run`: profile, device, preset, seeds, log folder.

A notebook's parameters cell holds plain scalars (papermill overrides them). `profile="auto"`
defers to the DLO_PROFILE environment variable, which is how nbgrader's autograder (which cannot
inject parameters) picks a scale, and otherwise to the hardware: `full` with a GPU, `tiny` without.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
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


def pick_backend(world_size: int, backend: str | None = None) -> str:
    """The process-group backend of `world_size` ranks, the one rule of `Run` and `dlo.distributed.launch`:
    None picks NCCL when every rank can have its own GPU, else gloo; NCCL asked for with fewer GPUs than ranks
    is refused (ValueError, one line). Under torchrun/srun the job's ranks and GPUs decide, by the rule every
    rank of the job applies alike (`dlo.distributed.placement.place`): a world size other than the job's is
    refused, and so is a job where only some ranks would have a GPU."""
    from dlo.distributed import placement

    job = placement.launched(os.environ)
    if job is not None:
        if world_size != job.world_size:
            raise ValueError(f"world_size={world_size} but {job.launcher} started {job.world_size} ranks; leave "
                             f"world_size=0 (the job's) or start {world_size} ranks")
        return placement.place(job, os.environ, placement.cuda_count(), backend).backend
    gpus = placement.cuda_count()
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if "nccl" in backend and gpus < world_size:
        raise ValueError(f"backend {backend!r} needs one GPU per rank: world_size={world_size} but {gpus} CUDA "
                         f"device(s) are visible; ask for fewer ranks, or device='cpu' / backend='gloo' for CPU ranks")
    return backend


def resolve_world(world_size: int, preset: Any, device: torch.device) -> tuple[int, str]:
    """(world_size, backend) of a day's experiments, the same rule on every day.

    world_size > 0 is taken as asked; 0 means the preset's `world_size` (1 on single-process days). On a
    GPU device every rank needs its own GPU (NCCL): with fewer GPUs than asked for, a 0 request
    shrinks to the GPU count and an explicit one is refused (`pick_backend`). On the CPU the ranks
    use gloo. Under torchrun/srun (more than one task) 0 means the job's ranks, and the job's GPUs, not
    this node's, decide (`pick_backend`).
    """
    if world_size < 0:
        raise ValueError(f"world_size must be >= 0 (0: the preset's), got {world_size}")
    from dlo.distributed.placement import launched

    job = launched(os.environ)
    if job is not None:  # the ranks exist already: the job's world, its GPUs judged on every rank alike
        world_size = world_size or job.world_size
        return world_size, pick_backend(world_size, "nccl" if device.type == "cuda" else "gloo")
    wanted = world_size or int(getattr(preset, "world_size", 1))
    if device.type == "cuda" and not world_size:
        wanted = min(wanted, torch.cuda.device_count())
    return wanted, pick_backend(wanted, "nccl" if device.type == "cuda" else "gloo")


@dataclass
class Run:
    """What a notebook needs after its parameters cell: resolved scale, device, ranks and folders.

    `world_size` and `backend` are the ranks and process-group backend of the day's distributed work
    (`dlo.distributed.launch(fn, run.world_size, backend=run.backend)`; 1 on single-process days);
    `mesh(...)` builds a DeviceMesh inside a rank. `params`: the day's own parameters-cell values
    (`dlo.registry.DaySpec.parameters`, e.g. Day 5's weights_dir).
    """

    day: str
    profile: str
    device: torch.device
    seed: int
    world_size: int
    data_dir: Path | None
    log_dir: Path
    preset: Any
    backend: str = "gloo"
    params: dict[str, Any] = field(default_factory=dict)

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
                f"world_size={self.world_size} ({self.backend}) data={data} logs={self.log_dir}\n  {self.preset}")


def smoke_requested() -> bool:
    """True when the harness asked for a smoke run (`dlo run --smoke` sets DLO_SMOKE=1): the profile's
    model sizes, with step counts, data sizes and sweep lengths cut to the minimum by `preset.smoke()`."""
    return os.environ.get("DLO_SMOKE", "") == "1"


def get_preset(day: str, profile: str, max_steps: int = 0, smoke: bool | None = None, **overrides: Any) -> Any:
    """The day's preset for `profile`: its `smoke()` version when a smoke run is asked for (`smoke`,
    default: DLO_SMOKE), `max_steps` > 0 applied through `with_max_steps` where the preset has it
    (which carries the settings that depend on the step count: warmup, interrupt point, ...), then
    `overrides`; finally `validate()`, whose ValueError says in one line what does not fit."""
    from dlo.registry import DAYS

    if day not in DAYS:
        raise ValueError(f"no presets for day {day!r}; known days: {', '.join(sorted(DAYS))}")
    presets = DAYS[day].presets
    if profile not in presets:
        raise ValueError(f"{day} has no profile {profile!r}; choose one of {', '.join(presets)}")
    preset = presets[profile]
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


def resolve(day: str, profile: str = "auto", device: str = "auto", seed: int = 0, max_steps: int = 0,
            world_size: int = 0, data_dir: str = "", log_dir: str = "", smoke: bool | None = None, **more: Any) -> Run:
    """A notebook's parameters cell as a `Run`, without doing any work (no folder made, no RNG seeded):
    ValueError (one line) for whatever cannot work, before anything starts: an unknown day, profile or
    device, a step count below what the preset needs, more ranks than GPUs, a data_dir that is not a
    folder, then the day's own preflight (`dlo.registry.DaySpec.preflight`: Day 5's weights and plan).
    `more`: the day's own parameters (`DaySpec.parameters`), the rest preset fields to override.
    `dlo.setup` (in the notebook) and `dlo run` (before the notebook starts) both call it."""
    from dlo.registry import DAYS

    profile = resolve_profile(profile)
    dev = resolve_device(device)
    if data_dir and not Path(data_dir).is_dir():
        raise ValueError(f"data_dir={data_dir!r} is not a folder; leave it empty for synthetic data")
    own = DAYS[day].parameters if day in DAYS else ()
    params = {k: more.pop(k) for k in own if k in more}
    preset = get_preset(day, profile, max_steps, smoke=smoke, **more)
    world_size, backend = resolve_world(world_size, preset, dev)  # 0 (the preset's) resolved, as asked else
    run = Run(day=day, profile=profile, device=dev, seed=seed, world_size=world_size,
              data_dir=Path(data_dir) if data_dir else None,
              log_dir=Path(log_dir or "runs"),  # beside the notebook: <day>/runs/<configuration>, no day twice
              preset=preset, backend=backend, params=params)
    if DAYS[day].preflight:
        DAYS[day].load(DAYS[day].preflight)(run)
    return run


def setup(day: str, profile: str = "auto", device: str = "auto", seed: int = 0, max_steps: int = 0,
          world_size: int = 0, data_dir: str = "", log_dir: str = "", **more: Any) -> Run:
    """`resolve` the notebook's parameters (its one-line ValueError before any work), make the log
    folder, seed every RNG and print a summary line."""
    run = resolve(day, profile, device, seed, max_steps, world_size, data_dir, log_dir, **more)
    run.log_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    print(run)
    return run
