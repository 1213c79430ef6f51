"""Point-to-point messages of a pipeline: activations forward, their gradients backward.

A stage boundary carries one tensor per micro-batch each way. Its shape is agreed up front, before
any message: every rank computes all boundary shapes itself from the model (`sample_shapes`, one
sample through the chain, no communication), so a receiver can allocate its buffer and nothing but
the payload crosses the wire (torch's PipelineStage instead exchanges shapes in a first round of
messages).

What NCCL needs. Gloo matches a receive to the send with the same tag, in any order. NCCL ignores
tags: on one communicator it matches the k-th send from rank A to rank B with the k-th receive at B
from A, and runs each communicator's sends and receives in posting order on one CUDA stream, where a
send may wait until its receive runs (whether it does depends on the size and the transport: count
on it). So an order that gloo forgives can deadlock on NCCL (rank A's stream holds "send to B, then
receive from B", B's holds "send to A, then receive from A") or, worse, deliver one micro-batch's
activation as another's when the two have the same shape. Whether torch gives a pair of ranks its
own communicator (the lazy default: a 2-rank one per pair, made at their first message, both ranks
waiting in it) or shares the group's (eager init, `device_id` at init_process_group) depends on the
version and the init.

How the order guarantees it (`StageComms`):
- each **channel** -- one kind of message ("act" or "grad") from one rank to one other
  (`channel(kind, src, dst)`) -- travels on a process group of its own (`channel_groups`, made once
  by every rank in one order, `pipeline_channels`). A channel's stream then holds only sends at its
  source and only receives at its destination, whatever torch shares: no stream waits on the other
  direction or on a third rank. Two direction groups (activations, gradients) are not enough:
  interleaving on p = 2 ranks sends activations both ways between ranks 0 and 1;
- on a channel the sender posts in the order of its actions and the receiver in the order of its
  own, and every schedule of the course runs each rank's forwards (and backwards) of the stages that
  face one channel in the same micro-batch order at both ends: the k-th send is the k-th receive.
  `dlo.distributed.pipeline_order` records every schedule's messages and checks both claims, with a
  simulation of NCCL's in-order execution;
- sends are non-blocking (`isend`, handles waited at the end of the step: two ranks that both send
  first, 1F1B's steady state, would wait forever on gloo too); receives block, and say first what
  they wait for (`dlo.distributed.heartbeat`), so a stuck run ends at the launcher's timeout naming
  each rank and the message it waits on;
- tags (kind, receiving stage, micro-batch) stay: gloo checks them, NCCL ignores them;
- a message between two stages of the same rank (p = 1) never leaves it: a send to oneself without
  a matching receive in the same NCCL group call would hang.

`P2PWatch` is the same heartbeat for code we did not write (a student's schedule in a check): a
dispatch mode that reports every send and receive the code posts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.distributed.current import heartbeat
from dlo.measure import collective_kind


def sample_shapes(modules: list[nn.Module], sample_shape: tuple[int, ...], dtype=torch.float32) -> list[tuple]:
    """Per-sample output shape of each module of a chain (module k eats module k-1's output), from one
    forward of a single zero sample where the modules are, without gradients and in eval mode (no
    BatchNorm statistics move). A meta-device forward would need no compute, but its first use costs
    every fresh rank a second of imports; one sample costs milliseconds at the course's sizes."""
    device = next((t.device for mod in modules for t in mod.parameters()), torch.device("cpu"))
    x, out = torch.zeros((1, *sample_shape), device=device, dtype=dtype), []
    with torch.no_grad():
        for mod in modules:
            modes = [(m, m.training) for m in mod.modules()]  # each submodule's own, restored after
            mod.eval()
            try:
                x = mod(x.to(next((t.device for t in mod.parameters()), x.device)))
            finally:
                for m, training in modes:
                    m.training = training
            out.append(tuple(x.shape[1:]))
    return out


class Message(NamedTuple):
    """What a message carries: "act", the activation into stage `stage` (from stage - 1), or "grad",
    the gradient of stage `stage`'s output (from stage + 1), of micro-batch mb."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.mb})"


def tag(kind: str, stage: int, mb: int, n_micro: int) -> int:
    """A message's tag: activations ("act") and gradients ("grad") into stage `stage` for micro-batch mb."""
    return 2 * (stage * n_micro + mb) + (kind == "grad")


def channel(kind: str, src: int, dst: int) -> tuple[str, int, int]:
    """The communicator a message travels on: one per kind and ordered pair of ranks (module docstring)."""
    return (kind, src, dst)


def pipeline_channels(p: int, n_stages: int) -> list[tuple[str, int, int]]:
    """Every channel of n_stages stages placed round-robin on p ranks (stage s on rank s % p), in one
    order on every rank; none between two stages of the same rank."""
    out = []
    for s in range(n_stages - 1):
        a, b = s % p, (s + 1) % p
        for ch in (channel("act", a, b), channel("grad", b, a)):
            if a != b and ch not in out:
                out.append(ch)
    return out


_GROUPS: dict = {}


def channel_groups(channels) -> dict:
    """A process group of the two ranks of each channel, made at first use in the list's order and
    kept for the process group's life. Collective: every rank of the world makes the same call."""
    if _GROUPS.get("world") is not dist.group.WORLD:  # a new default group: the old ones are gone
        _GROUPS.clear()
        _GROUPS.update(world=dist.group.WORLD, groups={})
    groups = _GROUPS["groups"]
    for ch in channels:
        if ch not in groups:
            groups[ch] = dist.new_group(sorted(ch[1:]))
    return {ch: groups[ch] for ch in channels}


class Wire:
    """How a rank's stages post their messages (`StageComms`): its rank, and a mailbox for messages
    between two stages of this rank, which never leave it."""

    def __init__(self, rank: int):
        self.rank, self.mailbox = rank, {}

    def isend(self, t: Tensor, dst: int, msg: Message, tag_: int):
        raise NotImplementedError

    def irecv(self, buf: Tensor, src: int, msg: Message, tag_: int):
        raise NotImplementedError


class TorchWire(Wire):
    """Messages through torch.distributed, each channel on its own process group (every backend: the
    CPU runs the communicators the GPUs do). Made by every rank at each pipeline step, for the
    channels of the whole pipeline (`pipeline_channels`)."""

    def __init__(self, channels):
        super().__init__(dist.get_rank())
        self.groups = channel_groups(channels)

    def isend(self, t, dst, msg, tag_):
        return dist.isend(t, dst, group=self.groups[channel(msg.kind, self.rank, dst)], tag=tag_)

    def irecv(self, buf, src, msg, tag_):
        return dist.irecv(buf, src, group=self.groups[channel(msg.kind, src, self.rank)], tag=tag_)


class StageComms:
    """The messages of one pipeline stage (see the module docstring). `in_shapes[i]` / `out_shapes[i]`:
    the tensor received / sent forward for micro-batch i; `prev` / `next`: the neighbours' ranks;
    `wire`: this rank's `Wire` (one for all its stages)."""

    def __init__(self, stage: int, n_stages: int, prev: int | None, next: int | None, in_shapes, out_shapes,
                 dtype: torch.dtype, device, wire: Wire):
        self.stage, self.n_stages, self.prev, self.next = stage, n_stages, prev, next
        self.in_shapes, self.out_shapes = list(in_shapes), list(out_shapes)
        self.dtype, self.device, self.wire = dtype, torch.device(device), wire
        self.pending: list = []  # (work, tensor): a send's buffer must live until it completes

    @property
    def m(self) -> int:
        return len(self.in_shapes)

    def _recv(self, shape, peer: int, msg: Message, what: str) -> Tensor:
        if peer == self.wire.rank:
            if msg not in self.wire.mailbox:
                raise RuntimeError(f"stage {self.stage} needs {what} before this rank computed it: the schedule "
                                   f"runs a stage's action before the one it depends on")
            return self.wire.mailbox.pop(msg)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        heartbeat(f"stage {self.stage} (rank {self.wire.rank}) waits for {what} from rank {peer}")
        self.wire.irecv(buf, peer, msg, tag(*msg, self.m)).wait()
        return buf

    def _send(self, t: Tensor, peer: int, msg: Message) -> None:
        if peer == self.wire.rank:  # a copy, as a message would be
            self.wire.mailbox[msg] = t.detach().clone()
            return
        t = t.detach().contiguous()
        self.pending.append((self.wire.isend(t, peer, msg, tag(*msg, self.m)), t))

    def recv_forward(self, i: int) -> Tensor:
        """The input activation of micro-batch i from the previous stage, as a leaf that wants a gradient."""
        x = self._recv(self.in_shapes[i], self.prev, Message("act", self.stage, i),
                       f"the activation of micro-batch {i} (stage {self.stage - 1} -> {self.stage})")
        return x.requires_grad_()

    def send_forward(self, y: Tensor, i: int) -> None:
        self._send(y, self.next, Message("act", self.stage + 1, i))

    def recv_backward(self, i: int) -> Tensor:
        """The gradient of this stage's output for micro-batch i, from the next stage."""
        return self._recv(self.out_shapes[i], self.next, Message("grad", self.stage, i),
                          f"the output gradient of micro-batch {i} (stage {self.stage + 1} -> {self.stage})")

    def send_backward(self, dx: Tensor, i: int) -> None:
        self._send(dx, self.prev, Message("grad", self.stage - 1, i))

    def wait(self) -> None:
        """Wait for every send of the step to complete (their buffers may then be freed)."""
        if self.pending:
            heartbeat(f"stage {self.stage} (rank {self.wire.rank}) waits for its {len(self.pending)} sends "
                      f"to be received")
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def describe_p2p(func, args) -> tuple[str, str] | None:
    """("send" or "recv", a phrase) for a c10d point-to-point op (`dlo.measure`'s table of ops), else None."""
    kind = collective_kind(func)
    if kind not in ("send", "recv"):
        return None
    tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    shape = "x".join(str(s) for s in tensors[0].shape) if tensors else "?"
    if kind == "send":
        return "send", f"send of a ({shape}) tensor to rank {args[2]}"
    peer = "any rank" if func._schema.name.endswith("any_source_") else f"rank {args[2]}"
    return "recv", f"recv of a ({shape}) tensor from {peer}"


class P2PWatch(TorchDispatchMode):
    """While active, every point-to-point send or receive posted on this rank becomes its heartbeat
    ("rank 1, my 1F1B step: last posted recv of a (3x16x8x8) tensor from rank 0"): what a rank that
    then hangs is waiting on, for the launcher's timeout message."""

    def __init__(self, label: str):
        super().__init__()
        self.label, self.sends, self.recvs = label, 0, 0
        heartbeat(f"{label}: started")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = describe_p2p(func, args)
        if found is not None:
            kind, what = found
            self.sends += kind == "send"
            self.recvs += kind == "recv"
            heartbeat(f"{self.label}: last posted {what}")
        return func(*args, **(kwargs or {}))


__all__ = ["sample_shapes", "Message", "tag", "channel", "pipeline_channels", "channel_groups", "Wire", "TorchWire",
           "StageComms", "P2PWatch"]
