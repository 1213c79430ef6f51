"""From a notebook's flat parameters to a ready `Run`: profile, device, preset, ranks, seeds, log folder.

A notebook's parameters cell holds plain scalars (papermill overrides them). `profile="auto"`
defers to the DLO_PROFILE environment variable, which is how nbgrader's autograder (which cannot
inject parameters) picks a scale, and otherwise to the hardware: `full` with a GPU, `tiny` without.
A day that launches ranks gets one GPU per rank, or, with fewer GPUs than its ranks (one GPU per
student), the tiny profile's gloo ranks on the CPU for its launches while the notebook's own process
keeps the GPU and its profile (`Ranks`, `resolve_ranks`; `Run.where()` says what runs where).
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

from dlo.cpus import notebook_threads
from dlo.tb import start_session

PROFILES = ("tiny", "full")


def resolve_profile(profile: str = "auto") -> str:
    if profile == "auto":
        profile = os.environ.get("DLO_PROFILE", "auto")
    if profile == "auto":
        profile = "full" if torch.cuda.is_available() else "tiny"
        if profile == "tiny":
            _warn_unused_gpu()
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)} or 'auto'")
    return profile


_warned: set[str] = set()


def _warn_unused_gpu() -> None:
    """`profile="auto"` chose tiny: say so, once per process, where an NVIDIA GPU is here that torch cannot use
    (dlo.nvidia.unused_gpu: a CPU build of torch, a driver too old for its CUDA build), so that a GPU node does
    not run the tiny profile unnoticed; the notebook's setup output and `dlo run` (which resolves every day's
    parameters first) both show it. A warning, not an error: the tiny profile is the whole course on a CPU
    (every exercise, check and claims table, and what the grader runs on CPU machines), so a student whose
    environment lacks the CUDA build, which they may not be able to change, still works through the day;
    the line names the fix, and `dlo doctor` says FIX for it. A GPU hidden on purpose (CUDA_VISIBLE_DEVICES)
    and a profile asked for by name (tiny, or DLO_PROFILE) say nothing."""
    from dlo.errors import warn
    from dlo.nvidia import unused_gpu

    reason = unused_gpu()
    if reason and reason not in _warned:
        _warned.add(reason)
        warn("profile", f"'auto' runs the tiny profile on the CPU: {reason}")


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
    GPU device every rank needs its own GPU (NCCL): fewer GPUs than ranks is refused (`pick_backend`;
    `resolve_ranks` moves a 0 request to CPU ranks before it gets here). On the CPU the ranks use gloo.
    Under torchrun/srun (more than one task) 0 means the job's ranks, and the job's GPUs, not this
    node's, decide (`pick_backend`).
    """
    if world_size < 0:
        raise ValueError(f"world_size must be >= 0 (0: the preset's), got {world_size}")
    from dlo.distributed.placement import launched

    job = launched(os.environ)
    if job is not None:  # the ranks exist already: the job's world, its GPUs judged on every rank alike
        world_size = world_size or job.world_size
        return world_size, pick_backend(world_size, "nccl" if device.type == "cuda" else "gloo")
    wanted = world_size or int(getattr(preset, "world_size", 1))
    return wanted, pick_backend(wanted, "nccl" if device.type == "cuda" else "gloo")


@dataclass(frozen=True)
class Ranks:
    """What the day's multi-rank launches use: `world_size` ranks of `backend`, each computing on `device`
    ("cuda": a GPU of its own; "cpu"), at the sizes of `preset` (from profile `profile`):
    `dlo.distributed.launch(fn, run.world_size, run.ranks.preset, ..., backend=run.backend)`.

    They are the day's own ranks (`why` empty), or, where a GPU device has fewer GPUs than the preset's
    ranks, the tiny profile's gloo ranks on the CPU (`why` says so): a launch never shrinks to one rank
    that runs no collective. The notebook's own process keeps `run.device` and `run.preset`."""

    world_size: int
    backend: str
    device: str
    profile: str
    preset: Any
    why: str = ""


def resolve_ranks(day: str, world_size: int, profile: str, preset: Any, device: torch.device, max_steps: int = 0,
                  smoke: bool | None = None, overrides: dict[str, Any] | None = None) -> Ranks:
    """The `Ranks` of `day`'s launches: `resolve_world`'s, except that with `world_size` 0 on a GPU device
    whose GPUs are fewer than the preset's ranks (one GPU per student) the launches run on the tiny
    preset's CPU ranks (`max_steps`, `smoke` and `overrides` applied to it as to `preset`). An explicit
    `world_size` above the GPUs stays refused in one line (device='cpu' asks for CPU ranks)."""
    from dlo.distributed.placement import launched

    wanted = world_size or int(getattr(preset, "world_size", 1))
    standing_in = launched(os.environ) is None  # under torchrun/srun the job's ranks exist: resolve_world's
    if device.type == "cuda" and not world_size and standing_in and pick_backend(wanted) != "nccl":
        return cpu_ranks(day, wanted, max_steps, smoke, overrides or {})
    n, backend = resolve_world(world_size, preset, device)
    return Ranks(n, backend, device.type, profile, preset)


