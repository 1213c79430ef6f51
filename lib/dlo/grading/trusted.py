"""The sandboxed backend of `dlo.grading.api`: the trusted side of `dlo grade`.

Checks run here, in a process where no student code ever ran, exactly as written (`@check`, plain
calls, `run_student`, `on_ranks`); the student's objects are `Remote` handles (`dlo.grading.remote`)
to objects living in a sandboxed runner (`python -I -m dlo.grading.jail_runner`, one per graded
notebook, under bubblewrap unless grading runs with --no-sandbox), its output in a log the trusted
side opened once (`open_log`). What comes back is data decoded by `dlo.grading.wire` (JSON and raw
tensor bytes, never a pickle), and the comparison with the reference happens here, out of the
student's reach.

    backend = SandboxBackend(prefix=bwrap_args, log=path)     # the runner starts on first use
    with use_backend(backend):
        backend.deadline = time.monotonic() + cell_timeout
        dlo.checks.day1.check_adamw_step(backend.captured("adamw_step", path_of_its_pickle))
    backend.close()                                             # kills the runner's process tree

One child per check (a fork of the warm runner: milliseconds), so a check that crashes, exits or
leaves threads behind affects only itself. A check that runs past the deadline kills the runner and
everything it started (ranks included); the next check starts a fresh runner. (About 325 lines: one
backend, its check sessions and the runner they share; the runner's process and the handles are
`dlo.grading.remote`.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from dlo.grading import files
from dlo.grading.api import stub_message
from dlo.grading.remote import CheckTimeout, Remote, Runner, RunnerDied, apply_after, materialise, rebuild_error
from dlo.grading.wire_request import Callback, Ref, dump_request
from dlo.measure.process import own_pid_in, snapshot

CLOSE_TIMEOUT = 10.0  # seconds a session gets to end after the check is done with it
START_TIMEOUT = 180.0  # seconds a runner gets to import torch and dlo


class StudentProcessDied(AssertionError):
    """The process running the student's code ended in the middle of a check."""


# ----------------------------------------------------------------------------- sessions

