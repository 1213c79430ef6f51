"""dlo.distributed.pipeline and its schedules: the action lists against torch's, the simulator against
the formulas, the partition against brute force, and the engines against one process on 2 ranks
(one launch for all of them), with a deadlock that names what each rank waits for."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.distributed import launch
from dlo.distributed import pipeline as pp
from dlo.distributed import pipeline_schedules as S
from dlo.distributed.pipeline_comms import TorchWire, pipeline_channels, sample_shapes, tag
from dlo.distributed.pipeline_order import RecordingWire, posted, record
from dlo.measure import SavedTensorMeter
from dlo.models.coatnet import coatnet
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE = 32


# ----------------------------------------------------------------------------- action lists

@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_gpipe_and_1f1b_lists_equal_torchs(p, m):
    assert S.gpipe_schedule(p, m) == S.torch_schedule("GPipe", p, m)
    if m >= p:  # torch refuses fewer micro-batches than stages for 1F1B
        ours, theirs = S.one_f_one_b_schedule(p, m), S.torch_schedule("1F1B", p, m)
        assert ours[:-1] == theirs[:-1]
        assert [a.kind for a in ours[-1]] == [a.kind for a in theirs[-1]]


def test_torchs_1f1b_list_numbers_the_last_ranks_forwards_from_one():
    """torch 2.13's Schedule1F1B.pipeline_order (read by get_schedule_ops and the visualizer) names
    micro-batch m on the last rank; the notebook says so. If this fails, torch fixed it: update the
    notebook's paragraph and compare all ranks in dlo.checks.day6.check_schedules."""
    last = S.torch_schedule("1F1B", 2, 4)[-1]
    assert [a.mb for a in last if a.kind == "F"] == [1, 2, 3, 4]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 2), (3, 6, 2), (4, 8, 2), (2, 4, 3)])
def test_interleaved_list_equals_torchs(p, m, v):
    assert S.interleaved_schedule(p, m, v) == S.torch_schedule("Interleaved1F1B", p, m, v)


def test_bad_schedule_parameters_fail_in_one_line():
    with pytest.raises(ValueError, match="multiple of p"):
        S.interleaved_schedule(2, 3)
    with pytest.raises(ValueError, match="m >= 1"):
        S.gpipe_schedule(2, 0)
    with pytest.raises(ValueError, match="more stages than blocks"):
        S.split_stages([1.0, 2.0], 3)


# ----------------------------------------------------------------------------- simulator and formulas

@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_simulated_bubble_equals_the_formulas(p, m):
    for sched in (S.gpipe_schedule(p, m), S.one_f_one_b_schedule(p, m)):
        ev = S.simulate(sched, t_f=1.0, t_b=2.0)
        assert S.bubble_fraction(ev) == pytest.approx(S.bubble_formula(p, m), abs=1e-12)
        assert max(e["end"] for e in ev) == pytest.approx((m + p - 1) * 3.0)  # t_pb = (p - 1)(t_f + t_b)
    if m % p == 0:
        ev = S.simulate(S.interleaved_schedule(p, m, 2), t_f=0.5, t_b=1.0)  # chunks: half a stage
        assert S.bubble_fraction(ev) == pytest.approx(S.bubble_formula(p, m, 2), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3)])
def test_memory_in_flight_and_zero_bubble(p, m):
    assert S.peak_in_flight(S.gpipe_schedule(p, m)) == [m] * p
    assert S.peak_in_flight(S.one_f_one_b_schedule(p, m)) == [min(p - r, m) for r in range(p)]
    zb = S.zero_bubble_schedule(p, m)
    assert S.peak_in_flight(zb) == [min(p, m)] * p  # ZB-H1 keeps 1F1B's peak on every rank
    if m >= p:  # Qi et al. 2023, Table 1, T_F = T_B = T_W = 1: bubbles 3(p - 1) and (p - 1)
        one = max(e["end"] for e in S.simulate(S.one_f_one_b_schedule(p, m), 1.0, 2.0))
        h1 = max(e["end"] for e in S.simulate(zb, 1.0, 1.0, 1.0))
        assert (one - 3 * m, h1 - 3 * m) == (3 * (p - 1), p - 1)


def test_simulator_reports_a_deadlocked_schedule():
    bad = S.gpipe_schedule(2, 2)
    bad[1] = [S.Action("B", 1, 0), S.Action("F", 1, 0), S.Action("F", 1, 1), S.Action("B", 1, 1)]  # B0 before F0
    with pytest.raises(ValueError, match="deadlocks.*rank 1 at 1B0"):
        S.simulate(bad)


