"""What Day 6's step checks (exercises 3-5) observe of a schedule beyond its loss and gradients: the
order of its actions. Re-used by `dlo.checks.day6`, whose docstring describes every Day 6 check.

Equal gradients do not make a pipeline: running F_i then B_i one micro-batch at a time, or the whole
batch in one forward, gives them too. What tells the schedules apart on a rank is how many micro-batches
it holds for backward when it sends each activation: GPipe's k-th forward holds k, 1F1B's holds
min(k, p - r) on rank r (warm-up, then one forward per backward). So each rank records every send
and receive its step posts (`OrderWatch`: peer, micro-batch size, and the bytes autograd holds for
backward at that moment, `GuardedMeter`), and the check compares those bytes at each activation
sent with the schedule's count of micro-batches alive, measured here one micro-batch at a time
(`stage_bytes`).
An activation can only be sent once its forward ran, so the profile holds however the receives are
posted (early `irecv`s, batched p2p). Hiding saved tensors from the meter would lower the count:
saved-tensor hooks (a step's own, innermost, would be the only ones autograd calls) are off limits
(`dlo.checks.saved.HOOKS`); the grader's meter (`GuardedMeter`) pushes its own through the builtins
captured at import, before anything is blocked. A forward that saves nothing (run under no_grad, or in a
custom autograd Function that keeps its tensors as `ctx` attributes, recomputing in backward) is still
unseen by the count held: GPipe with its forwards past 1F1B's window so hidden showed 1F1B's profile. So the
meter also adds up every byte saved since the step began (`SavedTensorMeter.made`): at the k-th activation sent,
k forwards' worth (each forward saved its activations), and at the end m micro-batches' worth (none saved
twice: a forward recomputed from a kept input, its first graph dropped, would save its activations twice).

Exercise 5: the order in which torch's stages ran their forward and backward chunks, recorded on each
rank, against the asked schedule's list (`torch_order`).
"""

from __future__ import annotations

import torch.distributed as dist

from dlo.checks.saved import GuardedMeter
from dlo.distributed.pipeline import make_stage_modules
from dlo.distributed.pipeline_comms import P2PWatch, describe_p2p
from dlo.measure import SavedTensorMeter


class OrderWatch(P2PWatch):
    """`P2PWatch` that also records each send and receive: [kind, peer (global rank; -1 for any source),
    the tensor's first dimension (the micro-batch's size), the bytes the meter holds then, the bytes it has
    seen saved since the step began]."""

    def __init__(self, label: str, meter: GuardedMeter):
        super().__init__(label)
        self.meter, self.events = meter, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = describe_p2p(func, args)
        if found is not None:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            size = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
            any_source = found[0] == "recv" and func._schema.name.endswith("any_source_")
            self.events.append([found[0], -1 if any_source else _global(args[1], args[2]), size, self.meter.bytes,
                                self.meter.made])
        return super().__torch_dispatch__(func, types, args, kwargs)


def _global(group, rank: int) -> int:
    """A group's rank as a global one (a step may send on a group of its own)."""
    try:
        return dist.get_global_rank(dist.ProcessGroup.unbox(group), rank)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return int(rank)


def stage_bytes(c: dict, p: int) -> list[dict[int, int]]:
    """Per stage but the last, the bytes its forward saves for backward for a micro-batch of each size
    (measured here, the input wanting a gradient past stage 0, as a stage's received activation does)."""
    mods = make_stage_modules(list(c["model"].blocks), c["bounds"])
    out: list[dict[int, int]] = [{} for _ in range(p - 1)]
    for x in {len(x): x for x in c["xs"]}.values():  # one micro-batch of each size
        h = x
        for r in range(p - 1):
            h = h.detach().clone().requires_grad_(r > 0)
            with SavedTensorMeter(exclude=[*mods[r].parameters(), *mods[r].buffers()]) as meter:
                y = mods[r](h)
            out[r][len(x)], h = meter.bytes, y
    return out


def _alive(schedule: str, k: int, p: int, r: int) -> int:
    """Micro-batches a rank holds for backward when it sends its k-th activation (k from 1)."""
    return k if schedule == "GPipe" else min(k, p - r)


def _rule(schedule: str, p: int, r: int) -> str:
    if schedule == "GPipe":
        return "all forwards first, each activation sent as soon as its forward is done, then the backwards"
    return f"warm up with p - r - 1 = {p - r - 1} forwards, then one forward, one backward"


def _counts(name: str, r: int, p: int, events: list, sizes: list[int], where: dict) -> None:
    """One activation and one gradient per micro-batch each way between neighbours, nothing else."""
    m, near = len(sizes), [q for q in (r - 1, r + 1) if 0 <= q < p]
    for e in events:
        if e[1] == -1 and len(near) == 1:  # a receive from any rank on an end stage: from its one neighbour
            e[1] = near[0]
        if e[1] not in near:
            peer = "from any rank" if e[1] == -1 else f"with rank {e[1]}"
            raise AssertionError(f"{name}: rank {r} posted a {e[0]} {peer}; a stage exchanges messages with its "
                                 f"neighbours only, naming the peer ({where})")
    want = {("recv", r - 1): "received activations from", ("send", r - 1): "sent gradients to",
            ("send", r + 1): "sent activations to", ("recv", r + 1): "received gradients from"}
    for (kind, peer), what in want.items():
        mine = [e for e in events if e[0] == kind and e[1] == peer]
        if peer in near and len(mine) != m:
            raise AssertionError(f"{name}: rank {r} {what} rank {peer} in {len(mine)} message(s), expected {m}: one "
                                 f"per micro-batch, each its own message ({where})")
        if kind == "send" and peer == r + 1 < p and sorted(e[2] for e in mine) != sorted(sizes):
            raise AssertionError(f"{name}: rank {r} sent activations of {[e[2] for e in mine]} samples, the "
                                 f"micro-batches have {sizes}: one message per micro-batch ({where})")


