"""What one srun task of a job resolves through the placement rule: `srun python tests/slurm/where.py OUT`
writes OUT/rank-<SLURM_PROCID>.json (rank, local rank, node, device, GPU, backend, world size, or the one-line
error, with the node and CUDA_VISIBLE_DEVICES SLURM gave the task). torch sees no CUDA on the test cluster:
the count is the one the rule would see, CUDA_VISIBLE_DEVICES's entries."""

import dataclasses
import json
import os
import sys
from pathlib import Path

from dlo.distributed.placement import PlacementError, from_env, visible_count

if __name__ == "__main__":
    try:
        found = dataclasses.asdict(from_env(os.environ, visible_count(os.environ) or 0))
    except PlacementError as exc:
        found = {"error": str(exc)}
    found.update(host=os.environ.get("SLURMD_NODENAME"), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    Path(sys.argv[1], f"rank-{os.environ['SLURM_PROCID']}.json").write_text(json.dumps(found))
