"""dlo.distributed.pipeline_order: every schedule of the course keeps the order NCCL needs (no tags:
the k-th send of a pair is the k-th receive, and an in-order replay completes), at p = 1..4 and the
m the course uses; the checker catches the hazards it is for (the direction groups of the code before,
interleaving on p = 2; two messages of the same shape swapped); and p = 1 keeps its messages home.
No process group: the engines run rank after rank in this process (the 2-rank launch of
test_pipeline.py checks that real gloo ranks post the same messages on the same process groups)."""

import pytest
import torch
import torch.nn.functional as F

from dlo.distributed import pipeline as pp
from dlo.distributed import pipeline_order as O
from dlo.distributed.pipeline_comms import Message, channel, pipeline_channels
from dlo.distributed.pipeline_schedules import interleaved_schedule
from dlo.presets import DAY6
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

COURSE_M = sorted({m for P in DAY6.values() for m in (*P.m_values, P.gantt_m, P.split_m)})  # the experiments'


def _cases():
    """(schedule, p, m, v): every schedule at p = 1..4, m from 1 to 2p + 1 (m < p, and m not a multiple
    of p, included) and the course's m; interleaving only where m is a multiple of p, with the course's
    v = 2 chunks per rank, and v = 3 up to m = 2p."""
    for name in O.SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in sorted({*range(1, 2 * p + 2), *COURSE_M}):
                if name != "interleaved":
                    yield name, p, m, 1
                elif m % p == 0:
                    yield from ((name, p, m, v) for v in ((2, 3) if m <= 2 * p else (2,)))


def _old_direction_groups(kind, src, dst):
    """The communicators of the code before: one process group per direction (activations, gradients)."""
    return kind


@pytest.mark.parametrize("name", O.SCHEDULES)
def test_every_course_schedule_keeps_the_order_nccl_needs(name):
    for sched, p, m, v in _cases():
        if sched != name:
            continue
        traces = O.record(name, p, m, v)
        n_stages = p * v
        ops = [op for t in traces for op in O.posted(t)]
        # every boundary crossing of the step recorded at both ends: (stages - 1) boundaries, m
        # micro-batches, an activation and a gradient, a send and a receive (none on one rank)
        assert len(ops) == (4 * (n_stages - 1) * m if p > 1 else 0), (name, p, m, v)
        assert all(op.blocking for op in ops if op.op == "recv"), (name, p, m, v)
        assert {op.channel for op in ops} == set(pipeline_channels(p, n_stages)), (name, p, m, v)
        assert O.nccl_problems(traces) == [], (name, p, m, v)


def test_the_direction_groups_deadlock_interleaving_on_two_ranks():
    """The hazard of the code before (its docstring said so, nothing refused it): activations both ways
    between ranks 0 and 1 on one communicator, each rank's receive queued behind its own send."""
    traces = O.record("interleaved", 2, 4, channel_of=_old_direction_groups)
    assert O.mismatches(traces) == []  # every message would arrive right: it is the order that hangs
    stuck = O.nccl_deadlock(traces, shared=False)
    assert stuck == ("rank 0 waits for its recv of act(stage 2, mb 0) (2x4, float32) from rank 1 on act, queued "
                     "behind its send of act(stage 1, mb 1) (2x4, float32) to rank 1; rank 1 waits for its recv of "
                     "act(stage 1, mb 1) (2x4, float32) from rank 0 on act, queued behind its send of act(stage 2, "
                     "mb 0) (2x4, float32) to rank 0")
    # with the group's own communicator for all peers (eager init), p = 3 deadlocks too, in a ring
    ring = O.nccl_deadlock(O.record("interleaved", 3, 3, channel_of=_old_direction_groups), shared=True)
    assert ring is not None and all(f"rank {r} waits" in ring for r in range(3))
    assert O.nccl_deadlock(O.record("interleaved", 3, 3, channel_of=_old_direction_groups), shared=False) is None
    assert O.nccl_problems(O.record("interleaved", 2, 4)) == []  # a channel per kind and direction


