"""One rank spawned by `dlo.distributed.launch`: `python -m dlo.distributed._worker WORKDIR`.

RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the environment. Files in WORKDIR:
payload.pkl (in), ready-<rank> (written once the process group is up), result-<rank>.pkl (out:
("ok", value) or ("error", traceback text, time of failure)).

`python -m dlo.distributed._worker --zygote WORKDIR FD ...` (`zygote`) starts all the ranks of a launch
at once: one fresh interpreter imports torch and dlo (1 to 2 CPU seconds, what every rank paid on its
own), and the heavy modules the launcher has imported (`_ranks.PRELOAD`), then forks the ranks, each
with its environment from WORKDIR/ranks.pkl and its stdout and stderr on the pipes the launcher passed
(FD: two per rank). Forking is safe here as it is not from a notebook:
this process has run no torch operation (no thread pool started) and never touched CUDA.
"""

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
    r = int(os.environ["RANK"])
    with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
        parent_path, backend, blob = pickle.load(f)
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    try:
        import cloudpickle
        import torch.distributed as dist

        from dlo.distributed.launch import dumps, init_from_env

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


def zygote(workdir, fds):
    """Import what every rank imports, fork the ranks, report "start R PID" and "exit R CODE" on stdout."""
    import cloudpickle  # noqa: F401 - imported once here rather than in each rank
    import torch
    import torch.distributed  # noqa: F401

    import dlo.distributed.launch  # noqa: F401

    with open(os.path.join(workdir, "ranks.pkl"), "rb") as f:
        envs, preload = pickle.load(f)
    for name in preload:  # what the launcher has imported and the ranks would import again
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a rank that needs it imports it itself, and reports what fails
            pass
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
        main(workdir)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # noqa: BLE001 - printed as a fresh interpreter would, then the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote(sys.argv[2], [int(fd) for fd in sys.argv[3:]])
    else:
        main(sys.argv[1])
