"""The grading-speed scripts of bench/ start and say how to run them (`--help`); what they measure takes minutes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", ["grade_class.py", "cell_cpu.py"])
def test_help_runs(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--day" in proc.stdout and "day1_optimizers" in proc.stdout, proc.stderr



def test_block_sweep_says_it_needs_a_gpu():
    """bench/block_sweep.py times kernels on a GPU only; without one it stops in one line, before any work."""
    proc = subprocess.run([sys.executable, str(BENCH / "block_sweep.py")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == "block_sweep: needs a CUDA GPU"


def test_every_carried_wheel_is_pinned_by_the_lock():
    """bench/carry_wheels.sh downloads each package at requirements/cpu.lock's version (no network here):
    a package the lock no longer holds would stop the next GPU session's set-up."""
    script = (BENCH / "carry_wheels.sh").read_text()
    names = script.split('PKGS="', 1)[1].split('"', 1)[0].split()
    lock = (BENCH.parent / "requirements" / "cpu.lock").read_text()

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    pinned = {norm(n) for n in re.findall(r"^([A-Za-z0-9_.\-]+)==", lock, re.M)}
    assert len(names) > 40 and not [n for n in names if norm(n) not in pinned]
    assert not {"torch", "triton"} & {norm(n) for n in names}  # the node's own: GBs, over the carry limit
