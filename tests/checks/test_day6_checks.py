"""The Day 6 checks accept the references (written as a student would, in exercise form) and reject
stubs, forbidden shortcuts and the mistakes students make: the wrong warm-up, unweighted micro-batch
losses, GPipe submitted as 1F1B, blocking sends that deadlock. The training-step checks (3, 4) take
their ranks from a pool kept alive across tests (`tests.rank_pool`: a launch costs seconds of
interpreter start-up; a failure on a rank ends the pool, so the forbidden call comes last of the
2-rank tests); the deadlock and torch.distributed.pipelining tests launch their ranks as the notebook
does (the step checks see whether torch's pipelining was imported on the rank, so it never runs in
the pool). The forbidden-reference rule is shown once in process (exercise 1) and once on ranks (3)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from dlo.checks import day6
from dlo.distributed import pipeline as pp
from dlo.distributed import pipeline_schedules as S

pytestmark = pytest.mark.usefixtures("one_thread")

def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- 1. schedules

def gpipe_ok(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b_ok(p, m, extra=0):
    out = []
    for r in range(p):
        w = min(p - r - 1 + extra, m)
        acts = [("F", i) for i in range(w)]
        for j in range(m - w):
            acts += [("F", w + j), ("B", j)]
        out.append(acts + [("B", j) for j in range(m - w, m)])
    return out


def bubble_ok(p, m):
    return (p - 1) / (m + p - 1)


def gpipe_backwards_reversed(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))] for _ in range(p)]


def one_f_one_b_warmup_p_minus_r(p, m):
    return one_f_one_b_ok(p, m, extra=1)


def gpipe_via_library(p, m):
    return [[(a.kind, a.mb) for a in acts] for acts in S.gpipe_schedule(p, m)]


def test_schedules_accept_the_reference():
    day6.check_schedules(gpipe_ok, one_f_one_b_ok, bubble_ok, seed=1, trials=6)


@pytest.mark.parametrize("fns,match", [
    ((gpipe_backwards_reversed, one_f_one_b_ok, bubble_ok), "gpipe: rank 0's actions differ"),
    ((gpipe_ok, one_f_one_b_warmup_p_minus_r, bubble_ok), "1f1b: rank 0's actions differ from 1F1B's"),
    ((gpipe_ok, one_f_one_b_ok, lambda p, m: (p - 1) / m), "bubble_fraction"),
    ((gpipe_via_library, one_f_one_b_ok, bubble_ok), "off limits")])
def test_schedules_reject(fns, match):
    with pytest.raises(AssertionError, match=match):
        day6.check_schedules(*fns)


def test_schedules_reject_a_stub():
    with pytest.raises(NotImplementedError):
        day6.check_schedules(stub, one_f_one_b_ok, bubble_ok)


# ----------------------------------------------------------------------------- 2. stage partition

def _dp(costs, p):
    """The exercise's dynamic programme, written out (the library's is forbidden inside the check)."""
    n = len(costs)
    if p > n:
        raise ValueError("more stages than blocks")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    best = {(0, 0): (0.0, 0)}
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            cands = [(max(best[(k - 1, i)][0], pre[j] - pre[i]), i) for i in range(k - 1, j) if (k - 1, i) in best]
            best[(k, j)] = min(cands)
    bounds, j = [n], n
    for k in range(p, 0, -1):
        j = best[(k, j)][1]
        bounds.append(j)
    bounds.reverse()
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def split_equal_counts(costs, p):
    """Same number of blocks per stage: contiguous and covering, but blind to the costs."""
    if p > len(costs):
        raise ValueError("too many")
    edges = [round(k * len(costs) / p) for k in range(p + 1)]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def split_round_robin(costs, p):
    if p > len(costs):
        raise ValueError("too many")
    return [list(range(s, len(costs), p)) for s in range(p)]


def split_no_error(costs, p):
    return _dp(costs, min(p, len(costs))) + [[]] * max(0, p - len(costs))


def test_split_accepts_the_reference():
    day6.check_split_stages(_dp, seed=1, trials=12)


@pytest.mark.parametrize("fn,match", [(split_equal_counts, "a partition with largest stage"),
                                      (split_round_robin, "contiguous runs"),
                                      (split_no_error, "must raise ValueError")])
def test_split_rejects(fn, match):
    with pytest.raises(AssertionError, match=match):
        day6.check_split_stages(fn)


# ----------------------------------------------------------------------------- 3., 4. training steps

class Steps:
    """One stage's forward and backward of micro-batches, in exercise form (point to point)."""

    def __init__(self, stage, microbatches, targets, loss_fn, weigh=True, blocking=False):
        self.s, self.xs, self.ys, self.loss_fn, self.weigh, self.blocking = (stage, microbatches, targets, loss_fn,
                                                                             weigh, blocking)
        self.inputs, self.outputs, self.sends, self.loss = {}, {}, [], 0.0
        self.total = sum(len(t) for t in targets) if stage.is_last else None

    def send(self, t, peer):
        if self.blocking:
            dist.send(t, peer)
        else:
            self.sends.append(dist.isend(t, peer))

    def forward(self, i):
        s = self.s
        if s.is_first:
            x = self.xs[i]
        else:
            x = torch.empty(s.in_shapes[i], dtype=s.dtype)
            dist.recv(x, s.rank - 1)
            x.requires_grad_()
        y = s.module(x)
        if s.is_last:
            share = len(self.ys[i]) / self.total if self.weigh else 1 / len(self.ys)
            y = self.loss_fn(y, self.ys[i]) * share
            self.loss += y.item()
        else:
            self.send(y.detach(), s.rank + 1)
        self.inputs[i], self.outputs[i] = x, y

    def backward(self, i):
        s = self.s
        if s.is_last:
            self.outputs.pop(i).backward()
        else:
            g = torch.empty(s.out_shapes[i], dtype=s.dtype)
            dist.recv(g, s.rank + 1)
            self.outputs.pop(i).backward(g)
        x = self.inputs.pop(i)
        if not s.is_first:
            self.send(x.grad, s.rank - 1)

    def finish(self):
        for w in self.sends:
            w.wait()
        return self.loss if self.s.is_last else None


