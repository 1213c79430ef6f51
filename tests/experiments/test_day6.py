"""dlo.experiments.day6: the presets, one small run of every experiment on 2 ranks (the tiny
notebook runs the full set), the report's tables and claims on its results, and the planner
against a hand count."""

import dataclasses

import pytest
import torch

import dlo.claims as claims_module
from dlo.accounting import optimizer_bytes
from dlo.claims import AGREES, BY_CONSTRUCTION, DISAGREES, NOT_MEASURABLE, PLANNED, VERDICTS
from dlo.distributed import launch
from dlo.distributed import pipeline_schedules as S
from dlo.distributed.pipeline_fit import message_gaps
from dlo.distributed.pipeline_schedules import bubble_formula
from dlo.experiments import day6 as E
from dlo.experiments import day6_report as report
from dlo.plan import GIB
from dlo.presets import Day6Preset
from dlo.registry import DAYS
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = Day6Preset(image_size=32, micro_batch=2, m_values=(2, 4), gantt_m=2, split_m=2, split_costs=("params", "flops"),
                   reps=1, warmup=0, stack_blocks=4, stack_width=32, stack_grid=4)


def test_presets_validate_and_smoke_keeps_the_model():
    for profile in ("tiny", "full"):
        P = DAYS["day6_pipeline"].presets[profile]
        P.validate()
        smoke = P.smoke()
        smoke.validate()
        assert (smoke.model, smoke.image_size, smoke.stack_width, smoke.stack_grid) == \
               (P.model, P.image_size, P.stack_width, P.stack_grid)
        assert smoke.reps == 1 and len(smoke.m_values) == 1 and smoke.micro_batch == 1
    assert DAYS["day6_pipeline"].presets["full"].with_max_steps(7).reps == 7
    with pytest.raises(ValueError, match="multiple of world_size"):
        dataclasses.replace(SMALL, gantt_m=3, m_values=(3,)).validate()
    with pytest.raises(ValueError, match="stack_blocks >= 2 x world_size"):
        dataclasses.replace(SMALL, stack_blocks=3).validate()


def test_run_all_on_two_ranks_and_its_report():
    R = launch(E.run_all, 2, SMALL, timeout=240)[0]
    rows = R["bubble"]["rows"]
    assert [(r["schedule"], r["m"]) for r in rows] == [(s, m) for s in E.SCHEDULE_NAMES for m in (2, 4)]
    assert all(0 <= b < 1 for r in rows for b in r["bubbles"]) and all(len(r["times_s"]) == 1 for r in rows)
    one = R["bubble"]["one_microbatch"]
    peaks = {(r["schedule"], r["m"]): r["peak_bytes"] for r in rows}
    # exact on the CPU: GPipe holds m micro-batches on each rank, 1F1B p - r of them
    assert peaks[("gpipe", 4)][0] == 4 * one and peaks[("1f1b", 4)][0] == 2 * one
    assert all(t["max_grad_diff"] < 1e-5 for t in R["torch"].values())  # torch's pipelining: our gradients
    assert set(R["bubble"]["gantt"]) == set(E.SCHEDULE_NAMES)
    assert set(R["splits"]["splits"]) == {"params", "flops"} and R["ddp"]["samples"] == 4
    # the report turns it into tables and verdicts; exact memory counts agree
    assert len(report.bubble_rows(R)) == len(rows) and len(report.memory_rows(R)) == len(rows)
    memory = report.memory_claims(R)
    assert memory and all(c.verdict == AGREES for c in memory)
    plan_rows = report.plan(SMALL, gpus=2, gpu_mem_gb=1.0)
    claims = report.bubble_claims(R) + report.other_claims(R, False, plan_rows) + report.zero_bubble_claims()
    assert all(c.verdict in VERDICTS for c in claims)
    # reps = 1: one timed step has no interval, so every claim on the timings is not measurable here
    timed = report.bubble_claims(R) + [c for c in report.other_claims(R, False, plan_rows)
                                       if "bubble" in c.claim and "p = 4" not in c.claim or "balancing" in c.claim]
    assert len(timed) == 6 + 3 and all(c.verdict == NOT_MEASURABLE and c.row()["how"] == report.ONE_STEP
                                       for c in timed)
    assert sum(c.verdict == NOT_MEASURABLE for c in claims) == 6 + 3 + 3  # and the three 4-GPU rows
    # our lists in our simulator: arithmetic on the course's own code, shown by construction (issue 34), the
    # simulated bubbles still Table 1's
    zb = report.zero_bubble_claims()
    assert [c.verdict for c in zb] == [BY_CONSTRUCTION] * 2 and [c.measured.value for c in zb] == [9.0, 3.0]
    assert report.split_rows(R)[0]["balanced by"] == "params" and report.stage_rows(R["splits"]["blocks"])
    # the recorded timelines are steps of the schedules the simulator replays (6.2's fit)
    lists = {"gpipe": S.gpipe_schedule(2, 2), "1f1b": S.one_f_one_b_schedule(2, 2),
             "interleaved": S.interleaved_schedule(2, 2, 2)}
    fits = report.timeline_fit_rows(R["bubble"]["gantt"], lists)
    assert [r["schedule"] for r in fits] == list(R["bubble"]["gantt"]) and all(r["fitted t_comm ms"] >= 0 for r in fits)
    # one clock for all ranks: no action starts before the message it waits for was sent
    assert min(g for s, ev in R["bubble"]["gantt"].items() for g in message_gaps(ev, lists[s])) > -1e-6


