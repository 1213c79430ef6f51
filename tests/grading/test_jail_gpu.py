"""The sandbox's GPU side on a CPU machine: the device nodes a GPU node has (mocked: `glob` and a fake
`nvidia-modprobe` on PATH) and the bwrap arguments and environment the jail builds from them. CUDA itself
in the sandbox is `bench/gpu_steps.py sandbox` on a GPU (the GPU session)."""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path

import pytest

from dlo.grading import jail
from dlo.grading.jail import Spec

H200_NODES = ["/dev/nvidia0", "/dev/nvidia-caps", "/dev/nvidia-modeset", "/dev/nvidiactl"]  # before any CUDA start
UVM_NODES = ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


@pytest.fixture
def gpu_node(monkeypatch, tmp_path):
    """A machine with one NVIDIA GPU whose /dev/nvidia-uvm appears once `nvidia-modprobe -u` ran (a
    fake on PATH that records its arguments), and a user who is not root (bwrap's user namespace)."""
    made = tmp_path / "modprobe-args"
    fake = tmp_path / "bin" / "nvidia-modprobe"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {made}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")

    def nodes() -> list[str]:
        return H200_NODES + (UVM_NODES if made.exists() else [])

    def fake_glob(pattern: str) -> list[str]:
        return [n for n in nodes() if fnmatch.fnmatch(n, pattern)]

    monkeypatch.setattr(jail.glob, "glob", fake_glob)
    real = os.path.exists
    monkeypatch.setattr(jail.os.path, "exists", lambda p: p in nodes() if str(p).startswith("/dev/nvidia") else real(p))
    monkeypatch.setattr(jail, "as_root", lambda: False)
    return made


def _binds(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--dev-bind-try"]


def test_every_gpu_node_is_bound_once_and_uvm_is_made_first(gpu_node, tmp_path):
    """CUDA in the sandbox needs /dev/nvidia-uvm, which the driver makes at the machine's first CUDA start:
    the jail makes it before binding (inside, a private /dev and no new privileges forbid it), and binds
    each node once (the /dev/nvidia* pattern matches /dev/nvidia-caps as well)."""
    args = Spec(mode="bwrap", scratch=str(tmp_path / "work"), bwrap="/usr/bin/bwrap").runner_prefix()
    binds = _binds(args)
    assert sorted(binds) == sorted(H200_NODES + UVM_NODES)
    assert len(binds) == len(set(binds))
    assert gpu_node.read_text().split() == ["-u", "-c=0"]
    for node in binds:
        i = args.index(node)
        assert args[i - 1:i + 2] == ["--dev-bind-try", node, node]


def test_no_gpu_binds_nothing_and_makes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(jail.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(jail, "as_root", lambda: False)
    called = []
    monkeypatch.setattr(jail.subprocess, "run", lambda *a, **k: called.append(a))
    args = Spec(mode="bwrap", scratch=str(tmp_path / "work"), bwrap="/usr/bin/bwrap").runner_prefix()
    assert _binds(args) == [] and called == []


def test_the_compilers_caches_are_the_sandboxs_own(monkeypatch, tmp_path):
    """A grader whose environment points torch.compile's or Triton's caches at its own (hidden) folders:
    inside the sandbox both go to the sandbox's writable HOME, where uid 65534 can write."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "inductor"))
    monkeypatch.setenv("TRITON_HOME", str(Path.home()))
    monkeypatch.setattr(jail, "as_root", lambda: False)
    spec = Spec(mode="bwrap", scratch=str(tmp_path / "work"), bwrap="/usr/bin/bwrap")
    args = spec.runner_prefix()
    env = {args[i + 1]: args[i + 2] for i, a in enumerate(args) if a == "--setenv"}
    home = spec.runner_dir / ".home"
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME"):
        assert Path(env[name]).is_relative_to(home), name
