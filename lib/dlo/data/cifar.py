"""CIFAR-10: the official binary files when `data_dir` is given, else a synthetic stand-in of the same shape.

Binary format (https://www.cs.toronto.edu/~kriz/cifar.html): each record is 1 label byte followed by
3072 pixel bytes, 1024 per channel (R, G, B), each channel row-major 32x32. A `data_dir` that is given
but does not hold them (the Python version, a tarball not unpacked, a truncated batch) is a one-line
`DataError`, never a silent fallback to synthetic data.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from dlo.data.layout import CIFAR_BIN, CIFAR_BIN_TAR, CIFAR_PY, DataError, how_to_get_cifar10

TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
RECORD = 1 + 3 * 32 * 32
BATCH_BYTES = 10_000 * RECORD  # every batch file of the official release: 10000 records


def cifar10_folder(data_dir: str | Path) -> Path:
    """`data_dir/cifar-10-batches-bin`, or `data_dir` itself, whichever holds the six binary batch files;
    else DataError saying what is there instead (the Python version, the tarball, part of the files)."""
    data_dir = Path(data_dir)
    names = TRAIN_FILES + TEST_FILES
    for folder in (data_dir / CIFAR_BIN, data_dir):
        present = [n for n in names if (folder / n).is_file()]
        if len(present) == len(names):
            return folder
        if present:
            missing = ", ".join(n for n in names if n not in present)
            raise DataError(f"{folder} lacks {missing} of CIFAR-10's binary version (an unpack cut short?): "
                            f"{how_to_get_cifar10(data_dir)}")
    python = [n for n in (CIFAR_PY, "data_batch_1", "cifar-10-python.tar.gz") if (data_dir / n).exists()]
    if python:
        raise DataError(f"{data_dir} holds {python[0]}, CIFAR-10's Python version; the course reads the binary "
                        f"version: {how_to_get_cifar10(data_dir)}")
    if (data_dir / CIFAR_BIN_TAR).is_file():
        raise DataError(f"{data_dir} holds {CIFAR_BIN_TAR}, not unpacked: tar xzf {data_dir / CIFAR_BIN_TAR} "
                        f"-C {data_dir}")
    raise DataError(f"{data_dir} has no {CIFAR_BIN}/ (CIFAR-10's binary version): {how_to_get_cifar10(data_dir)}")


def check_cifar10(data_dir: str | Path) -> str:
    """What the image days read, held to the official release (the six file names, 10000 records of
    3073 bytes each) without reading a byte of it: a description, or DataError (one line)."""
    folder = cifar10_folder(data_dir)
    wrong = [f"{n} has {size:,} bytes" for n in TRAIN_FILES + TEST_FILES
             if (size := (folder / n).stat().st_size) != BATCH_BYTES]
    if wrong:
        raise DataError(f"{folder}: {', '.join(wrong)}, not {BATCH_BYTES:,} (10000 records of {RECORD} bytes): "
                        f"a truncated or different download; {how_to_get_cifar10(data_dir)}")
    return f"CIFAR-10 binary version in {folder}: 50,000 training and 10,000 test images"


def load_cifar10_binary(data_dir: str | Path, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the binary split: x uint8 (N, 3, 32, 32), y int64 (N,). Any whole number of records is
    read (the tests' small files); `check_cifar10` holds a folder to the release's sizes."""
    folder = cifar10_folder(data_dir)
    records = []
    for name in TRAIN_FILES if train else TEST_FILES:
        raw = np.fromfile(folder / name, dtype=np.uint8)
        if raw.size == 0 or raw.size % RECORD:
            raise DataError(f"{folder / name} has {raw.size} bytes, not a whole number of {RECORD}-byte records")
        records.append(raw.reshape(-1, RECORD))
    data = np.concatenate(records)  # (N, 3073)
    y = torch.from_numpy(data[:, 0].astype(np.int64))
    x = torch.from_numpy(data[:, 1:].copy()).view(-1, 3, 32, 32)
    return x, y