def _results(p=2, ms=(2, 4), jitter=0.001, one=100, kept_alive=None, device="cuda:0") -> dict:
    """run_all's results as plain data: three timed steps per row, the bubble at the formula +- jitter;
    CUDA peaks of a base plus the micro-batches alive (1F1B keeps `kept_alive` of them if given)."""
    rows = []
    for schedule in E.SCHEDULE_NAMES:
        v = 2 if schedule == "interleaved" else 1
        for m in ms:
            f = bubble_formula(p, m, v)
            alive = m if schedule == "gpipe" else min(kept_alive or p, m)
            rows.append({"schedule": schedule, "p": p, "v": v, "m": m, "formula": f,
                         "times_s": [0.1, 0.11, 0.105], "bubbles": [f - jitter, f + jitter, f + jitter],
                         "peak_bytes": [10_000 + alive * one + 3, 10_000]})
    splits = {"params": {"times_s": [0.13, 0.131, 0.1305]}, "flops": {"times_s": [0.10, 0.101, 0.1005]}}
    return {"world": p, "device": device,
            "bubble": {"rows": rows, "one_microbatch": one, "memory_kind": "cuda max_memory_allocated"},
            "splits": {"splits": splits}, "torch": {"gpipe": {"max_grad_diff": 0.0}}}


def test_three_timed_steps_give_intervals_and_gpu_memory_can_fail(monkeypatch):
    monkeypatch.setattr(claims_module, "cpu_cores", lambda: 16)  # a GPU node: every rank has its core
    R = _results()
    plan_rows = [{"config": "1F1B, batch 16 = 8 x 2", "total": 1, "gpu": 2},
                 {"config": "DDP, batch 16 = 2 x 8", "world": 2, "total": 3, "gpu": 2}]
    claims = report.bubble_claims(R) + report.other_claims(R, True, plan_rows)
    assert [c.verdict for c in claims if c.verdict != AGREES] == [PLANNED], [c.row() for c in claims]
    assert all(c.measured.lo < c.measured.hi for c in claims[:6])  # three steps: a t-interval, not a point
    # noisy steps: the same mean, an interval wider than the tolerance
    assert {c.verdict for c in report.bubble_claims(_results(jitter=0.02))} == {"inconclusive at this scale"}
    # on a GPU, GPipe - 1F1B at the same m: the weights, inputs and workspace cancel
    memory = report.memory_claims(R)
    assert [c.claim for c in memory] == [f"GPipe - 1F1B: extra micro-batches alive on stage 0, m={m}" for m in (2, 4)]
    assert [c.verdict for c in memory] == [AGREES, AGREES]
    # a 1F1B that kept all m micro-batches alive, like GPipe, is caught at m = 4 (expected 2 more, got 0)
    assert [c.verdict for c in report.memory_claims(_results(kept_alive=4))] == [AGREES, DISAGREES]