def test_one_communicator_for_everything_deadlocks_1f1b():
    """1F1B's steady state on a single communicator (rank r sends an activation and waits for a gradient
    while rank r + 1 sends that gradient and waits for the activation): why directions need their own."""
    problems = O.nccl_problems(O.record("1f1b", 2, 3, channel_of=lambda kind, src, dst: "world"))
    assert len(problems) == 2 and all(p.startswith("NCCL deadlocks") for p in problems)
    assert O.nccl_problems(O.record("gpipe", 2, 3, channel_of=lambda kind, src, dst: "world")) == []


def test_two_messages_of_the_same_shape_swapped_are_caught():
    """Rank 0 sends micro-batches 1 and 0 in the wrong order: same shapes, so NCCL would deliver each as
    the other without an error, and gloo (matching tags) would not notice either."""
    traces = O.record("gpipe", 2, 3)
    events = traces[0]
    i, j = [k for k, (what, op) in enumerate(events) if what == "post" and op.op == "send"][:2]
    events[i], events[j] = events[j], events[i]
    problems = O.mismatches(traces)
    assert problems == ["on act-0-1, rank 0's send #1 to rank 1 is its send of act(stage 1, mb 1) (2x4, float32) to "
                        "rank 1 but rank 1's receive #1 from rank 0 is its recv of act(stage 1, mb 0) (2x4, float32) "
                        "from rank 0"]


def test_a_missing_message_is_caught():
    traces = O.record("1f1b", 3, 2)
    traces[2] = [(what, op) for what, op in traces[2] if op.msg != Message("grad", 1, 1)]  # rank 2 never sends it
    problems = O.nccl_problems(traces)
    assert "on grad-2-1, rank 2 sends 1 messages to rank 1, which receives 2" in problems
    assert any("rank 1 waits for its recv of grad(stage 1, mb 1)" in p for p in problems)


def test_channels_of_a_pipeline():
    assert pipeline_channels(1, 2) == []  # both stages on one rank: nothing leaves it
    assert pipeline_channels(3, 3) == [("act", 0, 1), ("grad", 1, 0), ("act", 1, 2), ("grad", 2, 1)]
    assert pipeline_channels(2, 4) == [("act", 0, 1), ("grad", 1, 0), ("act", 1, 0), ("grad", 0, 1)]
    assert channel("act", 1, 0) != channel("act", 0, 1)


def test_one_rank_keeps_its_messages_home():
    """p = 1 (one GPU: Day 6 shrinks to world 1) with two chunks: stage 0 hands stage 1 its activation
    and gets its gradient back on the rank (a send to oneself would hang on NCCL); the gradients are
    one process's."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 3).double()]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    F.cross_entropy(mods[1](mods[0](x)), y).backward()
    want = [q.grad.clone() for mod in mods for q in mod.parameters()]
    for mod in mods:
        mod.zero_grad(set_to_none=True)
    stages = pp.build_stages(mods, 1, [2, 2, 2], (4,), dtype=torch.float64, rank=0)
    wire = O.RecordingWire(0)
    for s in stages:
        s.wire = wire
    loss = pp.run_schedule(stages, interleaved_schedule(1, 3, 2)[0], list(x.split(2)), list(y.split(2)),
                           F.cross_entropy)
    assert loss == pytest.approx(F.cross_entropy(mods[1](mods[0](x)), y).item(), rel=1e-12)
    for g, q in zip(want, [q for mod in mods for q in mod.parameters()]):
        torch.testing.assert_close(q.grad, g, rtol=1e-12, atol=1e-14)
    assert wire.events == [] and wire.mailbox == {}


def test_a_schedule_that_reads_before_it_computes_fails_in_one_line():
    stages = pp.build_stages([torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)], 1, [2], (4,), rank=0)
    for s in stages:
        s.wire = O.RecordingWire(0)
    bad = [pp.Action("F", 1, 0), pp.Action("F", 0, 0), pp.Action("B", 1, 0), pp.Action("B", 0, 0)]
    with pytest.raises(RuntimeError, match="stage 1 needs the activation of micro-batch 0 .* before this rank"):
        pp.run_schedule(stages, bad, [torch.randn(2, 4)], [torch.tensor([0, 1])], F.cross_entropy)
