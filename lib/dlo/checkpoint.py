"""Training-state checkpoints that survive preemption: exact resume, atomic files, rotation, sharding.

An exact resume needs everything that decides the next step: weights, optimizer moments, the LR
scheduler's position, the AMP scaler's scale, every RNG (python, numpy, torch CPU and CUDA) and the
position in the data. `training_state` / `restore_training_state` gather and restore all of it.

A job can be killed at any instant, also in the middle of writing. `save_atomic` writes a temporary
file in the same folder, fsyncs it, renames it over the final name (os.replace is atomic on POSIX)
and fsyncs the folder, so a checkpoint file is either the complete old one or the complete new one.
`CheckpointManager` keeps the last N and resumes from the newest one that loads, warning about
(and skipping) any damaged file. `save_sharded` / `load_sharded` use torch.distributed.checkpoint:
each rank writes its own shards, and a load may use another world size (resharding).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------- RNG and data position

def rng_state() -> dict:
    """Every RNG a training step may draw from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved. torch's setters take CPU byte tensors only, and a checkpoint
    loaded with map_location="cuda" has moved them to the GPU (seen on an H200: "RNG state must be a
    torch.ByteTensor"), so they come back to the CPU first."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class ResumableBatches:
    """Endless shuffled mini-batches of tensors whose position can be saved and restored.

    Epoch e's order is a permutation drawn from (seed, e) alone, so the position is just
    (epoch, batch index): restoring it continues with exactly the batches an uninterrupted run sees.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int, seed: int = 0):
        n = len(tensors[0])
        if any(len(t) != n for t in tensors):
            raise ValueError(f"ResumableBatches: tensors have different lengths {[len(t) for t in tensors]}")
        if not 1 <= batch_size <= n:
            raise ValueError(f"ResumableBatches: batch_size must be in [1, {n}], got {batch_size}")
        self.tensors, self.batch_size, self.seed = tensors, batch_size, seed
        self.epoch, self.index = 0, 0
        self.per_epoch = n // batch_size  # drop the last partial batch

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        if self.index == self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.tensors[0]), generator=gen)
        rows = order[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        return tuple(t[rows] for t in self.tensors)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["batch_size"]) != (self.seed, self.batch_size):
            raise ValueError(f"ResumableBatches: checkpoint has seed/batch_size {state['seed']}/{state['batch_size']},"
                             f" this loader {self.seed}/{self.batch_size}; the batch order would differ")
        self.epoch, self.index = state["epoch"], state["index"]


# ----------------------------------------------------------------------------- whole training state

def training_state(model, optimizer, scheduler=None, scaler=None, loader=None, step: int = 0) -> dict:
    """One dict with everything needed to continue bit-identically from here."""
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "loader": loader.state_dict() if loader is not None else None,
            "rng": rng_state()}


def check_compatible(model, saved: dict) -> None:
    """Raise ValueError naming every missing, unexpected or wrongly shaped key, before anything loads."""
    own = model.state_dict()
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(saved))
              if isinstance(own[k], torch.Tensor) and tuple(own[k].shape) != tuple(saved[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else "",
                 f"shape mismatches [{'; '.join(shapes)}]" if shapes else ""]
        raise ValueError("checkpoint does not fit this model (another architecture or size?): "
                         + ", ".join(p for p in parts if p) + ". Nothing was loaded.")


def restore_training_state(state: dict, model, optimizer, scheduler=None, scaler=None, loader=None) -> int:
    """Load `state` into the live objects (model first checked key by key) and return its step."""
    check_compatible(model, state["model"])
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
        if obj is not None and state[name] is None:
            raise ValueError(f"the checkpoint holds no {name} state, but a {name} was passed to restore")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
        if obj is not None:
            obj.load_state_dict(state[name])
    set_rng_state(state["rng"])
    return state["step"]


# ----------------------------------------------------------------------------- atomic files

def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)  # makes the rename itself durable, not only the file's bytes
    os.close(fd)


def write_atomic(path, write, *, mode: str = "wb", durable: bool = True) -> Path:
    """`write(f)` into a temporary file beside `path`, then renamed onto it: a crash leaves either the old
    file or the new one, never half. durable=False skips the fsyncs: the rename stays atomic for a killed
    process (the bytes are in the page cache), only not for a machine that loses power."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # same filesystem
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # unpicklable object, full disk, Ctrl-C: no half-written file left behind
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)
    return path


