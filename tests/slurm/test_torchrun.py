"""slurm/torchrun.sbatch on two nodes with a GPU each (`--gres=gpu:1`: one rank per GPU): a Day 4 DDP step
written with dlo.distributed.launch runs one rank on each node, and both ranks end with the parameters of one
process trained on the full batch."""

import re

import pytest
import torch

from tests.slurm import ddp_step

pytestmark = pytest.mark.slurm


def test_two_nodes_agree_with_one_process_on_the_full_batch(slurm, tmp_path):
    out, log = tmp_path / "ranks.pt", tmp_path / "torchrun.out"
    job = slurm.sbatch("--nodes=2", "--gres=gpu:1", f"--output={log}", "slurm/torchrun.sbatch", ddp_step.__file__,
                       str(out))
    [state] = slurm.wait(job)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", text
    assert "2 node(s) x 1 rank(s)" in text and re.search(r", GPUs \d$", text, re.M)  # a rank per GPU given
    got = torch.load(out)
    assert sorted(node for node, _ in got) == ["n1", "n2"], "one rank on each node"
    want = ddp_step.reference()
    for node, params in got:
        # float64, same samples, only the summation order differs
        err = max((p - w).abs().max().item() for p, w in zip(params, want))
        assert err < 1e-12, f"rank on {node}: parameters differ from one process on the full batch by {err}"
