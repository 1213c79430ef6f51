"""Replies from the student's side that say less than the case asked for (Days 1, 3, 5-8, 10, 11).

Whatever a worker returns comes from the process where the student's code ran, which can rewrite what the reply goes
through or empty the worker's lists (`sys._getframe`, gc): a check must fail when the reply is short, empty or None
where a value is due, never compare nothing. Each test forges such a reply (the check module's `run_student` or
`on_ranks` wrapped to cut it, or the verification function called on it) and expects the check to fail with what
it got; the solutions still pass (the days' own test files). Also: helpers of the checks modules that do an
exercise's work with one slip (every checks module is loaded where the student's code runs) are off limits there.
"""

from __future__ import annotations

import pytest
import torch

import dlo.checks.day1_accum as day1_accum
import dlo.checks.day1_training as day1_training
import dlo.checks.day3 as day3
import dlo.checks.day3_offload as day3_offload
import dlo.checks.day3_resume as day3_resume
import dlo.checks.day6 as day6
import dlo.checks.day8_prune as day8_prune
import dlo.checks.day11_space as day11_space
import dlo.checks.day11_transfer as day11_transfer
from dlo.checks import day5_fsdp, day5_memory, day5_sync, day7_comms, day7_sequence, day7_shared, rank_count
from dlo.checks.day5_zero import case, tied_lm
from dlo.checks.day6_order import torch_order
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell


@pytest.fixture(scope="module")
def day1():
    return load_solution("day1_optimizers")


@pytest.fixture(scope="module")
def day3_sol():
    return load_solution("day3_checkpointing")


def cut(monkeypatch, module, name: str, how):
    """`module.name` (run_student, on_ranks) whose reply goes through `how` first, as the student side may shape it."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: how(real(*a, **k)))


# ----------------------------------------------------------------------------- Day 1

def test_a_schedule_whose_steps_were_emptied_fails(day1, monkeypatch):
    cut(monkeypatch, day1_training, "run_student", lambda lrs: lrs[:0])
    with pytest.raises(AssertionError, match=r"returned 0 of \d+ steps"):
        day1_training.check_warmup_cosine(day1.warmup_cosine, trials=1)


def test_a_schedule_worker_list_emptied_through_the_frames_fails():
    """The student's schedule itself empties the worker's list of lrs at its last step (sys._getframe)."""
    cell = student_cell(
        "import math, sys\n"
        "def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr, start_factor):\n"
        "    f = sys._getframe(1)\n"
        "    while 'out' not in f.f_locals:\n"
        "        f = f.f_back\n"
        "    f.f_locals['out'].clear()\n"
        "    return 0.0\n", "forged_schedule")
    with pytest.raises(AssertionError, match=r"returned 1 of \d+ steps"):  # the last step's lr only
        day1_training.check_warmup_cosine(cell.warmup_cosine, trials=1)


def test_accumulation_whose_gradients_were_left_out_fails(day1, monkeypatch):
    cut(monkeypatch, day1_accum, "run_student", lambda res: {**res, "grads": res["grads"][:1]})
    with pytest.raises(AssertionError, match="gradients of 1 of the model's 4 parameters"):
        day1_accum.check_accumulate_gradients(day1.accumulate_gradients, trials=1)


# ----------------------------------------------------------------------------- Day 3

def test_a_checkpoint_whose_parameter_gradients_were_left_out_fails(day3_sol, monkeypatch):
    cut(monkeypatch, day3, "run_student", lambda res: {**res, "grads": res["grads"][:1]})
    with pytest.raises(AssertionError, match=r"returned 1 of \d+ gradients"):
        day3.check_checkpoint_function(day3_sol.Checkpoint, trials=1, device="cpu")


@pytest.mark.parametrize("forged", [{"trials": []}, "grads"])
def test_offload_records_emptied_fail(day3_sol, monkeypatch, forged):
    how = (lambda res: {"trials": res["trials"], "grads": []}) if forged == "grads" else (lambda res: forged)
    cut(monkeypatch, day3_offload, "run_student", how)
    with pytest.raises(AssertionError, match=r"returned 0 of \d+ (tensors' records|gradients)"):
        day3_offload.check_offload_hooks(day3_sol.pack, day3_sol.unpack, device="cpu")


def test_resume_whose_resumed_runs_were_emptied_fails(day3_sol, monkeypatch, ranks):
    cut(monkeypatch, day3_resume, "run_student", lambda loaded: [])
    with pytest.raises(AssertionError, match=r"returned 0 of 3 resumed runs"):
        day3_resume.check_resume(day3_sol.save_training_state, day3_sol.load_training_state)


# ----------------------------------------------------------------------------- Days 5, 6, 7, 10: every rank

@pytest.mark.parametrize("results", [[], [{}], [{}, None], None])
def test_a_short_list_of_ranks_fails(results):
    with pytest.raises(AssertionError, match=r"results from \d of 2 ranks"):
        rank_count.every_rank("zero1", results, 2)
    assert rank_count.every_rank("ring", [[1], []], 2, of=list) == [[1], []]


def test_zero_drift_of_rank_0_left_out_fails():
    """verify_in_sync holds ranks 1.. to rank 0's drift: an empty one compared nothing; verify_owners now fails."""
    c = case(0)
    res = [{"drift": {}}, {"drift": {}}]
    day5_sync.verify_in_sync("zero1", res, 1, "w")  # nothing to compare against: the owners' check is the one
    with pytest.raises(AssertionError, match="rank 0's .* was not seen"):
        day5_sync.verify_owners("zero1", res, c, 0, 2, 1, "w")