class Session:
    """One check's child in the runner; the `@check` wrapper enters and leaves it."""

    def __init__(self, backend: SandboxBackend, name: str, forbid: tuple[str, ...], hint: str = ""):
        self.backend, self.name, self.forbid, self.hint = backend, name, tuple(forbid), hint
        self.runner: Runner | None = None
        self.wire: list[int] | None = None  # what the ranks' sockets sent in the last on_ranks (`api.wire_sent`)
        self.rank_memory: list[dict] | None = None  # the ranks' memory in the last on_ranks (`api.rank_memory`)
        self.callbacks: dict[int, object] = {}
        self.open = False
        self.child = self.host_pid = None  # the session's child: its pid in the sandbox, and here (`memory`)

    # -- the @check protocol
    def __enter__(self):
        self.backend.enter(self)
        return self

    def __exit__(self, *exc):
        self.backend.leave(self)
        return False

    def bind(self, obj):
        return obj._bound(self) if isinstance(obj, Remote) else obj

    def run(self, worker, args, kwargs):
        return self.request({"op": "run", "worker": worker, "args": args, "kwargs": kwargs})

    def on_ranks(self, worker, world_size, args, kwargs, timeout, backend, per_rank=None):
        stub = self.request({"op": "stub", "args": args, "kwargs": kwargs})
        if stub is not None:  # an untouched exercise: its verdict without starting ranks
            raise AssertionError(stub_message(self.name, str(stub)))
        reply = self.request({"op": "ranks", "worker": worker, "world_size": world_size, "args": args,
                              "kwargs": kwargs, "timeout": timeout, "backend": backend, "per_rank": per_rank})
        if type(reply) is not dict or type(reply.get("results")) is not list or len(reply["results"]) != world_size:
            raise RuntimeError("a malformed reply to a ranks request came from the sandbox")
        wire = reply.get("wire")  # measured by the session's child, which ran no student code
        self.wire = wire if type(wire) is list and len(wire) == world_size and all(
            type(b) is int for b in wire) else None
        if self.wire is None and backend == "gloo":  # every gloo launch there is metered: a check would skip its
            # byte and memory counts (`api.wire_sent() is None` reads as the tests' unmetered ranks), never pass so
            raise RuntimeError(f"grader: {self.name}'s ranks in the sandbox came back without their sockets' count")
        memory = reply.get("memory")  # the ranks' memory, read there too (`api.rank_memory`)
        self.rank_memory = memory if type(memory) is list and len(memory) == world_size and all(
            type(m) is dict and all(type(v) is int for v in m.values()) for m in memory) else None
        return reply["results"]

    def call(self, target: Remote, args, kwargs):
        args, kwargs = materialise(tuple(args)), materialise(dict(kwargs))
        reply = self.request({"op": "call", "target": target, "args": args, "kwargs": kwargs}, full=True)
        after = reply.get("after")
        if type(after) is list and len(after) == 2:
            apply_after(args, after[0])
            apply_after(kwargs, after[1])
        return reply.get("value")

    def getattr(self, target: Remote, name: str):
        return self.request({"op": "getattr", "target": target, "name": name})

    def memory(self, reset: bool = False):
        """The kernel's counters of the session's child, read here from /proc (`dlo.measure.process`); a
        RuntimeError (the grader's own: never a silent pass) where they cannot be read."""
        if self.open and self.child is not None and self.host_pid is None:
            self.host_pid = own_pid_in(self.child, self.runner.proc.pid)
        found = snapshot(self.host_pid, reset) if self.open and self.host_pid is not None else None
        if found is None:
            raise RuntimeError(f"grader: {self.name} could not read the sandbox's process in /proc (pid {self.child} "
                               f"there, {self.host_pid} here)")
        return found

    # -- the channel
    def start(self) -> None:
        self.runner = self.backend.runner()
        self.runner.send(dump_request({"op": "open", "forbid": self.forbid, "exercise": self.name,
                                             "hint": self.hint}))
        try:
            msg = self.receive()
            if msg.get("kind") == "error":
                self.wait_ended()
        except CheckTimeout:  # the session's child may still run: the next check's "open" would reach it
            self.backend.drop_runner()
            raise
        if msg.get("kind") == "error":
            raise rebuild_error(msg)
        if msg.get("kind") != "opened":
            raise RuntimeError(f"unexpected reply {msg.get('kind')!r} from the sandbox")
        # sent before any student code ran in the child, so its own
        self.child, self.host_pid = msg.get("pid") if type(msg.get("pid")) is int else None, None
        self.open = True

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        runner = self.runner
        try:
            runner.send(dump_request({"op": "close"}))
            self.wait_ended(min(CLOSE_TIMEOUT, self.backend.left()))
        except (CheckTimeout, RunnerDied):
            self.backend.drop_runner()

    def wait_ended(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.runner.recv_decoded(deadline, self).get("kind") != "ended":
            pass

    def receive(self) -> dict:
        return self.runner.recv_decoded(self.backend.deadline, self)

    def encode_ref(self, obj):
        if not isinstance(obj, Remote):
            return None
        if obj._ref.kind == "obj" and (obj._session is not self or not self.open):
            raise RuntimeError(f"{obj!r} belonged to a check that has ended; it cannot be used here")
        return obj._ref

    def callback(self, fn) -> Callback:
        cid = len(self.callbacks) + 1
        self.callbacks[cid] = fn
        return Callback(cid, getattr(fn, "__qualname__", "callback"))

    def request(self, req: dict, full: bool = False):
        if not self.open:
            raise RuntimeError(f"{self.name}: the check's sandbox session is closed")
        self.runner.send(dump_request(req, self.encode_ref, self.callback))
        while True:
            try:
                msg = self.receive()
            except CheckTimeout:
                self.open = False
                self.backend.drop_runner()
                raise
            kind = msg.get("kind")
            if kind == "result":
                return msg if full else msg.get("value")
            if kind == "error":
                raise rebuild_error(msg)
            if kind == "callback":
                self.answer_callback(msg)
            elif kind == "ended":
                self.open = False
                raise StudentProcessDied(_died_message(self.name, msg.get("code")))
            else:
                raise RuntimeError(f"unexpected reply {kind!r} from the sandbox")

    def answer_callback(self, msg: dict) -> None:
        fn = self.callbacks.get(msg.get("id"))
        args, kwargs = msg.get("args"), msg.get("kwargs")
        try:
            if fn is None or type(args) is not list or type(kwargs) is not dict:
                raise RuntimeError("malformed callback request")
            reply = {"op": "cb_result", "value": fn(*args, **kwargs)}
        except Exception as exc:  # noqa: BLE001 - the callback's failure is reported to the caller in the sandbox
            reply = {"op": "cb_error", "message": f"{type(exc).__name__}: {exc}"}
        self.runner.send(dump_request(reply, self.encode_ref, self.callback))


def _died_message(name: str, code) -> str:
    how = f"exit code {code}"
    if isinstance(code, int) and code < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-code).name}"
    return (f"{name}: the process running your code ended in the middle of the check ({how}): os._exit or "
            f"sys.exit in your code, a crash in native code, or out of memory?")


