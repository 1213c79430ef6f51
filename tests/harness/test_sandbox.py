"""The grader's channel and sandbox, piece by piece: what crosses from the student's process, what a
check can and cannot do there, what dies with it, and what bubblewrap hides."""

from __future__ import annotations

import io
import math
import os
import time
from pathlib import Path

import pytest
import torch

import dlo.checks
from dlo import reaper
from dlo.grading import api, forbid, testcells, wire
from dlo.grading.api import check, run_student, use_backend
from dlo.grading.jail import Spec, make_spec, probe
from dlo.grading.jail_kernel import SandboxedKernelManager
from dlo.grading.remote import TAG_ENV, CheckTimeout
from dlo.grading.trusted import LocalSandbox, StudentProcessDied

BWRAP = probe() == "bwrap"
needs_bwrap = pytest.mark.skipif(not BWRAP, reason=f"bubblewrap cannot run here: {probe()}")


# ----------------------------------------------------------------------------- the channel

def test_data_crosses_intact():
    value = {"t": (torch.arange(3.0), torch.nn.Parameter(torch.ones(2))), 7: [1, 2 ** 70, math.nan, True, None],
             "dt": torch.bfloat16, "s": torch.Size([2, 3]), "b": b"\x00\xff", "c": 1 + 2j, "dev": torch.device("cpu")}
    back = wire.decode(wire.encode(value))
    assert back.keys() == value.keys() and back["dt"] is torch.bfloat16 and back["s"] == torch.Size([2, 3])
    assert torch.equal(back["t"][0], value["t"][0]) and isinstance(back["t"][1], torch.nn.Parameter)
    assert back[7][:2] == [1, 2 ** 70] and math.isnan(back[7][2]) and back[7][3] is True and back[7][4] is None
    assert back["b"] == b"\x00\xff" and back["c"] == 1 + 2j and type(back["t"]) is tuple


class Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_the_trusted_side_never_unpickles():
    with pytest.raises(wire.Unsafe):
        wire.encode(Payload())  # not data: only a handle may stand for it
    buf = io.BytesIO()
    torch.save([Payload()], buf)  # a hand-made message whose "tensor bytes" are a pickle: they stay bytes
    n = len(buf.getvalue())
    head = b'{"v": {"t": 0, "rg": false, "P": false}, "T": [["uint8", [%d], 0, %d]]}' % (n, n)
    got = wire.decode(wire.FRAME.pack(len(head)) + head + buf.getvalue())
    assert got.dtype == torch.uint8 and bytes(got.numpy()) == buf.getvalue()
    for v in (b'{"zz": 1}', b'{"h": 1}', b'{"t": 3}', b'{"dt": "Tensor"}'):
        head = b'{"v": %s, "T": []}' % v
        with pytest.raises(ValueError, match="malformed"):
            wire.decode(wire.FRAME.pack(len(head)) + head)
    head = b'{"v": {"t": 0, "rg": false, "P": false}, "T": [["float64", [4], 0, 8]]}'  # 8 bytes for 4 doubles
    with pytest.raises(ValueError, match="does not match"):
        wire.decode(wire.FRAME.pack(len(head)) + head + bytes(8))


CHECKS = [getattr(m, n) for m in (getattr(dlo.checks, d) for d in dlo.checks.__all__) for n in dir(m)
          if n.startswith("check_")]


