"""Limits per grading job, piece by piece (`dlo.grading.limits`, `dlo.grading.jobwatch`): sizes and their
defaults, the command line's refusals, the rlimits the sandbox's wrapper sets, the limit an error names,
and the watch that stops the largest process of a job over its memory. No sandbox needed: the limits in the
jail and under `dlo grade` are tests/harness/test_limits.py (pytest -m trust)."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

from dlo import reaper
from dlo.cli import main
from dlo.grading import limits
from dlo.grading.jobwatch import JobWatch
from dlo.grading.limits import GIB, MIB, Limits, for_jobs, name_limits, parse_size, reached, size_text
from dlo.grading.testcells import error_output


def test_sizes_read_and_written_in_binary_units():
    assert parse_size("3G") == 3 * GIB and parse_size("1.5GiB") == 3 * GIB // 2 and parse_size("512M") == 512 * MIB
    assert parse_size("64k") == 64 * 1024 and parse_size("1048576") == MIB and parse_size(" 2 GB ") == 2 * GIB
    for bad in ("3X", "-1", "G", "", "1e9"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert [size_text(n) for n in (3 * GIB, 3 * GIB // 2, 512 * MIB, 4096, 12)] == \
        ["3 GiB", "1.5 GiB", "512 MiB", "4 KiB", "12 bytes"]


def test_defaults_are_each_jobs_share_and_never_under_an_honest_day():
    lim, warnings = for_jobs(2, 20 * GIB, threads=1)
    share = (20 * GIB - limits.GRADER_RESERVE) // 2 - limits.TRUSTED_PER_JOB
    assert lim == Limits(memory=share * 3 // 4, procs=256, file_size=share * 3 // 4, tmpfs=share // 8)
    assert not warnings
    assert for_jobs(1, 200 * GIB, threads=16)[0].procs == 64 * 16 + 192  # threads grow with the cores of a job
    small, warnings = for_jobs(8, 8 * GIB, threads=1)  # 8 jobs on 8 GiB: under what a day takes
    assert small.memory == limits.HONEST["memory"] and small.tmpfs == limits.HONEST["tmpfs"]
    assert len(warnings) == 1 and "lower --jobs" in warnings[0]
    given, warnings = for_jobs(2, 20 * GIB, threads=1, given={"memory": GIB, "procs": None})
    assert given.memory == GIB and given.procs == 256  # what the command line gave, as given
    assert len(warnings) == 1 and "--mem-per-job is under 3 GiB, the default's floor" in warnings[0]


@pytest.mark.parametrize("args, message", [
    (["--mem-per-job", "3X"], "argument --mem-per-job: '3X' is not a size (e.g. 3G, 512M, 1.5GiB)"),
    (["--mem-per-job", "100M"], "argument --mem-per-job: 100 MiB is too small: at least 512 MiB"),
    (["--procs-per-job", "many"], "argument --procs-per-job: 'many' is not a number"),
    (["--procs-per-job", "8"], "argument --procs-per-job: 8 is too small: at least 32"),
    (["--max-file-size", "0"], "argument --max-file-size: 0 bytes is too small: at least 1 MiB"),
    (["--tmpfs-size=-5M"], "argument --tmpfs-size: '-5M' is not a size"),
    (["--no-sandbox", "--tmpfs-size", "1G"], "the limits per job are set in the sandbox: --no-sandbox grades"),
])
def test_bad_limits_are_refused_in_one_line(capsys, tmp_path, args, message):
    try:
        rc = main(["grade", str(tmp_path), *args])
    except SystemExit as exc:  # argparse's own exit
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("dlo grade: "), err
    assert message in err, err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_the_wrapper_sets_each_rlimit_hard_before_the_command():
    lim = Limits(memory=3 * GIB, procs=300, file_size=5 * MIB, tmpfs=MIB)
    code = ("import resource\nfor n in ('DATA', 'NPROC', 'FSIZE'):\n"
            "    print(n, *resource.getrlimit(getattr(resource, 'RLIMIT_' + n)))\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 40, 2 ** 40))")
    proc = subprocess.run([*limits.wrapper(lim), sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split("\n")[:3] == [f"DATA {3 * GIB} {3 * GIB}", "NPROC 300 300", f"FSIZE {5 * MIB} {5 * MIB}"]
    assert os.geteuid() == 0 or "ValueError" in proc.stderr  # raising one back is refused (root may)
    assert limits.wrapper(None) == [] and limits.tmpfs_args(None, "/tmp") == ["--tmpfs", "/tmp"]
    assert not any("RLIMIT_DATA" in a for a in limits.wrapper(lim, gpus=True))  # not with CUDA (untried)
    assert limits.tmpfs_args(lim, "/tmp") == ["--size", str(MIB), "--tmpfs", "/tmp"]
    assert limits.tmpfs_args(lim, "/run", hiding=True) == ["--size", str(limits.HIDING_TMPFS), "--tmpfs", "/run"]


def _error(ename: str, evalue: str, tb: str = "") -> dict:
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": [tb] if tb else []}


@pytest.mark.parametrize("out, name", [
    (_error("MemoryError", ""), "memory"),
    (_error("RuntimeError", "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate "
                            "memory: you tried to allocate 4000000000 bytes. Error code 12"), "memory"),
    (_error("BlockingIOError", "[Errno 11] Resource temporarily unavailable",
            "\x1b[0;32m----> 5\x1b[0m pid \x1b[38;5;241m=\x1b[39m os\x1b[38;5;241m.\x1b[39mfork()"), "procs"),
    (_error("RuntimeError", "can't start new thread"), "procs"),
    (_error("OSError", "[Errno 27] File too large"), "file_size"),
    (_error("OSError", "[Errno 28] No space left on device: '/tmp/x'"), "tmpfs"),
    (_error("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"), None),  # the GPU's, not the job's
    (_error("BlockingIOError", "[Errno 11] Resource temporarily unavailable", "sock.recv(4)"), None),
    (_error("ValueError", "norm fails here"), None),
])
def test_which_limit_an_error_shows(out, name):
    assert reached(out) == name


def test_a_limit_is_named_in_the_cells_error_and_a_stopped_process_fails_the_cell():
    lim = Limits(memory=3 * GIB, procs=256, file_size=GIB, tmpfs=256 * MIB)
    outs = name_limits([{"output_type": "stream", "name": "stdout", "text": "x"}, _error("MemoryError", "")],
                       lim, "this cell")
    assert outs[1]["evalue"].endswith("memory limit of 3 GiB reached while running this cell (each submission is "
                                      "graded within its own limits; your instructor sets them: dlo grade "
                                      "--mem-per-job)")
    assert outs[1]["traceback"][0].startswith("memory limit of 3 GiB reached") and limits.is_note(outs[1]["evalue"])
    assert name_limits([_error("ValueError", "x")], lim, "this cell")[0]["evalue"] == "x"
    assert name_limits([_error("MemoryError", "")], None, "this cell")[0]["evalue"] == ""  # no limits: no note

    class Killed:
        what = "a process running your code (2.5 GiB)"
    outs = name_limits([], lim, "the checks of this cell", [Killed()], error_output)
    assert len(outs) == 1 and outs[0]["ename"] == "MemoryError"
    assert "memory limit of 3 GiB reached while running the checks of this cell; the grader stopped a process " \
           "running your code (2.5 GiB)" in outs[0]["evalue"]


HOG = """
import os, sys, time
held = b"x" * ({mib} << 20)            # touched: resident
if {fork}:
    if os.fork() == 0:                  # a child sharing every page with its parent
        time.sleep(60)
        os._exit(0)
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""


