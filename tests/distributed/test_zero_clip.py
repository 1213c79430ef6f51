"""Gradient accumulation and clipping with sharded gradients (dlo.experiments.day5_accum): ZeRO-1/2/3
against one process on the whole batch, the per-shard clipping slip, the bytes."""

import pytest
import torch

from dlo.checks.day5_zero import case, tied_lm
from dlo.claims import AGREES
from dlo.distributed.zero import ZeRO2
from dlo.experiments import day5_accum as accum
from dlo.plan import fake_world


def test_accumulated_clipped_sharded_gradients_match_one_process():
    micro = 2  # a second backward before the step is what accumulation adds; N = 3 pads every flat buffer
    res = accum.accumulate_and_clip(world_size=3, micro=micro)
    by = {r["engine"]: r for r in res["rows"]}
    assert res["clipped"]  # the norm exceeds max_norm: the clipping acts
    for name in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
        assert by[name]["max |param - one process|"] < 1e-6, name  # fp32, every rank
        assert by[name]["norm (rank 0)"] == pytest.approx(res["reference_norm"], rel=1e-5), name
        assert by[name]["all-reduce B"] == 8, name  # the norm: one fp64 scalar per step
    assert by["ZeRO-1"]["reduce-scatters"] == 1  # full gradients kept, reduced once
    for name in ("ZeRO-2", "ZeRO-3"):  # each bucket / unit pads to a multiple of N (36 B at N = 3)
        assert by[name]["reduce-scatter B"] == pytest.approx(micro * by["ZeRO-1"]["reduce-scatter B"], rel=1e-3)
    slip = next(r for name, r in by.items() if "own norm" in name)
    assert slip["max |param - one process|"] > 1e-5  # the check can fail: the slip is caught
    assert [c.verdict for c in accum.claims(res)] == [AGREES] * 4


def test_clip_and_experiment_refuse_bad_input():
    with fake_world(2):
        engine = ZeRO2(tied_lm(case(0), 0), torch.optim.SGD, lr=0.1)
        with pytest.raises(ValueError, match="max_norm"):
            engine.clip_grad_norm_(0)
    with pytest.raises(ValueError, match="world_size >= 2"):
        accum.accumulate_and_clip(world_size=1)
