"""dlo.resumable: a run interrupted by SIGTERM and restarted ends with the uninterrupted run's losses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

STEPS = 120  # the rest of the run after "step 3" (~0.5 s) leaves the SIGTERM ample time to land
ARGS = ["--steps", str(STEPS), "--save-every", "25", "--device", "cpu", "--model", "mlp", "--n-train", "256",
        "--image-size", "16", "--batch-size", "32", "--width", "8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two runs side by side; one thread each is plenty here


def _cmd(ckpt_dir) -> list[str]:
    return [sys.executable, "-m", "dlo.resumable", "--ckpt-dir", str(ckpt_dir), *ARGS]


def _losses(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


def test_sigterm_then_restart_gives_bit_identical_losses(tmp_path):
    whole = subprocess.Popen(_cmd(tmp_path / "whole"), stdout=subprocess.PIPE, text=True, env=ENV)  # alongside
    cut = subprocess.Popen(_cmd(tmp_path / "cut"), stdout=subprocess.PIPE, text=True, env=ENV)
    first = []
    for line in cut.stdout:  # let it take a few steps, then ask it to stop as Slurm would
        first.append(line)
        if line.startswith("step 3 "):
            cut.send_signal(signal.SIGTERM)
            break
    first += cut.stdout.readlines()
    assert cut.wait(timeout=60) == 0  # exit 0: Slurm requeues the job
    stopped = re.search(r"^SIGTERM: saved step (\d+), exiting", "".join(first), re.M)
    assert stopped, "".join(first)
    k = int(stopped.group(1))
    assert 3 <= k < STEPS

    rest = subprocess.run(_cmd(tmp_path / "cut"), stdout=subprocess.PIPE, text=True, env=ENV, timeout=60,
                          check=True).stdout
    want_out, _ = whole.communicate(timeout=60)
    assert whole.returncode == 0
    assert f"at step {k}\n" in rest  # resumed from the checkpoint written on SIGTERM
    want, got = _losses(want_out), {**_losses("".join(first)), **_losses(rest)}
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # the losses printed with repr(): bit-identical, not merely close
    final = re.compile(rf"^done step {STEPS} loss (\S+)$", re.M)
    assert final.search(rest).group(1) == final.search(want_out).group(1)
