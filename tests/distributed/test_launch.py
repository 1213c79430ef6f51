"""Tests for dlo.distributed.launch: results, __main__ functions, failures, timeouts, torchrun.

Every launch starts a fresh interpreter that imports torch (about 1-2 s on 2 cores) and forks the
ranks (one interpreter per rank with DLO_RANK_START=exec), so the file keeps to ten launches (plus one
torchrun). Wall-clock bounds below are hang guards, not speed checks.
"""

import _thread
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dlo.distributed as dd
from dlo.distributed import RankError, launch

PY = sys.executable


def _alive(pid):
    """True while pid exists and is not a zombie (Linux /proc)."""
    stat = f"/proc/{pid}/stat"
    if not os.path.exists(stat):
        return False
    with open(stat) as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def _worker_children():
    """Pids of dlo workers that are still children of this test process."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # the process ended while we looked
            continue
        if ppid == os.getpid() and b"dlo.distributed._worker" in cmd and b"--server" not in cmd:  # it outlives launches
            found.append(int(name))
    return found


def _assert_all_gone(pids, port):
    assert pids and not [p for p in pids if _alive(p)], f"leftover workers {pids}"
    assert _worker_children() == []
    with socket.socket() as s:  # SO_REUSEADDR as any server would: TIME_WAIT is not a leak
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_helpers_without_process_group():
    assert (dd.rank(), dd.world_size(), dd.is_main()) == (0, 1, True)


@pytest.mark.parametrize("n", [3, 4])  # 2 ranks: test_function_from_main_script
def test_results_by_rank(n, capsys):
    scale = 10.0  # captured by the closure below: cloudpickle ships it by value

    def body(offset, *, power):
        import torch.distributed as dist

        import dlo.distributed as dd

        r = dist.get_rank()
        t = torch.tensor([float(r + offset) ** power])
        dist.all_reduce(t)  # sum over ranks of (r + offset) ** power
        print(f"hi from {r} of {dist.get_world_size()}")
        return r, dd.world_size(), dd.is_main(), scale * t.item()

    out = launch(body, n, 1, power=2)
    total = sum(float(r + 1) ** 2 for r in range(n))
    assert out == [(r, n, r == 0, scale * total) for r in range(n)]
    lines = capsys.readouterr().out.splitlines()
    for r in range(n):
        assert f"[rank {r}] hi from {r} of {n}" in lines
    assert _worker_children() == []


def test_function_from_main_script(tmp_path):
    script = tmp_path / "student.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from dlo.distributed import launch

        class Box:  # a __main__ class, shipped both ways by value
            def __init__(self, v):
                self.v = v

        def gather_ranks(base):
            t = torch.zeros(dist.get_world_size())
            t[dist.get_rank()] = base + dist.get_rank()
            dist.all_reduce(t)
            return Box(t.tolist())

        if __name__ == "__main__":
            print("RESULT", [b.v for b in launch(gather_ranks, 2, 5)])
    """))
    done = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "RESULT [[5.0, 6.0], [5.0, 6.0]]" in done.stdout


def test_raising_rank_kills_the_others(capsys):
    def body():
        import subprocess
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            child = subprocess.Popen(["sleep", "120"])  # must die with its rank
            print(f"child pid {child.pid}")
            time.sleep(0.5)
            raise ValueError("boom on rank 1")
        dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins
        return "unreachable"

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(body, 2, timeout=60)
    assert time.monotonic() - t0 < 30  # hang guard
    err = info.value
    assert err.rank == 1 and isinstance(err, RuntimeError)
    assert "rank 1" in str(err) and "Traceback" in str(err)
    assert 'raise ValueError("boom on rank 1")' in str(err) and "ValueError: boom on rank 1" in str(err)
    child = int(re.search(r"\[rank 1\] child pid (\d+)", capsys.readouterr().out).group(1))
    assert not _alive(child)
    _assert_all_gone(err.pids, err.port)


def test_rank_killed_by_signal():
    def body():
        import os
        import signal

        import torch.distributed as dist

        if dist.get_rank() == 0:
            print("about to die")
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError) as info:
        launch(body, 2, timeout=60)
    err = info.value
    assert err.rank == 0 and err.exitcode == -9
    assert "SIGKILL" in str(err) and "about to die" in str(err)
    _assert_all_gone(err.pids, err.port)


