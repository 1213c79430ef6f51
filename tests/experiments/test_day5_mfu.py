"""dlo.experiments.day5_mfu: the production recipe on one rank beside its plan, at the smallest sizes on
a CPU (gloo). At the full profile on a GPU it is the GPU session's `day5_3b` step (bench/gpu_steps.py)."""

import dataclasses

from dlo.experiments.day5_mfu import PLANNED, recipe_vs_plan
from dlo.registry import DAYS

TINY = DAYS["day5_fsdp"].presets["tiny"]
SMALL = dataclasses.replace(TINY, seq_len=16, batch_per_rank=2, model_overrides=(("n_layers", 1),))


def test_one_rank_trains_and_is_set_beside_its_plan():
    got = recipe_vs_plan(SMALL, steps=3, timeout=240)
    assert got["world"] == 1 and got["device"] == "cpu" and got["model"] == "tiny" and not got["compile"]
    assert len(got["losses"]) == len(got["times_s"]) == 3 and got["step_s"] > 0 and got["tokens/s"] > 0
    assert got["mfu"] is None and got["peak_over_plan"] is None  # a CPU: no peak FLOP/s, no CUDA allocator
    assert got["peak_kind"] == "saved-tensor peak" and got["peak_bytes"] > 0
    assert set(got["planned"]) == set(PLANNED) and got["planned"]["total"] > got["planned"]["activations"] > 0
    assert got["plan_config"].startswith("FSDP2") and got["n_params"] > 0
