"""The trusted side's view of the jail: the runner process and the student's objects living in it.

`Runner` is one sandboxed runner (`python -I -m dlo.grading.jail_runner`, under bubblewrap unless
grading runs with --no-sandbox): its pipes, a deadline on every wait (`CheckTimeout`), and its kill
(`dlo.reaper.kill_tree`: the runner, its group and every process carrying its tag, ranks included).
What comes back is decoded by `dlo.grading.wire` (never a pickle); a student object that is not plain
data comes back as a `Remote` handle, whose calls and attributes are requests of the check's session
(`dlo.grading.trusted.Session`). After a call, `apply_after` copies the state the call left in the
sandbox (tensor values, grads, module parameters) into the trusted side's own objects, and
`rebuild_error` turns a student's exception, sent as strings, into one of the trusted side.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import select
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import torch

from dlo.grading import wire
from dlo.grading.forbid import ForbiddenCall
from dlo.grading.wire_request import OneShot, Ref
from dlo.reaper import kill_tree

TAG_ENV = "DLO_SANDBOX_TAG"  # marks every process of a runner, so that all of them can be found and killed


class CheckTimeout(TimeoutError):
    """The cell's checks ran out of time; the runner and all it started were killed."""


class RunnerDied(RuntimeError):
    """The sandboxed runner itself went away (not just one check's child)."""

    student_side = True  # the student's code took it down (memory, a signal): not a bug of the check


# ----------------------------------------------------------------------------- processes

class Runner:
    """One sandboxed runner process and its pipes."""

    def __init__(self, prefix: list[str], log_fd: int, cwd: Path, env: dict | None = None):
        """`log_fd`: the grader's own descriptor of the log (opened once, never by path again): the
        runner's stdout and stderr, whatever the student does to the file's name."""
        self.tag = uuid.uuid4().hex
        self.log_fd = log_fd
        cmd = [*prefix, sys.executable, "-I", "-m", "dlo.grading.jail_runner"]
        full_env = {**os.environ, **(env or {}), TAG_ENV: self.tag, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd,
                                     env=full_env, start_new_session=True, cwd=cwd)
        self.ready = False

    def send(self, payload: bytes) -> None:
        try:
            wire.write_frame(self.proc.stdin.fileno(), payload)
        except OSError:
            raise RunnerDied(self._died()) from None

    def recv(self, deadline: float | None) -> dict:
        fd = self.proc.stdout.fileno()
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CheckTimeout()
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        try:
            return wire.read_frame(fd)
        except wire.ChannelClosed:
            raise RunnerDied(self._died()) from None

    def recv_decoded(self, deadline: float | None, session) -> dict:
        """The next message, decoded safely; handles in it belong to `session` (a `trusted.Session`, or None)."""
        data = self.recv(deadline)
        make = None if session is None else (lambda i, ty: Remote(session.backend, Ref("obj", i), ty, session))
        try:
            msg = wire.decode(data, make_handle=make)
        except Exception as exc:  # noqa: BLE001 - json, a tensor's size or a tag check refused it
            raise RuntimeError(f"a malformed message came from the sandbox ({type(exc).__name__}: {exc})") from None
        if type(msg) is not dict:
            raise RuntimeError("a malformed message came from the sandbox")
        return msg

    def _died(self) -> str:
        tail = ""
        with contextlib.suppress(OSError):
            size = os.fstat(self.log_fd).st_size
            tail = os.pread(self.log_fd, 1500, max(0, size - 1500)).decode(errors="replace")
        return f"the grader's sandboxed runner stopped (exit code {self.proc.poll()}); its log ends with:\n{tail}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, grace: float = 2.0) -> None:
        """The end of a submission's checks: the channel closed, `grace` seconds for the runner to end by
        itself (it waits for its ranks' fork server, so their CPU time is counted where `time dlo grade`
        looks, not lost with the sandbox's PID namespace), then `kill` for whatever is left."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the runner reads the end: its loop returns, its exit handlers run
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        self.kill()

    def kill(self) -> None:
        kill_tree(self.proc.pid, mark=f"{TAG_ENV}={self.tag}")
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


# ----------------------------------------------------------------------------- handles

class Remote:
    """A student object that lives in the sandbox. Calls and attribute reads are requests; what
    comes back is plain data or another Remote (valid while its check runs)."""

    def __init__(self, backend, ref: Ref, label: str, session=None):
        self._backend, self._ref, self._label, self._session = backend, ref, label, session

    def _bound(self, session) -> Remote:
        return self if self._ref.kind == "obj" else Remote(self._backend, self._ref, self._label, session)

    def _sess(self):
        if self._session is not None:
            return self._session
        return self._backend.current or self._backend.adhoc()

    def __call__(self, *args, **kwargs):
        return self._sess().call(self, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._sess().getattr(self, name)

    def __repr__(self) -> str:
        return f"<{self._label} (in the sandbox)>"


def materialise(obj, depth: int = 0):
    """Generators become OneShot lists (a generator cannot travel; the student still sees one pass)."""
    if isinstance(obj, types.GeneratorType):
        return OneShot(list(obj))
    if depth < 8 and type(obj) in (list, tuple):
        return type(obj)(materialise(x, depth + 1) for x in obj)
    if depth < 8 and type(obj) is dict:
        return {k: materialise(v, depth + 1) for k, v in obj.items()}
    return obj


def apply_after(orig, st, depth: int = 0) -> None:
    """Copy the state a call left in the sandbox (tensor values, grads, module parameters and
    buffers) into the trusted side's own objects, in place. `st` is untrusted: shapes are checked."""
    if depth > 32 or type(st) is not list or not st or type(st[0]) is not str:
        return
    kind, d = st[0], depth + 1
    if kind == "tensor" and len(st) == 3 and isinstance(orig, torch.Tensor):
        _copy_tensor(orig, st[1], st[2])
    elif kind == "module" and len(st) == 4 and isinstance(orig, torch.nn.Module) and type(st[1]) is list:
        params = dict(orig.named_parameters(remove_duplicate=False))
        buffers = dict(orig.named_buffers())
        for pair in st[1]:
            if type(pair) is list and len(pair) == 2 and pair[0] in params:
                apply_after(params[pair[0]], pair[1], d)
        for pair in st[2] if type(st[2]) is list else ():
            if type(pair) is list and len(pair) == 2 and pair[0] in buffers and buffers[pair[0]] is not None:
                _copy_tensor(buffers[pair[0]], pair[1], None, grads=False)
        if type(st[3]) is bool:
            orig.train(st[3])
    elif kind == "seq" and len(st) == 2 and type(st[1]) is list:
        items = orig.items if isinstance(orig, OneShot) else orig
        if isinstance(items, (list, tuple)):
            for o, s in zip(items, st[1]):
                apply_after(o, s, d)
    elif kind == "map" and len(st) == 2 and type(st[1]) is list and isinstance(orig, dict):
        for pair in st[1]:
            if type(pair) is list and len(pair) == 2 and pair[0] in orig:
                apply_after(orig[pair[0]], pair[1], d)