def test_split_stages_is_optimal():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 8)
        costs = [rng.choice([0.0, 1.0, rng.uniform(0, 5)]) for _ in range(n)]
        p = rng.randint(1, n)
        got = S.split_stages(costs, p)
        assert [i for s in got for i in s] == list(range(n)) and all(got)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for cuts in itertools.combinations(range(1, n), p - 1))
        assert max(sum(costs[i] for i in s) for s in got) == pytest.approx(best)
    assert S.stage_bounds([[0, 1], [2, 3, 4]]) == [0, 2, 5]


def test_stage_modules_and_shapes():
    model = coatnet("tiny", image_size=IMAGE)
    with pytest.raises(ValueError, match="stage 1 of the split .* is empty"):
        pp.make_stage_modules(list(model.blocks), [0, 4, 4, 15])
    with pytest.raises(ValueError, match="more stages than blocks"):
        pp.make_stage_modules(list(model.blocks[:2]), [0, 1, 2, 2])
    mods = pp.make_stage_modules(list(model.blocks), [0, 5, 15])
    assert sample_shapes(mods, (3, IMAGE, IMAGE)) == [(32, 4, 4), (10,)]  # after S2's first block; logits
    stages = pp.build_stages(mods, 2, [3, 2], (3, IMAGE, IMAGE), rank=1)
    assert len(stages) == 1 and stages[0].is_last and stages[0].in_shapes == [(3, 32, 4, 4), (2, 32, 4, 4)]
    with pytest.raises(ValueError, match="cannot be placed"):
        pp.build_stages(mods, 3, [1], (3, IMAGE, IMAGE), rank=0)
    tags = {tag(k, s, i, 4) for k in ("act", "grad") for s in range(4) for i in range(4)}
    assert len(tags) == 32  # every message of a step has its own tag


# ----------------------------------------------------------------------------- engine order, no messages

@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (3, 5), (4, 4), (4, 7)])
def test_engines_run_the_schedule_lists_in_order(p, m):
    """Each rank's GPipe and 1F1B engine runs its forwards and backwards (recorded by its Timeline)
    in the order of the schedule's list for that rank, warm-up and drain included (m < p too); its
    messages are recorded, not sent (a receive gives zeros)."""
    for engine, schedule in ((pp.gpipe_step, S.gpipe_schedule), (pp.one_f_one_b_step, S.one_f_one_b_schedule)):
        for r in range(p):
            last = r == p - 1
            stage = pp.Stage(torch.nn.Linear(4, 3 if last else 4), r, p, p, [(2, 4)] * m, [(2, 3 if last else 4)] * m,
                             wire=RecordingWire(r))
            xs, ys = [torch.randn(2, 4) for _ in range(m)], [torch.tensor([0, 2])] * m
            tl = pp.Timeline(r)
            engine(stage, xs, ys, F.cross_entropy, tl)
            assert [(e["kind"], e["stage"], e["mb"]) for e in tl.events] == [tuple(a) for a in schedule(p, m)[r]]


# ----------------------------------------------------------------------------- engines on 2 ranks

def _case(m: int, equal: bool):
    torch.manual_seed(3)
    model = coatnet("tiny", image_size=IMAGE).double().eval()  # eval: BatchNorm per sample
    g = torch.Generator().manual_seed(4)
    B = 2 * m if equal else 2 * m + 1
    x, y = torch.randn(B, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64), torch.randint(0, 10, (B,), generator=g)
    return model, [t.clone() for t in x.tensor_split(m)], list(y.tensor_split(m)), x, y  # own storages


