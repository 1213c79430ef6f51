"""dlo.distributed.slurm.launch_slurm: a Day 4 DDP step shipped from the caller runs on a rank on each node
of the test cluster and its results come back; a rank's error comes back with its line; a timeout (as an
interrupted cell) cancels the job."""

import re
import subprocess
import sys
import time

import pytest

from dlo.distributed.slurm import launch_slurm
from tests.slurm import ddp_step

pytestmark = pytest.mark.slurm


@pytest.fixture
def on_cluster(slurm, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_ddp_step_on_two_nodes_comes_back(on_cluster, capsys):
    got = launch_slurm(ddp_step.ddp_step, 2, sbatch=["--gres=gpu:1"], folder=on_cluster / "job", poll=0.5)
    assert sorted(node for node, _ in got) == ["n1", "n2"]
    want = ddp_step.reference()
    for _, params in got:
        assert max((p - w).abs().max().item() for p, w in zip(params, want)) < 1e-12
    out = capsys.readouterr().out
    assert "2 node(s) x 1 rank(s)" in out and "RUNNING" in out  # the cell saw the job's state


CELL = """
import torch.distributed as dist
from dlo.distributed.slurm import RankError, launch_slurm

def refuse_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")  # the student's line
    return "fine"

try:
    launch_slurm(refuse_on_rank_one, 2, folder=FOLDER, poll=0.5)
except RankError as exc:
    print("RANK", exc.rank)
    print(exc.remote_traceback)
"""


def test_a_cell_function_ships_by_value_and_its_error_comes_back_with_its_line(on_cluster, slurm):
    # defined in __main__, as in a notebook: the nodes cannot import it, it travels by value
    cell = on_cluster / "cell.py"
    cell.write_text(CELL.replace("FOLDER", repr(str(on_cluster / "job"))))
    done = subprocess.run([sys.executable, str(cell)], capture_output=True, text=True, env=slurm.env, timeout=600,
                          cwd=on_cluster)
    assert done.returncode == 0, done.stderr
    assert "RANK 1" in done.stdout
    assert f'File "{cell}", line 7, in refuse_on_rank_one' in done.stdout
    assert 'raise ValueError("rank one refuses")  # the student\'s line' in done.stdout


def _sleep():
    time.sleep(600)


def test_timeout_cancels_the_job(on_cluster, capsys, slurm):
    with pytest.raises(TimeoutError, match="cancelled"):
        launch_slurm(_sleep, 1, timeout=20, folder=on_cluster / "job", poll=0.5)
    job = re.search(r"job (\d+):", capsys.readouterr().out).group(1)
    for _ in range(60):  # scancel is asynchronous: the job leaves the queue within seconds
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=slurm.env).stdout:
            break
        time.sleep(1)
    else:
        pytest.fail(f"job {job} still queued after the timeout")