@pytest.mark.parametrize("chk", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_every_forbidden_name_resolves(chk):
    assert hasattr(chk, "forbid"), f"{chk.__name__} is not a @check"
    for path in chk.forbid:
        assert forbid.forbidden_targets(path), path


# ----------------------------------------------------------------------------- a runner, unconfined

def student_add(a, b):
    return a + b


def student_scale(t, k):
    t.mul_(k)  # in place: must come back to the grader's tensor
    t.grad = torch.ones_like(t)


class StudentCounter:
    def __init__(self, start):
        self.n = start

    def bump(self):
        self.n += 1
        return self.n


def student_calls_back(step_fn):
    return [step_fn(x) for x in (1.0, 2.0)]


def student_exits(*args):
    os._exit(7)


def student_liar(*args):
    class Liar:
        def __eq__(self, other):
            return True

        def __reduce__(self):
            return (os.system, ("touch /tmp/dlo-liar-unpickled",))
    return Liar()


SLEEPER = "dlo-sleeper"  # the name of the child below (a program it cannot start: `dlo.grading.noexec`)


def student_hangs_with_a_child(*args):
    if os.fork() == 0:  # a child that escapes the runner's process group, and sleeps
        os.setsid()
        import ctypes  # PR_SET_NAME (bwrap's /proc/self/comm is read-only)

        ctypes.CDLL(None).prctl(15, SLEEPER.encode(), 0, 0, 0)
        while True:
            time.sleep(1)
    while True:
        pass


def _worker_count(cls, start, n):
    obj = cls(start)
    return [obj.bump() for _ in range(n)]


@check()
def check_everything(add, scale, counter_cls, calls_back, liar):
    assert add(2, 3) == 5 and add(torch.ones(2), 1).tolist() == [2.0, 2.0]
    t = torch.ones(3)
    scale(t, 4.0)
    assert t.tolist() == [4.0] * 3 and t.grad.tolist() == [1.0] * 3
    obj = counter_cls(10)  # an instance: a handle, its methods remote
    assert obj.bump() == 11 and obj.n == 11 and "StudentCounter" in repr(obj)
    seen = []
    assert calls_back(lambda x: seen.append(x) or 10 * x) == [10.0, 20.0] and seen == [1.0, 2.0]  # stays here
    assert run_student(_worker_count, counter_cls, 5, 2) == [6, 7]
    got = liar()
    assert not isinstance(got, int) and (got == 5) is False  # a handle, not the object: no __eq__ of theirs
    print("everything: ok")


@check()
def check_calls(fn):
    fn()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    import sys

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's worker travels by value
    with LocalSandbox(tmp_path_factory.mktemp("sandbox")) as sb:
        yield sb
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_check_runs_with_handles(sandbox, capsys):
    sandbox.run(check_everything, student_add, student_scale, StudentCounter, student_calls_back, student_liar)
    assert "everything: ok" in capsys.readouterr().out
    assert not os.path.exists("/tmp/dlo-liar-unpickled")


def test_a_dying_student_fails_only_its_check(sandbox):
    with pytest.raises(StudentProcessDied, match="exit code 7"):
        sandbox.run(check_calls, student_exits)
    sandbox.run(check_calls, lambda: None)  # the same runner serves the next check


def student_reports_its_process():
    import os

    print("pids", os.getpid(), os.getppid())


def test_each_check_is_a_fork_of_one_warm_runner(sandbox):
    """A check's cost without a stopwatch: each runs in a new child of the same warm runner (a fork:
    no interpreter start, no imports), which is milliseconds whatever the machine's load."""
    for _ in range(3):
        sandbox.run(check_calls, student_reports_its_process)
    pids = [tuple(map(int, line.split()[1:])) for line in sandbox.log.read_text().splitlines()
            if line.startswith("pids")][-3:]  # the student's output goes to the runner's log
    assert len(pids) == 3
    assert len({pid for pid, _ in pids}) == 3 and len({parent for _, parent in pids}) == 1, pids


def test_a_hang_past_the_deadline_kills_everything(tmp_path):
    before = set(_sleepers())
    with LocalSandbox(tmp_path) as sb, use_backend(sb):
        handle = sb.capture(student_hangs_with_a_child)
        runner = sb.runner()
        sb.deadline = time.monotonic() + 3
        with pytest.raises(CheckTimeout):
            check_calls(handle)
        # the escaped sleeper too
        assert runner.proc.poll() is not None and not reaper.tagged(f"{TAG_ENV}={runner.tag}")
    assert set(_sleepers()) <= before


def test_at_the_submissions_end_the_runner_ends_by_itself(tmp_path):
    """The submission's end closes the runner's channel and lets it exit (status 0): its exit handlers
    wait for its ranks' fork server, whose CPU time (the ranks') then reaches `time dlo grade`; killed at
    once, the server died with the sandbox's PID namespace, its CPU uncounted. A hang is still killed."""
    with LocalSandbox(tmp_path) as sb, use_backend(sb):
        runner = sb.runner()
    assert runner.proc.returncode == 0


def test_a_deadline_passing_while_a_check_opens_does_not_leave_the_runner_out_of_step(tmp_path):
    """On a loaded node the deadline can pass before the session's child says it is open: that runner is
    dropped, so the next check opens on a fresh one (it once reached the late child: "unknown request 'open'")."""
    with LocalSandbox(tmp_path) as sb, use_backend(sb):
        handle = sb.capture(lambda: None)
        first = sb.runner()
        sb.deadline = time.monotonic() - 1  # already past when the session is opened
        with pytest.raises(CheckTimeout):
            check_calls(handle)
        assert first.proc.poll() is not None
        sb.deadline = None
        check_calls(sb.capture(lambda: None))  # a fresh runner


def _sleepers() -> list[int]:
    """The sleepers alive (a killed one stays a zombie until whoever adopted it reaps it: not counted)."""
    return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if reaper.comm(pid) == SLEEPER and _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return reaper.stat_fields(pid)[0] != "Z"
    except OSError:  # gone meanwhile
        return False


# ----------------------------------------------------------------------------- bubblewrap

def student_reads(path):
    with open(path) as f:
        return f.read()


def student_writes(path):
    with open(path, "w") as f:
        f.write("x")


@check()
def check_cannot_read(fn, path):
    try:
        fn(path)
    except (FileNotFoundError, PermissionError) as exc:
        return type(exc).__name__
    raise AssertionError(f"read {path}")


@check()
def check_cannot_write(fn, path):
    try:
        fn(path)
    except OSError as exc:  # rebuilt here from the sandbox's message: the text, not the errno, crosses
        return str(exc)
    raise AssertionError(f"wrote {path}")


@needs_bwrap
def test_bwrap_hides_the_grader_and_keeps_the_system_read_only(tmp_path):
    secret = tmp_path / "course" / "solutions"
    secret.mkdir(parents=True)
    (secret / "day.ipynb").write_text("the answers")
    spec = make_spec("bwrap", tmp_path / "work", hidden=[tmp_path / "course"])
    spec.make_dirs()
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb:
        assert sb.run(check_cannot_read, student_reads, str(secret / "day.ipynb")) == "FileNotFoundError"
        assert "Read-only file system" in sb.run(check_cannot_write, student_writes, "/etc/dlo-test")
        assert "Read-only file system" in sb.run(check_cannot_write, student_writes, str(spec.captured_dir / "x"))
        # the kernel's capture folder is not there at all: the runner reads copies (`Spec.captured_dir`)
        assert "No such file or directory" in sb.run(check_cannot_write, student_writes, str(spec.capture_dir / "x"))
        sb.run(check_calls, lambda: None)  # and the library and torch are there


@needs_bwrap
def test_bwrap_timeout_takes_the_pid_namespace(tmp_path):
    spec = make_spec("bwrap", tmp_path / "work", hidden=[])
    spec.make_dirs()
    before = set(_sleepers())
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb, \
            use_backend(sb):
        handle = sb.capture(student_hangs_with_a_child)
        sb.runner()
        sb.deadline = time.monotonic() + 3
        with pytest.raises(CheckTimeout):
            check_calls(handle)
    time.sleep(0.5)
    assert set(_sleepers()) <= before


@needs_bwrap
def test_a_sandboxed_kernel_obeys_interrupts(tmp_path):
    """SIGINT goes to the kernel inside bwrap (to bwrap itself it would kill the kernel)."""
    from jupyter_client.utils import run_sync

    spec = make_spec("bwrap", tmp_path / "work", hidden=[])
    spec.make_dirs()
    km = SandboxedKernelManager(kernel_name="python3")
    km.spec = spec
    run_sync(km.start_kernel)()
    kc = km.blocking_client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(100)")
        while True:  # the cell is running (it printed its working directory): interrupt it
            msg = kc.get_iopub_msg(timeout=60)
            if msg["msg_type"] == "stream":
                assert msg["content"]["text"].strip() == str(spec.kernel_dir)
                break
        run_sync(km.interrupt_kernel)()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:  # a late reply to wait_for_ready's kernel_info
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert run_sync(km.is_alive)()
    finally:
        kc.stop_channels()
        run_sync(km.shutdown_kernel)(now=True)


# ----------------------------------------------------------------------------- test cells

def test_free_names_are_what_the_cell_reads():
    src = "dlo.checks.day1.check_adamw_step(adamw_step, seed=0)\nx = norm(3, 4)\nassert abs(x - 5) < 1e-9\nlen([])"
    assert testcells.free_names(src) == ["adamw_step", "norm"]


def test_hidden_tests_are_stripped_from_feedback():
    src = "visible()\n### BEGIN HIDDEN TESTS\nsecret()\n### END HIDDEN TESTS\nafter()"
    assert testcells.strip_hidden(src) == "visible()\nafter()"
    assert testcells.strip_hidden("a\n### BEGIN HIDDEN TESTS\nsecret()") == "a"  # unterminated: to the end


def test_spec_hides_nested_folders_once(tmp_path):
    (tmp_path / "root" / "out").mkdir(parents=True)
    spec = make_spec("bwrap", tmp_path / "root" / "out" / "work", hidden=[tmp_path / "root", tmp_path / "root" / "out"])
    hidden = [Path(h) for h in spec.hidden]  # as root, also the folders uid 65534 may not pass (pytest's 0700)
    root = (tmp_path / "root").resolve()
    assert any(h == root or h in root.parents for h in hidden) and root / "out" not in hidden
    assert not any(o != h and o in h.parents for o in hidden for h in hidden)
    assert Spec.read(_write(spec, tmp_path / "s.json")) == spec


def _write(spec, path):
    spec.write(path)
    return path


def test_captured_values_bind_as_data_or_handles(tmp_path):
    (tmp_path / "report.json").write_text('{"result": "data", "f": "ok", "gone": "not defined"}')
    (tmp_path / "result.data").write_bytes(wire.encode({"acc": 0.93, "curve": torch.ones(2)}))
    (tmp_path / "f.pkl").write_bytes(b"read by the runner only")
    with LocalSandbox(tmp_path / "sb") as sb:
        bound = testcells.bindings(["result", "f"], tmp_path, sb)
        assert bound["result"]["acc"] == 0.93 and "f (in the sandbox)" in repr(bound["f"])
        with pytest.raises(testcells.CaptureFailed, match="'gone' is not defined"):
            testcells.bindings(["gone"], tmp_path, sb)


def test_numpy_numbers_cross_as_python_numbers_on_both_backends():
    """A correct answer may return numpy scalars: the direct backend converts them as the wire does."""
    import numpy as np

    got = api.safe_data([np.int64(3), (np.float32(1.5), {"n": np.int32(2)})])
    assert got == [3, (1.5, {"n": 2})] and type(got[0]) is int and type(got[1][0]) is float
    with pytest.raises(TypeError, match="plain data only"):
        api.safe_data(object())


def student_reaches(folder):
    """What the student's code in the runner reaches of the kernel's folder (where a red team's kernel left a Unix
    socket to a helper computing with the references, 2026-12-02)."""
    import socket

    out = []
    for what, reach in (("socket", lambda: socket.socket(socket.AF_UNIX).connect(os.path.join(folder, "h.sock"))),
                        ("fifo", lambda: os.open(os.path.join(folder, "f.fifo"), os.O_WRONLY | os.O_NONBLOCK)),
                        ("folder", lambda: os.listdir(folder))):
        try:
            reach()
            out.append(f"{what}: reached")
        except OSError as exc:
            out.append(f"{what}: {type(exc).__name__}")
    return out


@check()
def check_reaches_nothing(fn):
    got = fn()
    if any(line.endswith("reached") for line in got):
        raise AssertionError(f"the runner reached the kernel's folder: {got}")


@needs_bwrap
def test_the_runner_sees_nothing_the_kernel_writes(tmp_path):
    """The runner reads copies of the captures (`Spec.captured_dir`), and the scratch folder is hidden in every
    sandbox but for its own folders: a socket or FIFO the kernel's code makes is out of the runner's reach."""
    import socket

    spec = make_spec("bwrap", tmp_path / "work", hidden=[])
    spec.make_dirs()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(spec.capture_dir / "h.sock"))
    server.listen(1)
    os.mkfifo(spec.capture_dir / "f.fifo")
    folder = str(spec.capture_dir)

    def reaches():
        return student_reaches(folder)
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb:
        sb.run(check_reaches_nothing, reaches)
    server.close()
    with LocalSandbox(spec.capture_dir) as unconfined, pytest.raises(AssertionError, match="reached"):
        unconfined.run(check_reaches_nothing, reaches)  # the same code, unconfined: it reaches them