def _engines_worker():
    r, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, bounds, m in (("naive", [0, 7, 15], 1), ("gpipe", [0, 7, 15], 3), ("1f1b", [0, 4, 15], 4),
                            ("interleaved", [0, 3, 7, 10, 15], 4)):
        model, xs, ys, _, _ = _case(m, equal=name == "1f1b")
        mods = pp.make_stage_modules(list(model.blocks), bounds)
        stages = pp.build_stages(mods, p, [len(t) for t in ys], (3, IMAGE, IMAGE), dtype=torch.float64)
        wire = RecordingWire(r, inner=TorchWire(pipeline_channels(p, len(mods))))  # sent, and recorded
        for s in stages:
            s.wire = wire
        held = [t for s in stages for t in (*s.module.parameters(), *s.module.buffers())]
        tl = pp.Timeline(r)
        with SavedTensorMeter(exclude=held) as meter:
            if name == "naive":
                loss = pp.naive_step(stages[0], xs[0], ys[0], F.cross_entropy, tl)
            elif name == "interleaved":
                loss = pp.run_schedule(stages, S.interleaved_schedule(p, m, 2)[r], xs, ys, F.cross_entropy, tl)
            else:
                loss = pp.ENGINES[name](stages[0], xs, ys, F.cross_entropy, tl)
        out[name] = {"loss": loss, "grads": {s.index: [q.grad for q in s.module.parameters()] for s in stages},
                     "order": [(e["kind"], e["stage"], e["mb"]) for e in tl.events], "peak": meter.peak,
                     "messages": [(o.op, o.peer, o.channel, tuple(o.msg)) for o in posted(wire.events)],
                     "groups": {ch: dist.get_process_group_ranks(g) for ch, g in wire.inner.groups.items()}}
    return out


def test_engines_equal_one_process_on_two_ranks():
    got = launch(_engines_worker, 2, timeout=120)
    schedules = {"naive": S.gpipe_schedule(2, 1), "gpipe": S.gpipe_schedule(2, 3),
                 "1f1b": S.one_f_one_b_schedule(2, 4), "interleaved": S.interleaved_schedule(2, 4, 2)}
    for name, bounds, m in (("naive", [0, 7, 15], 1), ("gpipe", [0, 7, 15], 3), ("1f1b", [0, 4, 15], 4),
                            ("interleaved", [0, 3, 7, 10, 15], 4)):
        model, xs, ys, x, y = _case(m, equal=name == "1f1b")
        if name == "naive":
            x, y = xs[0], ys[0]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        mods = pp.make_stage_modules(list(model.blocks), bounds)
        assert got[0][name]["loss"] is None and got[1][name]["loss"] == pytest.approx(loss.item(), rel=1e-12)
        for s, mod in enumerate(mods):
            for g, q in zip(got[s % 2][name]["grads"][s], mod.parameters()):
                torch.testing.assert_close(g, q.grad, rtol=1e-9, atol=1e-12)
        recorded = record("gpipe" if name == "naive" else name, 2, m)  # this process, no peer
        for r in range(2):  # the engines ran exactly the schedules' action lists, and posted the recorded messages
            assert got[r][name]["order"] == [tuple(a) for a in schedules[name][r]]
            assert got[r][name]["messages"] == [(o.op, o.peer, o.channel, tuple(o.msg)) for o in posted(recorded[r])]
            assert got[r][name]["groups"] == {ch: [0, 1] for ch in pipeline_channels(2, len(mods))}
    # 1F1B on 2 ranks: rank 0 holds at most 2 of the 4 micro-batches, rank 1 one; equal micro-batches
    model, xs, _, _, _ = _case(4, equal=True)
    first = pp.make_stage_modules(list(model.blocks), [0, 4, 15])[0]
    with SavedTensorMeter(exclude=[*first.parameters(), *first.buffers()]) as meter:
        first(xs[0])
    assert got[0]["1f1b"]["peak"] == 2 * meter.peak


def _mismatched_worker():
    """Rank 0 starts with a backward whose gradient rank 1 sends only after a forward that waits for
    rank 0: both ranks wait for each other."""
    r, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)]
    stages = pp.build_stages(mods, p, [2, 2], (4,))
    xs, ys = [torch.randn(2, 4), torch.randn(2, 4)], [torch.tensor([0, 1]), torch.tensor([2, 0])]
    actions = S.one_f_one_b_schedule(p, 2)[r]
    if r == 0:
        actions = [S.Action("B", 0, 0)] + actions
    pp.run_schedule(stages, actions, xs, ys, F.cross_entropy)


def test_a_deadlock_names_what_each_rank_waits_for():
    with pytest.raises(TimeoutError) as err:
        launch(_mismatched_worker, 2, timeout=4)
    msg = str(err.value)
    assert "rank 0 (its last heartbeat: 'stage 0 (rank 0) waits for the output gradient of micro-batch 0" in msg
    assert "rank 1 (its last heartbeat: 'stage 1 (rank 1) waits for the activation of micro-batch 0" in msg
