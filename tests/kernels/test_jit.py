"""When Triton's JIT cannot build its CUDA launcher (a node without a C compiler, the Python headers or
libcuda), every kernel fails at its first launch with one line naming the cause and `dlo doctor`, and no
kernel falls back to its torch reference: a benchmark refuses (dlo.kernels.runtime's docstring says why).
Simulated on a CPU: torch is told CUDA is available, and the build Triton's CUDA driver does on first use
is Triton's own build of a C file, run without a compiler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton.runtime.build import compile_module_from_src
from triton.runtime.driver import DriverConfig

from dlo.cli import main as cli_main
from dlo.kernels import flash_attention, runtime
from dlo.kernels.runtime import JITUnavailable, kernel_available
from tests.fake_gpu import jit_prerequisites


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine as the kernels' launch path sees it; the launcher's build is the test's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "_launcher_built", False)
    builds = []

    def use(build):
        def active(self):
            builds.append(1)
            return build()
        monkeypatch.setattr(DriverConfig, "active", property(active))
        return builds
    return use


def triton_builds_a_c_file():
    """What Triton's CUDA driver does first (CudaUtils: compile_module_from_src of driver.c)."""
    return compile_module_from_src(src="/* dlo test: the launcher */ int dlo_launcher;", name="cuda_utils")


def test_no_compiler_is_one_line_naming_it_and_dlo_doctor(tmp_path, monkeypatch, gpu):
    jit_prerequisites(tmp_path, monkeypatch, cc=False)
    builds = gpu(triton_builds_a_c_file)
    with pytest.raises(JITUnavailable) as err:
        kernel_available("cuda")
    message = str(err.value)
    assert "\n" not in message and message.startswith("Triton cannot build its CUDA launcher here, so no kernel "
                                                      "can run: no C compiler (Triton uses $CC, else gcc, else clang")
    assert "`dlo doctor`" in message and "libcuda" not in message and "Python.h" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # not Triton's traceback under it
    with pytest.raises(JITUnavailable):
        kernel_available(torch.device("cuda", 0))  # tried again: a fixed PATH needs no restart
    assert len(builds) == 2


def test_a_failure_without_a_known_cause_keeps_triton_s_error(tmp_path, monkeypatch, gpu):
    jit_prerequisites(tmp_path, monkeypatch)

    def broken():
        raise RuntimeError("ptxas fell over\nand more lines")

    gpu(broken)
    with pytest.raises(JITUnavailable, match=r"can run: RuntimeError: ptxas fell over \(`dlo doctor`") as err:
        kernel_available("cuda")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_the_launcher_is_built_once_per_process_and_not_on_cpu_tensors(tmp_path, monkeypatch, gpu):
    builds = gpu(lambda: SimpleNamespace(utils=object()))
    assert kernel_available("cpu") is False and builds == []
    assert kernel_available("cuda") and kernel_available("cuda:1") and builds == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "_launcher_built", False)
    assert kernel_available("cuda") and builds == [1]  # no CUDA at all: torch's own error comes at the launch


def test_a_benchmark_refuses_rather_than_time_the_reference(tmp_path, monkeypatch, gpu, capsys):
    jit_prerequisites(tmp_path, monkeypatch, headers=False)
    gpu(triton_builds_a_c_file)
    monkeypatch.setattr(flash_attention, "flash_attention_ref",
                        lambda *a, **k: pytest.fail("the reference ran in the kernel's place"))
    with pytest.raises(JITUnavailable, match="no Python.h in"):
        flash_attention.bench()
    assert cli_main(["bench", "flash_attention", "--out", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dlo bench: Triton cannot build its CUDA launcher here")
    assert not (tmp_path / "results").exists()
