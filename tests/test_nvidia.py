"""dlo.nvidia: a GPU that torch cannot use is said in one line with its fix, and profile="auto" warns with it
instead of running the tiny profile unnoticed on a GPU node (issue 32: a .venv installed on a login node)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dlo import config, nvidia
from tests.fake_gpu import fake_gpu_node, no_gpu

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("DLO_PROFILE", raising=False)
    monkeypatch.setattr(config, "_warned", set(), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    nvidia.driver.cache_clear()
    yield
    nvidia.driver.cache_clear()


def test_auto_on_a_gpu_node_with_torchs_cpu_build_warns_in_one_line_once(tmp_path, monkeypatch, capsys):
    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert config.resolve_profile("auto") == "tiny"
    assert config.resolve_profile("auto") == "tiny"
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dlo profile: warning: 'auto' runs the tiny profile on the CPU: torch ")
    assert "is a CPU build but nvidia-smi lists 1 GPU(s) here (NVIDIA H100 80GB HBM3, driver 580.65.06)" in line
    assert "make venv GPU=1" in line


def test_a_profile_asked_for_or_gpus_hidden_on_purpose_say_nothing(tmp_path, monkeypatch, capsys):
    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert config.resolve_profile("tiny") == "tiny"
    monkeypatch.setenv("DLO_PROFILE", "tiny")
    assert config.resolve_profile("auto") == "tiny"
    monkeypatch.delenv("DLO_PROFILE")
    for hidden in ("", "-1", "NoDevFiles"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert config.resolve_profile("auto") == "tiny"
    assert capsys.readouterr().err == ""


def test_without_the_drivers_files_nvidia_smi_is_never_started(tmp_path, monkeypatch, capsys):
    calls = no_gpu(tmp_path, monkeypatch)
    assert config.resolve_profile("auto") == "tiny"
    assert nvidia.driver() is None and nvidia.unused_gpu(ask_torch=True) is None
    assert not calls.exists() and capsys.readouterr().err == ""


def test_a_driver_file_but_nvidia_smi_failing_is_no_gpu(tmp_path, monkeypatch):
    calls = fake_gpu_node(tmp_path, monkeypatch, answers=False)
    assert nvidia.driver() is None and nvidia.unused_gpu() is None
    assert calls.read_text().count("called") == 1


def test_the_minimum_driver_follows_nvidias_table():
    assert nvidia.too_old("575.57.08", "13.0") == "580"
    assert nvidia.too_old("580.65.06", "13.0") is None and nvidia.too_old("590.1", "13.1") is None
    assert nvidia.too_old("520.61.05", "12.8") == "525.60.13"
    assert nvidia.too_old("525.60.13", "12.8") is None and nvidia.too_old("535.54.03", "12.4") is None
    assert nvidia.too_old("450.51", "11.8") == "450.80.02"
    assert nvidia.too_old("100.0", "99.0") is None  # a CUDA major not in the table: no claim


def test_cuda_build_on_a_driver_too_old_names_the_minimum(tmp_path, monkeypatch, capsys):
    fake_gpu_node(tmp_path, monkeypatch, driver="550.54.15", gpus=("NVIDIA A100-SXM4-40GB",) * 4)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    reason = nvidia.unused_gpu()
    assert "built for CUDA 13.0, which needs an NVIDIA driver >= 580" in reason
    assert "nvidia-smi lists 4 GPU(s) here (NVIDIA A100-SXM4-40GB, driver 550.54.15)" in reason
    assert config.resolve_profile("auto") == "tiny"
    assert "needs an NVIDIA driver >= 580" in capsys.readouterr().err


def test_cuda_build_that_sees_no_gpu_gives_torchs_reason_when_asked(tmp_path, monkeypatch):
    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        raise RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.\nmore")

    monkeypatch.setattr(torch.cuda, "init", init)
    assert nvidia.unused_gpu().endswith("`dlo doctor` prints torch's reason")  # a notebook never asks torch
    assert nvidia.unused_gpu(ask_torch=True).endswith(
        ": CUDA driver initialization failed, you might not have a CUDA gpu.")


def test_a_cpu_build_is_told_when_the_driver_is_too_old_for_the_cuda_lock_too(tmp_path, monkeypatch):
    fake_gpu_node(tmp_path, monkeypatch, driver="570.86.15")
    monkeypatch.setattr(torch.version, "cuda", None)
    reason = nvidia.unused_gpu()
    assert "is a CPU build" in reason and "its CUDA 13.0 needs a driver >= 580" in reason


def test_the_locked_cuda_is_the_one_of_gpu_txt():
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (REPO / "requirements" / "gpu.txt").read_text(), flags=re.M))
    assert pins["cuda-bindings"].split(".")[:2] == nvidia.LOCKED_CUDA.split(".")  # cuda-bindings 13.0.x: CUDA 13.0
    assert nvidia.min_driver(nvidia.LOCKED_CUDA) == "580"  # what the README and environment.yml say


def test_dlo_run_says_it_once_before_any_notebook_starts(tmp_path, monkeypatch, capsys):
    from dlo.harness.run import check_day

    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    for day in ("day1_optimizers", "day3_checkpointing"):  # every day's parameters are resolved first
        check_day(day, REPO / "solutions" / day / f"{day}.ipynb", {"profile": "auto"})
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dlo profile: warning: 'auto' runs the tiny profile on the CPU: ")
