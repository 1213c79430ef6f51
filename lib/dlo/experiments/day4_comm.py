"""Day 4: what the collectives cost and what a rank really sends.

- the all-reduce time per message size is `dlo.distributed.collectives.bus_bandwidth` (sizes
  interleaved round by round after an untimed warm-up round: the first calls set up connections and
  buffers, not part of alpha, so not fitted);
- `ring_sent`: the bytes the ring all-reduce's messages carry, counted by `dlo.measure.CommCounter`
  on the exercise's algorithm (`dlo.distributed.collectives.ring_all_reduce`);
- `wire_bytes` (`loopback_sent`): the bytes gloo's own all-reduce puts on the loopback interface,
  from the kernel's counters: the algorithm the backend really runs, measured from outside it (also
  what a DDP hook sends from the backend's callback threads, which `CommCounter` does not see);
- `powersgd_bytes`: PowerSGD's message from its definition, to check the hook's count against.

All run on every rank inside `dlo.distributed.launch`.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from dlo.distributed.collectives import ring_all_reduce
from dlo.measure import CommCounter


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


def loopback_tx() -> tuple[int, int]:
    """(bytes, packets) transmitted so far on the loopback interface, from /proc/net/dev (Linux)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                fields = rest.split()
                return int(fields[8]), int(fields[9])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def loopback_sent(fn, calls: int) -> tuple[float, int]:
    """(bytes, packets) this host's ranks put on the loopback interface per call of `fn` (called
    `calls` times on every rank between barriers), per rank. A control window of the same length
    (barriers and sleep only) measures the background (other processes, the barriers), subtracted.
    Ranks on one host talk over TCP on loopback, whose counters see every byte of every backend
    thread, also those a dispatch mode on the calling thread cannot see."""
    world = dist.get_world_size()
    dist.barrier()
    (b0, p0), t0 = loopback_tx(), time.perf_counter()
    for _ in range(calls):
        fn()
    dist.barrier()
    (b1, p1), dt = loopback_tx(), time.perf_counter() - t0
    dist.barrier()
    c0, q0 = loopback_tx()
    time.sleep(dt)
    dist.barrier()
    c1, q1 = loopback_tx()
    return ((b1 - b0) - (c1 - c0)) / world / calls, ((p1 - p0) - (q1 - q0)) // world // calls


def wire_bytes(nbytes: int, calls: int, trials: int) -> dict:
    """What gloo's own all-reduce of `nbytes` puts on the wire per rank (`loopback_sent`), over
    nbytes ("ratio", one per trial of `calls` all-reduces), and the packets: each carries ~52-66
    bytes of IP + TCP headers, and gloo a small header per message, the overhead over the model."""
    if not os.path.exists("/proc/net/dev"):
        raise RuntimeError("wire_bytes reads /proc/net/dev (Linux only)")
    world, x = dist.get_world_size(), torch.ones(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(x)  # connections up, buffers allocated
    ratios, packets, overhead = [], [], []
    for _ in range(trials):
        sent, pk = loopback_sent(lambda: dist.all_reduce(x), calls)
        ratios.append(sent / (4 * x.numel()))
        packets.append(pk)
        overhead.append((sent - 2 * (world - 1) / world * 4 * x.numel()) / max(1, pk))
    return {"world": world, "bytes": 4 * x.numel(), "calls": calls, "ratio": ratios, "packets": packets,
            "overhead per packet": overhead}


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


