"""Day 10's experiments: the launch's measurements and claims on 2 gloo ranks at small sizes (ring, Ulysses and
the all-gather version equal to one process, the control differing; torch's FLOP counter balanced by the
zig-zag split; the bytes on the wire against the formulas; expert parallelism equal to one process), the MoE
runs' arithmetic, and the planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlo import claims as C
from dlo.distributed import context_parallel as cp
from dlo.distributed import launch
from dlo.experiments import day10, day10_moe, day10_report
from dlo.presets import DAY10

# the tiny profile's message sizes (work_seq, moe_tokens: gloo's headers stay within the claims' 5%), fewer of the rest
SMALL = dataclasses.replace(DAY10["tiny"], seq_lens=(16, 64), timing_reps=3, max_steps=3, seeds=3)


@pytest.fixture(scope="module")
def ranks():
    return launch(day10.run_all, 2, SMALL, backend="gloo", timeout=300)


def test_the_ranks_measure_what_the_claims_need(ranks):
    cp_claims = {c.claim: c for c in day10_report.cp_claims(ranks, SMALL)}
    for impl in ("ring", "ulysses", "all-gather"):
        assert cp_claims[f"{impl} attention on 2 ranks equals attention on one process (outputs, q/k/v grads)"
                         ].verdict == C.AGREES
    work = [r["work"] for r in ranks]
    assert work[0]["zig-zag"]["flops"] == work[1]["zig-zag"]["flops"]
    assert work[1]["contiguous"]["flops"] == 2 * work[0]["contiguous"]["flops"]
    counted = cp.ring_work(SMALL.work_seq, 2, causal=True, zigzag=False)
    assert work[1]["contiguous"]["flops"] / work[0]["contiguous"]["flops"] == counted[1] / counted[0]
    assert cp_claims["ring attention's memory per rank grows linearly with T (only O and L kept)"].verdict == C.AGREES
    if "wire" in ranks[0]:
        wire = [c for c in cp_claims.values() if "bytes each rank sends" in c.claim]
        assert [c.verdict for c in wire] == [C.AGREES, C.AGREES], [c.row() for c in wire]
    assert max(r["ep"]["error"] for r in ranks) < 1e-10 < min(r["ep"]["control"] for r in ranks)


def test_moe_claims_from_short_runs(ranks):
    pairs = day10_moe.pairs(SMALL, 0, torch.device("cpu"))
    claims = {c.claim: c for c in day10_report.moe_claims(pairs, day10_moe.flops(SMALL), ranks, SMALL)}
    assert claims["expert parallelism on 2 ranks equals the one-process MoE"].verdict == C.AGREES
    assert claims["an MoE token costs what a dense layer of its active parameters costs"].verdict == C.AGREES
    a2a = next(c for c in claims.values() if c.claim.startswith("all-to-all bytes"))
    assert a2a.verdict == (C.AGREES if "wire" in ranks[0]["ep"] else C.NOT_MEASURABLE), a2a.row()
    # the paired rows are judged on 3 seeds: their verdict is the data's; their evidence is paired
    assert all("paired by seed" in c.row()["evidence"] for c in claims.values() if "aux" in c.claim)


def test_loads_imbalance_and_drops():
    load = torch.tensor([6, 2, 0, 0])  # 8 assignments of 4 tokens, top-2, over 4 experts
    assert day10_moe.imbalance(load) == 3.0
    assert day10_moe.dropped_share(load, 2, 1.0) == (6 - 2) / 8  # C = ceil(8 / 4) = 2
    assert day10_moe.dropped_share(load, 2, 3.0) == 0.0          # C = 6


def test_planner_rows_and_uneven_splits():
    rows = {r["config"]: r for r in day10.plan(DAY10["full"], gpus=8, gpu_mem_gb=80)}
    P, t = DAY10["full"], DAY10["full"].seq_lens[-1] // 8
    ring = rows["ring attention (one layer)"]
    assert ring["main"] and ring["fits"]
    assert ring["activations"] == 4 * P.batch * P.heads * t * P.head_dim * 2 + cp.ring_saved_bytes(
        P.batch, P.heads, P.seq_lens[-1], P.head_dim, 8, 4)
    assert rows["all-gather attention"]["activations"] > ring["activations"]
    for r in rows.values():
        assert r["total"] == r["params"] + r["grads"] + r["optimizer"] + r["activations"] + r["transient"]
    with pytest.raises(ValueError, match="experts"):
        day10.plan(P, gpus=16, gpu_mem_gb=80)