def test_zero_memory_samples_emptied_fail():
    c = case(0)
    m = day5_memory.verify_memory("zero2", [{"held": 0, "live": 0}], c, 2, 2, "w")
    empty = [{"samples": {"outside": [], "backward": [], "forward": []}}]
    with pytest.raises(AssertionError, match="returned 0 of the 1 or more samples"):
        day5_memory.verify_backward("zero2", empty, c, m, 1.0, "w")
    with pytest.raises(AssertionError, match="returned 0 of the 1 or more samples"):
        day5_memory.verify_forward("zero3", empty, c, m, "w")
    one = [{"samples": {"outside": [0], "backward": [0], "forward": [0]}}]
    with pytest.raises(AssertionError, match=f"returned 1 of the {c['n_blocks']} or more samples"):
        day5_memory.verify_forward("zero3", one, c, m, "w")
    assert len(list(tied_lm(c, 0).blocks)) == c["n_blocks"]


def test_fsdp_structure_with_no_blocks_fails():
    s = {"root": True, "blocks_sharded": [], "blocks_checkpointed": [], "tied": True, "shard0": True, "compiled": []}
    with pytest.raises(AssertionError, match="blocks_sharded of 0 of the model's 2 blocks"):
        day5_fsdp._check_fsdp_structure("fsdp2", s, 2, "w")
    with pytest.raises(AssertionError, match="blocks_sharded of 0 of the model's 2 blocks"):
        day5_fsdp._check_flags_honoured("fsdp2", {"structure": s, "ffn_calls": 2}, 2, "w")


def test_a_pipeline_step_with_ranks_left_out_fails(monkeypatch):
    monkeypatch.setattr(day6, "on_ranks", lambda *a, **k: [])
    with pytest.raises(AssertionError, match="results from 0 of 2 ranks"):
        day6.check_gpipe_step(student_cell("def step(*a):\n    return 0.0\n", "forged_step").step)


