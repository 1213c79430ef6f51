"""The session's child of the sandboxed runner (`dlo.grading.jail_runner`): the one process per `@check`
call where the student's code runs, in the jail.

It blocks the check's forbidden references (`dlo.grading.forbid.forbidden`), seals the grader's
modules, then loads the student's captured objects (cloudpickle: only here) when a request first
names them and answers the check's requests (`call`, `getattr`, `run`, `stub`, `ranks`: see
`jail_runner`) until the check closes the session. What goes back is plain data (`dlo.grading.wire`):
a result or a handle number, the state of the arguments after a call (`state`), or the student's
exception with the student's frames first (`error`).
"""

from __future__ import annotations

import os
import sys
import traceback

import cloudpickle

from dlo import reaper
from dlo.distributed.launch import disown_fork_server
from dlo.grading import api, forbid, frames, wire
from dlo.grading.seal import seal
from dlo.grading.wire_request import Callback, OneShot, Ref


class Session:
    """A check's session in the runner's forked child: its requests answered, the student's objects by handle."""

    def __init__(self, fd: int, req: dict):
        self.fd = fd
        self.name, self.forbid = req.get("exercise", "check"), tuple(req.get("forbid", ()))
        self.hint = req.get("hint", "")
        self.objects: dict[int, object] = {}
        self.captured: dict[str, object] = {}
        self.ran_student = False  # whether the student's code has run in this process (loaded or called)

    def send(self, msg: dict, handles: bool = True) -> None:
        try:
            data = wire.encode(msg, self.handle if handles else None)
        except BaseException as exc:  # noqa: BLE001 - a value that cannot be encoded fails this request
            data = wire.encode(error(exc if not isinstance(exc, wire.Unsafe) else TypeError(
                f"{self.name}: a {exc} cannot be returned to the grader; a check worker returns plain data only "
                f"(tensors, numbers, strings, lists, tuples, dicts)")))
        wire.write_frame(self.fd, data)

    def handle(self, obj) -> int:
        i = len(self.objects) + 1
        self.objects[i] = obj
        return i

    def serve(self) -> None:
        try:
            # for good: this process ends with the session, and nothing the student's code does may undo it
            self._blocked = forbid.forbidden(self.forbid, self.name, self.hint, for_good=True)
            self._blocked.__enter__()
            # the grader's modules sealed for good: the student's objects are loaded after this, and only
            # the grader's own requests see the real modules (`sealing.loads`)
            self.sealing = seal()
        except BaseException as exc:  # noqa: BLE001
            self.send(error(exc))
            return
        Callback.call_back = self.call_back
        reaper.subreaper(True)  # the stub probe's orphans stay below this process (`probe_stub`)
        self.send({"kind": "opened", "pid": os.getpid()})  # in its PID namespace: `trusted.Session.memory`
        while True:
            req = self.next_request()
            if req.get("op") == "close":
                sys.stdout.flush()
                os._exit(0)
            self.reply(req)

    def next_request(self) -> dict:
        """The next request; one that cannot be loaded here (a worker this runner cannot import) is
        answered with the error and skipped."""
        while True:
            frame = wire.read_frame(self.fd)
            try:
                return self.sealing.loads(frame)
            except BaseException as exc:  # noqa: BLE001
                self.send(error(exc))

    def reply(self, req: dict) -> None:
        try:
            msg = self.answer(req)
        except BaseException as exc:  # noqa: BLE001 - the student's exception goes back as data
            msg = error(exc)
        self.send(msg, handles=req.get("op") in ("call", "getattr"))

    def answer(self, req: dict) -> dict:
        op = req["op"]
        if op == "ranks":
            return {"kind": "result", "value": self.ranks(req), "after": None}
        if op == "stub":
            return {"kind": "result", "value": self.probe_stub(req), "after": None}
        if not self.ran_student:  # loading the captures below may run the student's code (__reduce__)
            self.ran_student = True
            disown_fork_server()  # nor may that code ask the ranks' fork server for unguarded ranks
            # nor start a thread, for good: the meters and watches are the calling thread's (no ranks are
            # launched from here once the student's code ran, `ranks`: their launcher's threads are not needed)
            self._threads = forbid.no_threads(self.name, "")  # held: a collected generator would restore them
            self._threads.__enter__()
        args, kwargs = self.resolve(req.get("args", ())), self.resolve(req.get("kwargs", {}))
        if op == "call":
            value = self.resolve(req["target"])(*args, **kwargs)
            return {"kind": "result", "value": value, "after": [state(args), state(kwargs)]}
        if op == "getattr":
            return {"kind": "result", "value": getattr(self.resolve(req["target"]), req["name"]), "after": None}
        if op == "run":
            value = api.safe_data(req["worker"](*args, **kwargs), f"{self.name}: the worker's result")
            return {"kind": "result", "value": value, "after": None}
        raise ValueError(f"unknown request {op!r}")

    def ranks(self, req: dict):
        """The worker on the ranks, with the captured objects unloaded (each rank loads them)."""
        args, kwargs = req.get("args", ()), req.get("kwargs", {})
        if self.ran_student or refs(args, "obj") or refs(kwargs, "obj"):
            raise RuntimeError(f"grader: {self.name} starts ranks after the student's code ran in the check's "
                               f"process; the ranks' shards must reach no process that ran it (call on_ranks "
                               f"first, or in a check of its own)")
        ranks = api.DirectSession(self.name, self.forbid, self.hint)  # each rank blocks, seals and loads
        results = ranks.on_ranks(req["worker"], req["world_size"], args, kwargs, req["timeout"], req["backend"],
                                 per_rank=req.get("per_rank"))
        return {"results": results, "wire": ranks.wire, "memory": ranks.rank_memory}  # both read here

    def probe_stub(self, req: dict) -> str | None:
        """The name of the first captured object that is the release's stub, else None; loaded and
        inspected in a grandchild (its code may run while it loads) without the session's channel,
        which exits before the reply, with everything it started."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            disown_fork_server()  # the probe loads the student's objects: their code runs here
            os.close(self.fd)  # the channel: the probe's code must not answer for the session, nor read
            # the ranks' request that its answer would bring (every rank's part)
            try:
                objs = [self.resolve(x) for x in (*req.get("args", ()), *req.get("kwargs", {}).values())]
                stub = next((o for o in objs if api.is_stub(o)), None)
                os.write(write, b"-" if stub is None else b"+" + str(getattr(stub, "__name__", "the answer"))
                         .encode()[:200])
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            answer = f.read(201)
        os.waitpid(pid, 0)
        reaper.kill_tree(os.getpid(), include_root=False)
        return answer[1:].decode(errors="replace") if answer[:1] == b"+" else None

    def resolve(self, obj, depth: int = 0):
        """The request with every Ref replaced by the student's object it names."""
        if isinstance(obj, Ref):
            if obj.kind == "obj":
                return self.objects[obj.key]
            if obj.key not in self.captured:
                with open(obj.key, "rb") as f:
                    self.captured[obj.key] = cloudpickle.load(f)
            return self.captured[obj.key]
        if depth > wire.MAX_DEPTH:
            return obj
        if type(obj) in (list, tuple):
            return type(obj)(self.resolve(x, depth + 1) for x in obj)
        if type(obj) is dict:
            return {k: self.resolve(v, depth + 1) for k, v in obj.items()}
        if isinstance(obj, OneShot):
            return OneShot([self.resolve(x, depth + 1) for x in obj.items])
        return obj

    def call_back(self, cb: Callback, args, kwargs):
        """Ask the trusted side to run its callable; serve requests it makes meanwhile."""
        self.send({"kind": "callback", "id": cb.cid, "args": list(args), "kwargs": dict(kwargs)})
        while True:
            req = self.next_request()
            if req.get("op") == "cb_result":
                return req["value"]
            if req.get("op") == "cb_error":
                raise RuntimeError(f"{cb.name} (the grader's function) raised {req['message']}")
            if req.get("op") == "close":
                os._exit(0)
            self.reply(req)