# ----------------------------------------------------------------------------- the backend

class SandboxBackend:
    """The session factory given to `use_backend`, and the runner's owner.

    `prefix`: the sandbox command (bwrap and its flags; [] runs the runner unconfined); `log`: where the
    runner's output goes (opened once here: keep it out of every folder the sandbox can write); `cwd`: the
    unconfined runner's working directory (bwrap's own --chdir otherwise). `deadline`
    (time.monotonic() seconds, or None) bounds every wait for the sandbox; the executor sets it per
    cell. `close()` kills the runner and every process it started."""

    def __init__(self, prefix: list[str] | None = None, log: Path | None = None, env: dict | None = None,
                 cwd: Path | None = None, captures: Path | None = None):
        self.prefix, self.env = list(prefix or []), env
        self.captures, self._copies = (Path(captures) if captures else None), 0
        self.log = Path(log) if log else Path(os.devnull)
        self.cwd = Path(cwd) if cwd else self.log.parent
        self._log_fd: int | None = None
        self.deadline: float | None = None
        self.current: Session | None = None
        self._adhoc: Session | None = None
        self._runner: Runner | None = None

    def __call__(self, name: str, forbid: tuple[str, ...], hint: str = "") -> Session:
        return Session(self, name, forbid, hint)

    def captured(self, label: str, path: str | Path) -> Remote:
        """The handle of a student object that the kernel pickled into `path` (read in the sandbox only): with
        `captures` (the jail's `captured_dir`), a copy there, since the runner sees no folder the kernel writes."""
        if self.captures is not None:
            path = self._copy_in(Path(path))
        return Remote(self, Ref("cap", str(path)), label)

    def _copy_in(self, path: Path) -> Path:
        """The kernel's regular file copied where the runner reads it (a link, a socket or a FIFO is no capture:
        `files.open_file` refuses them)."""
        with files.opened_dir(path.parent) as folder, os.fdopen(files.open_file(path.name, folder), "rb") as src:
            self._copies += 1
            dest = self.captures / f"{self._copies}-{path.name}"
            with open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
        os.chmod(dest, 0o644)
        return dest

    def left(self) -> float:
        return CLOSE_TIMEOUT if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def runner(self) -> Runner:
        if self._runner is not None and not self._runner.alive():
            self.drop_runner()
        if self._runner is None:
            self._runner = Runner(self.prefix, self.log_fd(), self.cwd, self.env)
        if not self._runner.ready:  # a cold start (torch import on a busy node) is not the student's time
            deadline = None if self.deadline is None else max(self.deadline, time.monotonic() + START_TIMEOUT)
            msg = self._runner.recv_decoded(deadline, None)
            if msg.get("kind") != "ready":
                raise RunnerDied(f"the sandboxed runner did not start ({msg.get('kind')!r})")
            self._runner.ready = True
        return self._runner

    def drop_runner(self, graceful: bool = False) -> None:
        if self._runner is not None:
            if graceful:
                self._runner.close()
            else:
                self._runner.kill()
            self._runner = None
        for s in (self.current, self._adhoc):
            if s is not None:
                s.open = False

    def enter(self, session: Session) -> None:
        if self.current is not None:
            raise RuntimeError(f"{session.name}: checks do not nest under the sandboxed backend (called inside "
                               f"{self.current.name}); call them one after the other")
        self.end_cell()  # an open ad-hoc session gives way: the runner serves one session at a time
        session.start()
        self.current = session

    def leave(self, session: Session) -> None:
        self.current = None
        session.close()

    def adhoc(self) -> Session:
        """The session of student objects used outside any check (a test cell's plain `assert`)."""
        if self._adhoc is None or not self._adhoc.open:
            self._adhoc = Session(self, "test cell", ())
            self._adhoc.start()
        return self._adhoc

    def end_cell(self) -> None:
        if self._adhoc is not None:
            self._adhoc.close()
            self._adhoc = None

    def close(self) -> None:
        self.end_cell()
        self.drop_runner(graceful=True)  # the submission's end: no check is running
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def log_fd(self) -> int:
        """The log, opened once (appending, readable for the tail a dead runner leaves), never through a
        link nor as a special file; every runner of this backend writes to this descriptor."""
        if self._log_fd is None:
            if self.log == Path(os.devnull):
                self._log_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            else:
                from dlo.grading.files import open_log

                self.log.parent.mkdir(parents=True, exist_ok=True)
                self._log_fd = open_log(self.log)
        return self._log_fd

    def warm(self) -> None:
        """Start the runner now (it imports torch: seconds) so the first check does not wait for it."""
        if self._runner is None:
            self._runner = Runner(self.prefix, self.log_fd(), self.cwd, self.env)



