"""One rank spawned by `dlo.distributed.launch`: `python -m dlo.distributed._worker WORKDIR`.

RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the environment (srun's own variables under `launch_slurm`:
`dlo.distributed.placement`). Files in WORKDIR:
payload.pkl (in), ready-<rank> (written once the process group is up), result-<rank>.pkl (out:
("ok", value) or ("error", traceback text, time of failure)).

`python -m dlo.distributed._worker --zygote WORKDIR FD ...` (`zygote`) starts all the ranks of a launch
at once: one fresh interpreter imports torch and dlo (1 to 2 CPU seconds, what every rank paid on its
own), and the heavy modules the launcher has imported (`_ranks.PRELOAD`), then forks the ranks, each
with its environment from WORKDIR/ranks.pkl and its stdout and stderr on the pipes the launcher passed
(FD: two per rank). Forking is safe here as it is not from a notebook:
this process has run no torch operation (no thread pool started) and never touched CUDA.

`python -m dlo.distributed._worker --server FD dumpable|undumpable MODULE ...` (`fork_server`) pays that import once per
launching process instead of once per launch: it imports as the zygote does, then waits on the Unix
socket FD for launches, and forks for each a zygote (`zygote`, its report on the pipe sent with the
request) which forks the ranks. It runs nothing but forks: what a request names is read by the forked
zygote, never by the server, so a request cannot change what the next launch's ranks start from. A
MODULE written +MODULE is imported by the server at its first launch rather than at its start, whatever
that launch asks (the grader's runner starts a server for every submission: DTensor and torch._dynamo,
a CPU second, are then paid only by a day whose checks launch ranks, and once, not by every zygote).
"""

import gc
import importlib
import os
import pickle
import random
import sys
import time
import traceback


def _write(workdir, r, record):
    tmp = os.path.join(workdir, f"result-{r}.tmp")
    with open(tmp, "wb") as f:
        f.write(record)
    os.replace(tmp, os.path.join(workdir, f"result-{r}.pkl"))  # atomic: the parent never sees half


def main(workdir):
    from dlo.distributed.placement import ranks

    r = ranks(os.environ).rank  # RANK where launch spawned it, SLURM_PROCID under launch_slurm's srun
    with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
        parent_path, backend, blob = pickle.load(f)
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    try:
        import cloudpickle
        import torch.distributed as dist

        from dlo.distributed.current import dumps, init_from_env

        fn, args, kwargs = cloudpickle.loads(blob)
        device = init_from_env(backend)
        open(os.path.join(workdir, f"ready-{r}"), "w").close()
        record = dumps(("ok", fn(*args, **kwargs)))
    except Exception:
        _write(workdir, r, pickle.dumps(("error", traceback.format_exc(), time.time())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no cleanup: a process group with dead peers may block in destroy
    _write(workdir, r, record)
    # Stay until every rank is done: rank 0 hosts the TCP store the others still talk to.
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])  # NCCL: name the GPU, or it guesses and warns
    else:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip C++ static destructors: live gloo threads there can abort a finished rank


def warm(preload):
    """Import what every rank imports (and `preload`: what the launcher has imported and the ranks would
    import again); the torch module."""
    import cloudpickle  # noqa: F401 - imported once here rather than in each rank
    import torch
    import torch.distributed  # noqa: F401

    import dlo.distributed.current  # noqa: F401

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a rank that needs it imports it itself, and reports what fails
            pass
    return torch


def zygote(workdir, fds):
    """Import what every rank imports, fork the ranks, report "start R PID" and "exit R CODE" on stdout."""
    with open(os.path.join(workdir, "ranks.pkl"), "rb") as f:
        envs, preload = pickle.load(f)
    torch = warm(preload)
    ranks = {}
    for r, env in enumerate(envs):
        pid = os.fork()
        if pid == 0:
            _rank(workdir, env, fds[2 * r:2 * r + 2], fds, torch)
        ranks[pid] = r
        os.write(1, f"start {r} {pid}\n".encode())
    for fd in fds:
        os.close(fd)
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            os.write(1, f"exit {ranks.pop(pid)} {os.waitstatus_to_exitcode(status)}\n".encode())


