"""A GPU node as dlo.nvidia sees it, on a machine without one: the driver's file, and `nvidia-smi` as a script
first on PATH that lists GPUs with a driver version (or fails, as it does without a driver). torch's side is
the test's own (monkeypatch torch.cuda.is_available, torch.version.cuda)."""

from __future__ import annotations

from pathlib import Path

from dlo import nvidia

H100 = "NVIDIA H100 80GB HBM3"


def fake_gpu_node(tmp_path: Path, monkeypatch, driver: str = "580.65.06", gpus: tuple[str, ...] = (H100,),
                  answers: bool = True, path: str | None = None) -> Path:
    """Make this process see a node with `gpus` on NVIDIA driver `driver`; the returned file counts the
    calls of nvidia-smi (one line each). `path`: the rest of PATH after the fake's folder (default: the
    current PATH; "" for none, e.g. no compiler)."""
    import os

    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "nvidia-smi.calls"
    rows = "".join(f"echo '{driver}, {name}'\n" for name in gpus)
    body = rows + "exit 0\n" if answers else "echo 'NVIDIA-SMI has failed because it could not communicate " \
                                             "with the NVIDIA driver.'\nexit 9\n"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho called >> '{calls}'\n{body}")
    (bin_dir / "nvidia-smi").chmod(0o755)
    version = tmp_path / "proc-driver-nvidia-version"
    version.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}\n")
    monkeypatch.setattr(nvidia, "DRIVER_FILES", (version,))
    rest = os.environ.get("PATH", "") if path is None else path
    monkeypatch.setenv("PATH", f"{bin_dir}:{rest}" if rest else str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvidia.driver.cache_clear()
    return calls


def no_gpu(tmp_path: Path, monkeypatch) -> Path:
    """A machine without the driver's files; an nvidia-smi is on PATH anyway, to show it is never run."""
    calls = fake_gpu_node(tmp_path, monkeypatch)
    monkeypatch.setattr(nvidia, "DRIVER_FILES", (tmp_path / "absent",))
    return calls


def jit_prerequisites(tmp_path: Path, monkeypatch, cc: bool = True, headers: bool = True,
                      libcuda: bool = True) -> None:
    """What Triton's JIT needs to build its CUDA launcher, each present or not, whatever this machine has:
    a `gcc` on PATH (only the fake folder of `fake_gpu_node` and this one are on it), Python.h where
    sysconfig says, libcuda.so.1 through TRITON_LIBCUDA_PATH (else an ldconfig that lists none), and a
    Triton cache folder of the test's own."""
    import sysconfig

    from dlo.kernels import runtime

    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'fake-bin'}:{tools}")
    monkeypatch.delenv("CC", raising=False)
    if cc:
        (tools / "gcc").write_text("#!/bin/sh\nexit 1\n")
        (tools / "gcc").chmod(0o755)
    include = tmp_path / "include"
    include.mkdir(exist_ok=True)
    if headers:
        (include / "Python.h").write_text("/* fake */\n")
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(include)})
    ldconfig = tools / "ldconfig"
    ldconfig.write_text("#!/bin/sh\necho '12 libs found in cache `/etc/ld.so.cache`'\n")
    ldconfig.chmod(0o755)
    monkeypatch.setattr(runtime, "LDCONFIG", str(ldconfig))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    if libcuda:
        lib = tmp_path / "driver-lib"
        lib.mkdir(exist_ok=True)
        (lib / "libcuda.so.1").write_bytes(b"")
        monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(lib))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
