"""In which order `dlo grade` grades, and what it says while it does: longest expected first, a live line.

A class is graded fastest when the longest submissions start first (a long one started last keeps
one job busy while the others wait: the longest-processing-time rule). What a submission is expected
to take is its day's median time in the run before (the records a resumed run keeps, else the times
the last run kept in the cache, `history_path`), else the day's estimate below. The order only decides
when a submission starts: scores and CSVs are the same in any order.

`Progress` prints a line when grading starts (queued, running, done), when a submission finishes,
and every `HEARTBEAT` seconds while one runs, naming the slowest running submission and the
time left (the expected times still to go, spread over the jobs, scaled by how long the finished ones
took against their expectation).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from dlo.cpus import usable_cores
from dlo.registry import DAYS, UNKNOWN_GRADE_CPU_S

# CPU seconds to grade each day's solution (`dlo.registry.DaySpec.grade_cpu_s`). Only their order matters.
ESTIMATES = {spec.name: spec.grade_cpu_s for spec in DAYS.values()}
# Wall seconds to run each day's notebook (`DaySpec.run_s`), for `dlo run`'s order. Only their order matters.
RUN_SECONDS = {spec.name: spec.run_s for spec in DAYS.values()}
UNKNOWN = UNKNOWN_GRADE_CPU_S  # a day with no estimate (a course of one's own)
HEARTBEAT = 20.0


def cores() -> int:
    """What a run may spread over: the affinity mask, the cgroup's CPU quota, SLURM's cpus-per-task."""
    return usable_cores()


def history_path() -> Path:
    """The per-day grading times kept between runs (scheduling only; nothing else reads them)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlo" / "grade-seconds.json"


def mode(profile: str, full_notebook: bool) -> str:
    return f"{profile}/{'full' if full_notebook else 'graded'}"


def day_medians(records) -> dict[str, float]:
    by_day: dict[str, list[float]] = {}
    for r in records:
        if r.get("status") == "graded" and r.get("seconds"):
            by_day.setdefault(r["day"], []).append(float(r["seconds"]))
    return {d: statistics.median(v) for d, v in by_day.items()}


def expected(keys, earlier_records, key_mode: str) -> dict:
    """{(student, day): seconds expected}: the day's median in `earlier_records` (those a resumed run
    keeps), else in the cache, else ESTIMATES."""
    from dlo.harness.results import read_json  # nbgrader's: not for `dlo run`, which needs only `order`

    earlier = day_medians(earlier_records)
    cached = (read_json(history_path()) or {}).get(key_mode)
    cached = {d: float(v) for d, v in cached.items() if isinstance(v, (int, float))} if isinstance(cached, dict) else {}
    return {k: earlier.get(k[1]) or cached.get(k[1]) or ESTIMATES.get(k[1], UNKNOWN) for k in keys}


def remember(records, key_mode: str) -> None:
    """Keep this run's per-day medians for the next run's order (a cache: failing to write is no error)."""
    from dlo.harness.results import read_json, write_json

    try:
        data = read_json(history_path()) or {}
        data[key_mode] = {**(data.get(key_mode) or {}), **day_medians(records)}
        write_json(history_path(), data)
    except OSError:
        pass


def order(todo, seconds: dict) -> list:
    """Longest expected first; equal ones by student and day (the same order every time)."""
    return sorted(todo, key=lambda k: (-seconds[k], k))


def fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """The live line: a bar, done/total, failures, running (the slowest), queued, time left."""

    def __init__(self, todo, seconds: dict, jobs: int, total: int, done: int, width: int = 24, out=print):
        self.expected, self.jobs, self.total, self.done, self.width, self.out = seconds, jobs, total, done, width, out
        self.queued, self.running, self.failed = set(todo), {}, 0
        self.took = self.planned = 0.0  # of the submissions finished in this run: seconds taken, expected
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def begin(self) -> None:
        with self.lock:
            self._line(f"grading {len(self.queued)} submission(s), {self.jobs} at a time, longest expected first")
        self.ticker.start()

    def started(self, key) -> None:
        with self.lock:
            self.queued.discard(key)
            self.running[key] = time.monotonic()

    def left_out(self, key) -> None:
        """A submission that will not be graded after all (`dlo run --grade`: its notebook was not made)."""
        with self.lock:
            self.queued.discard(key)
            self.total -= 1

    def update(self, rec: dict) -> None:
        key = (rec["student"], rec["day"])
        with self.lock:
            self.running.pop(key, None)
            self.queued.discard(key)
            self.done += 1
            self.failed += rec["status"] != "graded"
            self.took += rec["seconds"]
            self.planned += self.expected.get(key, 0.0)
            self._line(f"{rec['student']}/{rec['day']}: {rec['status']} {rec['score']:g} in {rec['seconds']:.1f} s")

    def say(self, text: str) -> None:
        with self.lock:
            self.out(text, flush=True)

    def end(self) -> None:
        self.stop.set()

    def _tick(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            with self.lock:
                if self.running:
                    self._line("")

    def left(self) -> float:
        """Seconds still expected, spread over the jobs; scaled by how the finished ones compared."""
        now, scale = time.monotonic(), self.took / self.planned if self.planned else 1.0
        todo = sum(self.expected.get(k, 0.0) * scale for k in self.queued)
        todo += sum(max(0.0, self.expected.get(k, 0.0) * scale - (now - t)) for k, t in self.running.items())
        return todo / max(1, self.jobs)

    def _line(self, tail: str) -> None:
        fill = round(self.width * self.done / max(self.total, 1))
        text = (f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} done, {self.failed} failed, "
                f"{len(self.running)} running, {len(self.queued)} queued")
        if self.running:
            key, since = min(self.running.items(), key=lambda kv: (kv[1], kv[0]))
            text += f" (slowest {key[0]}/{key[1]}: {fmt_time(time.monotonic() - since)})"
        text += f", ~{fmt_time(self.left())} left"
        self.out(text + (f" | {tail}" if tail else ""), flush=True)

