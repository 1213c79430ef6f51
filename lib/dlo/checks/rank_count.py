"""Each rank's reply, all of them (`every_rank`: the checks on ranks of Days 5, 6, 7 and 10), and what the launcher
read of each rank's memory in a counted case, for the checks that hold a student's step to the course's own on the
same case (Day 5's ZeRO-2, Day 6's 1F1B).

A counted case runs on ranks the check launches (`dlo.grading.api.on_ranks`) with a worker whose
`counted_prelude` runs the course's reference first, on each rank, before any student object exists
(`dlo.grading.ranks.run_on_rank`); the rank then marks, and the student's step runs the same case. The
process that launched the ranks reads their memory from /proc at the start, at the mark and every few
milliseconds after (`dlo.grading.meter.SocketMeter.memory`). Both peaks are measured from the rank's
resident memory at the mark, once the reference let go (what a rank's first step leaves for good, its
lazily made buffers and imports, is in that baseline for both): the reference's is the high water mark at
the mark, the student's the highest one read after it (where the launcher may not reset the mark, as in the
grader's sandbox, where the ranks are not dumpable, that reading is at least the reference's: what a step
under it reached is not known, nor needed).
"""

from __future__ import annotations

from dlo.grading.api import rank_memory


def every_rank(name: str, results, world_size: int, where: str = "", of: type = dict) -> list:
    """`results` of an `on_ranks` as the check needs them: one per rank, each a dict (a short or empty list
    of replies came from the student's side, whose code can rewrite what the ranks' replies go through, and
    would leave ranks unchecked)."""
    got = len(results) if isinstance(results, list) else 0
    if got != world_size or not all(isinstance(r, of) for r in results):
        raise AssertionError(f"{name}: the grader got results from {got} of {world_size} ranks: each rank's "
                             f"reply must come back whole" + (f" ({where})" if where else ""))
    return results


def counted_peaks(name: str, where: str) -> list[tuple[int, int]]:
    """(the reference's peak, the student's peak) in bytes above the mark, for each rank of the check's last
    `on_ranks`. Called only where the launcher meters the ranks (`api.wire_sent` is not None): a count it
    could not read is the grader's error, never a pass; a rank that never reached its end hand-over, or
    started a process (whose memory is not the rank's), fails."""
    counts = rank_memory()
    if counts is None:
        raise RuntimeError(f"grader: {name} could not read the ranks' memory in /proc ({where})")
    peaks = []
    for r, m in enumerate(counts):
        if not m["ended"] or m["below"] or m["child_ticks"]:
            what = "never reached its end" if not m["ended"] else "started a process"
            raise AssertionError(f"{name}: rank {r} {what} in the counted case: the grader reads each rank's memory "
                                 f"from outside it, and a rank's work stays in the rank ({where})")
        peaks.append((m["prelude_peak"] - m["mark_rss"], max(0, m["peak"] - m["mark_rss"])))
    return peaks