class LocalSandbox(SandboxBackend):
    """A sandboxed backend for tests and for an instructor trying a check the way `dlo grade` runs it:
    `capture(obj)` pickles an object by value (as the grader pickles a notebook's), `run(check, *objs)`
    calls the check with the captured objects under this backend. The runner is unconfined unless a
    bwrap `prefix` is given. Use as a context manager (the runner is killed on exit)."""

    def __init__(self, folder: Path, prefix: list[str] | None = None, log: Path | None = None,
                 captures: Path | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        super().__init__(prefix=prefix, log=log or self.folder / "runner.log", cwd=self.folder, captures=captures)
        self._n = 0

    def capture(self, obj) -> Remote:
        import cloudpickle

        from dlo import pickling

        module = sys.modules.get(getattr(obj, "__module__", ""), None)
        by_value = module is not None and module.__name__ not in ("__main__", "builtins") \
            and not module.__name__.startswith(("dlo.", "torch", "numpy")) \
            and module.__name__ not in cloudpickle.list_registry_pickle_by_value()
        if by_value:
            cloudpickle.register_pickle_by_value(module)
        try:
            data = pickling.dumps(obj)  # as the kernel captures: file names and lines kept
        finally:
            if by_value:
                cloudpickle.unregister_pickle_by_value(module)
        self._n += 1
        path = self.folder / f"object{self._n}.pkl"
        path.write_bytes(data)
        return self.captured(getattr(obj, "__name__", type(obj).__name__), path)

    def run(self, check, *objs, **kwargs):
        from dlo.grading.api import use_backend

        with use_backend(self):
            return check(*(self.capture(o) for o in objs), **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