def test_timeout_names_the_hanging_rank():
    def body():
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(600)
        return "done"

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        launch(body, 2, timeout=3)
    assert time.monotonic() - t0 < 30  # hang guard
    err = info.value
    assert "ranks [1] still running after" in str(err) and "ranks [0] finished" in str(err)
    assert err.ranks == [1]
    _assert_all_gone(err.pids, err.port)


def test_timeout_names_each_rank_heartbeat_and_tells_progress_from_a_stall():
    def body():
        import time

        import torch.distributed as dist

        from dlo.distributed import heartbeat

        if dist.get_rank() == 0:
            heartbeat("recv activation of micro-batch 3 from rank 1")
            time.sleep(600)  # stuck: no more output or heartbeat
        for i in range(10_000):  # busy: a heartbeat every 0.1 s
            heartbeat(f"step {i}")
            time.sleep(0.1)

    with pytest.raises(TimeoutError) as info:
        launch(body, 2, timeout=3)
    msg = str(info.value)
    assert "rank 0 (its last heartbeat: 'recv activation of micro-batch 3 from rank 1'" in msg
    assert "rank 1 (its last heartbeat: 'step " in msg
    assert "still making progress" in msg and "raise `timeout=`" in msg  # rank 1 is alive: no deadlock guess
    _assert_all_gone(info.value.pids, info.value.port)


