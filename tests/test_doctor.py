"""dlo.doctor: one line per topic, FIX with the fix when something is missing, bad input refused first."""

import subprocess
from types import SimpleNamespace

import pytest
import torch
from triton.runtime.driver import DriverConfig

from dlo import doctor, nvidia
from dlo.cli import main as cli_main
from dlo.kernels import runtime
from tests.data.folders import write_cifar_release, write_tokens
from tests.fake_gpu import fake_gpu_node, jit_prerequisites

H100 = ("NVIDIA H100", 79.6, (9, 0))


def test_this_machine_reports_every_topic(capsys):
    assert cli_main(["doctor", "day4_ddp"]) in (0, 1)  # FIX lines are findings about the machine, not errors
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out][:6] == ["torch", "gpus", "triton", "jit", "bwrap", "data"]
    assert all(line.startswith(("ok ", "FIX")) for line in out)


def test_triton_compiles_for_the_gpu_found_and_says_when_it_cannot():
    ok, _, text = doctor.triton_line([H100])
    assert ok and "sm_90" in text, text
    ok, _, text = doctor.triton_line([("old", 4.0, (1, 0))])  # no such architecture: ptxas refuses
    assert not ok and "cannot compile for sm_10" in text


def test_the_triton_check_compiles_in_a_cache_of_its_own(tmp_path, monkeypatch):
    """Two processes compiling the same kernel into one Triton cache can fail (triton-lang/triton#11512): the
    cause of this file's one flaky failure in make test. The check leaves the shared cache untouched."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "shared"))
    ok, _, text = doctor.triton_line([H100])
    assert ok, text
    assert not (tmp_path / "shared").exists() or not any((tmp_path / "shared").iterdir())
    import triton
    assert triton.knobs.cache.dir == str(tmp_path / "shared")  # the scope put it back


def test_plan_fits_four_h100_but_not_one_small_gpu():
    assert all(ok for ok, _, _ in doctor.plan_lines(["day4_ddp"], [H100] * 4))
    [(ok, topic, text)] = doctor.plan_lines(["day4_ddp"], [("small", 1.0, (8, 0))])
    assert not ok and topic == "plan day4_ddp" and "does not fit 1 x 1 GiB" in text


def test_data_folder_without_cifar_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_PROFILE", "tiny")
    ok, _, text = doctor.data_line(tmp_path)
    assert not ok and "cifar-10-batches-bin" in text
    (tmp_path / "cifar-10-batches-bin").mkdir()  # an empty folder is not CIFAR-10 (it was "ok")
    assert not doctor.data_line(tmp_path)[0]
    write_cifar_release(tmp_path)
    write_tokens(tmp_path)
    assert doctor.data_line(tmp_path)[0]


def test_bad_input_is_one_line_before_any_check(tmp_path, capsys):
    assert cli_main(["doctor", "day9_nothing"]) == 2
    assert cli_main(["doctor", "--data-dir", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 2


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no GPU; the test says which build it is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    nvidia.driver.cache_clear()


def test_nvidia_smi_answering_with_torchs_cpu_build_is_a_fix_line(tmp_path, monkeypatch, capsys, no_cuda):
    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli_main(["doctor", "day1_optimizers"]) == 1
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["torch"].startswith("FIX  torch  ") and "make venv GPU=1" in lines["torch"]
    assert "is a CPU build but nvidia-smi lists 1 GPU(s)" in lines["torch"]
    assert "none visible to torch; nvidia-smi lists 1 (NVIDIA H100 80GB HBM3, driver 580.65.06)" in lines["gpus"]


def test_a_driver_too_old_for_the_cuda_build_is_a_fix_line(tmp_path, monkeypatch, no_cuda):
    fake_gpu_node(tmp_path, monkeypatch, driver="575.57.08")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    ok, topic, text = doctor.torch_line()
    assert not ok and topic == "torch" and "CUDA 13.0, which needs an NVIDIA driver >= 580" in text
    assert "driver 575.57.08" in text


def test_a_cuda_build_that_sees_no_gpu_says_torchs_reason(tmp_path, monkeypatch, no_cuda):
    fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        raise RuntimeError("No CUDA GPUs are available")

    monkeypatch.setattr(torch.cuda, "init", init)
    ok, _, text = doctor.torch_line()
    assert not ok and text.endswith("sees no GPU although nvidia-smi lists 1 GPU(s) here (NVIDIA H100 80GB HBM3, "
                                    "driver 580.65.06): No CUDA GPUs are available")


def test_triton_jit_prerequisites_each_get_their_fix(tmp_path, monkeypatch, no_cuda):
    fake_gpu_node(tmp_path, monkeypatch)
    jit_prerequisites(tmp_path, monkeypatch, cc=False, headers=False, libcuda=False)
    ok, topic, text = doctor.jit_line([])
    assert not ok and topic == "jit" and text.startswith("Triton cannot build its CUDA launcher: ")
    assert "no C compiler (Triton uses $CC, else gcc, else clang on PATH)" in text
    assert f"no Python.h in {tmp_path / 'include'}" in text and "no libcuda.so.1" in text
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert f"CC={tmp_path / 'no-such-cc'} is not a command" in doctor.jit_line([])[2]
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert "is not writable: set TRITON_CACHE_DIR" in doctor.jit_line([])[2]


def test_triton_jit_with_every_prerequisite_is_ok_and_not_needed_without_a_gpu(tmp_path, monkeypatch, no_cuda):
    jit_prerequisites(tmp_path, monkeypatch, cc=False, headers=False, libcuda=False)
    monkeypatch.setattr(nvidia, "DRIVER_FILES", (tmp_path / "absent",))
    nvidia.driver.cache_clear()
    assert doctor.jit_line([]) == (True, "jit", "not needed: no NVIDIA GPU here (the kernels run in Triton's "
                                                "interpreter)")
    fake_gpu_node(tmp_path, monkeypatch)
    jit_prerequisites(tmp_path, monkeypatch)
    ok, _, text = doctor.jit_line([])
    assert ok and text.startswith(f"its prerequisites are here ({tmp_path / 'tools' / 'gcc'}, Python.h, "
                                  f"libcuda.so.1 in {tmp_path / 'driver-lib'}); not built")


def test_on_a_gpu_doctor_builds_the_launcher_and_says_why_it_cannot(tmp_path, monkeypatch, no_cuda):
    fake_gpu_node(tmp_path, monkeypatch)
    jit_prerequisites(tmp_path, monkeypatch)
    monkeypatch.setattr(runtime, "_launcher_built", False)

    def broken(self):  # where Triton's CUDA driver compiles its launcher with the C compiler, and it fails
        raise subprocess.CalledProcessError(1, ["gcc", "cuda_utils.c"])

    monkeypatch.setattr(DriverConfig, "active", property(broken))
    ok, _, text = doctor.jit_line([H100])
    assert not ok and "CalledProcessError: Command '['gcc', 'cuda_utils.c']'" in text and "`dlo doctor`" in text
    monkeypatch.setattr(DriverConfig, "active", property(lambda self: SimpleNamespace(utils=object())))
    assert doctor.jit_line([H100]) == (True, "jit", f"builds Triton's CUDA launcher ({tmp_path / 'tools' / 'gcc'}, "
                                                    f"Python.h, libcuda.so.1 in {tmp_path / 'driver-lib'})")
