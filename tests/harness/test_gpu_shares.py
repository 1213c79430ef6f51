"""Findings 3 and 4 of issue 32, with a mocked device count and the parent's CUDA_VISIBLE_DEVICES: grading slots
take their GPUs from the parent's entries (a job given 4,5,6,7 hands out 4,5 and 6,7, never 0,1 and 2,3), and
`dlo run` never lets two notebooks on GPUs share one (one at a time with every GPU, or disjoint shares that hold
what each day wants; a --jobs that would not is refused in one line). No notebook runs: papermill is mocked."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path

import pytest
import torch

from dlo import nvidia
from dlo.errors import BadInput
from dlo.harness import run, shares


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """A process given `n` GPUs named `names` by its job (CUDA_VISIBLE_DEVICES), on a node with the driver."""
    def given(names: str):
        n = len(names.split(","))
        (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06\n")
        monkeypatch.setattr(nvidia, "DRIVER_FILES", (tmp_path / "version",))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", names)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return given


def test_grading_slots_share_out_the_parents_gpus(gpus):
    gpus("4,5,6,7")
    assert [shares.slot_env(s, 2, "full")["CUDA_VISIBLE_DEVICES"] for s in (0, 1)] == ["4,5", "6,7"]
    gpus("GPU-8f2a,GPU-11c0,MIG-GPU-8f2a/1/0")
    assert [shares.slot_env(s, 3, "full")["CUDA_VISIBLE_DEVICES"] for s in range(3)] == [
        "GPU-8f2a", "GPU-11c0", "MIG-GPU-8f2a/1/0"]
    assert "CUDA_VISIBLE_DEVICES" not in shares.slot_env(0, 1, "full")  # alone: the parent's GPUs as they are


def test_without_the_nvidia_driver_grading_counts_no_gpu_and_does_not_ask_torch(monkeypatch, tmp_path):
    from dlo.distributed import placement

    monkeypatch.setattr(nvidia, "DRIVER_FILES", (tmp_path / "absent",))
    monkeypatch.setattr(placement, "cuda_count", lambda: pytest.fail("torch asked on a machine without a driver"))
    assert shares.gpus("auto") == shares.gpus("full") == 0
    assert "CUDA_VISIBLE_DEVICES" not in shares.slot_env(0, 2, "auto")


# Days 5 and 7 want 8 ranks (the full presets' world_size), Days 1 and 2 one GPU.
WANTS = {"day1_optimizers": 1, "day2_mixed_precision": 1, "day5_fsdp": 8, "day7_tensor_parallel": 8}


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    """`dlo.harness.run.main` with every day resolved on CUDA at its world size, and notebooks that only record
    the GPUs they were given and who ran beside them."""
    seen, running, lock = {}, set(), threading.Lock()
    monkeypatch.setattr(run, "select_days", lambda root, days, all_days, notebooks: days)
    monkeypatch.setattr(run, "build_parameters", lambda src, profile, pairs: {})
    monkeypatch.setattr(run, "check_day", lambda day, src, params, smoke=False: types.SimpleNamespace(
        device=torch.device("cuda"), world_size=WANTS[day]))
    monkeypatch.setattr(run, "default_jobs", lambda: 2)  # what 2 cores or more give

    def notebook(src, dest, params, timeout, cell_timeout, smoke=False, env=None):
        import os

        day = Path(src).parent.name
        mine = set((env or {}).get("CUDA_VISIBLE_DEVICES", os.environ["CUDA_VISIBLE_DEVICES"]).split(","))
        with lock:
            running.add(day)
            seen[day] = (mine, set(running) - {day})
        time.sleep(0.3)  # long enough for a notebook started beside it to be seen
        with lock:
            running.discard(day)
        return "ok", 0.3

    monkeypatch.setattr(run, "run_notebook", notebook)

    def main(days, jobs=None):
        seen.clear()
        code = run.main(tmp_path, days, False, "full", [], "solutions", str(tmp_path / "out"), 60, 60, jobs=jobs)
        assert code == 0
        return seen
    return main


def test_notebooks_on_gpus_never_share_one(gpus, fake_run, capsys):
    gpus("0,1,2,3,4,5,6,7")
    seen = fake_run(["day5_fsdp", "day7_tensor_parallel"])  # 8 ranks each on 8 GPUs: one at a time
    assert seen["day5_fsdp"][1] == set() and seen["day7_tensor_parallel"][1] == set()
    assert seen["day5_fsdp"][0] == {str(g) for g in range(8)}  # every GPU
    seen = fake_run(["day1_optimizers", "day2_mixed_precision"], jobs=2)  # 1 GPU each: side by side, disjoint
    shares = sorted(sorted(seen[day][0]) for day in ("day1_optimizers", "day2_mixed_precision"))
    assert shares == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    capsys.readouterr()


def test_jobs_that_would_leave_a_day_without_its_gpus_are_refused(gpus, fake_run):
    gpus("4,5,6,7")
    with pytest.raises(BadInput, match=r"--jobs 2: 4 GPU\(s\) split 2 ways leave 2 per notebook, but day5_fsdp "
                                       r"wants 4; use --jobs 1"):
        fake_run(["day1_optimizers", "day5_fsdp"], jobs=2)
    seen = fake_run(["day1_optimizers", "day2_mixed_precision"], jobs=2)
    shares = sorted(sorted(seen[day][0]) for day in ("day1_optimizers", "day2_mixed_precision"))
    assert shares == [["4", "5"], ["6", "7"]]  # the parent's GPUs, not 0-3
