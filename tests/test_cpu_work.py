"""What each day's full profile asks of the CPU (`dlo.cpu_work`), counted from the presets and bounded:
no cell of a GPU run may take minutes of CPU by accident (issue 32)."""

import pytest

from dlo.cpu_work import BUDGET, WORK, cpu_work, over_budget
from dlo.registry import DAYS


def test_every_day_has_an_inventory():
    assert set(WORK) == set(DAYS)
    with pytest.raises(ValueError, match="no CPU inventory for 'day9'"):
        cpu_work("day9", None)


@pytest.mark.parametrize("day", list(DAYS))
def test_no_full_profile_asks_minutes_of_the_cpu(day):
    """Before: Day 5's memory table, 20 fp32 passes of Llama 3.2 1B at 8192 tokens in the notebook's
    process (1.7e15 FLOP; now fake tensors: 0), and Day 3's resume runs writing 20 checkpoints of 2 GB
    (save_every 10; now 25: 8 checkpoints, the preemption at step 45 resumes from step 25)."""
    assert over_budget(day, DAYS[day].presets["full"]) == []
    assert over_budget(day, DAYS[day].presets["tiny"]) == []


def test_day5_counts_are_what_its_cells_compute():
    """The inventory's formula (6N + 12 l h s per token) against FlopCounterMode on the code it stands
    for, at the tiny profile's sizes."""
    from dlo.experiments import day5_hsdp, day5_reshard
    from dlo.measure import count_flops

    P = DAYS["day5_fsdp"].presets["tiny"]
    counted = cpu_work("day5_fsdp", P)["flops"]
    reshard, hsdp = (v for k, v in counted.items() if k.startswith(("reshard", "HSDP")))
    assert count_flops(lambda: day5_reshard.reshard_prefetch(P, 8)) == pytest.approx(reshard, rel=0.1)
    assert count_flops(lambda: day5_hsdp.hsdp_bytes(P, 2, 4)) == pytest.approx(hsdp, rel=0.1)
    assert counted["memory table (fake tensors)"] == 0 < BUDGET["flops"]


def test_day3_counts_the_checkpoints_of_its_resume_runs():
    import dataclasses

    P = dataclasses.replace(DAYS["day3_checkpointing"].presets["tiny"], max_steps=10, interrupt_at=5, save_every=2)
    # uninterrupted: 2 4 6 8 10; job 1: 2 4; job 2 resumes from 4: 6 8 10
    assert next(iter(k for k in cpu_work("day3_checkpointing", P)["bytes"] if k.startswith("resume"))) == \
        "resume: 10 checkpoints written"