def _saved_by_forwards(name: str, r: int, k: int, n: int, made: int, want: int, mean: float, slack: float,
                       where: dict) -> None:
    """At the k-th activation sent, the step has saved for backward what k forwards save (`SavedTensorMeter.made`)."""
    if made < want - slack:
        raise AssertionError(
            f"{name}: when rank {r} sent activation {k} of {n}, its forwards had saved {made / mean:.1f} "
            f"micro-batches of activations for backward in all ({made} bytes), {k} forwards save {k}: run each "
            f"forward with autograd recording (no torch.no_grad, no custom autograd.Function keeping tensors as "
            f"ctx attributes), so that what your stage keeps for backward is what autograd saved ({where})")


def _saved_once(name: str, r: int, made: int, want: int, mean: float, slack: float, where: dict) -> None:
    """Over the step, each micro-batch's activations saved once: no forward recomputed."""
    if made > want + slack:
        raise AssertionError(
            f"{name}: rank {r}'s step saved {made / mean:.1f} micro-batches of activations for backward in all "
            f"({made} bytes) for {want / mean:.0f} micro-batches: one forward per micro-batch, its activations "
            f"kept in autograd's graph until its backward (not dropped and recomputed) ({where})")


def verify_order(name: str, schedule: str, got: list[dict], c: dict, where: dict) -> None:
    """Each rank's messages (`OrderWatch.events`) against `schedule` ("GPipe" or "1F1B"): one per
    micro-batch each way, and at each activation sent the micro-batches held for backward."""
    p, sizes = len(got), [len(t) for t in c["ys"]]
    for r, res in enumerate(got):
        _counts(name, r, p, res["events"], sizes, where)
    if p < 2:
        return
    per_mb = stage_bytes(c, p)
    for r, res in enumerate(got[:-1]):
        sent = [e for e in res["events"] if e[0] == "send" and e[1] == r + 1]
        mean = sum(per_mb[r][b] for b in sizes) / len(sizes)
        slack = 0.25 * min(per_mb[r].values())  # a quarter of a micro-batch: tells k from k + 1
        for k, (_, _, _, held, made) in enumerate(sent, 1):
            alive = _alive(schedule, k, p, r)
            want = sum(per_mb[r][e[2]] for e in sent[k - alive:k])
            if abs(held - want) > slack:
                raise AssertionError(
                    f"{name}: when rank {r} sent activation {k} of {len(sent)}, it held {held / mean:.1f} "
                    f"micro-batches of activations for backward ({held} bytes), {schedule} holds {alive} there: "
                    f"{_rule(schedule, p, r)} ({where})")
            _saved_by_forwards(name, r, k, len(sent), made, sum(per_mb[r][e[2]] for e in sent[:k]), mean, slack,
                               where)
        _saved_once(name, r, res["made"], sum(per_mb[r][b] for b in sizes), mean, slack, where)
    if schedule == "GPipe":  # the last rank has no activation to send: its forwards all come before its backwards
        r, events = p - 1, got[-1]["events"]
        first_grad = next(i for i, e in enumerate(events) if e[0] == "send")
        late = sum(1 for e in events[first_grad:] if e[0] == "recv")
        if late:
            raise AssertionError(f"{name}: the last rank (rank {r}) sent a gradient before receiving all its "
                                 f"activations ({late} received after): GPipe runs all forwards, then all backwards "
                                 f"({where})")


# ----------------------------------------------------------------------------- exercise 5: torch's schedules

def torch_order(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int]]]:
    """Per rank, the (kind, stage) of each forward and backward chunk that torch's `schedule` runs: the
    library's lists, equal to torch's own (`get_schedule_ops`; importing torch's pipelining here would cost
    seconds a grading process)."""
    from dlo.distributed.pipeline_schedules import gpipe_schedule, interleaved_schedule, one_f_one_b_schedule

    acts = {"GPipe": lambda: gpipe_schedule(p, m), "1F1B": lambda: one_f_one_b_schedule(p, m),
            "Interleaved1F1B": lambda: interleaved_schedule(p, m, v)}[schedule]()
    return [[(a.kind, a.stage) for a in rank] for rank in acts]


def verify_torch_order(name: str, schedule: str, r: int, order: list, want: list, where: dict) -> None:
    got = [tuple(a[:2]) if isinstance(a, (list, tuple)) else a for a in order]  # [kind, stage, chunk, probe]
    if got != want:
        show = lambda acts: " ".join(f"{k}{s}" for k, s in acts)  # noqa: E731
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise AssertionError(f"{name}: torch's stages on rank {r} did not run {schedule}'s order of forward and "
                             f"backward chunks: build the schedule that `schedule` names (first difference at "
                             f"position {i}; F/B and the stage):\n  expected {show(want)}\n  got      {show(got)}\n"
                             f"({where})")
