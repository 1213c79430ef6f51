"""The way a check runs the student's code: what every day's checks are written against (their
comparisons and messages are `dlo.grading.compare`).

**Running student code.** A check never calls a student object and a reference in the same place
where the student's code could see the reference. It is written as:

    @check(forbid=("torch.optim.AdamW", "dlo.optim.reference.adamw_step"))
    def check_adamw_step(fn, seed=0):
        ...inputs and the reference are made here...
        fn(param, grad, m, v, step, **hp)          # a plain call: in-place changes come back
        out = run_student(_worker, fn, seed)       # a trusted worker that uses the student's objects
        outs = on_ranks(_rank_worker, 2, cls, seed)  # the same on N ranks (torch.distributed ready)
        ...compare with the reference here...

- `check(forbid=..., hint=...)` marks a check function. Its positional arguments are the student's
  objects. While student code runs under the check, every dotted name in `forbid` (the library
  references and torch functions that solve the exercise; "module.*" for every public function and
  class of a module) raises `ForbiddenCall`, under that name and under every other module attribute
  of the same package bound to the same object (re-exports such as `dlo.optim.adamw_step`, the
  defining module such as `torch.optim.adamw.AdamW`); passing the reference itself as the answer
  fails the same way (`dlo.grading.forbid`).
- `run_student(worker, *args)` / `on_ranks(worker, n, *args)` run a *trusted* worker (a module-level
  function of a checks module) that receives the student's objects among its arguments, in the
  process (or on the ranks) where student code runs. A worker only runs the student's code and
  records what it observed; it returns plain data (`safe_data`: tensors, numbers, strings, None,
  lists/tuples/dicts of those). It never computes or receives the expected values.

Two backends implement this. The *direct* one (here) runs everything in the calling process (ranks
through `dlo.distributed.launch`): the immediate feedback of a notebook's test cell. The *sandboxed*
one (`dlo.grading.trusted`, used by `dlo grade`) runs the same check code in a trusted process where
the student's objects are remote handles living in a sandboxed runner (`dlo.grading.jail_runner`); only
plain data comes back (`dlo.grading.wire`), and the comparison happens where the student's code cannot
see it. So a check must not rely on more than the rules above: a plain call's result is plain data
(or a handle whose attributes and methods are remote), trusted callables passed to the student stay
with the check (called back), and anything that needs the student's code inside an autograd graph,
an instance of a student class or a training loop goes through a worker.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import hashlib
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from numbers import Integral, Real

import torch

from dlo.grading import identity
from dlo.grading.forbid import Guarded, blocker, forbidden, forbidden_targets, plan
from dlo.grading.frames import GraderError, as_grader_error, fold_exception, fold_traceback_text, grader_error_text
from dlo.grading.meter import SocketMeter
from dlo.grading.ranks import rank_payload, run_on_rank, worker_ref, write_shards
from dlo.grading.seal import sealed
from dlo.measure.comm import wire_agrees

RANK_TIMEOUT = 120.0      # seconds a check's ranks may run: a deadlock ends here, not never


# ----------------------------------------------------------------------------- plain data across the boundary

SAFE_SCALARS = (int, float, bool, str, bytes, type(None), complex)


def safe_data(obj, what: str = "the result"):
    """`obj` as plain data (tensors, numbers, strings, None, torch dtypes/sizes, lists, tuples and dicts
    of those), else TypeError: only such values may cross from student code to a check. Other numbers
    (numpy's scalars) become Python ints and floats, as the sandbox's wire format makes them."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            err = TypeError(f"{what}: a tensor subclass ({type(obj).__name__}) cannot be returned; use a plain tensor")
            err.student_side = True
            raise err
        return obj
    if isinstance(obj, (SAFE_SCALARS, torch.dtype, torch.Size)):
        return obj
    if isinstance(obj, Integral):
        return int(obj)
    if isinstance(obj, Real):
        return float(obj)
    if isinstance(obj, (list, tuple)):
        items = [safe_data(item, f"{what}[{i}]") for i, item in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {safe_data(k, f"a key of {what}"): safe_data(v, f"{what}[{k!r}]") for k, v in obj.items()}
    err = TypeError(f"{what} is a {type(obj).__name__}; a check worker returns plain data only (tensors, numbers, "
                    f"strings, lists, tuples, dicts)")
    err.student_side = True  # what the student's code gave back: not the grader's fault (`frames.grader_fault`)
    raise err


# ----------------------------------------------------------------------------- the two backends

class DirectSession:
    """The feedback backend: student code runs in this process (and on ranks from `launch`), with the
    check's forbidden names blocked while it runs."""

    def __init__(self, name: str, forbid: tuple[str, ...], hint: str = ""):
        self.name, self.forbid, self.hint = name, tuple(forbid), hint
        self.wire: list[int] | None = None  # what each rank's sockets sent in the last on_ranks (`wire_sent`)
        self.rank_memory: list[dict] | None = None  # each rank's memory, counted by the launcher (`rank_memory`)

    def bind(self, obj):
        """A student object as the check will use it: callables (not classes) run with `forbid` active;
        a forbidden reference passed as the answer is the blocker (as the sandbox, which loads it by name)."""
        for path in self.forbid:
            if any(getattr(owner, attr, None) is obj for owner, attr in forbidden_targets(path)):
                return blocker(path, self.name, self.hint)
        found = plan(self.forbid, self.name, self.hint) if self.forbid else None
        copied = identity.copy_in(obj, found.codes, found.originals) if found else None
        if copied is not None:  # a copy the notebook made before the check (the sandbox refuses to make one)
            return blocker(f"a copy of {copied}", self.name, self.hint)
        if callable(obj) and not isinstance(obj, type) and self.forbid:
            return Guarded(obj, self.forbid, self.name, self.hint)
        return obj

    def memory(self, reset: bool = False):
        """None: in a notebook the kernel's count of this process would also hold what the notebook's own
        malloc keeps (measured: up to 40 MiB beside Day 1's honest accumulation, 12-16 MiB in the grader's
        session, whose malloc returns large blocks at once: `steady_malloc`, not to be imposed on a
        notebook's experiments). The watches judge there; this count is the grader's independent evidence."""
        return None

    def run(self, worker, args, kwargs):
        return safe_data(run_worker(worker, self.forbid, self.name, args, kwargs, self.hint),
                         f"{self.name}: the worker's result")

    def on_ranks(self, worker, world_size, args, kwargs, timeout, backend, per_rank=None):
        from dlo.distributed.launch import RankError, launch

        stub = next((obj for obj in (*args, *kwargs.values()) if is_stub(obj)), None)
        if stub is not None:  # its first call raises on every rank: say so without starting them
            raise AssertionError(stub_message(self.name, getattr(stub, "__name__", "the answer")))
        shards = write_shards(per_rank, world_size)
        meter = SocketMeter(world_size) if backend == "gloo" else None  # gloo: every byte a rank sends is TCP
        try:
            # each rank blocks and seals for good (it ends with the launch), after handing its sockets to the meter
            results = launch(run_on_rank, world_size, worker_ref(worker), self.forbid, self.name, self.hint,
                             rank_payload(args, kwargs), shards, meter and meter.path, True, backend=backend,
                             timeout=timeout)
        except RankError as e:  # the rank's own message (assertion or exception) is the useful part
            own = grader_error_text(e.remote_traceback or "")
            if own:  # the worker's own bug (`ranks.run_on_rank`): the grader's, as on this side
                raise GraderError(own) from None
            if e.remote_traceback:
                raise AssertionError(f"{self.name}: rank {e.rank} raised "
                                     f"{fold_traceback_text(e.remote_traceback)}") from None
            raise AssertionError(f"{self.name}: {e}") from None
        except TimeoutError as e:
            raise AssertionError(deadlock_message(self.name, e)) from None
        finally:
            if shards is not None:
                shutil.rmtree(shards, ignore_errors=True)
            self.wire = meter.close() if meter is not None else None
            self.rank_memory = meter.memory() if meter is not None else None
        if meter is not None and meter.tampered:
            raise AssertionError(f"{self.name}: {meter.tampered}: each rank hands its sockets to the grader's byte "
                                 f"meter once, before your code runs; something else claimed to be a rank")
        return [safe_data(r, f"{self.name}: rank {i}'s result") for i, r in enumerate(results)]


_STUB_OPS = {"RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PRECALL", "PUSH_NULL"}  # no effect of their own


def is_stub(obj) -> bool:
    """True for the release's untouched answer: a function whose whole body is `raise
    NotImplementedError()`, or a class whose own __init__ is one (calling it can only raise). Launching
    ranks to watch each raise costs N interpreter starts per check; the verdict is known before."""
    fn = getattr(obj, "_fn", obj)  # a Guarded student callable
    if isinstance(fn, type):
        fn = fn.__dict__.get("__init__")
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in _STUB_OPS]
    return (len(ops) in (2, 3) and ops[0] == ("LOAD_GLOBAL", "NotImplementedError")
            and ops[-1][0] == "RAISE_VARARGS" and (len(ops) == 2 or ops[1] == ("CALL", 0)))


def stub_message(exercise: str, label: str) -> str:
    return f"{exercise}: {label} raised NotImplementedError on every rank: the exercise is not done yet"


def deadlock_message(name: str, err: Exception) -> str:
    return (f"{name}: the ranks did not finish ({err}). A deadlock? Every send needs a matching recv on the "
            f"peer, every collective must be called by every rank in the same order; blocking send/recv on all "
            f"ranks at once waits forever: use dist.isend/dist.irecv and wait on both")


def run_worker(worker, forbid, name, args, kwargs, hint=""):
    """A trusted worker run where student code runs (in process: `run_student` of a direct check): the
    check's forbidden names blocked and the grader's modules sealed around it (`dlo.grading.seal`)."""
    with forbidden(forbid, name, hint), sealed():
        return worker(*args, **kwargs)


_state = threading.local()


def _backend():
    """The session factory in use: the sandbox's while `dlo grade` runs checks, else DirectSession."""
    return getattr(_state, "backend", None) or DirectSession


@contextlib.contextmanager
def use_backend(factory) -> Iterator[None]:
    """Run checks with another session factory (the sandbox) inside the block."""
    old = getattr(_state, "backend", None)
    _state.backend = factory
    try:
        yield
    finally:
        _state.backend = old


def _session():
    session = getattr(_state, "session", None)
    if session is None:
        raise RuntimeError("run_student/on_ranks are for code inside a @check function")
    return session


def check(*, forbid: tuple[str, ...] = (), hint: str = "") -> Callable:
    """Decorator of a check function: its positional arguments are the student's objects, bound to a
    session (direct or sandboxed) for the duration of the call; `forbid` lists the dotted names the
    student's code may not call while it runs ("module.*": every public function and class of that
    module; re-exports of a name are blocked with it), `hint` what to use instead."""
    def deco(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            session = _backend()(f.__name__.removeprefix("check_"), tuple(forbid), hint)
            outer = getattr(_state, "session", None)
            _state.session = session
            try:
                with (session if hasattr(session, "__enter__") else contextlib.nullcontext()):
                    return f(*(session.bind(a) for a in args), **kwargs)
            except BaseException as exc:
                if outer is None:  # the outermost check: what the notebook shows
                    own = as_grader_error(exc, session.name)  # the check's own bug: never the student's to fix
                    if own is not None:
                        raise own from exc
                    fold_exception(exc)
                raise
            finally:
                _state.session = outer
        wrapper.forbid = tuple(forbid)
        return wrapper
    return deco


def run_student(worker: Callable, *args, **kwargs):
    """Run the trusted `worker(*args, **kwargs)` where student code runs; plain data comes back."""
    return _session().run(worker, args, kwargs)


def student_memory(reset: bool = False):
    """The kernel's counters of the process where the student's code runs (`dlo.measure.process.snapshot`:
    its resident memory and high water mark, reset first with `reset` where the reader may, the processes
    it started), read by the grading process from outside the sandbox's process, which cannot change them
    (`trusted.Session.memory`). None in a notebook's own check (`DirectSession.memory`) and where unreadable."""
    memory = getattr(_session(), "memory", None)
    return memory(reset) if memory is not None else None


def on_ranks(worker: Callable, world_size: int, *args, timeout: float = RANK_TIMEOUT, backend: str = "gloo",
             per_rank: list | None = None, **kwargs) -> list:
    """Run the trusted `worker(*args, **kwargs)` on `world_size` ranks (torch.distributed initialised,
    gloo by default: the checks compare float64 CPU tensors); the per-rank plain-data results.
    `per_rank`: one part of the case per rank, rank r's given as the worker's first argument and
    never seen by the other ranks (each rank holds only its shard, not the whole problem)."""
    if per_rank is None:
        return _session().on_ranks(worker, world_size, args, kwargs, timeout, backend)
    return _session().on_ranks(worker, world_size, args, kwargs, timeout, backend, per_rank=per_rank)


def wire_sent() -> list[int] | None:
    """The bytes each rank's TCP sockets sent during the check's last `on_ranks` (gloo), as the kernel
    counted them and read from outside the ranks (`dlo.grading.meter`); None where it was not measured
    (the tests' reused ranks). Compared with what the ranks' counters report by `verify_wire`."""
    return getattr(_session(), "wire", None)


def rank_memory() -> list[dict] | None:
    """Each rank's memory in the check's last `on_ranks`, read by the launching process from /proc for a
    worker with a `counted_prelude` (`dlo.grading.meter.SocketMeter.memory`): None where not counted."""
    return getattr(_session(), "rank_memory", None)


def verify_wire(name: str, records: list[list[dict]], world_size: int, where: str) -> None:
    """What each rank's counter reported (`records`, per rank: `CommCounter.records()` on the rank, beside the
    student's code) against the bytes its TCP sockets sent in the last `on_ranks` (`wire_sent`: the kernel's
    counters, read by the process that launched the ranks): a counter the student's code patched, or bytes
    sent beside it (the C++ process group called directly, a socket of one's own), disagree. Not measured on
    the tests' reused ranks (nothing to compare)."""
    sent = wire_sent()
    if sent is None:
        return
    problem = wire_agrees(records, sent, world_size)
    if problem:
        raise AssertionError(f"{name}: {problem}. The grader counts every byte twice: by the messages your "
                             f"ranks send and by what their sockets send, read outside them; code that "
                             f"changes the count on the rank, or moves bytes the count does not see, fails ({where})")


_SECRET = secrets.token_bytes(16)  # drawn once per grading process (`new_secret`); never leaves it


def new_secret() -> None:
    """Draw this process's secret anew: a grading process forked from a warm one (`dlo.harness.warm`)
    calls it first, so that no two submissions share the secret their cases are mixed from."""
    global _SECRET
    _SECRET = secrets.token_bytes(16)


def case_seed(seed: int) -> int:
    """The seed a check draws its case from. Under the grader's sandboxed backend: a secret one mixed
    from `seed` and a number drawn in the grading process (the student's code never sees it: the ranks
    get the materialised case, each its own part), so that a case cannot be recomputed where the
    student's code runs. In a notebook's direct checks: `seed` itself (reproducible feedback)."""
    if _backend() is DirectSession:
        return seed
    return int.from_bytes(hashlib.sha256(_SECRET + str(seed).encode()).digest()[:4], "big")