def _rank(workdir, env, own, fds, torch):
    """In a forked rank: a session of its own, its pipes as stdout and stderr, its environment; then `main`."""
    code = 1
    try:
        os.setsid()  # as start_new_session: the launcher kills the rank's group
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, std in ((null, 0), (own[0], 1), (own[1], 2)):
            os.dup2(fd, std)
        for fd in (null, *fds):  # the other ranks' pipes: their readers see the end when those ranks end
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))  # read at import
        random.seed()  # a fresh interpreter's seed, not the zygote's (shared by every rank)
        # what the rank inherited (torch, the preloaded modules: ~300k objects) stays out of its collections
        # and gc.get_objects (dlo.measure.held.live_bytes), and its pages are not copied by the collector
        gc.freeze()
        main(workdir)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # noqa: BLE001 - printed as a fresh interpreter would, then the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_server(sock_fd, undumpable, preload):
    """Warm once, then for each request on `sock_fd` (JSON {"workdir", "cwd"} with the report pipe and the
    ranks' pipes as passed descriptors) fork a zygote in the launcher's folder; end when the launcher
    closes its end. `undumpable` (the launcher is: the grader's runner) first: then no process of the
    same user may write the memory that every later launch's ranks are forked from."""
    import socket

    from dlo import reaper

    if undumpable:
        reaper.undumpable("the fork server would be open to the ranks")
    warm([m for m in preload if not m.startswith("+")])
    os.write(1, b"ready\n")
    serve_forks(socket.socket(fileno=sock_fd), preload)


def serve_forks(sock, preload):
    """The server's loop (`fork_server`, or a fork of a process that has only imported: the grader's
    runner): a zygote forked for each launch requested on `sock`, until its other end is closed. The
    modules of `preload` written "+MODULE" are imported at the first launch (a fixed list: no request
    names any), so that a process that never launches does not pay for them."""
    import json
    import signal
    import socket

    later = [m[1:] for m in preload if m.startswith("+")]
    # the zygotes are waited for here as they end (their ranks by them), not left to the kernel's
    # auto-reaping (SIG_IGN): a process's CPU time reaches its parent's getrusage(RUSAGE_CHILDREN), and
    # so `time` of the command above, only through a wait
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap(block=False))
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 65536, 256)
        if not msg:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _reap(block=True)
            return
        try:
            req = json.loads(msg)
            workdir, cwd, report, rank_fds = str(req["workdir"]), str(req["cwd"]), fds[0], fds[1:]
        except (ValueError, KeyError, IndexError, TypeError):  # not a launch: nothing is forked
            for fd in fds:
                os.close(fd)
            continue
        if later:  # the same modules whatever the request: it names none of them
            warm(later)
            later = []
        if os.fork() == 0:
            _served_zygote(sock, workdir, cwd, report, rank_fds)
        for fd in fds:
            os.close(fd)


def _reap(block: bool, timeout: float = 5.0) -> None:
    """Wait for the server's exited zygotes; `block`: also for those still ending, up to `timeout` s (a
    zygote the launcher left running stays for the subreaper above)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if not block or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _served_zygote(sock, workdir, cwd, report, rank_fds):
    """In the server's fork: a session of its own (the launcher kills it by its group), the report pipe as
    stdout, the launcher's working folder; then the zygote, whose ranks are reaped here."""
    import signal

    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        os.setsid()
        os.dup2(report, 1)
        os.close(report)
        os.chdir(cwd)
        os.write(1, f"pid {os.getpid()}\n".encode())
        zygote(workdir, rank_fds)
        code = 0
    except BaseException:  # noqa: BLE001 - printed as a fresh zygote would
        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote(sys.argv[2], [int(fd) for fd in sys.argv[3:]])
    elif sys.argv[1] == "--server":
        fork_server(int(sys.argv[2]), sys.argv[3] == "undumpable", sys.argv[4:])
    else:
        main(sys.argv[1])
