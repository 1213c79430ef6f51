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
SAVED = re.compile(r"^SIGTERM: saved step (\d+), exiting for requeue$", re.M)
RESUMED = re.compile(r"^resumed from .*ckpt-0*(\d+)\.pt at step (\d+)$", re.M)


def _signal_if_late(slurm, job: str, log, steps_in: int = 1500, timeout: float = 600) -> None:
    """Make sure that some run of the job is cut while its trainer trains, so that it saves.

    slurmctld signals the batch shell 10 to 40 s after the start, but (a) on a fast idle machine the first run
    can finish before that (CI's first try: 5000 steps done, never requeued), and (b) on a loaded one the
    signal can land while Python still imports, before the trainer's handler is installed (CI, 4420d3d: every
    cut run killed unsaved, no "saved step" line). Until a run has saved, a run that gets `steps_in` steps
    past where it started with no signal yet gets the same signal through SLURM (`scancel --batch`)."""
    deadline, signalled = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if SAVED.search(text) or any(j.get("JobState") in ENDED for j in slurm.jobs(job)):
            return
        runs = re.split(r"^.* start, restart count (\d+)$", text, flags=re.M)
        if len(runs) >= 3:  # [before, count, this run's lines] for the newest run
            count, run = runs[-2], runs[-1]
            start = RESUMED.search(run)
            first = int(start.group(2)) if start else 0
            steps = re.findall(r"^step (\d+) ", run, re.M)
            if count not in signalled and "time limit near" not in run and steps and int(steps[-1]) >= first + steps_in:
                slurm.run("scancel", "--batch", "--signal=USR1", job)
                signalled.add(count)
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
    saved, resumed = SAVED.findall(text), RESUMED.findall(text)
    assert saved and set(saved) <= {step for step, _ in resumed}, text[-2000:]

    name = f"ckpt-{STEPS:08d}.pt"
    got, want = (torch.load(tmp_path / d / name, weights_only=False)["model"] for d in ("cut", "whole"))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key  # bit-identical, not merely close
    final = re.compile(rf"^done step {STEPS} loss (\S+)$", re.M)
    assert final.search(text).group(1) == final.search(out).group(1)
