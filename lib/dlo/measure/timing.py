"""Time on any device: synchronise, warm up, keep every sample (part of `dlo.measure`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlo.estimates import Estimate, median_interval

# ----------------------------------------------------------------------------- time


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work so that a host clock measures it (no-op on the CPU)."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds of every timed call; the statistics a table needs."""

    times_s: list[float]
    warmup: int = 0

    @property
    def n(self) -> int:
        return len(self.times_s)

    @property
    def median_s(self) -> float:
        xs = sorted(self.times_s)
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median_s

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0.05 means the middle half of the calls lie within 5%."""
        xs = sorted(self.times_s)
        q1, q3 = xs[len(xs) // 4], xs[(3 * len(xs)) // 4]
        return (q3 - q1) / self.median_s if self.median_s > 0 else 0.0

    def estimate(self, unit: float = 1.0) -> Estimate:
        """The median with its 95% interval (order statistics), times `unit` (1e3 for ms)."""
        return median_interval([t * unit for t in self.times_s])


def time_fn(fn: Callable[[], object], *, device=None, warmup: int = 2, reps: int = 10,
            min_time_s: float = 0.0, max_reps: int = 1000, before: Callable[[], object] | None = None) -> Timing:
    """Call `fn` `warmup` times untimed, then at least `reps` times (and until `min_time_s` has
    passed, at most `max_reps`), synchronising `device` around each call. `before()` runs untimed
    ahead of every timed call (e.g. a barrier, so that ranks start a collective together)."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"time_fn: need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + min_time_s
    while len(times) < reps or (time.perf_counter() < end and len(times) < max_reps):
        sync(device)
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(times, warmup)


def time_interleaved(fns: dict[str, Callable[[], object]], *, device=None, warmup: int = 2,
                     reps: int = 10) -> dict[str, Timing]:
    """Time several variants side by side in one process: round r calls every variant once, in
    order, so slow phases of a shared machine hit all of them. Returns a Timing per name."""
    if not fns:
        raise ValueError("time_interleaved: no functions to time")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + reps):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: Timing(ts, warmup) for name, ts in times.items()}
