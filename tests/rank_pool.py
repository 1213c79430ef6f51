"""One launch of ranks serving many checks: the tests' way to call a check's `on_ranks` cheaply.

A check calls `on_ranks(worker, n, ...)`; in a notebook that is one `dlo.distributed.launch` of n
fresh interpreters (seconds of start-up on a small CPU). The tests of the parallel days call dozens
of checks, so there `RankPool` keeps n ranks alive and hands them one job after another: the same
trusted worker, the same forbidden names blocked and modules sealed around it
(`dlo.grading.ranks.run_on_rank`), the same plain-data results (`safe_data`) and the same
comparisons in the check. What differs is transport only, and the real path stays tested: a job
that fails on a rank ends the pool (a peer may be stuck in a collective), its ranks are killed by
pid and the next job starts a fresh launch; the accept tests of every check still meet the real
launch through `dlo grade`'s test and the deadlock tests.

    with RankPool() as pool, pool.serving():   # DirectSession.on_ranks goes through the pool
        day7.check_tp_linears(...)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback

import cloudpickle
import pytest
import torch

from dlo.distributed.current import dumps
from dlo.distributed.launch import launch
from dlo.grading.api import DirectSession, deadlock_message, safe_data
from dlo.grading.frames import fold_traceback_text
from dlo.grading.ranks import rank_payload, run_on_rank, worker_ref, write_shards


@pytest.fixture(scope="module")
def one_thread():
    """The test process computes its references on one thread: a second OpenMP thread gains little on
    these small models, and on a busy 2-core box (ranks, other jobs) spinning OpenMP threads can make a
    0.4 s CoAtNet step take 20 s. Use as `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def serve(jobdir: str) -> None:
    """On each rank: run job-<k>.pkl files in order until a stop file; a failure ends the rank."""
    import torch.distributed as dist

    r = dist.get_rank()
    with open(os.path.join(jobdir, f"pid-{r}"), "w") as f:
        f.write(str(os.getpid()))
    k = 0
    while True:
        path = os.path.join(jobdir, f"job-{k}.pkl")
        while not os.path.exists(path):
            if os.path.exists(os.path.join(jobdir, "stop")):
                return None
            time.sleep(0.01)
        with open(path, "rb") as f:
            worker, forbid, name, hint, payload, shards = cloudpickle.load(f)
        try:
            record = ("ok", dumps(run_on_rank(worker, forbid, name, hint, payload, shards)))
        except BaseException:  # noqa: BLE001 - reported to the check, then this rank ends
            record = ("error", traceback.format_exc())
        tmp = os.path.join(jobdir, f"result-{k}-{r}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(record, f)
        os.replace(tmp, os.path.join(jobdir, f"result-{k}-{r}.pkl"))
        if record[0] == "error":
            os._exit(1)  # the launch sees a rank gone: its peers are killed with it
        k += 1


class RankPool:
    """Ranks kept alive across checks, one world size at a time (2 cores: never two pools)."""

    def __init__(self):
        self.world_size, self.jobdir, self.thread, self.k = None, None, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self, world_size: int) -> None:
        self.stop()
        self.world_size, self.k = world_size, 0
        self.jobdir = tempfile.mkdtemp(prefix="dlo-rank-pool-")
        self.thread = threading.Thread(target=self._run, args=(self.jobdir, world_size), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(jobdir: str, world_size: int) -> None:
        with contextlib.suppress(Exception):  # a failed job's ranks: reported by `run`
            launch(serve, world_size, jobdir, backend="gloo", timeout=3600)

    def stop(self, kill: bool = False) -> None:
        if self.thread is None:
            return
        if kill:
            for r in range(self.world_size):
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(self.jobdir, f"pid-{r}")) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
        open(os.path.join(self.jobdir, "stop"), "w").close()
        self.thread.join(timeout=30)
        shutil.rmtree(self.jobdir, ignore_errors=True)
        self.world_size, self.jobdir, self.thread = None, None, None

    def run(self, session: DirectSession, worker, world_size: int, args, kwargs, timeout: float, per_rank=None) -> list:
        """What DirectSession.on_ranks returns for this job, or its AssertionError."""
        if self.world_size != world_size or not self.thread.is_alive():
            self.start(world_size)
        k, self.k = self.k, self.k + 1
        shards = write_shards(per_rank, world_size)
        if shards is not None:  # inside the job folder: gone with the pool
            shards = shutil.move(shards, os.path.join(self.jobdir, f"shards-{k}"))
        job = cloudpickle.dumps((worker_ref(worker), session.forbid, session.name, session.hint,
                                 rank_payload(args, kwargs), shards))
        tmp = os.path.join(self.jobdir, f"job-{k}.tmp")
        with open(tmp, "wb") as f:
            f.write(job)
        os.replace(tmp, os.path.join(self.jobdir, f"job-{k}.pkl"))
        results, start = [None] * world_size, None
        while True:
            for r in range(world_size):
                path = os.path.join(self.jobdir, f"result-{k}-{r}.pkl")
                if results[r] is None and os.path.exists(path):
                    with open(path, "rb") as f:
                        results[r] = pickle.load(f)
                    if results[r][0] == "error":
                        self.stop(kill=True)
                        raise AssertionError(f"{session.name}: rank {r} raised "
                                             f"{fold_traceback_text(results[r][1], ('tests/rank_pool.py',))}")
            if all(x is not None for x in results):
                return [safe_data(pickle.loads(x[1]), f"{session.name}: rank {r}'s result")
                        for r, x in enumerate(results)]
            if start is None and all(os.path.exists(os.path.join(self.jobdir, f"pid-{r}")) for r in range(world_size)):
                start = time.monotonic()  # the clock starts once the ranks are up, as launch's
            if not self.thread.is_alive() or (start is not None and time.monotonic() - start > timeout):
                self.stop(kill=True)
                raise AssertionError(deadlock_message(session.name, TimeoutError(f"{timeout:g} s")))
            time.sleep(0.005)

    @contextlib.contextmanager
    def serving(self):
        """DirectSession.on_ranks through this pool inside the block."""
        pool, real = self, DirectSession.on_ranks

        def on_ranks(session, worker, world_size, args, kwargs, timeout, backend, per_rank=None):
            if backend != "gloo":
                return real(session, worker, world_size, args, kwargs, timeout, backend, per_rank)
            return pool.run(session, worker, world_size, args, kwargs, timeout, per_rank)
        DirectSession.on_ranks = on_ranks
        try:
            yield self
        finally:
            DirectSession.on_ranks = real