def test_torch_pipeline_reply_with_no_gradients_and_no_last_stage_fails(monkeypatch):
    """A reply that says every chunk ran in the right order, no rank holds the last stage and there are no gradients:
    no student code needed to run for it, and it compared nothing before."""
    def forged(worker, p, fn, timeout, per_rank):
        return [{sched: {"chunks": part["m"] * (part["n_stages"] // p), "last": False, "losses": None, "grads": {},
                         "order": [[k, s, 0] for k, s in torch_order(sched, p, part["m"], part["n_stages"] // p)[r]]}
                 for sched, part in parts.items()} for r, parts in enumerate(per_rank)]
    monkeypatch.setattr(day6, "on_ranks", forged)
    step = student_cell("def step(*a):\n    return []\n", "forged_torch_step").step
    with pytest.raises(AssertionError, match=r"returned the gradients of stages \[\]"):
        day6.check_torch_pipeline(step, schedules=("GPipe",))


def test_tensor_parallel_replies_of_one_rank_and_no_flops_fail():
    with pytest.raises(AssertionError, match="results from 1 of 2 ranks"):
        day7_comms.verified("tp_swiglu", [{"records": [], "out": {}}], 2, {})
    day7_shared.expect_split_work("tp_swiglu", 0, 1000, 2, {})  # an upper bound only: 0 passes it
    with pytest.raises(AssertionError, match="counted 0 FLOPs in rank 1"):
        day7_shared.expect_own_work("tp_swiglu", [{"flops": 500}, {"flops": 0}], 1000, 2, {})


def test_vocab_parallel_ce_judged_on_every_collective_the_rank_issued():
    """The per-trial lists of calls can come back empty; the rank's whole record (held to its sockets) still shows
    the logits gathered."""
    cases = [{"where": {"N": 7}, "logits": torch.zeros(7, 6, dtype=torch.float64)}]
    day7_sequence._ce_records("ce", [[{"kind": "all_reduce", "bytes": 3 * 7 * 8}]], cases)
    with pytest.raises(AssertionError, match=r"\['all_gather'\]"):
        day7_sequence._ce_records("ce", [[{"kind": "all_gather", "bytes": 6 * 7 * 8}]], cases)


# ----------------------------------------------------------------------------- Days 8 and 11

def test_a_pruned_pair_reply_of_one_layer_fails(monkeypatch):
    sol = load_solution("day8_quantization_pruning")
    cut(monkeypatch, day8_prune, "run_student", lambda got: {"layers": got["layers"][:1]})
    with pytest.raises(AssertionError, match="returned 1 of 2 new layers"):
        day8_prune.check_prune_linear_pair(sol.prune_linear_pair, trials=1)


def test_sample_config_types_left_out_fail(monkeypatch):
    sol = load_solution("day11_learning_faster")
    cut(monkeypatch, day11_space, "run_student", lambda types: [])
    with pytest.raises(AssertionError, match=r"types of 0 of the config's \d+ values"):
        day11_space.check_sample_config(sol.sample_config, trials=1)


@pytest.mark.parametrize("key", ["modes", "grad"])
def test_freeze_reply_with_records_left_out_fails(monkeypatch, key):
    sol = load_solution("day11_learning_faster")
    cut(monkeypatch, day11_transfer, "run_student",
        lambda got: {**got, key: {k: v for k, v in got[key].items() if k.startswith("1")}})
    with pytest.raises(AssertionError, match="the grader got the"):
        day11_transfer.check_freeze(sol.freeze, trials=1)


SLIPS_THAT_SOLVE = [
    ("dlo.checks.day8", "check_gradual_sparsity", "dlo.checks.day8_prune._schedule_slips",
     "import dlo.checks.day8_prune as m\n"
     "def fn(step, s_f, t0, t1, s_i):\n"
     "    slips = m._schedule_slips(min(max(step, t0), t1), s_f, t0, t1, s_i)\n"
     "    return next(v for k, v in slips.items() if k.startswith('no clamp'))\n"),
    ("dlo.checks.day11", "check_early_stop", "dlo.checks.day11_early._rule",
     "import dlo.checks.day11_early as m\n"
     "def fn(history, patience, min_delta, mode):\n"
     "    return m._rule(history, patience, min_delta, mode)\n"),
]


@pytest.mark.parametrize("module,check,helper,source", SLIPS_THAT_SOLVE, ids=[s[1] for s in SLIPS_THAT_SOLVE])
def test_a_checks_helper_that_solves_the_exercise_is_off_limits(module, check, helper, source):
    import importlib

    fn = student_cell(source, f"forged_{check}").fn
    chk = getattr(importlib.import_module(module), check)
    assert helper in chk.forbid
    chk.__wrapped__(fn)  # unguarded, the helper does the exercise's work: full marks
    with pytest.raises(Exception, match=helper.rsplit(".", 1)[-1]):
        chk(fn)


def test_the_slips_helpers_of_days_10_and_11_are_off_limits():
    from dlo.checks import day10, day10_moe

    assert "dlo.checks.day10._merge_slips" in day10.check_merge_partials.forbid
    assert {"dlo.checks.day10_moe._kept_with", "dlo.checks.day10_moe._route_slips"} <= set(day10_moe.check_route.forbid)
    assert {"dlo.checks.day10_moe._dispatch_slips", "dlo.checks.day10_moe._combine_slips"} <= set(
        day10_moe.check_dispatch_combine.forbid)
    assert "dlo.checks.day11_space._space_slips" in day11_space.check_sample_config.forbid
