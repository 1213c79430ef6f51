"""slurm/preemptible.sbatch under a one-minute time limit: SLURM signals the batch shell before the limit,
the trainer checkpoints, the job requeues itself and resumes, possibly several times, and ends with the
parameters of an uninterrupted run of the same steps, bit for bit; its log shows the restart count."""

import re
import subprocess
import sys
import time

import pytest
import torch

from tests.slurm.conftest import ENDED

pytestmark = pytest.mark.slurm
STEPS = 5000  # ~75 s of steps on an idle core: longer than the first signal (10 to 40 s after the start)
ARGS = ["--steps", str(STEPS), "--save-every", "500", "--device", "cpu", "--model", "mlp", "--n-train", "256",
        "--image-size", "16", "--batch-size", "32", "--width", "8"]


def _signal_if_late(slurm, job: str, log, at_step: int = 1500, timeout: float = 600) -> None:
    """slurmctld signals the batch shell 10 to 40 s after the start; on a fast idle machine the first run
    can finish before that (CI's first try: 5000 steps done, never requeued). Once the first run is past
    `at_step` with no signal yet, send the same signal through SLURM ourselves (`scancel --batch`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "time limit near" in text or any(j.get("JobState") in ENDED for j in slurm.jobs(job)):
            return
        if re.search(rf"^step {at_step} ", text, re.M):
            slurm.run("scancel", "--batch", "--signal=USR1", job)
            return
        time.sleep(0.2)


def test_time_limit_requeue_resume_gives_the_uninterrupted_parameters(slurm, tmp_path):
    log = tmp_path / "job.out"
    # --signal=B:USR1@50 with --time=1: the signal comes once 10 s have passed, at slurmctld's next
    # time-limit check (every 30 s), so each run of the job is cut after 10 to 40 s.
    job = slurm.sbatch("--gres=gpu:1", "--time=1", "--signal=B:USR1@50", f"--output={log}", "slurm/preemptible.sbatch",
                       "--ckpt-dir", str(tmp_path / "cut"), *ARGS)
    whole = subprocess.Popen([sys.executable, "-m", "dlo.resumable", "--ckpt-dir", str(tmp_path / "whole"), *ARGS],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm.env)
    _signal_if_late(slurm, job, log)
    out, err = whole.communicate(timeout=900)
    assert whole.returncode == 0, err
    [state] = slurm.wait(job)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", text
    assert re.search(r", GPUs \d$", text, re.M)  # as its header submits it (the trainer here is told --device cpu)
    restarts = int(state["Restarts"])
    assert restarts >= 1, f"never requeued: the run ended before the time limit's signal\n{text[-2000:]}"
    # every run of the job logged its restart count, and each was cut by the time limit's signal but the last
    assert re.findall(r"restart count (\d+)", text) == [str(i) for i in range(restarts + 1)], text[-2000:]
    assert text.count("time limit near: asking the trainer to checkpoint, then requeueing") == restarts
    # a signal that lands while Python still starts kills it unsaved (that run resumes from the last
    # checkpoint); the others save the step they were at, and the next run resumes from exactly there
    saved = re.findall(r"^SIGTERM: saved step (\d+), exiting for requeue$", text, re.M)
    resumed = re.findall(r"^resumed from .*ckpt-0*(\d+)\.pt at step (\d+)$", text, re.M)
    assert saved and set(saved) <= {step for step, _ in resumed}, text[-2000:]

    name = f"ckpt-{STEPS:08d}.pt"
    got, want = (torch.load(tmp_path / d / name, weights_only=False)["model"] for d in ("cut", "whole"))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key  # bit-identical, not merely close
    final = re.compile(rf"^done step {STEPS} loss (\S+)$", re.M)
    assert final.search(text).group(1) == final.search(out).group(1)
