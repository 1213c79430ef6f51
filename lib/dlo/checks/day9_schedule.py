"""Day 9's check of one continuous-batching scheduler step (Yu et al. 2022, Orca; Kwon et al. 2023, Sec. 4.5),
re-exported by `dlo.checks.day9`: the student's plain function against `dlo.inference.batching.Scheduler`
put in the same state (running sequences holding their blocks, a waiting queue, free blocks), on hidden states
that make it preempt (one victim, or several; victims in mid-block, holding a partial last block), decode
sequences in mid-block that need no block, stop at the batch limit, and stop at a request that does not fit.
"""

from __future__ import annotations

import math
import random

from dlo.grading.api import case_seed, check
from dlo.grading.compare import fmt, ok
from dlo.inference.batching import Request, Scheduler, Sequence
from dlo.inference.paged import BlockManager

SCHEDULERS = ("dlo.inference.batching.Scheduler", "dlo.inference.batching.serve", "dlo.inference.batching.simulate")


def reference_step(running, waiting, num_free: int, block_size: int, max_batch: int) -> tuple[list, list, list]:
    """The library's scheduler in the same state: running [rid, cached tokens] in admission order (each holding
    ceil(cached / block_size) blocks), waiting [rid, tokens to prefill] in queue order."""
    held = sum(math.ceil(c / block_size) for _, c in running)
    manager = BlockManager(held + num_free, block_size)
    scheduler = Scheduler(manager, max_batch)
    for rid, cached in running:
        manager.add(rid)
        manager.append_slots(rid, cached)
        scheduler.running.append(Sequence(Request(rid, (0,) * cached, 1 << 20)))
    scheduler.waiting.extend(Sequence(Request(rid, (0,) * tokens, 1 << 20)) for rid, tokens in waiting)
    plan = scheduler.schedule(now=0)
    return tuple([s.request.rid for s in part] for part in (plan.decode, plan.prefill, plan.preempted))


def _state(rng: random.Random, t: int) -> dict:
    """A hidden state, by t % 7: short of blocks (preemption); just enough blocks for the running sequences'
    new ones plus the head request (the budget); a head request that does not fit while a later one would
    (first come, first served); anything; short by more than one victim frees (every other time: victims in mid-block,
    `_state_mid_block_victims`); sequences in mid-block that need no new block, more of them than free blocks;
    a batch limit below what the blocks admit."""
    kind, bs = t % 7, rng.choice([2, 3, 4])
    if kind == 4 and t // 7 % 2:  # every other time: preemption among sequences in mid-block
        return _state_mid_block_victims(rng, bs)
    if kind >= 4:
        return _state_more(rng, kind, bs)
    running = [[rid, rng.randint(1, 4 * bs)] for rid in range(rng.randint(1, 5))]
    waiting = [[10 + i, rng.randint(1, 5 * bs)] for i in range(rng.randint(2, 6))]
    num_free = rng.randint(len(running) + 1, len(running) + 8)
    if kind in (0, 1):  # at block boundaries: each running sequence needs a new block
        running = [[rid, bs * rng.randint(1, 3)] for rid, _ in running]
    if kind == 0:  # one short: the victim frees 2-3 blocks, enough for a one-block head it must not admit
        running = [[rid, bs * rng.randint(2, 3)] for rid, _ in running]
        num_free, waiting[0][1] = len(running) - 1, 1
    elif kind == 1:  # the head takes what is left after the running sequences' blocks; the next needs one more
        k = rng.randint(1, 3)
        num_free, waiting[0][1], waiting[1][1] = len(running) + k, k * bs, 1
    elif kind == 2:  # the head does not fit, the next one would
        waiting[0][1], waiting[1][1] = 40 * bs, 1
    return dict(running=running, waiting=waiting, num_free=num_free, block_size=bs,
                max_batch=rng.randint(len(running) + 2, len(running) + 4))


