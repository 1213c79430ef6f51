"""The nbgrader process's warm start (dlo.harness.warm): each child a fresh grading process, a secret of its
own, its crash or kill reported as a fresh process's would be, the warm process untouched; the exec path kept.

One warm process for the module (its imports: a few CPU seconds); its children run the code given as their
argument instead of nbgrader (what they run after the fork is `nbgrader_cli`'s, graded in test_toy_course)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dlo import reaper
from dlo.harness import nbgrader_cli, warm

# the warm process as `nbgrader_cli --warm` is (its imports, or lighter ones), its children exec'ing their argument
SERVE = "import sys; from dlo.harness.warm import run_child, serve; " \
        "argv = serve(int(sys.argv[1]){}) or sys.exit(0); run_child(exec, argv[0], {{}})"
SEED = "from dlo.grading import api\nwith api.use_backend(object): print(api.case_seed(0))"  # the secret's seed


@pytest.fixture(scope="module")
def server():
    ws = warm.WarmStart([sys.executable, "-c", SERVE.format("")])
    assert ws.start(dict(os.environ)) is not None, "the warm process did not start (threads after its imports?)"
    yield ws
    ws.close()


def run(server, code: str, cwd: Path, timeout: float | None = 60, **env) -> subprocess.CompletedProcess:
    """`code` in a child of the warm server, as the pool runs nbgrader_cli (nbgrader_cli.child)."""
    old, nbgrader_cli.GRADER = nbgrader_cli.GRADER, server
    try:
        return nbgrader_cli.child([sys.executable, "-m", "dlo.harness.nbgrader_cli", code], cwd, env=env,
                                  timeout=timeout, warm=True)
    finally:
        nbgrader_cli.GRADER = old


def test_each_child_draws_its_own_secret(server, tmp_path):
    seeds = [run(server, SEED, tmp_path) for _ in range(2)]
    assert [p.returncode for p in seeds] == [0, 0], seeds
    assert seeds[0].stdout != seeds[1].stdout, "two submissions graded with one secret"


def test_a_child_is_a_fresh_process_in_its_folder(server, tmp_path):
    code = "import atexit, os, sys; print(os.getcwd(), os.environ['DLO_X'], os.getsid(0) == os.getpid()); " \
           "atexit.register(print, 'atexit'); print('err', file=sys.stderr); sys.exit(3)"
    proc = run(server, code, tmp_path, DLO_X="yes")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, f"{tmp_path} yes True\natexit\n", "err\n")
    assert run(server, "raise ValueError('no')", tmp_path).returncode == 1  # as an uncaught exception exits
    assert "DLO_X" not in run(server, "import os; print(sorted(os.environ))", tmp_path).stdout  # not kept


def test_crashes_and_kills_are_reported_and_the_next_child_runs(server, tmp_path):
    assert run(server, "import os; os._exit(7)", tmp_path).returncode == 7
    assert run(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path).returncode == -9
    with pytest.raises(TimeoutError):  # killed with its tree by the pool's timeout, as a fresh process is
        run(server, "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)", tmp_path,
            timeout=2)
    assert run(server, "print('next')", tmp_path).stdout == "next\n"
    assert server.proc.poll() is None


def test_the_warm_process_holds_no_file_of_a_child(server, tmp_path):
    (tmp_path / "answer.txt").write_text("42")
    assert run(server, "f = open('answer.txt'); print(f.read())", tmp_path).stdout == "42\n"
    held = [os.readlink(f"/proc/{server.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.proc.pid}/fd")]
    assert all(h == "/dev/null" or h.startswith(("pipe:", "socket:", "anon_inode:")) for h in held), held
    assert reaper.children(server.proc.pid) == []  # every child reaped


def test_exec_when_asked_or_when_the_warm_process_cannot_start(monkeypatch, tmp_path):
    cmd = [sys.executable, "-c", "import sys; print(sys.argv[0])"]
    monkeypatch.setenv(warm.START_ENV, "exec")
    assert warm.WarmStart([sys.executable, "-c", SERVE.format("")]).start(dict(os.environ)) is None
    assert nbgrader_cli.child(cmd, tmp_path, warm=True).stdout == "-c\n"  # a fresh interpreter ran the command
    monkeypatch.delenv(warm.START_ENV)
    broken = warm.WarmStart([sys.executable, "-c", "import sys; sys.exit(1)"])
    assert broken.spawn(["x"], tmp_path, dict(os.environ), dict(os.environ)) is None and broken.failed


def test_a_dead_warm_process_means_exec(tmp_path):
    ws = warm.WarmStart([sys.executable, "-c", SERVE.format(", ('json',)")])
    assert ws.start(dict(os.environ)) is not None
    os.kill(ws.proc.pid, signal.SIGKILL)
    ws.proc.wait()
    assert ws.spawn(["print(1)"], tmp_path, dict(os.environ), dict(os.environ)) is None and ws.failed
    ws.close()


def test_a_stopped_warm_process_ends_by_itself_and_later_children_are_fresh_processes(tmp_path):
    """`dlo grade` stops the warm process once its last submission is graded (`nbgrader_cli.stop_warm`), so
    that it ends while the tables and reports are written: stop() does not wait for it, and a child asked
    for afterwards is a fresh interpreter (the exec path), never one forked from a process told to end."""
    ws = warm.WarmStart([sys.executable, "-c", SERVE.format(", ('json',)")])
    proc = ws.start(dict(os.environ))
    assert proc is not None
    ws.stop()
    assert proc.wait(timeout=30) == 0  # it read the socket's end and returned from serve
    assert ws.spawn(["print(1)"], tmp_path, dict(os.environ), dict(os.environ)) is None and ws.failed
    ws.close()  # what atexit does later: nothing left to end


LEAVER = "import os, signal, subprocess, sys; subprocess.Popen(['sleep', '60'], start_new_session=True); " \
         "print('left one'); sys.stdout.flush(); {}"


@pytest.mark.parametrize("end", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(0)"])
def test_what_a_child_leaves_running_is_killed_when_it_ends(server, tmp_path, monkeypatch, end):
    """A grading process killed (the out-of-memory killer) before it could take its kernel with it, or one that
    left a process behind: what it started in a session of its own holds its stdout, so reading that to its
    end waited for the notebook's time limit. Now the child's end is seen and what carries its mark killed."""
    code = LEAVER.format(end)
    monkeypatch.setattr(nbgrader_cli, "LEFT_GRACE", 0.1)
    for proc in (run(server, code, tmp_path, timeout=50),  # forked from the warm process
                 nbgrader_cli.child([sys.executable, "-c", code], tmp_path, timeout=50)):  # a fresh interpreter
        assert (proc.returncode, proc.stdout) == (-9 if "KILL" in end else 0, "left one\n")
        assert not _left(tmp_path)


def _left(folder: Path) -> list[int]:
    """The `sleep`s started in `folder` still running."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if reaper.comm(int(entry)) == "sleep" and os.readlink(f"/proc/{entry}/cwd") == str(folder):
                out.append(int(entry))
        except OSError:
            continue
    return out