class Job:
    """Hogs started by a parent of their own (`root`), as a grading job's processes are: the watch counts
    what is below it, not the test's worker and what it started earlier (a rank fork server holds ~200 MiB)."""

    def __init__(self, *hogs: tuple[int, bool]):
        lines = [f"{sys.executable} -c {shlex.quote(HOG.format(mib=mib, fork=fork))} &" for mib, fork in hogs]
        # the hogs' stderr kept: once in make test a hog ended before it was ready, and nothing said why
        self.err = tempfile.TemporaryFile("w+")
        self.root = subprocess.Popen(["bash", "-c", "\n".join([*lines, "wait"])], stdout=subprocess.PIPE,
                                     stderr=self.err, text=True)
        self.pids = [self._ready() for _ in hogs]  # in the order they got ready

    def _ready(self) -> int:
        line = self.root.stdout.readline()
        if not line.startswith("ready "):
            try:  # bash's own status first (close kills it): did something else end the job?
                status = self.root.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = "still running"
            self.close()
            self.err.seek(0)
            raise RuntimeError(f"a hog ended before it was ready (stdout {line!r}, bash: {status}): {self.err.read()}")
        return int(line.split()[1])

    def close(self) -> None:
        for pid in [*reaper.descendants(self.root.pid), self.root.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        self.root.wait()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def _gone(pid: int) -> bool:
    """`pid` was killed (a zombie until its parent, the job's bash, reaps it) or has left."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_the_watch_stops_the_largest_process_of_a_job_over_its_memory():
    """Two processes of 150 and 100 MiB under a 200 MiB limit: the larger is killed, the event kept; a fork
    that shares its parent's 150 MiB does not count them twice (the proportional share decides)."""
    shared = Job((150, True))
    try:
        time.sleep(0.2)
        assert JobWatch(200 * MIB, root=shared.root.pid).check() is None  # 2 x 150 MiB resident, 150 MiB held
    finally:
        shared.close()
    both = Job((150, False), (100, False))
    try:
        watch = JobWatch(200 * MIB, root=both.root.pid)
        sizes = {pid: _rss_mib(pid) for pid in both.pids}
        big, small = max(sizes, key=sizes.get), min(sizes, key=sizes.get)
        start = time.monotonic()
        event = watch.check()
        assert event is not None and event.pid == big and event.total > 200 * MIB
        assert _gone(big) and _rss_mib(small) > 90  # the other keeps running
        assert watch.since(start) == [event] and "a process running your code (15" in event.what
        assert watch.check() is None  # under the limit again
    finally:
        both.close()