def gpipe_ok_step(stage, xs, ys, loss_fn, **kw):
    run, m = Steps(stage, xs, ys, loss_fn, **kw), len(stage.in_shapes)
    for i in range(m):
        run.forward(i)
    for i in range(m):
        run.backward(i)
    return run.finish()


def one_f_one_b_ok_step(stage, xs, ys, loss_fn, **kw):
    run, m = Steps(stage, xs, ys, loss_fn, **kw), len(stage.in_shapes)
    w = min(stage.p - stage.rank - 1, m)
    for i in range(w):
        run.forward(i)
    for j in range(m - w):
        run.forward(w + j)
        run.backward(j)
    for j in range(m - w, m):
        run.backward(j)
    return run.finish()


def gpipe_mean_of_means(stage, xs, ys, loss_fn):
    """Each micro-batch's mean loss divided by m: right only when the micro-batches are equal."""
    return gpipe_ok_step(stage, xs, ys, loss_fn, weigh=False)


def gpipe_via_library(stage, xs, ys, loss_fn):
    return pp.gpipe_step(stage, xs, ys, loss_fn)


def one_f_one_b_blocking(stage, xs, ys, loss_fn):
    return one_f_one_b_ok_step(stage, xs, ys, loss_fn, blocking=True)


def test_gpipe_accepts_the_reference(ranks):
    day6.check_gpipe_step(gpipe_ok_step, seed=0)


def test_one_f_one_b_rejects_gpipe_for_its_memory(ranks):
    with pytest.raises(AssertionError, match=r"kept [4-9]\.0 micro-batches of activations alive .* at most p = 2"):
        day6.check_one_f_one_b_step(gpipe_ok_step, seed=0)


@pytest.mark.parametrize("fn,match", [(gpipe_mean_of_means, "weigh each micro-batch's mean loss"),
                                      (gpipe_via_library, "off limits")])
def test_gpipe_rejects(fn, match, ranks):
    with pytest.raises(AssertionError, match=match):
        day6.check_gpipe_step(fn, seed=0)


def test_one_f_one_b_accepts_the_reference_on_three_ranks(ranks):
    day6.check_one_f_one_b_step(one_f_one_b_ok_step, seed=1, world_size=3)


def test_a_deadlocked_1f1b_ends_at_the_timeout_naming_each_ranks_last_message(pool):
    pool.stop()  # the pool's ranks are done: the rest of this module launches its own
    with pytest.raises(AssertionError) as err:
        day6.check_one_f_one_b_step(one_f_one_b_blocking, seed=0, timeout=8)
    msg = str(err.value)
    assert "did not finish" in msg and "A deadlock?" in msg
    for r, peer in ((0, 1), (1, 0)):  # both ranks stuck in a blocking send to each other
        assert re.search(rf"rank {r} \(its last heartbeat: 'rank {r}, your 1F1B step \(p=2, m=\d\): last posted "
                         rf"send of a \([0-9x]+\) tensor to rank {peer}'", msg), msg


# ----------------------------------------------------------------------------- 5. torch.distributed.pipelining

def torch_ok(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = [PipelineStage(mod, s, n_stages, torch.device("cpu")) for mod, s in zip(stage_modules, stage_ids)]
    if schedule == "Interleaved1F1B":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    else:
        sched = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule](stages[0], n_microbatches, loss_fn=loss_fn)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    losses = [] if last else None
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    return losses


def test_torch_pipeline_accepts_the_reference():
    day6.check_torch_pipeline(torch_ok, seed=0)
