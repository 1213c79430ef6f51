"""Collectives from first principles: a ring all-reduce built from point-to-point messages, the
bus-bandwidth measurement of nccl-tests and the alpha-beta cost model fitted to it. (What a rank
sends is counted by `dlo.measure.CommCounter`.)

Ring all-reduce (Patarasuk & Yuan 2009; the NCCL default for large messages): cut the tensor into N
chunks; in N-1 reduce-scatter steps every rank sends one chunk to its right neighbour and adds the
chunk arriving from its left one, so that rank r ends owning the full sum of chunk (r + 1) mod N;
N-1 all-gather steps then pass the finished chunks around the ring. Each rank sends
2 (N-1) chunks of n/N elements, i.e. 2 (N-1)/N * n: almost 2n whatever N, which is why the ring
is bandwidth optimal. Under the alpha-beta model (latency alpha per message, beta seconds per byte)

    T_ring(n) = 2 (N-1) alpha + 2 (N-1)/N * n * beta,
    T_tree(n) ~ 2 log2(N) alpha + 2 log2(N) * n * beta   (reduce up a binary tree, broadcast down),

so trees win for small messages (fewer latency terms) and rings for large ones.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from dlo.measure import time_fn

# torch >= 2.10 calls the single-tensor collectives all_gather_single / reduce_scatter_single (the older
# all_gather_into_tensor / reduce_scatter_tensor names warn); GPU nodes may run an older torch
# (environment.yml: torch >= 2.6). The engines use these two names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place with isend/irecv only (reduce-scatter, then all-gather).

    Any shape, any size (sizes smaller than the world size included): the flat tensor is padded to
    a multiple of N so that every chunk has the same length. Returns `tensor`.
    """
    world_size, r = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return tensor
    flat = tensor.detach().reshape(-1).clone()
    pad = (-flat.numel()) % world_size
    buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat  # (N * chunk,)
    chunks = buf.view(world_size, -1)  # (N, chunk): chunk i travels around the ring
    right, left = (r + 1) % world_size, (r - 1) % world_size
    incoming = torch.empty_like(chunks[0])
    # reduce-scatter: at step s rank r sends chunk (r - s) and adds the chunk (r - s - 1) from the left
    for s in range(world_size - 1):
        _exchange(chunks[(r - s) % world_size], incoming, right, left)
        chunks[(r - s - 1) % world_size] += incoming
    # all-gather: rank r now owns the sum of chunk (r + 1); pass finished chunks on
    for s in range(world_size - 1):
        _exchange(chunks[(r + 1 - s) % world_size], incoming, right, left)
        chunks[(r - s) % world_size].copy_(incoming)
    tensor.copy_(buf[:flat.numel()].view_as(tensor))
    return tensor


def _exchange(send, recv, right, left):
    """Send to the right neighbour and receive from the left one at once: with blocking send/recv
    every rank would sit in send waiting for a receiver that is itself sending (deadlock)."""
    ops = [dist.isend(send.contiguous(), right), dist.irecv(recv, left)]
    for op in ops:
        op.wait()


# ------------------------------------------------------------------------------- bandwidth

def bus_factor(world_size: int) -> float:
    """2 (N-1)/N: the share of the message each rank sends in a ring all-reduce (nccl-tests' busbw)."""
    return 2.0 * (world_size - 1) / world_size


def bus_bandwidth(sizes_bytes, reps: int = 5, warmup: int = 1, device=None, dtype=torch.float32,
                  trials: int = 3) -> list[dict]:
    """Time dist.all_reduce for each message size on the current process group (every rank calls it).

    A round times every size once: a burst of `reps` all-reduces after a barrier, divided by reps, so
    that the ranks' skew leaving the barrier is paid once, not per operation (nccl-tests does the
    same). Each round starts at another size, so that no size always follows the largest burst and a
    slow phase of a shared machine hits all of them; the first `warmup` rounds are not kept (the first
    calls pay for connections and buffers, a set-up cost, not the alpha of the model).
    Rows {"bytes", "times_s" (one per kept round), "s" (their median), "algbw GB/s", "busbw GB/s"};
    algbw = bytes / time, busbw = algbw * 2 (N-1)/N, comparable across world sizes and with the link's
    peak (nccl-tests' convention).
    """
    if not dist.is_initialized():
        raise RuntimeError("bus_bandwidth: no process group; run it inside dlo.distributed.launch")
    device = torch.device(device or "cpu")
    world_size, sizes = dist.get_world_size(), list(sizes_bytes)
    elem = torch.empty((), dtype=dtype).element_size()
    xs = {n: torch.ones(max(1, int(n) // elem), dtype=dtype, device=device) for n in sizes}
    times: dict = {n: [] for n in sizes}
    for rnd in range(warmup + trials):
        k = rnd % len(sizes)
        for n in [*sizes[k:], *sizes[:k]]:
            dist.barrier()  # every rank starts together: the timing is of the collective, not the skew
            t = time_fn(lambda x=xs[n]: [dist.all_reduce(x) for _ in range(reps)], device=device, warmup=0, reps=1)
            if rnd >= warmup:
                times[n].append(t.median_s / reps)
    rows = []
    for n, ts in times.items():
        med, nbytes = statistics.median(ts), xs[n].numel() * elem
        rows.append({"bytes": nbytes, "times_s": ts, "s": med, "algbw GB/s": nbytes / med / 1e9,
                     "busbw GB/s": nbytes / med / 1e9 * bus_factor(world_size)})
    return rows


def fit_alpha_beta(sizes_bytes, seconds, world_size: int) -> dict:
    """Least-squares fit of the ring model T = 2(N-1) alpha + 2(N-1)/N * n * beta to measured times.

    Returns {"alpha": seconds per message, "beta": seconds per byte, "GB/s": 1 / beta / 1e9}.
    """
    if world_size < 2:
        raise ValueError("fit_alpha_beta: a one-rank all-reduce sends nothing; use world_size >= 2")
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError("fit_alpha_beta: need at least two (size, time) pairs of equal length")
    n = torch.tensor([float(s) for s in sizes_bytes], dtype=torch.float64)
    t = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
    a = torch.stack([torch.full_like(n, 2.0 * (world_size - 1)), bus_factor(world_size) * n], dim=1)  # (S, 2)
    # relative residuals: a plain fit would ignore the small messages, where alpha lives
    w = 1.0 / t
    alpha, beta = torch.linalg.lstsq(a * w[:, None], (t * w)[:, None]).solution.flatten().tolist()
    if alpha <= 0 or beta <= 0:
        # noisy timings (shared CPU cores) can make one term negative: fall back on the two ends,
        # the smallest message for the latency and the largest for the bandwidth
        small, large = int(n.argmin()), int(n.argmax())
        alpha = max(t[small].item(), 1e-12) / a[small, 0].item()
        beta = max((t[large] - a[large, 0] * alpha).item(), 0.5 * t[large].item()) / a[large, 1].item()
    return {"alpha": alpha, "beta": beta, "GB/s": 1.0 / beta / 1e9}


def allreduce_time(n_bytes: float, world_size: int, alpha: float, beta: float, algo: str = "ring") -> float:
    """Alpha-beta estimate of an all-reduce of n_bytes over world_size ranks ("ring" or "tree")."""
    if world_size == 1:
        return 0.0
    if algo == "ring":
        return 2 * (world_size - 1) * alpha + bus_factor(world_size) * n_bytes * beta
    if algo == "tree":
        steps = 2 * math.ceil(math.log2(world_size))
        return steps * alpha + steps * n_bytes * beta
    raise ValueError(f"allreduce_time: algo must be 'ring' or 'tree', got {algo!r}")
