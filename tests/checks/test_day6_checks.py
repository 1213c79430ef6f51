"""The Day 6 checks accept the solution notebook's code and reject stubs, forbidden shortcuts and the
mistakes students make: the wrong warm-up, unweighted micro-batch losses, GPipe submitted as 1F1B,
blocking sends that deadlock.

The reference solutions are the notebook's own solution cells (executed here from
solutions/day6_pipeline), so these tests prove what the grader will see. The training-step checks
(3, 4) take their ranks from a pool kept alive across tests (`tests.rank_pool`: a launch costs
seconds of interpreter start-up; a failure on a rank ends the pool, so the forbidden call comes last
of the 2-rank tests); the deadlock and torch.distributed.pipelining tests launch their ranks as the
notebook does (the step checks see whether torch's pipelining was imported on the rank, so it never
runs in the pool). The forbidden-reference rule is shown once in process (exercise 1) and once on
ranks (3)."""

from __future__ import annotations

import re

import pytest

from dlo.checks import day6
from dlo.distributed import pipeline as pp
from dlo.distributed import pipeline_schedules as S
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sol():
    return load_solution("day6_pipeline")


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- 1. schedules

def gpipe_backwards_reversed(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))] for _ in range(p)]


def one_f_one_b_warmup_p_minus_r(p, m):
    """1F1B with one warm-up forward too many on every rank: p - r instead of p - r - 1."""
    out = []
    for r in range(p):
        w = min(p - r, m)
        acts = [("F", i) for i in range(w)]
        for j in range(m - w):
            acts += [("F", w + j), ("B", j)]
        out.append(acts + [("B", j) for j in range(m - w, m)])
    return out


def gpipe_schedule_via_library(p, m):
    return [[(a.kind, a.mb) for a in acts] for acts in S.gpipe_schedule(p, m)]


def bubble_equal_stages(t_f, t_b, m):
    """Section 2's formula, blind to the stages' durations."""
    p = len(t_f)
    return (p - 1) / (m + p - 1)


def bubble_slowest_slots(t_f, t_b, m):
    """(m + p - 1) slots of the slowest stage's forward + backward: 1F1B's rough pace, not GPipe's step."""
    p, slow = len(t_f), max(f + b for f, b in zip(t_f, t_b))
    return 1 - m * sum(t_f + t_b) / p / ((m + p - 1) * slow)


def bubble_over_ideal(t_f, t_b, m):
    p = len(t_f)
    return (p - 1) / m


def test_schedules_accept_the_reference(sol):
    day6.check_schedules(sol.gpipe_schedule, sol.one_f_one_b_schedule, sol.gpipe_bubble, seed=1, trials=6)


@pytest.mark.parametrize("slot,wrong,match", [
    (0, gpipe_backwards_reversed, "gpipe: rank 0's actions differ"),
    (1, one_f_one_b_warmup_p_minus_r, "1f1b: rank 0's actions differ from 1F1B's"),
    (2, bubble_over_ideal, "gpipe_bubble: .*against \\(p - 1\\)/\\(m \\+ p - 1\\)"),
    (2, bubble_equal_stages, "replayed with these durations.*the equal-stage formula"),
    (2, bubble_slowest_slots, "replayed with these durations.*two phases, each paced by its own slowest stage"),
    (0, gpipe_schedule_via_library, "off limits")])
def test_schedules_reject(sol, slot, wrong, match):
    """Exercise 1's bubble is GPipe's at unequal stages, derived (issue 34: it copied section 2's formula):
    the formula itself, or (m + p - 1) slots of the slowest stage, fail with the model they used named."""
    fns = [sol.gpipe_schedule, sol.one_f_one_b_schedule, sol.gpipe_bubble]
    fns[slot] = wrong  # the solution's other two functions alongside the mistake
    with pytest.raises(AssertionError, match=match):
        day6.check_schedules(*fns)


def test_schedules_reject_a_stub(sol):
    with pytest.raises(NotImplementedError):
        day6.check_schedules(stub, sol.one_f_one_b_schedule, sol.gpipe_bubble)


# ----------------------------------------------------------------------------- 2. stage partition

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


def test_split_accepts_the_reference(sol):
    day6.check_split_stages(sol.split_stages, seed=1, trials=12)


@pytest.mark.parametrize("fn,match", [(split_equal_counts, "a partition with largest stage"),
                                      (split_round_robin, "contiguous runs")])
def test_split_rejects(fn, match):
    with pytest.raises(AssertionError, match=match):
        day6.check_split_stages(fn)


