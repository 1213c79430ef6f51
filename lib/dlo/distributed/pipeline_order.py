"""The order of a pipeline's messages, recorded and checked against what NCCL needs.

Gloo matches messages by tag, so the CPU runs cannot see an order that NCCL would deadlock on or
deliver wrongly (`dlo.distributed.pipeline_comms`, module docstring). This module makes the order
visible and checks it without a GPU:

- `RecordingWire` stands in for torch.distributed under a rank's stages (`Stage.wire`): each send
  and receive is recorded as a `P2POp` -- send or receive, the peer, the channel (communicator) it
  is posted on, what it carries (`Message`: activation or gradient, stage, micro-batch), shape and
  dtype -- and each wait on one, in posting order; with `inner` it also forwards them (real ranks);
- `record(name, p, m)` runs the library's own engine of a course schedule rank after rank in this
  process, every message recorded instead of sent (a receive gives zeros): one trace per rank;
- `mismatches(traces)`: per channel and pair of ranks, the k-th send of A to B must be the k-th
  receive of B from A -- the same message, not just the same shape;
- `nccl_deadlock(traces, shared)`: NCCL's execution replayed. Each rank runs its trace, blocked by a
  wait until the op completes; each communicator runs a rank's ops in posting order (one CUDA
  stream), and a send and its receive complete together, when both are first in their queues (a
  send waits for its receive, whatever NCCL could buffer: the check holds for every message size).
  `shared=False` is torch's lazy default, a 2-rank communicator per pair of ranks made at their first
  message (both ranks wait there for each other); `shared=True` one communicator per process group
  for all peers (eager init). A replay that completes is a schedule NCCL runs; the replay's rules
  are stricter than the GPU's (a CPU that does not wait for the stream can only run further), so
  passing here is enough.

`nccl_problems` runs both checks under both communicator layouts; the tests run it over every
schedule of the course at p in 2..4 and the m the course uses.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dlo.distributed.pipeline import build_stages, gpipe_step, one_f_one_b_step, run_schedule
from dlo.distributed.pipeline_comms import Message, Wire, channel
from dlo.distributed.pipeline_schedules import interleaved_schedule, zero_bubble_schedule


@dataclass(eq=False)  # identity: two ops of a trace are never the same op
class P2POp:
    """One posted send or receive of rank `rank` (see the module docstring); `blocking`: the rank
    waited for it before posting anything else."""

    rank: int
    op: str  # "send" or "recv"
    peer: int
    channel: object
    msg: Message
    shape: tuple
    dtype: torch.dtype
    blocking: bool = False

    def __str__(self) -> str:
        where = "to" if self.op == "send" else "from"
        shape = "x".join(map(str, self.shape))
        return f"{self.op} of {self.msg} ({shape}, {str(self.dtype).replace('torch.', '')}) {where} rank {self.peer}"


def channel_name(ch) -> str:
    return "-".join(map(str, ch)) if isinstance(ch, tuple) else str(ch)


class _Handle:
    def __init__(self, wire, op: P2POp, work):
        self.wire, self.op, self.work = wire, op, work

    def wait(self) -> None:
        events = self.wire.events
        self.op.blocking = events[-1] == ("post", self.op)
        events.append(("wait", self.op))
        if self.work is not None:
            self.work.wait()


class RecordingWire(Wire):
    """A rank's messages recorded as `events`, ("post", P2POp) and ("wait", P2POp) in order.
    `channel_of(kind, src, dst)` names the communicator of a message (the library's `channel`;
    a test plants another); `inner`, a `Wire` that really sends (else a receive gives zeros)."""

    def __init__(self, rank: int, channel_of=channel, inner: Wire | None = None):
        super().__init__(rank)
        self.channel_of, self.inner, self.events = channel_of, inner, []
        if inner is not None:
            self.mailbox = inner.mailbox

    def _post(self, op: str, peer: int, msg: Message, t) -> P2POp:
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        rec = P2POp(self.rank, op, peer, self.channel_of(msg.kind, src, dst), msg, tuple(t.shape), t.dtype)
        self.events.append(("post", rec))
        return rec

    def isend(self, t, dst, msg, tag_):
        rec = self._post("send", dst, msg, t)
        return _Handle(self, rec, self.inner.isend(t, dst, msg, tag_) if self.inner is not None else None)

    def irecv(self, buf, src, msg, tag_):
        rec = self._post("recv", src, msg, buf)
        if self.inner is None:
            buf.zero_()
        return _Handle(self, rec, self.inner.irecv(buf, src, msg, tag_) if self.inner is not None else None)


# ----------------------------------------------------------------------------- recording the engines

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
WIDTH = 4  # every boundary the same shape: a mix-up of two messages shows only by what they carry


def record(name: str, p: int, m: int, v: int = 2, channel_of=channel) -> list[list[tuple]]:
    """Each rank's events (`RecordingWire`) in one step of schedule `name` (`SCHEDULES`) on p ranks
    and m micro-batches (v chunks per rank when interleaved), run by the library's engine for it:
    `gpipe_step`, `one_f_one_b_step`, `run_schedule` of `interleaved_schedule` or of ZB-H1's list
    (`zero_bubble_schedule`; its W actions carry no message and are left out, B doing the whole
    backward). Stage s is one Linear on rank s % p."""
    n_stages = p * (v if name == "interleaved" else 1)
    actions = {"interleaved": lambda: interleaved_schedule(p, m, v),
               "zero-bubble": lambda: [[a for a in acts if a.kind != "W"] for acts in zero_bubble_schedule(p, m)]}
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose among {', '.join(SCHEDULES)}")
    lists = actions[name]() if name in actions else None
    torch.manual_seed(0)
    modules = [nn.Linear(WIDTH, WIDTH) for _ in range(n_stages)]
    xs, ys = [torch.randn(2, WIDTH) for _ in range(m)], [torch.tensor([0, 1])] * m
    traces = []
    for r in range(p):
        wire = RecordingWire(r, channel_of)
        stages = build_stages(modules, p, [2] * m, (WIDTH,), rank=r)
        for s in stages:
            s.wire = wire
        if lists is not None:
            run_schedule(stages, lists[r], xs, ys, F.cross_entropy)
        else:
            (gpipe_step if name == "gpipe" else one_f_one_b_step)(stages[0], xs, ys, F.cross_entropy)
        traces.append(wire.events)
    return traces


def posted(trace: list[tuple]) -> list[P2POp]:
    """The ops of one rank's events, in posting order."""
    return [op for what, op in trace if what == "post"]


