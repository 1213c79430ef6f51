"""dlo.cpus: the cores a process may use (affinity, cgroup quota, SLURM) and a notebook's torch threads."""

from __future__ import annotations

import os

import pytest
import torch

from dlo import cpus


def _cgroup(tmp_path, self_lines, files):
    for rel, text in files.items():
        f = tmp_path / "cg" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    me = tmp_path / "self_cgroup"
    me.write_text("\n".join(self_lines) + "\n")
    return tmp_path / "cg", me


@pytest.mark.parametrize("self_lines, files, cores", [
    (["0::/job_42/step_0"], {"job_42/step_0/cpu.max": "150000 100000\n"}, 2),  # v2: 1.5 cores -> 2
    (["0::/job_42/step_0"], {"job_42/step_0/cpu.max": "max 100000\n"}, None),  # v2: no quota
    (["0::/"], {}, None),  # v2: no cpu controller file
    (["4:memory:/x", "1:cpu,cpuacct:/docker/abc"],
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
     4),  # v1 container: 4 cores
    (["1:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1: none
])
def test_a_cgroup_quota_is_read_as_whole_cores(tmp_path, self_lines, files, cores):
    root, me = _cgroup(tmp_path, self_lines, files)
    assert cpus.quota_cores(root, me) == cores


def test_usable_cores_is_the_fewest_of_affinity_quota_and_slurm(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # a whole node's mask
    monkeypatch.setattr(cpus, "quota_cores", lambda: None)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert cpus.usable_cores() == 16
    monkeypatch.setattr(cpus, "quota_cores", lambda: 6)  # a container's quota the mask does not show
    assert cpus.usable_cores() == 6
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")  # a site without task binding
    assert cpus.usable_cores() == 4
    monkeypatch.setenv("DLO_CORES", "2")  # one of two notebooks side by side
    assert cpus.cpu_cores() == 2


@pytest.mark.parametrize("omp, profile, device, threads", [
    (None, "tiny", "cpu", 1),  # a busy shared node: never a spinning second thread
    (None, "full", "cpu", 8), (None, "tiny", "cuda", 8),
    ("2", "tiny", "cpu", 2),  # what the job gave wins (dlo run / dlo grade set each notebook's share)
    ("64", "full", "cpu", 8),  # but never more than the usable cores
])
def test_notebook_threads(monkeypatch, omp, profile, device, threads):
    monkeypatch.setattr(cpus, "usable_cores", lambda: 8)
    monkeypatch.delenv("DLO_CORES", raising=False)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpus.notebook_threads(profile, device) == threads


def test_setup_sets_the_notebook_threads(monkeypatch, tmp_path):
    """A student's Validate on a shared 2-core node took 1237 s for Day 1 (issue 38): torch's two spinning
    threads against the machine's other work; the tiny CPU profile now runs one, set by dlo.setup."""
    import dlo

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dlo.setup("day1_optimizers", profile="tiny", device="cpu", log_dir=str(tmp_path / "logs"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