def test_keyboard_interrupt_kills_all_ranks():
    def body():
        import time

        time.sleep(600)

    # A shell that starts a job in the background ignores SIGINT, and then interrupt_main() does
    # nothing: install Python's handler for the duration, as an interactive kernel has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(3.0, _thread.interrupt_main)  # what Jupyter's stop button does
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(body, 2, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert _worker_children() == []


def test_nccl_without_enough_gpus_fails_fast():
    n = torch.cuda.device_count() + 1
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        launch(print, n, backend="nccl")
    assert time.monotonic() - t0 < 5  # no spawn, no rendezvous


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive int"):
        launch(print, 0)
    with pytest.raises(TypeError, match="callable"):
        launch("print", 2)


def test_launcher_env_mismatch_and_missing_master(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="started 2 processes"):
        launch(print, 3)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task of an srun step (a batch script is none)
    with pytest.raises(RuntimeError, match="sbatch script must export"):
        launch(print, 2)


def test_torchrun_path(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        import dlo.distributed
        from dlo.distributed import launch

        def body(k):
            t = torch.tensor([float(dist.get_rank() + k)])
            dist.all_reduce(t)
            return dist.get_rank(), t.item(), os.getpid()

        out = launch(body, 2, 1)
        assert dlo.distributed.is_main() == (os.environ["RANK"] == "0")  # the group stays up
        with open(f"rank{os.environ['RANK']}.txt", "w") as f:  # a file each: stdout lines interleave
            f.write(f"RANK{os.environ['RANK']} PID {os.getpid()} GOT {out}")
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = "\n".join((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    got = re.findall(r"RANK(\d) PID (\d+) GOT (.*)", text)
    assert [g[0] for g in got] == ["0", "1"], text
    # fn ran in the two torchrun processes themselves (no spawning) and both got the same list
    expected = f"[(0, 3.0, {got[0][1]}), (1, 3.0, {got[1][1]})]"
    assert got[0][2] == got[1][2] == expected


def test_a_backend_other_than_the_jobs_group_is_refused_in_one_line(tmp_path):
    """Under torchrun, a second launch asking for another backend ran on the first one's group regardless
    (Day 10's frameworks cell asks for gloo: on a job's NCCL group its CPU tensors failed inside a collective)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch.distributed as dist
        from dlo.distributed import launch

        launch(dist.get_rank, 2, backend="gloo")
        try:
            launch(dist.get_rank, 2, backend="nccl")
            said = "ran"
        except ValueError as e:
            said = str(e)
        with open(f"rank{os.environ['RANK']}.txt", "w") as f:
            f.write(said)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for r in (0, 1):
        said = (tmp_path / f"rank{r}.txt").read_text()
        assert said.startswith("launch(..., backend='nccl'): this job's process group is already 'gloo'"), said


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_results_come_back_on_cpu():
    def body():
        import torch.distributed as dist

        t = torch.full((3,), float(dist.get_rank() + 1), device="cuda")
        dist.all_reduce(t)
        return t, torch.cuda.current_device()

    out = launch(body, 2)  # backend None: nccl with a GPU per rank
    for r, (t, dev) in enumerate(out):
        assert t.device.type == "cpu" and t.tolist() == [3.0, 3.0, 3.0] and dev == r


class _FakeRank:
    """Stands in for a worker Popen in `_watch`: only poll() is used."""

    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_ranks_that_returned_then_aborted_in_teardown_are_a_success(tmp_path):
    from dlo.distributed._spawn import _watch
    from dlo.distributed.current import dumps

    for r in range(2):
        (tmp_path / f"ready-{r}").touch()
        (tmp_path / f"result-{r}.pkl").write_bytes(dumps(("ok", 10 * r)))
    # rank 1 wrote its result, then gloo's threads aborted the interpreter at exit (SIGABRT)
    assert _watch([_FakeRank(0), _FakeRank(-6)], str(tmp_path), timeout=5) == ("ok", [0, 10])


def test_rank_dead_before_its_result_is_blamed(tmp_path):
    from dlo.distributed._spawn import _watch
    from dlo.distributed.current import dumps

    (tmp_path / "result-0.pkl").write_bytes(dumps(("ok", 0)))
    outcome = _watch([_FakeRank(None), _FakeRank(-6)], str(tmp_path), timeout=5)
    assert outcome[:4] == ("failed", 0, 1, -6)


class _DiesLater(_FakeRank):
    """A rank the parent first sees alive, then killed by a signal."""

    def __init__(self, code, alive_polls):
        super().__init__(code)
        self.alive_polls = alive_polls

    def poll(self):
        self.alive_polls -= 1
        return None if self.alive_polls >= 0 else self.code


def test_a_killed_rank_is_blamed_even_when_its_peers_error_lands_first(tmp_path):
    """The race CI hit: rank 0 is SIGKILLed, rank 1 loses its peer and writes an exception file
    before the parent's next poll of rank 0. The parent must wait to see the cause."""
    import time

    from dlo.distributed._spawn import _watch
    from dlo.distributed.current import dumps

    (tmp_path / "result-1.pkl").write_bytes(dumps(("error", "Connection closed by peer", time.time())))
    outcome = _watch([_DiesLater(-9, alive_polls=1), _FakeRank(1)], str(tmp_path), timeout=5)
    assert outcome[:4] == ("failed", 0, 0, -9)


def _whoami():
    import random

    return os.getpid(), os.getppid(), os.getsid(0), random.random(), torch.get_num_threads(), os.environ["RANK"]


def test_ranks_forked_by_the_zygote_are_like_fresh_interpreters(monkeypatch):
    """One interpreter imports torch for all the ranks and forks them (issue 25); each rank still leads its
    own session (killpg reaches what it starts), has its own random seed and its share of the threads.
    DLO_RANK_START=exec starts each rank as its own interpreter, the launcher's child."""
    monkeypatch.delenv("DLO_RANK_START", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # this process's share: split over the 2 ranks
    threads = max(1, min(len(os.sched_getaffinity(0)), 4) // 2)
    forked = launch(_whoami, 2)
    assert [r[5] for r in forked] == ["0", "1"] and forked[0][1] == forked[1][1] != os.getpid()
    assert all(pid == sid for pid, _, sid, *_ in forked) and forked[0][3] != forked[1][3]
    assert [r[4] for r in forked] == [threads, threads]
    monkeypatch.setenv("DLO_RANK_START", "exec")
    fresh = launch(_whoami, 2)
    assert [r[5] for r in fresh] == ["0", "1"] and {r[1] for r in fresh} == {os.getpid()}


def test_each_rank_gets_its_share_of_the_launchers_threads(monkeypatch):
    """The launcher's OMP_NUM_THREADS (a grading job's share) is split over its ranks, never given to
    each: 2 ranks with 2 threads each on 2 cores spin OpenMP workers against each other (a Day 6 check
    took 3.5x the CPU). Without it, the usable cores are split."""
    from dlo.distributed._ranks import rank_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [rank_threads(n) for n in (1, 2, 3)] == [2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # more than the cores: the cores bound it
    assert [rank_threads(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    for junk in ("", "0", "two"):  # unset or unreadable: the cores
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert rank_threads(4) == 2


def _zygote_parent():
    """On a rank: the pid of its zygote's parent (the fork server, or the launcher for a fresh zygote), its folder."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1]), os.getcwd()


@pytest.fixture
def own_server(monkeypatch):
    """A fork server of this test's own (the process's is left alone), closed after it."""
    from dlo.distributed import _forkserver

    monkeypatch.delenv("DLO_RANK_START", raising=False)
    monkeypatch.setattr(_forkserver, "_SERVER", {})
    yield _forkserver
    proc = _forkserver._SERVER.get("proc")
    _forkserver._close()
    if proc is not None:
        proc.wait(timeout=30)


def test_launches_fork_from_one_server_in_the_launchers_folder(own_server, tmp_path, monkeypatch):
    """The first launch starts the fork server; every later one forks its zygote from it (torch imported
    once per process), in the folder the launcher is in at that launch."""
    first = launch(_zygote_parent, 2)
    server = own_server.pid()
    monkeypatch.chdir(tmp_path)
    second = launch(_zygote_parent, 2)
    assert server is not None and {p for p, _ in first + second} == {server}
    assert [c for _, c in second] == [str(tmp_path)] * 2 and own_server.pid() == server


def test_a_bad_request_or_a_killed_server_costs_only_the_warm_start(own_server):
    """A request that is not a launch forks nothing and the server serves on; a server killed (by code
    it outlived) is not used again: each launch starts its own zygote, as without a server."""
    launch(_whoami, 2)
    server = own_server.pid()
    own_server._SERVER["sock"].send(b"not json")
    assert [r[5] for r in launch(_whoami, 2)] == ["0", "1"] and own_server.pid() == server
    os.kill(server, signal.SIGKILL)
    own_server._SERVER["proc"].wait(timeout=30)
    parents = {p for p, _ in launch(_zygote_parent, 2)}
    assert own_server._SERVER.get("failed") and parents == {os.getpid()}


def _imported(name):
    return name in sys.modules


def test_the_graders_server_imports_the_rest_of_preload_at_its_first_launch(own_server, monkeypatch):
    """`start_fork_server(preload_all=True)` (the grader's runner) names the modules of PRELOAD this process
    has not imported with a +: the server imports them before its first launch's zygote (every later one
    inherits them; a day whose checks launch no rank never pays), not at its start."""
    from dlo.distributed import _ranks

    seen = []
    with monkeypatch.context() as m:
        m.setattr(_ranks, "PRELOAD", ("dlo.distributed.launch", "tabnanny"))
        m.setattr(_ranks._forkserver, "start", lambda command, preload, env: seen.append(preload))
        _ranks.start_fork_server()
        _ranks.start_fork_server(preload_all=True)
    assert seen == [["dlo.distributed.launch"], ["dlo.distributed.launch", "+tabnanny"]]
    # a module implied by one imported (torch._dynamo by dlo.checks): at once for a notebook's server, at the
    # first launch for the grader's (whose day may launch no rank: every submission would pay for it)
    seen.clear()
    with monkeypatch.context() as m:
        m.setattr(_ranks, "PRELOAD", ("dlo.distributed.launch", "tabnanny"))
        m.setattr(_ranks, "IMPLIED", {"tabnanny": "dlo.distributed.launch"})
        m.setattr(_ranks._forkserver, "start", lambda command, preload, env: seen.append(preload))
        _ranks.start_fork_server()
        _ranks.start_fork_server(preload_all=True)
    assert seen == [["dlo.distributed.launch", "tabnanny"], ["dlo.distributed.launch", "+tabnanny"]]
    # the real server, asked for a module no rank imports of itself
    own_server.start(_ranks.worker_command(), ["+tabnanny"], dict(os.environ))
    assert launch(_imported, 2, "tabnanny") == [True, True] and not _imported("tabnanny")


def test_a_notebook_that_imports_the_checks_hands_its_ranks_torch_dynamo(tmp_path):
    """A check's ranks run the grader's TorchDispatchMode, whose first dispatch imports torch._dynamo (torch
    wraps every mode's handler in _disable_dynamo): 1.5 CPU s in each rank of each check when the notebook's
    kernel had not imported it. Having imported dlo.checks, the launcher's ranks start with it imported."""
    script = tmp_path / "checks_kernel.py"
    script.write_text(textwrap.dedent("""
        import sys
        import dlo.checks
        from dlo.distributed import launch

        def has_dynamo():
            return "torch._dynamo" in sys.modules

        assert "torch._dynamo" not in sys.modules, "importing dlo.checks imported torch._dynamo"
        print(launch(has_dynamo, 2), "torch._dynamo" in sys.modules)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[True,", "True]", "False"]  # the ranks have it, the launcher still does not


def test_the_server_is_as_closed_as_its_launcher(tmp_path):
    """Launched from an undumpable process (the grader's runner), the server and the ranks forked from
    it are undumpable too: no process of their user may read or write their memory."""
    script = tmp_path / "closed.py"
    script.write_text(textwrap.dedent("""
        import ctypes, sys
        from dlo.distributed import launch

        def dumpable():
            return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)

        if sys.argv[1] == "closed":
            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
        print(launch(dumpable, 2))
    """))
    env = {k: v for k, v in os.environ.items() if k != "DLO_RANK_START"}
    out = [subprocess.run([PY, str(script), how], capture_output=True, text=True, env=env, timeout=120)
           for how in ("open", "closed")]
    assert [o.stdout.strip().splitlines()[-1] for o in out] == ["[1, 1]", "[0, 0]"], [o.stderr[-500:] for o in out]


def test_a_process_that_has_only_imported_forks_its_server(tmp_path):
    """The grader's runner forks its server (no second interpreter, no second import of torch): the
    launches fork from that child, which keeps none of the runner's other descriptors (its channels
    to the grader); with a thread running it is not safe to fork, and a fresh server is started."""
    script = tmp_path / "forked.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading
        from dlo.distributed import launch
        from dlo.distributed.launch import start_fork_server

        def parent():
            with open(f"/proc/{os.getppid()}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])

        channel = os.pipe()  # stands for the runner's channel to the grader
        if sys.argv[1] == "thread":
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        server = start_fork_server(fork=True)
        with open(f"/proc/{server}/cmdline", "rb") as f:
            forked = f.read() == open("/proc/self/cmdline", "rb").read()
        held = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
        mine = {os.readlink(f"/proc/self/fd/{fd}") for fd in channel}
        print(forked, bool(held & mine), set(launch(parent, 2)) == {server})
    """))
    env = {k: v for k, v in os.environ.items() if k != "DLO_RANK_START"}
    out = [subprocess.run([PY, str(script), how], capture_output=True, text=True, env=env, timeout=120)
           for how in ("imports", "thread")]
    lines = [o.stdout.strip().splitlines()[-1] if o.stdout.strip() else o.stderr[-800:] for o in out]
    assert lines == ["True False True", "False False True"]


def test_the_ranks_cpu_time_reaches_the_launchers_parent(tmp_path):
    """A rank's CPU seconds reach the launching process's getrusage(RUSAGE_CHILDREN), and so `time` of
    the command above it (`time make run`): the server waits for its zygotes (they wait for their ranks)
    and the launcher, at its exit, for the server. Once, the server let the kernel reap its zygotes
    (SIGCHLD ignored) and nobody waited for the server: `time` missed half of what make run spent."""
    script = tmp_path / "burn.py"
    script.write_text(textwrap.dedent("""
        import resource, time
        from dlo.distributed import launch

        def burn(seconds):
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass

        launch(burn, 1, 2.0)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(usage.ru_utime + usage.ru_stime)
    """))
    env = {k: v for k, v in os.environ.items() if k != "DLO_RANK_START"}
    import resource

    def cpu():  # user and system: process_time() in a loop is mostly the latter
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before = cpu()
    out = subprocess.run([PY, str(script)], capture_output=True, text=True, env=env, timeout=120)
    after = cpu()
    assert out.returncode == 0, out.stderr[-800:]
    # the script's children: the server (its imports) and the rank's 2 s, which alone is over 1.8
    below = (after - before) - float(out.stdout.split()[-1])
    assert below >= 1.8, f"{below:.2f} CPU s of the launcher's children counted, the rank burned 2"