def _copy_tensor(orig: torch.Tensor, new, grad, grads: bool = True) -> None:
    if not isinstance(new, torch.Tensor):
        return
    with torch.no_grad():
        if new.shape == orig.shape and new.dtype == orig.dtype:
            orig.copy_(new)
        else:
            orig.data = new.to(orig.device)  # the student resized or re-typed it: mirror that
    if not grads:
        return
    if isinstance(grad, torch.Tensor):
        orig.grad = grad.to(orig.device, orig.dtype) if grad.shape == orig.shape else None
    elif orig.grad is not None:
        orig.grad = None


_REBUILT = {name: obj for name, obj in vars(builtins).items()
            if isinstance(obj, type) and issubclass(obj, Exception)
            and name not in ("StopIteration", "StopAsyncIteration", "GeneratorExit")}


def rebuild_error(msg: dict) -> Exception:
    """A student's exception as an exception of the trusted side: the builtin of that name (or
    ForbiddenCall), else RuntimeError. Built from strings only; never unpickled."""
    name, text, tb = (msg.get(k) for k in ("type", "message", "traceback"))
    if not all(isinstance(x, str) for x in (name, text, tb)):
        return RuntimeError("malformed error message from the sandbox")
    if name == "ForbiddenCall":
        exc: Exception = ForbiddenCall(text)
    else:
        try:
            exc = _REBUILT[name](text) if name in _REBUILT else RuntimeError(f"{name}: {text}")
        except TypeError:  # an exception class whose constructor wants other arguments
            exc = RuntimeError(f"{name}: {text}")
    exc.remote_traceback = tb
    return exc