def test_split_rejects_no_error_for_more_stages_than_blocks(sol):
    def split_no_error(costs, p):  # the solution, padded with empty stages where it must raise
        return sol.split_stages(costs, min(p, len(costs))) + [[]] * max(0, p - len(costs))
    with pytest.raises(AssertionError, match="must raise ValueError"):
        day6.check_split_stages(split_no_error)


# ----------------------------------------------------------------------------- 3., 4. training steps

def gpipe_step_via_library(stage, xs, ys, loss_fn):
    return pp.gpipe_step(stage, xs, ys, loss_fn)


def test_gpipe_accepts_the_reference(sol, ranks):
    day6.check_gpipe_step(sol.gpipe_step, seed=0)


def test_one_f_one_b_rejects_gpipe_for_its_memory(sol, ranks):
    with pytest.raises(AssertionError, match=r"kept [4-9]\.0 micro-batches of activations alive .* at most p = 2"):
        day6.check_one_f_one_b_step(sol.gpipe_step, seed=0)


def test_gpipe_rejects_unweighted_micro_batch_losses(sol, ranks):
    gpipe_step = sol.gpipe_step  # the closure ships this function to the ranks, not the whole namespace

    def gpipe_mean_of_means(stage, xs, ys, loss_fn):
        """Each micro-batch's mean loss divided by m: right only when the micro-batches are equal (the
        solution's weight len(y) / batch is undone and 1 / m put in its place)."""
        def unweighted(out, y):  # called on the last stage only, where ys is the list of targets
            return loss_fn(out, y) * sum(len(t) for t in ys) / len(y) / len(ys)
        return gpipe_step(stage, xs, ys, unweighted)
    with pytest.raises(AssertionError, match="weigh each micro-batch's mean loss"):
        day6.check_gpipe_step(gpipe_mean_of_means, seed=0)


# Red team (Day 6): each passed its check at seeds 0..9 before the check read the order of the messages
# and the bytes held for backward at each activation sent (`dlo.checks.day6_order`); GPipe with its
# forwards past 1F1B's window hidden from that count (a custom Function's ctx attribute, or a graph dropped
# and recomputed) passed until the check also added up the bytes saved since the step began.

def in_order(micro_batches, order: str):
    """The solution's micro-batch steps (`MicroBatches`) in another order of ("F" | "B", i) (defined
    here: the ranks get this function by value, never this module)."""
    def step(stage, xs, ys, loss_fn):
        p, r, m = stage.p, stage.rank, len(stage.in_shapes)
        naive = [a for i in range(m) for a in (("F", i), ("B", i))]  # one micro-batch in flight: no pipelining
        gpipe = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        acts = {"naive": naive, "gpipe, the last stage naive": naive if r == p - 1 else gpipe,
                "gpipe, backwards reversed": gpipe[:m] + gpipe[m:][::-1]}[order]
        run = micro_batches(stage, xs, ys, loss_fn)
        for kind, i in acts:
            (run.forward if kind == "F" else run.backward)(i)
        return run.finish()
    return step


def one_batch_step():
    """The micro-batches concatenated: one forward, one backward, one message each way."""
    def step(stage, xs, ys, loss_fn):
        import torch
        import torch.distributed as dist
        r, batch = stage.rank, sum(s[0] for s in stage.in_shapes)
        if stage.is_first:
            x = torch.cat(xs)
        else:
            x = torch.empty((batch, *stage.in_shapes[0][1:]), dtype=stage.dtype)
            dist.recv(x, r - 1)
            x.requires_grad_()
        y = stage.module(x)
        if stage.is_last:
            y = loss_fn(y, torch.cat(ys))
            y.backward()
        else:
            dist.send(y.detach(), r + 1)
            g = torch.empty_like(y)
            dist.recv(g, r + 1)
            y.backward(g)
        if not stage.is_first:
            dist.send(x.grad, r - 1)
        return y.item() if stage.is_last else None
    return step


def gpipe_hidden_from_the_meter(gpipe_step, how):
    """GPipe whose step runs under saved-tensor hooks of its own (the innermost: the only ones autograd
    calls), so that the grader's meter sees no activation: by the class, or by the builtins captured here,
    before the check."""
    import torch
    autograd = torch._C._autograd
    push, pop = autograd._push_saved_tensors_default_hooks, autograd._pop_saved_tensors_default_hooks

    def step(stage, xs, ys, loss_fn):
        if how == "class":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                return gpipe_step(stage, xs, ys, loss_fn)
        push(lambda t: t, lambda t: t)
        try:
            return gpipe_step(stage, xs, ys, loss_fn)
        finally:
            pop()
    return step