def cpu_ranks(day: str, wanted: int, max_steps: int, smoke: bool | None, overrides: dict[str, Any]) -> Ranks:
    """The tiny profile's gloo ranks on the CPU, standing in for `wanted` NCCL ranks this machine cannot
    give: the collectives still run, on the sizes a CPU finishes in minutes."""
    tiny = get_preset(day, "tiny", max_steps, smoke=smoke, **overrides)
    from dlo.distributed.placement import cuda_count

    n, backend = resolve_world(0, tiny, torch.device("cpu"))
    gpus = cuda_count()
    return Ranks(n, backend, "cpu", "tiny", tiny, f"{wanted} NCCL ranks need {wanted} GPUs, {gpus} visible")


@dataclass
class Run:
    """What a notebook needs after its parameters cell: resolved scale, device, ranks and folders.

    `device` and `preset` are the notebook's own process's; `ranks` what the day's launches use (their
    world size, backend, device and preset: `Ranks`), `world_size` and `backend` short for its two
    (`dlo.distributed.launch(fn, run.world_size, run.ranks.preset, backend=run.backend)`; 1 on
    single-process days); `where()` says what runs where. `mesh(...)` builds a DeviceMesh inside a rank.
    `params`: the day's own parameters-cell values (`dlo.registry.DaySpec.parameters`, e.g. Day 5's weights_dir).
    """

    day: str
    profile: str
    device: torch.device
    seed: int
    ranks: Ranks
    data_dir: Path | None
    log_dir: Path
    preset: Any
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def backend(self) -> str:
        return self.ranks.backend

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

    def where(self) -> str:
        """What runs where, a short block for the notebook (`setup` prints it on days that launch ranks):
        each part with its ranks, backend, device, profile and sizes (the preset's `sizes()`), and why the
        launches are CPU ranks when they are."""
        from dlo.distributed.placement import cuda_count
        from dlo.tables import format_table

        def sizes(preset) -> str:
            return preset.sizes() if hasattr(preset, "sizes") else str(preset)

        r = self.ranks
        gpus = cuda_count()
        rows = [{"part": "the notebook's own cells (run.preset)", "ranks": "1", "backend": "-",
                 "device": str(self.device), "profile": self.profile, "sizes": sizes(self.preset)},
                {"part": "launches (run.ranks.preset)", "ranks": str(r.world_size), "backend": r.backend,
                 "device": r.device if r.device == "cpu" else f"{r.device}, one GPU per rank", "profile": r.profile,
                 "sizes": "as above" if r.preset == self.preset else sizes(r.preset)},
                {"part": "the exercises' checks", "ranks": "2-3", "backend": "gloo", "device": "cpu", "profile": "-",
                 "sizes": "their own small cases"}]
        text = f"what runs where ({gpus} GPU{'s' * (gpus != 1)} visible):\n" + format_table(rows)
        if r.why:  # CPU ranks standing in for GPUs: what that changes, and how to get the day's own
            text += (f"\nwhy: {r.why}: the launches run on {r.world_size} CPU ranks at the tiny sizes; their times "
                     f"are CPU times (GPU claims: not measurable here), bytes and counts exact. A node with enough "
                     f"GPUs runs the day's own ranks.")
        return text


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
        raise ValueError(f"no presets for day {day!r}; known days: {', '.join(DAYS)}")  # by number
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
    folder or lacks what the day reads (`dlo.data.check`), then the day's own preflight
    (`dlo.registry.DaySpec.preflight`: Day 5's weights and plan).
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
    ranks = resolve_ranks(day, world_size, profile, preset, dev, max_steps, smoke, more)
    run = Run(day=day, profile=profile, device=dev, seed=seed, ranks=ranks,
              data_dir=Path(data_dir) if data_dir else None,
              log_dir=Path(log_dir or "runs"),  # beside the notebook: <day>/runs/<configuration>, no day twice
              preset=preset, params=params)
    from dlo.data.check import check_data
    check_data(run)  # what the day reads from data_dir, or one line (DataError): never a silent synthetic fallback
    if DAYS[day].preflight:
        DAYS[day].load(DAYS[day].preflight)(run)
    return run


def setup(day: str, profile: str = "auto", device: str = "auto", seed: int = 0, max_steps: int = 0,
          world_size: int = 0, data_dir: str = "", log_dir: str = "", **more: Any) -> Run:
    """`resolve` the notebook's parameters (its one-line ValueError before any work), make the log
    folder, set torch's threads (`dlo.cpus.notebook_threads`), seed every RNG and print a summary line."""
    run = resolve(day, profile, device, seed, max_steps, world_size, data_dir, log_dir, **more)
    run.log_dir.mkdir(parents=True, exist_ok=True)
    start_session()  # this session's TensorBoard curves replace an earlier run's (dlo.tb.writer)
    # threads from the cores this process may use, never spinning ones against a busy machine (dlo.cpus)
    torch.set_num_threads(notebook_threads(run.profile, run.device.type))
    seed_everything(seed)
    print(run)
    if hasattr(run.preset, "world_size"):  # a day that launches ranks
        print(run.where())
    return run