def _templates(num_classes: int, image_size: int, gen: torch.Generator) -> torch.Tensor:
    """One smooth colour pattern per class: a sum of 3 random plane waves per channel, in [0, 1]."""
    coords = torch.linspace(0, 1, image_size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")  # (H, W)
    shape = (num_classes, 3, 3, 1, 1)  # (class, channel, wave, H, W)
    freq = 0.5 + 2.5 * torch.rand(shape, generator=gen)  # cycles per image: low, so the pattern is smooth
    angle = 2 * math.pi * torch.rand(shape, generator=gen)
    phase = 2 * math.pi * torch.rand(shape, generator=gen)
    waves = torch.cos(2 * math.pi * freq * (xx * torch.cos(angle) + yy * torch.sin(angle)) + phase)
    colour = 0.3 + 0.4 * torch.rand(num_classes, 3, 1, 1, generator=gen)
    return (colour + 0.12 * waves.sum(dim=2)).clamp(0, 1)  # (K, 3, H, W)


def synthetic_cifar10(n: int, *, seed: int = 0, num_classes: int = 10, image_size: int = 32,
                      noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic CIFAR-shaped task: x float (N, 3, H, W) in about [0, 1], y int64 (N,).

    The class templates are fixed (independent of `seed`), so two seeds draw two samples of the same
    task (train and test). Each image is its class template mixed with another class's (up to 45%),
    circularly shifted anywhere, contrast- and brightness-jittered, plus Gaussian pixel noise:
    learnable (a small CNN beats chance within a few dozen steps), but not trivially.
    """
    if n < 1 or num_classes < 2 or image_size < 4:
        raise ValueError(f"need n >= 1, num_classes >= 2, image_size >= 4; got {n}, {num_classes}, {image_size}")
    templates = _templates(num_classes, image_size, torch.Generator().manual_seed(2024))
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    other = (y + torch.randint(1, num_classes, (n,), generator=gen)) % num_classes  # a different class
    mix = 0.45 * torch.rand(n, 1, 1, 1, generator=gen)
    x = (1 - mix) * templates[y] + mix * templates[other]  # (N, 3, H, W)
    # Any circular shift: the class lives in the pattern, not its position, so a linear model on pixels is
    # left with colour cues (about 50%) while a CNN's translation invariance pays off.
    shifts = torch.randint(0, image_size, (n, 2), generator=gen)
    x = torch.stack([torch.roll(img, (int(dy), int(dx)), dims=(1, 2)) for img, (dy, dx) in zip(x, shifts)])
    contrast = 0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=gen)
    brightness = 0.1 * torch.randn(n, 1, 1, 1, generator=gen)
    x = (x - 0.5) * contrast + 0.5 + brightness + noise * torch.randn(x.shape, generator=gen)
    return x, y


def _normalise(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel standardisation with the training set's statistics (the test set must not leak in)."""
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True)
    return (x_train - mean) / std, (x_test - mean) / std


def _subset(x: torch.Tensor, y: torch.Tensor, n: int, gen: torch.Generator, split: str):
    if n > len(y):
        raise ValueError(f"asked for {n} {split} images but the {split} split has only {len(y)}")
    idx = torch.randperm(len(y), generator=gen)[:n]
    return x[idx], y[idx]


def cifar10(data_dir: str | Path | None = None, *, n_train: int, n_test: int, seed: int = 0,
            image_size: int = 32) -> tuple[TensorDataset, TensorDataset]:
    """Train and test TensorDatasets of normalised float images (N, 3, S, S) and int64 labels.

    Real CIFAR-10 (a seeded random subset, resized if image_size != 32) when `data_dir` is given (its
    binary files, else DataError: never a silent fallback), else `synthetic_cifar10`; prints which one.
    """
    if data_dir is not None and str(data_dir) != "":
        gen = torch.Generator().manual_seed(seed)
        x_tr, y_tr = _subset(*load_cifar10_binary(data_dir, train=True), n_train, gen, "train")
        x_te, y_te = _subset(*load_cifar10_binary(data_dir, train=False), n_test, gen, "test")
        x_tr, x_te = x_tr.float() / 255, x_te.float() / 255
        if image_size != 32:
            # Area interpolation averages pixels: the honest way to shrink an image.
            x_tr = F.interpolate(x_tr, size=(image_size, image_size), mode="area")
            x_te = F.interpolate(x_te, size=(image_size, image_size), mode="area")
        print(f"data: CIFAR-10 from {data_dir} ({n_train} train, {n_test} test, {image_size}x{image_size})")
    else:
        # A distinct seed stream for the test set: fresh samples of the same task.
        x_tr, y_tr = synthetic_cifar10(n_train, seed=seed, image_size=image_size)
        x_te, y_te = synthetic_cifar10(n_test, seed=seed + 100_003, image_size=image_size)
        print(f"data: synthetic CIFAR-10 stand-in ({n_train} train, {n_test} test, {image_size}x{image_size})")
    x_tr, x_te = _normalise(x_tr, x_te)
    return TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te)