def gpipe_hidden_past_the_window(how):
    """GPipe as 1F1B: the forwards past 1F1B's window (micro-batch p - r on) hidden from the count held, so
    that the meter sees 1F1B's at every activation sent. "ctx": a custom autograd Function whose forward
    (run without grad: nothing saved) keeps its input as a ctx attribute and recomputes in backward;
    "twice": an ordinary forward whose graph is dropped once its activation is sent, recomputed in backward."""
    def step(stage, xs, ys, loss_fn):
        import torch
        import torch.distributed as dist
        params = [q for q in stage.module.parameters() if q.requires_grad]

        class Recompute(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *ps):
                ctx.x = x  # an attribute, not save_for_backward: no saved-tensor hook sees it
                return stage.module(x)

            @staticmethod
            def backward(ctx, g):
                with torch.enable_grad():
                    x = ctx.x.detach().requires_grad_(ctx.x.requires_grad)
                    torch.autograd.backward(stage.module(x), g)
                return (x.grad, *[None] * len(params))

        r, m = stage.rank, len(stage.in_shapes)
        total = sum(len(t) for t in ys) if stage.is_last else None
        ins, outs, sends, loss = {}, {}, [], 0.0
        for i in range(m):
            if stage.is_first:
                x = xs[i]
            else:
                x = torch.empty(stage.in_shapes[i], dtype=stage.dtype)
                dist.recv(x, r - 1)
                x.requires_grad_()
            # past the window (1F1B's p - r micro-batches held at a send; "twice": that send's own included)
            hide = not stage.is_last and i >= stage.p - r - (how == "twice")
            y = Recompute.apply(x, *params) if hide and how == "ctx" else stage.module(x)
            if stage.is_last:
                y = loss_fn(y, ys[i]) * (len(ys[i]) / total)
                loss += y.item()
            else:
                sends.append(dist.isend(y.detach(), r + 1))
            if hide and how == "twice":
                y = None  # the graph dropped once the activation is sent
            ins[i], outs[i] = x, y
        for i in range(m):
            x, y = ins.pop(i), outs.pop(i)
            if stage.is_last:
                y.backward()
            else:
                g = torch.empty(stage.out_shapes[i], dtype=stage.dtype)
                dist.recv(g, r + 1)
                (stage.module(x) if y is None else y).backward(g)
            if not stage.is_first:
                sends.append(dist.isend(x.grad, r - 1))
        for work in sends:
            work.wait()
        return loss if stage.is_last else None
    return step


STEP_RED_TEAM = [  # (check, the cheat from the solution, the phrase of the message)
    ("check_gpipe_step", lambda sol: in_order(sol.MicroBatches, "naive"), "GPipe holds 2 there"),
    ("check_gpipe_step", lambda sol: one_batch_step(), r"in 1 message\(s\), expected \d+: one per micro-batch"),
    ("check_gpipe_step", lambda sol: in_order(sol.MicroBatches, "gpipe, the last stage naive"),
     "sent a gradient before receiving all its activations"),
    ("check_one_f_one_b_step", lambda sol: in_order(sol.MicroBatches, "naive"), "1F1B holds 2 there"),
    ("check_one_f_one_b_step", lambda sol: gpipe_hidden_past_the_window("ctx"),
     r"its forwards had saved 2\.0 micro-batches of activations for backward in all \(\d+ bytes\), 3 forwards"),
    ("check_one_f_one_b_step", lambda sol: gpipe_hidden_past_the_window("twice"),
     r"micro-batches: one forward per micro-batch, its activations kept in autograd's graph until its backward"),
]


@pytest.mark.parametrize("check,cheat,phrase", STEP_RED_TEAM, ids=[f"{c}-{p[:20]}" for c, _, p in STEP_RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3])
def test_a_step_with_the_right_gradients_but_not_the_schedule_fails(sol, ranks, check, cheat, phrase, seed):
    """Equal gradients come from any order of the micro-batches: the check reads the schedule itself."""
    with pytest.raises(AssertionError, match=phrase):
        getattr(day6, check)(cheat(sol), seed=seed)


@pytest.mark.parametrize("seed", [0, 3])
def test_gpipe_accepts_other_honest_orders(sol, ranks, seed):
    """Backwards in reverse order, receives posted in advance: still GPipe."""
    day6.check_gpipe_step(in_order(sol.MicroBatches, "gpipe, backwards reversed"), seed=seed)


def test_gpipe_rejects_the_library_engine(ranks):  # a failure on a rank: the last 2-rank test of the pool
    with pytest.raises(AssertionError, match="off limits"):
        day6.check_gpipe_step(gpipe_step_via_library, seed=0)


