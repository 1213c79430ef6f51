"""The conventions every `dlo` command follows (`dlo.errors`): one-line errors on stderr as `dlo <command>: ...`,
exit status 2 for bad usage or values and 1 for a failed run, progress bars only on a terminal, and no process
left behind when a command is stopped (SIGTERM, SIGHUP, Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from dlo import progress
from dlo.cli import main
from tests.harness.conftest import DAY, REPO, edit_cells, grade_id


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`dlo ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse's own exit
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc: int, out: str, err: str, status: int, start: str) -> None:
    assert rc == status, (rc, out, err)
    assert out == "" and err.startswith(start) and len(err.strip().splitlines()) == 1, (out, err)


@pytest.fixture
def empty_course(tmp_path, monkeypatch) -> Path:
    (tmp_path / "solutions").mkdir()
    monkeypatch.setenv("DLO_DAYS", "")  # a course of one's own, without a day yet
    return tmp_path


@pytest.mark.parametrize("args,start", [
    (["run"], "dlo run: name the days to run (dlo run DAY ...) or pass --all for every day"),
    (["run", "--all", "day1_optimizers"], "dlo run: name the days to run (dlo run DAY ...) or pass --all for every "
                                          "day, not both"),
    (["run", "nope"], "dlo run: unknown day(s) nope; the days are: (none)"),
    (["run", "--profile", "huge"], "dlo run: argument --profile: invalid choice: 'huge'"),
    (["run", "x", "--timeout", "0"], "dlo run: argument --timeout: 0 is not a positive number"),
    (["grade"], "dlo grade: SUBMITTED_DIR is required (or --merge DIR)"),
    (["grade", "sub", "--merge", "out"], "dlo grade: --merge DIR takes no SUBMITTED_DIR and no --shard"),
    (["grade", "sub"], "dlo grade: no day notebooks under"),
    (["grade", "sub", "--jobs", "0"], "dlo grade: argument --jobs: 0 is not a positive number"),
    (["setup", "student", "--cell-timeout", "-5"], "dlo setup: argument --cell-timeout: -5 is not a positive number"),
    (["plan", "day5_fsdp", "--gpus", "0"], "dlo plan: argument --gpus: 0 is not a positive number"),
    (["nope"], "dlo: argument command: invalid choice: 'nope'"),
])
def test_bad_usage_is_one_line_on_stderr_and_exit_2(capsys, empty_course, args, start):
    assert_one_line(*cli(capsys, "--root", str(empty_course), *args), 2, start)


@pytest.mark.parametrize("args", [["release"], ["check"], ["run", "--all", "--out", "out"],
                                  ["grade", "sub", "--out", "out"]])
def test_the_folders_on_disk_must_be_the_registrys_days(capsys, tmp_path, args):
    """A folder of solutions/ that `dlo.registry` does not name, or a registry day without its notebook:
    one line naming it, exit 2, before anything is written."""
    (tmp_path / "solutions" / "day9_new").mkdir(parents=True)
    (tmp_path / "sub" / "ann").mkdir(parents=True)
    assert_one_line(*cli(capsys, "--root", str(tmp_path), *args), 2,
                    f"dlo {args[0]}: solutions/day9_new is not a day of dlo.registry (add a DaySpec there")
    (tmp_path / "solutions" / "day9_new").rmdir()
    assert_one_line(*cli(capsys, "--root", str(tmp_path), *args), 2,
                    f"dlo {args[0]}: solutions/ under {tmp_path} lacks the notebook of day1_optimizers, "
                    "day2_mixed_precision")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["solutions", "sub"]  # no course/, no out/


def test_the_installed_command_exits_2_with_the_prefix():
    proc = subprocess.run([sys.executable, "-m", "dlo.cli", "--root", str(REPO), "run", "day9_nope"],
                          capture_output=True, text=True, timeout=120)
    assert_one_line(proc.returncode, proc.stdout, proc.stderr, 2, "dlo run: unknown day(s) day9_nope; the days are: "
                                                                   "day1_optimizers")


def test_a_failed_run_exits_1(capsys, tmp_path, monkeypatch):
    # a course whose notebook has no parameters cell: a broken course, not a bad command line
    nb = tmp_path / "solutions" / "bare" / "bare.ipynb"
    nb.parent.mkdir(parents=True)
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), nb)
    monkeypatch.setenv("DLO_DAYS", "bare")
    rc, out, err = cli(capsys, "--root", str(tmp_path), "run", "bare")
    assert_one_line(rc, out, err, 1, f"dlo run: {nb}: no cell tagged 'parameters'")


# ----------------------------------------------------------------------------- progress bars

def test_bars_only_on_a_terminal_unless_forced(monkeypatch):
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, text):
            pass

        def flush(self):
            pass

    monkeypatch.delenv("DLO_HEADLESS", raising=False)
    for forced, tty, wanted in [(None, False, False), (None, True, True), ("1", False, True), ("0", True, False)]:
        if forced is None:
            monkeypatch.delenv("DLO_PROGRESS", raising=False)
        else:
            monkeypatch.setenv("DLO_PROGRESS", forced)
        monkeypatch.setattr(sys, "stderr", Stream(tty))
        assert progress.bars_wanted() is wanted and progress.drawn() is wanted
        bar = progress.tqdm(range(3))
        assert bar.disable is not wanted and list(bar) == [0, 1, 2]  # closing a bar disables it
    monkeypatch.setenv("DLO_HEADLESS", "1")  # a kernel of `dlo run`: text bars for the saved notebook
    monkeypatch.delenv("DLO_PROGRESS")
    assert progress.drawn()


# ----------------------------------------------------------------------------- a stopped command

SLEEPER = "import subprocess, time\nsubprocess.Popen(['sleep', '301'])\ntime.sleep(301)"


def tagged(tag: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose environment carries DLO_TEST_TAG=tag."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"DLO_TEST_TAG={tag}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
    return {pid: cmd for pid, cmd in found.items() if cmd}  # a zombie has no command line


def stop_and_check(cmd: list[str], signum: int, ready: str, timeout: float = 300) -> subprocess.Popen:
    """Start `cmd` with a tag of its own in its environment, wait until a tagged process runs `ready`, send
    `signum` to the command alone, and check that nothing tagged is left once it has exited."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DLO_PROFILE": "tiny", "DLO_TEST_TAG": tag})
    try:
        end = time.monotonic() + timeout
        while not any(ready in c for c in tagged(tag).values()):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < end, f"nothing ran {ready!r} in {timeout} s"
            time.sleep(0.2)
        proc.send_signal(signum)
        proc.log = proc.communicate(timeout=120)[0]
        left = tagged(tag)
        assert not left, (left, proc.log)
        return proc
    finally:  # whatever this test started, and only that
        if proc.poll() is None:
            proc.kill()
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stopped_run_leaves_no_process(tmp_path, signum, monkeypatch):
    nb = tmp_path / "solutions" / "sleepy" / "sleepy.ipynb"
    nb.parent.mkdir(parents=True)
    nbformat.write(new_notebook(cells=[new_code_cell('profile: str = "auto"', metadata={"tags": ["parameters"]}),
                                       new_code_cell(SLEEPER)],
                                metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}}), nb)
    monkeypatch.setenv("DLO_DAYS", "sleepy")
    proc = stop_and_check([sys.executable, "-m", "dlo.cli", "--root", str(tmp_path), "run", "sleepy", "--out",
                           str(tmp_path / "out")], signum, ready="sleep 301")
    assert proc.returncode == 128 + signum
    assert f"dlo run: stopped by {signal.Signals(signum).name}; every process it started was ended" in proc.log