def test_plan_matches_a_hand_count():
    P = dataclasses.replace(SMALL, micro_batch=2, plan_batch=16, split_m=4)
    rows = {r["config"]: r for r in report.plan(P, gpus=2, gpu_mem_gb=1.0)}
    stages = report.stage_partition(E.model_config(P), 2)
    n = sum(s["params"] for s in stages)
    # 1F1B, m = 8 micro-batches of 2: rank r holds min(2 - r, 8) of them; the worst rank is shown
    one_f = rows["1F1B, batch 16 = 8 x 2"]
    want = max(16 * s["params"] + min(2 - r, 8) * 2 * s["saved_per_sample"] for r, s in enumerate(stages))
    assert one_f["total"] == want and one_f["gpu"] == GIB
    gpipe = rows["GPipe, batch 16 = 8 x 2"]
    assert gpipe["total"] == max(16 * s["params"] + 8 * 2 * s["saved_per_sample"] for s in stages)
    ddp = rows["DDP, batch 16 = 2 x 8"]  # the whole model, a half of the batch per GPU
    assert (ddp["params"], ddp["optimizer"]) == (4 * n, optimizer_bytes("adamw", 4 * n))
    assert ddp["activations"] == 8 * sum(s["saved_per_sample"] for s in stages)
    assert {r["config"] for r in rows.values() if r.get("main")} == {
        "notebook: 1F1B splits, m = 4 x 2", "notebook: DDP, 8 samples", "notebook: bubble sweep, GPipe m = 4 x 2"}


def test_stack_is_identical_blocks_on_every_call():
    a, b = E.stack(SMALL, "cpu"), E.stack(SMALL, "cpu")
    assert len(a) == SMALL.stack_blocks
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        assert torch.equal(x, y)
    xs, ys = E.stack_batch(SMALL, 3, "cpu")
    assert len(xs) == 3 and xs[0].shape == (2, 32, 4, 4) and a[0](xs[0]).shape == xs[0].shape


def test_timings_on_shared_cores_and_rows_fixed_by_construction_are_no_evidence(monkeypatch):
    """2 ranks + the kernel on 2 cores: every timing row is "not measurable here" with that reason;
    the bubble at m = 1 is (p-1)/p whatever the durations: "by construction"; the plan's DDP row is
    "planned", and no row judges 1F1B's memory with the min(p - r, m) it claims."""
    monkeypatch.setattr(claims_module, "cpu_cores", lambda: 2)
    R = _results(ms=(1, 2, 4), device="cpu")
    plan_rows = [{"config": "1F1B, batch 16 = 8 x 2", "total": 1, "gpu": 2},
                 {"config": "DDP, batch 16 = 2 x 8", "world": 2, "total": 3, "gpu": 2}]
    bubble = [c for c in report.bubble_claims(R) if not c.claim.startswith("interleaved bubble, p=2, m=1")]
    assert [c.verdict for c in bubble if c.claim.endswith("m=1")] == [BY_CONSTRUCTION] * 2  # GPipe, 1F1B
    timed = [c for c in bubble if not c.claim.endswith("m=1")] + [
        c for c in report.other_claims(R, False, plan_rows) if "bubble" in c.claim and "p = 4" not in c.claim
        or "balancing" in c.claim]
    assert len(timed) == 6 + 3 and all(c.verdict == NOT_MEASURABLE and "kernel > 2 cores" in c.reason for c in timed)
    other = report.other_claims(R, False, plan_rows)
    assert not any(c.claim.startswith("1F1B trains") for c in other)
    assert [c.verdict for c in other if c.claim.startswith("DDP")] == [PLANNED]
    # the same rows on 4 cores are judged
    monkeypatch.setattr(claims_module, "cpu_cores", lambda: 4)
    assert all(c.verdict == AGREES for c in report.bubble_claims(R) if not c.claim.endswith("m=1"))