def test_one_f_one_b_rejects_work_hidden_in_a_thread(sol, ranks):
    """GPipe's step run in a thread: the saved-tensor meter (thread-local hooks) would see nothing of
    its activations. Threads are refused on the ranks (a failure on a rank: the pool starts again)."""
    gpipe_step = sol.gpipe_step

    def gpipe_in_a_thread(stage, xs, ys, loss_fn):
        import threading

        import torch
        import torch.distributed as dist
        out = []
        worker = threading.Thread(target=lambda: out.append(gpipe_step(stage, xs, ys, loss_fn)))
        worker.start()
        worker.join()
        token = torch.zeros(1)  # one message on the calling thread: the watch sees the stages talk
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, token, 1 - stage.rank),
                                            dist.P2POp(dist.irecv, torch.empty(1), 1 - stage.rank)]):
            work.wait()
        return out[0]
    with pytest.raises(AssertionError, match="starting a thread is off limits while this check runs on the ranks"):
        day6.check_one_f_one_b_step(gpipe_in_a_thread, seed=0)


@pytest.mark.parametrize("how,phrase", [("class", "saved_tensors_hooks is off limits"),
                                        ("builtin", "_push_saved_tensors_default_hooks is off limits")])
def test_one_f_one_b_rejects_activations_hidden_from_the_meter(sol, ranks, how, phrase):
    """Red team: GPipe as 1F1B with its own saved-tensor hooks (peak 0 on the grader's meter) passed; the
    hooks are off limits now, also through the builtin the step captured before the check (a failure on
    a rank: the pool starts again)."""
    with pytest.raises(AssertionError, match=phrase):
        day6.check_one_f_one_b_step(gpipe_hidden_from_the_meter(sol.gpipe_step, how), seed=0)


def test_one_f_one_b_accepts_the_reference_on_three_ranks(sol, ranks):
    day6.check_one_f_one_b_step(sol.one_f_one_b_step, seed=1, world_size=3)


def test_a_deadlocked_1f1b_ends_at_the_timeout_naming_each_ranks_last_message(sol, pool):
    micro_batches, schedule = sol.MicroBatches, sol.one_f_one_b_schedule

    def one_f_one_b_blocking(stage, xs, ys, loss_fn):
        """The solution's 1F1B order and micro-batch steps, but each send waited on as soon as it is
        posted (a blocking send): rank 0's next activation and rank 1's gradient wait for each other."""
        run = micro_batches(stage, xs, ys, loss_fn)
        for kind, i in schedule(stage.p, len(stage.in_shapes))[stage.rank]:
            (run.forward if kind == "F" else run.backward)(i)
            for work in run.sends:
                work.wait()
        return run.finish()

    pool.stop()  # the pool's ranks are done: the rest of this module launches its own
    with pytest.raises(AssertionError) as err:
        day6.check_one_f_one_b_step(one_f_one_b_blocking, seed=0, timeout=8)
    msg = str(err.value)
    assert "did not finish" in msg and "A deadlock?" in msg
    for r, peer in ((0, 1), (1, 0)):  # both ranks stuck in a blocking send to each other
        assert re.search(rf"rank {r} \(its last heartbeat: 'rank {r}, your 1F1B step \(p=2, m=\d\): last posted "
                         rf"send of a \([0-9x]+\) tensor to rank {peer}'", msg), msg


# ----------------------------------------------------------------------------- 5. torch.distributed.pipelining

def test_torch_pipeline_accepts_the_reference(sol):
    day6.check_torch_pipeline(sol.torch_pipeline_step, seed=0)


def torch_pipeline_always_gpipe():
    """Red team: `schedule` ignored, GPipe always (LoopedBFS, GPipe for two stages a rank, for interleaving).
    Made here, so that the ranks get it by value, never this module."""
    def step(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule):
        import torch
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS
        stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(stage_modules, stage_ids)]
        sched = (ScheduleLoopedBFS(stages, n_microbatches, loss_fn=loss_fn) if len(stages) > 1
                 else ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn))
        losses = [] if n_stages - 1 in stage_ids else None
        sched.step(*((x,) if 0 in stage_ids else ()), target=y if losses is not None else None, losses=losses)
        return losses
    return step


@pytest.mark.parametrize("schedules", [("1F1B",), ("Interleaved1F1B",)])
def test_torch_pipeline_rejects_another_schedule(schedules):
    with pytest.raises(AssertionError, match=f"did not run {schedules[0]}'s order of forward and backward chunks"):
        day6.check_torch_pipeline(torch_pipeline_always_gpipe(), seed=3, schedules=schedules)
