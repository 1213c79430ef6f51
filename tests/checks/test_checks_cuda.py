"""The checks' CUDA paths (GPU only; bench/gpu_steps.py's gpu_tests step runs this file on a lent GPU):
Day 2's autocast trial (GPU_TOL), Day 3's checkpoint (the CUDA RNG) and offload (the device's memory freed)
with the instructors' solutions, and an offload that keeps a clone on the device, which only the device's
allocator shows (on a CPU .cpu() is the same storage and nothing is offloaded)."""

from __future__ import annotations

import re

import pytest
import torch

from dlo.checks import day2, day3
from tests.checks.conftest import load_solution

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def sol2():
    return load_solution("day2_mixed_precision")


@pytest.fixture(scope="module")
def sol3():
    return load_solution("day3_checkpointing")


@pytest.mark.parametrize("seed", [0, 1])
def test_autocast_step_on_cuda(sol2, seed):
    day2.check_autocast_train_step(sol2.autocast_train_step, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_checkpoint_and_offload_on_cuda(sol3, seed):
    day3.check_checkpoint_function(sol3.Checkpoint, seed=seed, device="cuda")
    day3.check_offload_hooks(sol3.pack, sol3.unpack, seed=seed, device="cuda")


_ON_DEVICE: list = []


def pack_keeps_a_device_clone(t):
    """A full host copy to show, and a clone kept on t's device for unpack's fast path."""
    _ON_DEVICE.append(t.clone())
    return t.device, t.cpu(), len(_ON_DEVICE) - 1


def unpack_the_device_clone(packed):
    return _ON_DEVICE[packed[2]]


@pytest.mark.parametrize("seed", [0, 3])
def test_offload_rejects_a_clone_kept_on_the_device(seed):
    with pytest.raises(AssertionError, match=re.escape("pack kept a copy on the device")):
        day3.check_offload_hooks(pack_keeps_a_device_clone, unpack_the_device_clone, seed=seed, device="cuda")
