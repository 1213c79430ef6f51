"""`dlo plan DAY`: the full profile's memory per GPU, worked out without one; its one-line errors."""

import os
import subprocess
import sys

import pytest

from dlo.plan import DoesNotFit, check_fits, format_rows, main_configs, row, split_evenly
from dlo.registry import DAYS, plan_day

# the days planned in their experiments module (Days 5-7 plan in their report modules, tested beside them)
MY_DAYS = [d for d, spec in DAYS.items() if spec.planner == f"{spec.experiments}:plan"]


def plan_cli(*args, env=None):
    env = {**{k: v for k, v in os.environ.items() if k not in ("DLO_PROGRESS", "DLO_HEADLESS")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "dlo.cli", "plan", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.parametrize("day", MY_DAYS)
def test_every_full_profile_fits_an_80_gb_gpu(day):
    rows = plan_day(day)
    check_fits(rows)
    assert all(r["gpu"] == 80 * 2**30 and r["activations"] >= 0 for r in rows)
    assert main_configs(rows) and all(r["config"] in format_rows(rows) for r in rows)


def test_world_follows_gpus_on_distributed_days_only():
    assert {r["world"] for r in plan_day("day4_ddp")} == {4}  # the preset's ranks
    assert {r["world"] for r in plan_day("day4_ddp", gpus=2)} == {2}
    assert {r["world"] for r in plan_day("day1_optimizers", gpus=8)} == {1}  # single process


def test_main_configurations():
    rows = [row("a", 1, params=1, grads=1, optimizer=1, activations=1, gpu_mem_gb=1),
            row("b", 1, params=2 ** 31, grads=0, optimizer=0, activations=0, gpu_mem_gb=1, main=True)]
    assert main_configs(rows) == ["b"] and main_configs(rows[:1]) == ["a"]  # the first row without a mark
    with pytest.raises(DoesNotFit, match="^b at 1 rank"):
        check_fits(rows, main_configs(rows))


def test_cli_prints_the_table_and_fails_when_the_main_configuration_does_not_fit():
    ok = plan_cli("day3_checkpointing")
    assert ok.returncode == 0 and "policy: none" in ok.stdout and "80 GiB" in ok.stdout
    small = plan_cli("day3_checkpointing", "--gpu-mem", "16")
    assert small.returncode == 1 and "policy: none" in small.stdout
    assert small.stderr.strip().startswith("dlo plan: does not fit: policy: none at 1 rank(s) needs")
    assert len(small.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    (["day9_nope"], "dlo plan: no planner for 'day9_nope'; days with one: day1_optimizers, day2_mixed_precision"),
    (["day4_ddp", "--gpus", "-1"], "dlo plan: argument --gpus: -1 is not a positive number"),
    (["day5_fsdp", "--gpus", "0"], "dlo plan: argument --gpus: 0 is not a positive number"),  # not "the default"
    (["day4_ddp", "--gpu-mem", "0"], "dlo plan: argument --gpu-mem: 0 is not a positive number"),
    (["day6_pipeline", "--gpus", "3"], "dlo plan: the claim's batch of 640"),  # not "batch 640 = 3 x 213"
])
def test_cli_bad_input_is_one_line(args, message):
    proc = plan_cli(*args)
    assert proc.returncode == 2 and proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def test_no_gpus_and_a_batch_the_ranks_cannot_share_are_refused():
    with pytest.raises(ValueError, match="need gpus >= 1"):
        plan_day("day4_ddp", gpus=0)
    with pytest.raises(ValueError, match=r"^the claim's batch of 640, the notebook's DDP batch of 128 cannot be split "
                                         r"evenly over 3 GPUs \(data parallel\); plan for 1, 2, 4, 8, 16, 32, 64, 128"):
        plan_day("day6_pipeline", gpus=3)
    assert {r["world"] for r in plan_day("day6_pipeline", gpus=4)} == {4}
    split_evenly("x", {"a": 6, "b": 4}, 2)
    with pytest.raises(ValueError, match=r"^b of 4 cannot be split evenly over 3 GPUs \(x\); plan for 1, 2 GPUs"):
        split_evenly("x", {"a": 6, "b": 4}, 3)


def test_a_log_gets_no_progress_bars_unless_asked():
    """`dlo plan day7_tensor_parallel 2>log`: stderr is no terminal, so no carriage-return bars in the log."""
    quiet = plan_cli("day7_tensor_parallel")
    assert quiet.returncode == 0 and "TP 2" in quiet.stdout and quiet.stderr == ""
    forced = plan_cli("day7_tensor_parallel", env={"DLO_PROGRESS": "1"})
    assert forced.returncode == 0 and "plan: splitting the meta model" in forced.stderr and "it/s]" in forced.stderr