def save_atomic(obj, path) -> Path:
    """torch.save `obj` to `path` so that a crash leaves either the old file or the new one, never half."""
    return write_atomic(path, lambda f: torch.save(obj, f))


class CheckpointManager:
    """`folder/<prefix>-<step>.pt` files: atomic saves, keep the last `keep_last`, resume from the newest good one."""

    def __init__(self, folder, keep_last: int = 3, prefix: str = "ckpt"):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.folder, self.keep_last, self.prefix = Path(folder), keep_last, prefix
        self.pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of the finished checkpoints, oldest first; temporary files are ignored."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := self.pattern.fullmatch(p.name))]
        return sorted(found)

    def save(self, state: dict, step: int) -> Path:
        path = save_atomic(state, self.folder / f"{self.prefix}-{step:08d}.pt")
        for _, old in self.checkpoints()[:-self.keep_last]:  # rotate only after the new one is safe
            old.unlink()
        return path

    def load_latest(self, map_location="cpu"):
        """(state, path) of the newest checkpoint that loads, or (None, None) when there is none.

        A damaged file (truncated copy, disk error) is skipped with a warning naming it, and the
        next older one is tried: one bad file must not cost the whole run.
        """
        for _, path in reversed(self.checkpoints()):
            try:
                return torch.load(path, map_location=map_location, weights_only=False), path
            except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for bad files
                warnings.warn(f"skipping unreadable checkpoint {path} ({type(err).__name__}: {err}); "
                              f"trying the previous one", RuntimeWarning, stacklevel=2)
        return None, None


# ----------------------------------------------------------------------------- sharded (distributed)

def _old_folder(folder: Path) -> Path:
    return folder.with_name(folder.name + ".old")


def save_sharded(state_dict: dict, folder) -> Path:
    """torch.distributed.checkpoint save of a (possibly DTensor-sharded) state dict, every rank calls it.

    The ranks write into `folder.partial`; after a barrier rank 0 moves the previous `folder` aside
    to `folder.old`, renames `folder.partial` to `folder`, and only then deletes `folder.old`. A kill
    at any instant leaves a whole checkpoint in `folder` or, between the two renames, in `folder.old`
    (which load_sharded falls back to); never a half-written one and never none.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    partial, old = folder.with_name(folder.name + ".partial"), _old_folder(folder)
    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    if main and partial.exists():
        shutil.rmtree(partial)
    if distributed:
        dist.barrier()
    dcp.save(state_dict, checkpoint_id=str(partial), no_dist=not distributed)
    if distributed:
        dist.barrier()
    if main:
        if folder.exists():
            if old.exists():  # left by a kill after an earlier swap: `folder` is the good one
                shutil.rmtree(old)
            os.replace(folder, old)
        os.replace(partial, folder)
        _fsync_dir(folder.parent)  # both renames durable before the previous checkpoint goes
        if old.exists():
            shutil.rmtree(old)
    if distributed:
        dist.barrier()
    return folder


def load_sharded(state_dict: dict, folder) -> dict:
    """Fill `state_dict` in place (its tensors or DTensors give the wanted layout) from a saved folder.

    When `folder` is missing but `folder.old` exists, save_sharded was killed between its two renames:
    `folder.old` is then the newest whole checkpoint and is loaded instead.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    if not folder.exists() and _old_folder(folder).is_dir():
        folder = _old_folder(folder)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a finished torch.distributed.checkpoint folder (no .metadata)")
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state_dict, checkpoint_id=str(folder), no_dist=not distributed)
    return state_dict