# ----------------------------------------------------------------------------- the checks

def mismatches(traces: list[list[tuple]]) -> list[str]:
    """Per channel and ordered pair (A, B): where A's k-th send to B is not B's k-th receive from A
    (message, shape, dtype), or the counts differ; one line each, empty when all match."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for trace in traces:
        for op in posted(trace):
            src, dst = (op.rank, op.peer) if op.op == "send" else (op.peer, op.rank)
            (sends if op.op == "send" else recvs)[(channel_name(op.channel), src, dst)].append(op)
    out = []
    for key in sorted(set(sends) | set(recvs)):
        ch, src, dst = key
        for k, (s, r) in enumerate(zip(sends[key], recvs[key]), 1):
            if (s.msg, s.shape, s.dtype) != (r.msg, r.shape, r.dtype):
                out.append(f"on {ch}, rank {src}'s send #{k} to rank {dst} is its {s} but rank {dst}'s receive "
                           f"#{k} from rank {src} is its {r}")
                break
        if len(sends[key]) != len(recvs[key]):
            out.append(f"on {ch}, rank {src} sends {len(sends[key])} messages to rank {dst}, which receives "
                       f"{len(recvs[key])}")
    return out


class _Replay:
    """State of `nccl_deadlock`'s replay: where each rank is, each stream's queue of posted ops."""

    def __init__(self, traces, shared: bool):
        self.traces, self.shared = traces, shared
        self.pc = [0] * len(traces)
        self.queues: dict = defaultdict(deque)
        self.done: set[int] = set()
        self.opened: dict = defaultdict(set)  # (channel, pair) -> ranks that reached its first message

    def stream(self, rank: int, ch, peer: int) -> tuple:
        """The queue of rank's ops on channel ch with peer: one per channel, or per channel and peer."""
        return (rank, channel_name(ch)) if self.shared else (rank, channel_name(ch), peer)

    def advance(self, r: int) -> bool:
        """Run rank r until it blocks; whether it moved."""
        moved, trace = False, self.traces[r]
        while self.pc[r] < len(trace):
            what, op = trace[self.pc[r]]
            if what == "wait" and id(op) not in self.done:
                break
            if what == "post" and not self.shared:  # the pair's communicator is made by both, together
                pair = (channel_name(op.channel), frozenset((r, op.peer)))
                self.opened[pair].add(r)
                if len(self.opened[pair]) < 2:
                    break
            if what == "post":
                self.queues[self.stream(r, op.channel, op.peer)].append(op)
            self.pc[r] += 1
            moved = True
        return moved

    def match(self) -> bool:
        """Complete every send whose receive is also first in its queue; whether one did."""
        moved = False
        for q in list(self.queues.values()):
            if not q or q[0].op != "send":
                continue
            s = q[0]
            peer_q = self.queues.get(self.stream(s.peer, s.channel, s.rank))
            if peer_q and peer_q[0].op == "recv" and peer_q[0].peer == s.rank:
                self.done.update((id(q.popleft()), id(peer_q.popleft())))
                moved = True
        return moved

    def blocked(self, r: int) -> str:
        what, op = self.traces[r][self.pc[r]]
        if what == "post":
            return f"rank {r} waits for rank {op.peer} to open their communicator {channel_name(op.channel)} (its {op})"
        q = self.queues[self.stream(r, op.channel, op.peer)]
        behind = f", queued behind its {q[0]}" if q and q[0] is not op else ""
        return f"rank {r} waits for its {op} on {channel_name(op.channel)}{behind}"


def nccl_deadlock(traces: list[list[tuple]], shared: bool = False) -> str | None:
    """Replay the traces as NCCL runs them (module docstring); None if every op completes, else what
    each stuck rank waits for."""
    replay = _Replay(traces, shared)
    while True:
        moved = [replay.advance(r) for r in range(len(traces))]
        if not (replay.match() or any(moved)):
            break
    stuck = [replay.blocked(r) for r, trace in enumerate(traces) if replay.pc[r] < len(trace)]
    stuck += [f"rank {q[0].rank}'s {q[0]} is never received" for q in replay.queues.values() if q and not stuck]
    return "; ".join(stuck) or None


def nccl_problems(traces: list[list[tuple]]) -> list[str]:
    """`mismatches`, then a deadlock under either communicator layout; empty when NCCL runs it."""
    out = mismatches(traces)
    for shared, layout in ((False, "a communicator per pair of ranks"), (True, "one communicator per group")):
        stuck = nccl_deadlock(traces, shared)
        if stuck:
            out.append(f"NCCL deadlocks with {layout}: {stuck}")
    return out


__all__ = ["P2POp", "RecordingWire", "SCHEDULES", "channel_name", "mismatches", "nccl_deadlock", "nccl_problems",
           "posted", "record"]