@pytest.mark.slow
def test_a_stopped_grade_leaves_no_process(toy_root, tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_DAYS", DAY)  # the toy course's one day (dlo.registry.names)

    def sleep_in_add(cell):
        if grade_id(cell) == "add":
            cell["source"] = SLEEPER

    edit_cells(toy_root / "course" / DAY / f"{DAY}.ipynb", tmp_path / "sub" / "ann" / DAY / f"{DAY}.ipynb",
               sleep_in_add)
    proc = stop_and_check([sys.executable, "-m", "dlo.cli", "--root", str(toy_root), "grade", str(tmp_path / "sub"),
                           "--out", str(tmp_path / "out"), "--jobs", "1"], signal.SIGTERM, ready="sleep 301")
    assert proc.returncode in (130, 143) and "run the same command again" in proc.log, proc.log


@pytest.mark.slow
@pytest.mark.scale  # CI's toy-class step (.ci/run), beside the other killed and interrupted gradings
def test_a_stopped_run_with_grade_leaves_no_process(toy_root, tmp_path, monkeypatch):
    """`dlo run --grade` stopped while its notebook runs and its grading waits for it (the grading's warm
    process and course started meanwhile): every process ends, the exit status says the signal."""
    monkeypatch.setenv("DLO_DAYS", DAY)
    nb = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    book = nbformat.read(nb, as_version=4)
    book.cells.append(new_code_cell(SLEEPER))  # an experiment after the graded cells that never ends
    nbformat.write(book, nb)
    proc = stop_and_check([sys.executable, "-m", "dlo.cli", "--root", str(toy_root), "run", DAY, "--out",
                           str(tmp_path / "sub" / "ref"), "--grade", str(tmp_path / "graded")], signal.SIGTERM,
                          ready="sleep 301")
    assert proc.returncode == 143, proc.log
    assert "dlo run: stopped by SIGTERM; every process it started was ended" in proc.log