def refs(obj, kind: str, depth: int = 0) -> bool:
    """Whether `obj` holds a `Ref` of this kind (through lists, tuples and dicts)."""
    if isinstance(obj, Ref):
        return obj.kind == kind
    if depth < wire.MAX_DEPTH and type(obj) in (list, tuple):
        return any(refs(x, kind, depth + 1) for x in obj)
    if depth < wire.MAX_DEPTH and type(obj) is dict:
        return any(refs(x, kind, depth + 1) for x in obj.values())
    return False


def state(obj, depth: int = 0):
    """What the trusted side copies back after a call: tensor values and grads, module parameters
    and buffers, through lists, tuples, dicts and one-shot iterators; None for anything else."""
    if depth > 32:
        return None
    d = depth + 1
    if type(obj) in (wire.torch.Tensor, wire.torch.nn.Parameter):
        grad = obj.grad if type(obj.grad) is wire.torch.Tensor else None
        return ["tensor", obj, grad]
    if isinstance(obj, wire.torch.nn.Module):
        params = [[n, state(p, d)] for n, p in obj.named_parameters(remove_duplicate=False)]
        buffers = [[n, b] for n, b in obj.named_buffers() if type(b) is wire.torch.Tensor]
        return ["module", params, buffers, bool(obj.training)]
    if isinstance(obj, OneShot):
        obj = obj.items
    if type(obj) in (list, tuple):
        return ["seq", [state(x, d) for x in obj]]
    if type(obj) is dict:
        return ["map", [[k, state(v, d)] for k, v in obj.items() if type(k) in (str, int)]]
    return None


def error(exc: BaseException) -> dict:
    """A student's exception as data: its type, message, and the frames of the student's code (the
    grader's - this runner, the checks, the launcher - folded into a count), the exception first."""
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a student exception whose __str__ raises
        message = f"<{type(exc).__name__} whose message cannot be shown>"
    folded = frames.fold_frames(traceback.extract_tb(exc.__traceback__))
    kept = [line for line in folded if not line.startswith("  (")]
    tb = "".join([*(["in your code (most recent call last):\n"] if kept else []), *kept[-12:], *folded[len(kept):]])
    return {"kind": "error", "type": type(exc).__name__[:100], "message": message[:20000], "traceback": tb[-8000:]}
