"""dlo.measure.process: the kernel's count of a process, read from /proc (a Linux test: the grader's)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dlo.measure.process import Snapshot, growth, own_pid_in, snapshot

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
MIB = 1 << 20


def _held_for_a_moment(mib: int) -> None:
    block = bytearray(mib * MIB)  # zero-filled: every page touched
    del block


def test_the_high_water_mark_sees_a_block_freed_before_the_reading():
    before = snapshot(os.getpid(), reset=True)
    assert before is not None and before.reset  # our own process: we may reset its mark
    _held_for_a_moment(64)  # above any malloc threshold: its own pages, returned at free
    after = snapshot(os.getpid())
    grew, exact = growth(before, after)
    assert exact and 60 * MIB <= grew < 80 * MIB
    assert after.rss < before.rss + 16 * MIB  # gone now; only the mark remembers it


def test_without_a_reset_an_old_mark_only_bounds_the_growth():
    before = Snapshot(rss=100 * MIB, hwm=300 * MIB, child_ticks=0, below=0, reset=False)
    assert growth(before, Snapshot(110 * MIB, 300 * MIB, 0, 0, False)) == (200 * MIB, False)  # at most the old mark
    assert growth(before, Snapshot(110 * MIB, 350 * MIB, 0, 0, False)) == (250 * MIB, True)  # it rose: measured
    assert growth(Snapshot(100 * MIB, 100 * MIB, 0, 0, True), Snapshot(100 * MIB, 140 * MIB, 0, 0, False)) == (
        40 * MIB, True)


def test_a_child_is_found_by_its_pid_and_counted_below_its_parent_until_waited_for():
    before = snapshot(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        time.sleep(0.2)  # exited, not waited for: a zombie, still below us
        assert snapshot(os.getpid()).below == before.below + 1
    finally:
        os.waitpid(pid, 0)
    assert snapshot(os.getpid()).below == before.below


def test_the_pid_in_a_process_s_own_namespace_maps_to_ours():
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        assert own_pid_in(pid, os.getpid()) == pid  # no PID namespace between us: the same number
        assert own_pid_in(pid, pid) is None  # not below itself
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_gone_process_reads_as_none():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert snapshot(pid) is None