def _state_more(rng: random.Random, kind: int, bs: int) -> dict:
    waiting = [[10 + i, rng.randint(1, 2 * bs)] for i in range(rng.randint(3, 6))]
    r = rng.randint(3, 6) if kind == 4 else rng.randint(2, 5) if kind == 5 else rng.randint(1, 4)
    if kind == 4:  # all at block boundaries, the last two holding one block: 2+ victims (each frees 1, needs 1)
        running = [[rid, bs * (1 if rid >= r - 2 else rng.randint(1, 3))] for rid in range(r)]
        num_free = rng.randint(0, r - 3)
    else:  # some in mid-block (no new block); kind 5: fewer free blocks than running sequences, enough for them
        boundary = set(rng.sample(range(r), rng.randint(0, r - 1)))
        running = [[rid, bs * rng.randint(1, 3) - (0 if rid in boundary else rng.randint(1, bs - 1))]
                   for rid in range(r)]
        need = len(boundary)
        num_free = rng.randint(need, r - 1) if kind == 5 else need + sum(-(-n // bs) for _, n in waiting) + \
            rng.randint(0, 2)
    max_batch = r + (rng.randint(1, len(waiting) - 1) if kind == 6 else rng.randint(2, 4))
    return dict(running=running, waiting=waiting, num_free=num_free, block_size=bs, max_batch=max_batch)


def _state_mid_block_victims(rng: random.Random, bs: int) -> dict:
    """Two victims, the latest admitted in mid-block: it needs no new block yet goes first, and frees m >= 2
    blocks, the last partial; the next, at a block boundary, frees h. The free blocks are exactly what the c
    boundary sequences left need once both are gone, so a victim counted as floor(n / block_size) blocks, or as
    one block, leaves one short (a third victim), and a victim chosen among those needing a block is the wrong one."""
    m, h = rng.randint(2, 3), rng.randint(1, 2)
    c = m + h + rng.randint(0, 1)
    front = [bs * rng.randint(1, 3) for _ in range(c)] + \
        [bs * rng.randint(1, 3) - rng.randint(1, bs - 1) for _ in range(rng.randint(0, 2))]
    rng.shuffle(front)
    tokens = front + [bs * h, bs * m - rng.randint(1, bs - 1)]
    running = [[rid, n] for rid, n in enumerate(tokens)]
    waiting = [[10 + i, rng.randint(1, 2 * bs)] for i in range(rng.randint(2, 4))]
    return dict(running=running, waiting=waiting, num_free=c - m - h, block_size=bs,
                max_batch=len(running) + rng.randint(2, 4))


def _slip(got: tuple, want: tuple, s: dict) -> str:
    """What the first difference says about the student's step."""
    (g_dec, g_pre, g_out), (w_dec, _, w_out) = got, want
    if g_out != w_out:
        if not w_out:
            return ("nothing to preempt: only a sequence at a block boundary (n % block_size == 0) needs a new block "
                    "for its next token, and those fit in the free blocks")
        if g_out[:len(w_out)] == w_out:
            return ("preempted too many: a victim frees every block it holds, ceil(n / block_size), its partial "
                    "last block included; stop as soon as the rest need no more new blocks than are free")
        if g_out and w_out[:len(g_out)] == g_out:
            return ("keep preempting: after each victim (its blocks freed), preempt the next latest admitted while the "
                    "rest still need more new blocks than are free")
        if sorted(g_out) == sorted(w_out) or (g_out and g_out[0] == s["running"][0][0] and w_out):
            return ("preempt the latest admitted sequence first (the end of `running`), one at a time, until the rest "
                    "fit, and list them in the order you preempted them")
        if g_out and g_out[0] != w_out[0] and w_out[0] == s["running"][-1][0]:
            return ("the victim is the latest admitted sequence (the end of `running`), whether or not it needs a new "
                    "block itself: preempting it frees its blocks for the others")
        return ("preempt while the blocks the running sequences need for one more token exceed the free blocks "
                "(a sequence of n cached tokens needs a new block when n % block_size == 0), freeing each victim's")
    if g_dec != w_dec:
        return "decode every running sequence that was not preempted, in admission order"
    if w_out and g_pre:
        return "admit nothing in a step that preempted: the victims wait at the queue's head at least one step"
    if len(g_dec) + len(g_pre) > s["max_batch"]:
        return f"at most max_batch={s['max_batch']} sequences per step, running and admitted together"
    order = [rid for rid, _ in s["waiting"]]
    if g_pre != order[:len(g_pre)]:
        return "first come, first served: admit from the head of the queue and stop at the first that does not fit"
    return ("the budget: the running sequences' new blocks for this step come first, then each admitted request "
            "takes ceil(tokens / block_size) blocks")


@check(forbid=SCHEDULERS)
def check_schedule_step(fn, seed: int = 0, trials: int = 14) -> None:
    """`fn(running, waiting, num_free, block_size, max_batch) -> (decode, prefill, preempted)` lists of rids,
    against `dlo.inference.batching.Scheduler.schedule` in the same state."""
    name, rng = "schedule_step", random.Random(case_seed(seed))
    for t in range(trials):
        s = _state(rng, t)
        out = fn([list(r) for r in s["running"]], [list(w) for w in s["waiting"]], s["num_free"], s["block_size"],
                 s["max_batch"])
        # three sequences of rids: a tuple of tuples is as clear an answer as the lists the text asks for
        if not (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(x, (list, tuple)) for x in out)):
            shape = type(out).__name__ + (f" of {', '.join(type(x).__name__ for x in out)}"
                                          if isinstance(out, (tuple, list)) else "")
            raise AssertionError(f"{name}: return three lists of rids (decode, prefill, preempted), got a {shape} "
                                 f"({fmt(s)})")
        got = tuple([int(r) for r in x] for x in out)
        want = reference_step(s["running"], s["waiting"], s["num_free"], s["block_size"], s["max_batch"])
        if got != want:
            raise AssertionError(f"{name}: {_slip(got, want, s)}. Got (decode, prefill, preempted) = {got}, expected "
                                 f"{want} ({fmt(s)})")
    ok(name, f"{trials} hidden states, seed={seed}")
