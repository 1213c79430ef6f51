"""Day 4: what the collectives cost and what a rank really sends.

- the all-reduce time per message size is `dlo.distributed.collectives.bus_bandwidth` (sizes
  interleaved round by round after an untimed warm-up round: the first calls set up connections and
  buffers, not part of alpha, so not fitted);
- `ring_sent`: the bytes the ring all-reduce's messages carry, counted by `dlo.measure.CommCounter`
  on the exercise's algorithm (`dlo.distributed.collectives.ring_all_reduce`): a count of the course's
  own code, which sends only to rank + 1, so it restates that code;
- `wire_bytes` (`dlo.measure.tcp_sent_by_socket`): the bytes gloo's own all-reduce hands to this rank's
  TCP sockets, in all and per connection (gloo keeps one socket per peer), from the kernel's per-socket
  counters (TCP_INFO): the algorithm the backend really runs, measured from outside it (also what a DDP
  hook sends from the backend's callback threads, which `CommCounter` does not see), and only this
  process's sockets, so other jobs on a shared node do not count;
- `powersgd_parts` / `powersgd_bytes`: PowerSGD's messages from its definition, to judge the bytes
  the sockets saw against.

All run on every rank inside `dlo.distributed.launch`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dlo.distributed.collectives import ring_all_reduce
from dlo.measure import CommCounter, tcp_available, tcp_sent_by_socket


def ring_sent(n: int) -> float:
    """Bytes this rank's messages carry in one ring all-reduce of n fp32 values
    (`dlo.distributed.collectives.ring_all_reduce`, the exercise's algorithm), over 4 n."""
    with CommCounter() as comm:
        ring_all_reduce(torch.ones(n))
    return comm.sent("send") / (4 * n)


def wire_bytes(nbytes: int, calls: int, trials: int) -> dict:
    """What gloo's own all-reduce of `nbytes` hands to this rank's TCP sockets (`tcp_sent_by_socket`),
    over nbytes, per trial of `calls` all-reduces: in all ("ratio"), on each connection ("peers": every
    socket's share, largest first; a ring puts all of 2(N-1)/N on one, a tree or reduce + broadcast
    spreads it), the TCP segments it took ("segments"), and the bytes over the algorithm's 2(N-1)/N n
    ("excess per call": gloo's message headers). On a real wire each segment also carries ~52-66 bytes
    of TCP/IP (and Ethernet) headers."""
    if not tcp_available():
        raise RuntimeError("wire_bytes reads this process's TCP sockets (Linux only)")
    world_size, x = dist.get_world_size(), torch.ones(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(x)  # connections up, buffers allocated
    ratios, peers, segments, excess = [], [], [], []
    for _ in range(trials):
        per = tcp_sent_by_socket(lambda: dist.all_reduce(x), calls)
        sent, segs = sum(b for b, _ in per.values()), sum(n for _, n in per.values())
        ratios.append(sent / (4 * x.numel()))
        peers.append(sorted((b / (4 * x.numel()) for b, _ in per.values()), reverse=True))
        segments.append(segs)
        excess.append(sent - 2 * (world_size - 1) / world_size * 4 * x.numel())
    return {"world": world_size, "bytes": 4 * x.numel(), "calls": calls, "ratio": ratios, "peers": peers,
            "segments": segments, "excess per call": excess}


def powersgd_parts(net: nn.Module, rank: int, min_compression_rate: float = 2.0) -> dict[str, int]:
    """The bytes of PowerSGD's three all-reduces per step, from its definition (Vogels et al. 2019), in
    fp32: "uncompressed" (the vectors, biases, and matrices too small to gain, sent whole: one all-reduce
    on the calling thread), "P" (n x r for every gradient viewed as an n x m matrix, n = its first
    dimension) and "Q" (m x r), each all-reduced from the previous one's callback. A matrix whose n m is
    not more than min_compression_rate times (n + m) r is sent whole, as torch's hook does
    (PowerSGDState's documented min_compression_rate, default 2): compressing it would save too little."""
    parts = {"uncompressed": 0, "P": 0, "Q": 0}
    for p in net.parameters():
        n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1)
        r = min(rank, n, m)
        if p.dim() <= 1 or (n + m) * r * min_compression_rate >= n * m:
            parts["uncompressed"] += 4 * p.numel()
        else:
            parts["P"], parts["Q"] = parts["P"] + 4 * n * r, parts["Q"] + 4 * m * r
    return parts


def powersgd_bytes(net: nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """What PowerSGD all-reduces per step (`powersgd_parts`, summed): (n + m) r values per compressed
    matrix, the rest whole."""
    return sum(powersgd_parts(net, rank, min_compression_rate).values())


