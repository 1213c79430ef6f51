"""What this process's TCP sockets send, as the kernel counts them: the bytes a gloo rank really puts on the
wire, measured from outside the backend and outside the course's own counters (`CommCounter`).

`tcp_counters` reads one socket; here every socket of the process is read at once (every thread's: gloo
sends from its own threads), and `tcp_sent_by_socket` takes what a function sends per call between
barriers, the barriers' own traffic subtracted. gloo keeps one socket per peer, so a socket is a
connection. Days 4 and 7 judge wire claims with these, and the context-parallel tests check their byte
formulas against them.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from dlo.measure.comm import tcp_counters


def tcp_available() -> bool:
    """Whether `tcp_tx_by_socket` can read this process's sockets (Linux: TCP_INFO and /proc/self/fd)."""
    return hasattr(socket, "TCP_INFO") and os.path.isdir("/proc/self/fd")


def tcp_tx_by_socket() -> dict[int, tuple[int, int]]:
    """{descriptor: (payload bytes, data segments)} sent so far by each of this process's TCP sockets
    (`dlo.measure.tcp_counters`: the kernel's per-socket counters). Every thread's sockets count (gloo
    sends from its own threads); the payload is what TCP carries: the backend's messages with its own
    headers, not TCP/IP's. gloo keeps one socket per peer, so a socket is a connection."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
        except OSError:  # closed since the listing
            continue
        out[int(fd)] = tcp_counters(int(fd))
    return out


def tcp_sent_by_socket(fn, calls: int) -> dict[int, tuple[float, int]]:
    """{socket: (bytes, data segments)} this rank's TCP sockets send per call of `fn` (called `calls` times
    on every rank between barriers), each socket's control window (the barriers only) subtracted. The
    counters are this process's own: exact, whatever else runs on the machine (an earlier version read the
    loopback interface, which every process on the host shares: a loaded node moved the result)."""
    def delta(a, b):
        return {fd: (b[fd][0] - a.get(fd, (0, 0))[0], b[fd][1] - a.get(fd, (0, 0))[1]) for fd in b}

    dist.barrier()
    t0 = tcp_tx_by_socket()
    for _ in range(calls):
        fn()
    dist.barrier()
    t1 = tcp_tx_by_socket()
    dist.barrier()
    c0 = tcp_tx_by_socket()
    dist.barrier()
    window, control = delta(t0, t1), delta(c0, tcp_tx_by_socket())
    return {fd: ((b - control.get(fd, (0, 0))[0]) / calls, (n - control.get(fd, (0, 0))[1]) // calls)
            for fd, (b, n) in window.items()}


def tcp_sent(fn, calls: int) -> tuple[float, int]:
    """(bytes, data segments) all of this rank's TCP sockets send per call of `fn` (`tcp_sent_by_socket`)."""
    per = tcp_sent_by_socket(fn, calls).values()
    return sum(b for b, _ in per), sum(n for _, n in per)
