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


@dataclass
class Run:
    """What a notebook needs after its parameters cell: resolved scale, device and folders."""

    day: str
    profile: str
    device: torch.device
    seed: int
    world_size: int
    data_dir: Path | None
    log_dir: Path
    preset: Any

    def writer(self, name: str):
        """A TensorBoard SummaryWriter logging under log_dir/name."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.log_dir / name))

    def __str__(self) -> str:
        data = self.data_dir or "synthetic"
        return (f"{self.day}: profile={self.profile} device={self.device} seed={self.seed} "
                f"world_size={self.world_size} data={data} logs={self.log_dir}\n  {self.preset}")


def get_preset(day: str, profile: str, max_steps: int = 0, **overrides: Any) -> Any:
    from dlo.presets import PRESETS

    if day not in PRESETS:
        raise ValueError(f"no presets for day {day!r}; known days: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[day][profile]
    if max_steps > 0:
        overrides["max_steps"] = max_steps
    unknown = set(overrides) - {f.name for f in dataclasses.fields(preset)}
    if unknown:
        raise ValueError(f"{type(preset).__name__} has no field(s) {sorted(unknown)}")
    return dataclasses.replace(preset, **overrides)


def setup(day: str, profile: str = "auto", device: str = "auto", seed: int = 0, max_steps: int = 0,
          world_size: int = 1, data_dir: str = "", log_dir: str = "", **overrides: Any) -> Run:
    """Resolve a notebook's parameters into a `Run`, seed every RNG and print a summary line."""
    profile = resolve_profile(profile)
    dev = resolve_device(device)
    if data_dir and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data_dir={data_dir!r} is not a folder; leave it empty for synthetic data")
    run = Run(day=day, profile=profile, device=dev, seed=seed, world_size=world_size,
              data_dir=Path(data_dir) if data_dir else None,
              log_dir=Path(log_dir or os.path.join("runs", day, "tb")),
              preset=get_preset(day, profile, max_steps, **overrides))
    run.log_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    print(run)
    return run
