"""Day 4: what the collectives cost and what a rank really sends.

- the all-reduce time per message size is `dlo.distributed.collectives.bus_bandwidth` (sizes
  interleaved round by round after an untimed warm-up round: the first calls set up connections and
  buffers, not part of alpha, so not fitted);
- `ring_sent`: the bytes the ring all-reduce's messages carry, counted by `dlo.measure.CommCounter`
  on the exercise's algorithm (`dlo.distributed.collectives.ring_all_reduce`);
- `wire_bytes` (`tcp_sent`): the bytes gloo's own all-reduce hands to this rank's TCP sockets, from
  the kernel's per-socket counters (TCP_INFO): the algorithm the backend really runs, measured from
  outside it (also what a DDP hook sends from the backend's callback threads, which `CommCounter`
  does not see), and only this process's sockets, so other jobs on a shared node do not count;
- `powersgd_bytes`: PowerSGD's message from its definition, to check the hook's count against.

All run on every rank inside `dlo.distributed.launch`.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from dlo.distributed.collectives import ring_all_reduce
from dlo.measure import CommCounter, tcp_counters


def ring_sent(n: int) -> float:
    """Bytes this rank's messages carry in one ring all-reduce of n fp32 values
    (`dlo.distributed.collectives.ring_all_reduce`, the exercise's algorithm), over 4 n."""
    with CommCounter() as comm:
        ring_all_reduce(torch.ones(n))
    return comm.sent("send") / (4 * n)


def ring_peers(n: int) -> dict[int, float]:
    """The same all-reduce's bytes per connection: {peer: bytes this rank sent it / 4 n}. A ring
    sends 2(N-1)/N n to one neighbour; a tree or reduce + broadcast moves the same total over
    several connections, n at most on each (they differ from N = 3 on)."""
    with CommCounter() as comm:
        ring_all_reduce(torch.ones(n))
    return {peer: b / (4 * n) for peer, b in sorted(comm.sent_by_peer().items())}


def tcp_available() -> bool:
    """Whether `tcp_tx` can read this process's sockets (Linux: TCP_INFO and /proc/self/fd)."""
    return hasattr(socket, "TCP_INFO") and os.path.isdir("/proc/self/fd")


def tcp_tx() -> tuple[int, int]:
    """(payload bytes, data segments) sent so far by this process's TCP sockets (`dlo.measure.tcp_counters`:
    the kernel's per-socket counters). Every thread's sockets count (gloo sends from its own threads); the
    payload is what TCP carries: the backend's messages with its own headers, not TCP/IP's."""
    sent = segs = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
        except OSError:  # closed since the listing
            continue
        b, n = tcp_counters(int(fd))
        sent, segs = sent + b, segs + n
    return sent, segs


def tcp_sent(fn, calls: int) -> tuple[float, int]:
    """(bytes, data segments) this rank's TCP sockets send per call of `fn` (called `calls` times on
    every rank between barriers). A control window (the barriers only) is subtracted. The counters are
    this process's own: exact, whatever else runs on the machine (an earlier version read the loopback
    interface, which every process on the host shares: a loaded node moved the result)."""
    dist.barrier()
    b0, s0 = tcp_tx()
    for _ in range(calls):
        fn()
    dist.barrier()
    b1, s1 = tcp_tx()
    dist.barrier()
    c0, q0 = tcp_tx()
    dist.barrier()
    c1, q1 = tcp_tx()
    return ((b1 - b0) - (c1 - c0)) / calls, ((s1 - s0) - (q1 - q0)) // calls


def wire_bytes(nbytes: int, calls: int, trials: int) -> dict:
    """What gloo's own all-reduce of `nbytes` hands to this rank's TCP sockets (`tcp_sent`), over
    nbytes ("ratio", one per trial of `calls` all-reduces), the TCP segments it took ("segments"),
    and the bytes over the algorithm's 2(N-1)/N n ("excess per call": gloo's message headers). On a
    real wire each segment also carries ~52-66 bytes of TCP/IP (and Ethernet) headers."""
    if not tcp_available():
        raise RuntimeError("wire_bytes reads this process's TCP sockets (Linux only)")
    world_size, x = dist.get_world_size(), torch.ones(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(x)  # connections up, buffers allocated
    ratios, segments, excess = [], [], []
    for _ in range(trials):
        sent, segs = tcp_sent(lambda: dist.all_reduce(x), calls)
        ratios.append(sent / (4 * x.numel()))
        segments.append(segs)
        excess.append(sent - 2 * (world_size - 1) / world_size * 4 * x.numel())
    return {"world": world_size, "bytes": 4 * x.numel(), "calls": calls, "ratio": ratios, "segments": segments,
            "excess per call": excess}


def powersgd_bytes(net: nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """What PowerSGD all-reduces per step, from its definition (Vogels et al. 2019): P (n x r) and
    Q (m x r) for every gradient viewed as an n x m matrix (n = its first dimension), the vectors
    (biases) uncompressed, in fp32. A matrix whose n m is not more than min_compression_rate times
    (n + m) r is sent whole, as torch's hook does (PowerSGDState's documented min_compression_rate,
    default 2): compressing it would save too little."""
    total = 0
    for p in net.parameters():
        n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1)
        r = min(rank, n, m)
        small = (n + m) * r * min_compression_rate >= n * m
        total += 4 * (p.numel() if p.dim() <= 1 or small else (n + m) * r)
    return total


