"""Point-to-point messages of a pipeline: activations forward, their gradients backward.

A stage boundary carries one tensor per micro-batch each way. Its shape is agreed up front, before
any message: every rank computes all boundary shapes itself from the model (`sample_shapes`, one
sample through the chain, no communication), so a receiver can allocate its buffer and nothing but
the payload crosses the wire (torch's PipelineStage instead exchanges shapes in a first round of
messages).

The rules that keep a schedule free of deadlock (`StageComms`):
- sends are non-blocking (`dist.isend`, handles waited at the end of the step): on gloo a blocking
  `send` waits until the peer posts the matching receive, so two ranks that both send first (1F1B's
  steady state: rank r sends an activation while rank r + 1 sends a gradient) wait forever;
- receives block, and say first what they wait for (`dlo.distributed.heartbeat`), so a stuck run
  ends at the launcher's timeout naming each rank and the message it waits on;
- every message has a tag made of its kind, the receiving stage and the micro-batch, so two kinds of
  message between the same two ranks (interleaved schedules with p = 2) cannot be confused;
- NCCL ignores tags and runs a communicator's sends and receives in posting order on one stream, so
  1F1B's steady state (rank r sends an activation and waits for a gradient while rank r + 1 sends
  that gradient and waits for the activation) would queue each behind the other: activations and
  gradients travel on two process groups of their own (`direction_groups`). Interleaving with
  p = 2 on NCCL still mixes directions between one pair of ranks: use p >= 3 there.

`P2PWatch` is the same heartbeat for code we did not write (a student's schedule in a check): a
dispatch mode that reports every send and receive the code posts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.distributed.launch import heartbeat
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


_GROUPS: dict = {}


def direction_groups():
    """(forward, backward) process groups for the two directions of messages: (None, None), the
    default group, on gloo; two NCCL communicators over all ranks otherwise (created once, by every
    rank at its first pipeline step)."""
    if "nccl" not in dist.get_backend():
        return None, None
    if "nccl" not in _GROUPS:
        _GROUPS["nccl"] = (dist.new_group(), dist.new_group())
    return _GROUPS["nccl"]


def tag(kind: str, stage: int, mb: int, n_micro: int) -> int:
    """A message's tag: activations ("act") and gradients ("grad") into stage `stage` for micro-batch mb."""
    return 2 * (stage * n_micro + mb) + (kind == "grad")


class StageComms:
    """The messages of one pipeline stage (see the module docstring). `in_shapes[i]` / `out_shapes[i]`:
    the tensor received / sent forward for micro-batch i; `prev` / `next`: the neighbours' ranks."""

    def __init__(self, stage: int, n_stages: int, prev: int | None, next: int | None, in_shapes, out_shapes,
                 dtype: torch.dtype, device):
        self.stage, self.n_stages, self.prev, self.next = stage, n_stages, prev, next
        self.in_shapes, self.out_shapes = list(in_shapes), list(out_shapes)
        self.dtype, self.device = dtype, torch.device(device)
        self.pending: list = []  # (work, tensor): a send's buffer must live until it completes
        self.fwd_group, self.bwd_group = direction_groups()

    @property
    def m(self) -> int:
        return len(self.in_shapes)

    def _recv(self, shape, peer: int, tag_: int, group, what: str) -> Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        heartbeat(f"stage {self.stage} (rank {dist.get_rank()}) waits for {what} from rank {peer}")
        dist.irecv(buf, peer, group=group, tag=tag_).wait()
        return buf

    def _send(self, t: Tensor, peer: int, tag_: int, group) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, peer, group=group, tag=tag_), t))

    def recv_forward(self, i: int) -> Tensor:
        """The input activation of micro-batch i from the previous stage, as a leaf that wants a gradient."""
        x = self._recv(self.in_shapes[i], self.prev, tag("act", self.stage, i, self.m), self.fwd_group,
                       f"the activation of micro-batch {i} (stage {self.stage - 1} -> {self.stage})")
        return x.requires_grad_()

    def send_forward(self, y: Tensor, i: int) -> None:
        self._send(y, self.next, tag("act", self.stage + 1, i, self.m), self.fwd_group)

    def recv_backward(self, i: int) -> Tensor:
        """The gradient of this stage's output for micro-batch i, from the next stage."""
        return self._recv(self.out_shapes[i], self.next, tag("grad", self.stage, i, self.m), self.bwd_group,
                          f"the output gradient of micro-batch {i} (stage {self.stage + 1} -> {self.stage})")

    def send_backward(self, dx: Tensor, i: int) -> None:
        self._send(dx, self.prev, tag("grad", self.stage - 1, i, self.m), self.bwd_group)

    def wait(self) -> None:
        """Wait for every send of the step to complete (their buffers may then be freed)."""
        if self.pending:
            heartbeat(f"stage {self.stage} (rank {dist.get_rank()}) waits for its {len(self.pending)} sends "
                      f"to be received")
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _describe(func, args) -> tuple[str, str] | None:
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
        found = _describe(func, args)
        if found is not None:
            kind, what = found
            self.sends += kind == "send"
            self.recvs += kind == "recv"
            heartbeat(f"{self.label}: last posted {what}")
        return func(*args, **(kwargs or {}))


__all__ = ["sample_shapes", "direction_groups", "tag", "StageComms", "P2PWatch"]
