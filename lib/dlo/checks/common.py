"""What every day's checks share: comparisons with actionable messages, and the way a check runs
the student's code.

**Comparisons.** `assert_close(name, what, got, want, where)` explains the first mismatch (shape,
max error, expected vs got at one index); `ok(name, detail)` prints the one success line.

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
  fails the same way.
- `run_student(worker, *args)` / `on_ranks(worker, n, *args)` run a *trusted* worker (a module-level
  function of a checks module) that receives the student's objects among its arguments, in the
  process (or on the ranks) where student code runs. A worker only runs the student's code and
  records what it observed; it returns plain data (`safe_data`: tensors, numbers, strings, None,
  lists/tuples/dicts of those). It never computes or receives the expected values.

Two backends implement this. The *direct* one (here) runs everything in the calling process (ranks
through `dlo.distributed.launch`): the immediate feedback of a notebook's test cell. The *sandboxed*
one (`dlo.checks.sandbox`, used by `dlo grade`) runs the same check code in a trusted process where
the student's objects are remote handles living in a sandboxed runner (`dlo.checks.runner`); only
plain data comes back (`dlo.checks.wire`), and the comparison happens where the student's code cannot
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
import importlib
import math
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from numbers import Integral, Real

import torch

from dlo.seal import sealed

DTYPE = torch.float64
RTOL, ATOL = 1e-9, 1e-12  # float64: correct code agrees to ~1e-15; slips show at >= 1e-7
RANK_TIMEOUT = 120.0      # seconds a check's ranks may run: a deadlock ends here, not never


# ----------------------------------------------------------------------------- messages and comparisons

def fmt(where) -> str:
    """A check's context for a message: a dict of hyper-parameters or a string."""
    if isinstance(where, dict):
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in where.items())
    return str(where)


def ok(name: str, detail: str) -> None:
    """The one line a passing check prints."""
    print(f"{name}: ok ({detail})")


def assert_close(name: str, what: str, got, want, where=None, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    """got == want elementwise within atol + rtol * |want| (in float64), else AssertionError naming
    the first worst mismatch. `got` may be a tensor, a number or a list of numbers; nan counts as an
    infinite error; a missing value or a wrong shape is named as such."""
    ctx = f" ({fmt(where)})" if where not in (None, "", {}) else ""
    if got is None:
        raise AssertionError(f"{name}: {what} is None; expected a value{ctx}")
    try:
        got_t = torch.as_tensor(got).detach().to("cpu", DTYPE)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{name}: {what} is a {type(got).__name__}, expected a tensor or number{ctx}") from None
    want_t = torch.as_tensor(want).detach().to("cpu", DTYPE)
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{name}: {what} has shape {tuple(got_t.shape)}, expected {tuple(want_t.shape)}{ctx}")
    err = (got_t - want_t).abs().nan_to_num(math.inf)
    bad = err > atol + rtol * want_t.abs()
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err, -1.0).flatten()))
        raise AssertionError(
            f"{name}: {what} differs from the reference{ctx}: max abs error {err.max():.3g} "
            f"(tolerance {atol:g} + {rtol:g}*|expected|); e.g. at flat index {i}: expected "
            f"{want_t.flatten()[i].item():.10g}, got {got_t.flatten()[i].item():.10g}")


def assert_number(name: str, what: str, got, where=None) -> float:
    """`got` as a float (a one-element tensor is accepted), else AssertionError."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, Real) or isinstance(got, bool):
        ctx = f" ({fmt(where)})" if where else ""
        raise AssertionError(f"{name}: {what} must be a number, got {type(got).__name__}{ctx}")
    return float(got)


def odd_shape(rng: random.Random) -> tuple[int, ...]:
    """A 1-3 dimensional shape of odd sizes (nothing divides evenly; 1 appears)."""
    dims = rng.choice([1, 2, 3])
    return tuple(rng.choice([1, 3, 5, 7, 11, 13]) for _ in range(dims - 1)) + (rng.choice([3, 7, 17, 33]),)


def rand(shape, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype) * scale


# ----------------------------------------------------------------------------- forbidden references

class ForbiddenCall(AssertionError):
    """A check's forbidden reference was called by the student's code."""


_ABSENT = object()


def _resolve(path: str):
    """'torch.optim.AdamW' -> (the module or class holding it, 'AdamW')."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:-1]:
                owner = getattr(owner, attr)
        except AttributeError:
            break
        if parts[-1] != "*" and not hasattr(owner, parts[-1]):
            break
        return owner, parts[-1]
    raise ValueError(f"forbid: cannot resolve {path!r}")


def forbidden_targets(path: str) -> list[tuple[object, str]]:
    """(holder, attribute) pairs to block for one forbidden name: the name itself, every other module
    attribute of the same package or of dlo bound to the same object (re-exports such as
    dlo.optim.adamw_step or dlo.distributed.collectives.all_gather_single, the defining module such as
    torch.optim.adamw.AdamW), and for "module.*" every public function or
    class defined in that module."""
    owner, attr = _resolve(path)
    if attr == "*":
        name = owner.__name__
        return [pair for a, v in sorted(vars(owner).items()) if not a.startswith("_")
                and (isinstance(v, type) or callable(v)) and getattr(v, "__module__", None) == name
                for pair in forbidden_targets(f"{name}.{a}")]
    # the name's own package, and dlo, whose engines re-export torch's collectives under names of their own
    packages = dict.fromkeys((path.split(".")[0], "dlo"))
    return [(owner, attr)] + [pair for package in packages for pair in _aliases(package, getattr(owner, attr))
                              if pair != (owner, attr)]


_ALIASES: dict[tuple[str, int], list] = {}


def _aliases(package: str, obj) -> list[tuple[object, str]]:
    """Every (module, attribute) of `package` bound to `obj` (cached: a scan of the package's modules)."""
    key = (package, id(obj))
    if key not in _ALIASES:
        found = []
        for name, module in list(sys.modules.items()):
            if module is None or not (name == package or name.startswith(package + ".")) \
                    or name.startswith("dlo.checks"):  # the grader's own namespaces keep their references
                continue
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            found += [(module, a) for a, v in items if v is obj]
        _ALIASES[key] = found
    return _ALIASES[key]


def _code_names(code) -> set[str]:
    """The global and attribute names a code object (and the functions nested in it) mentions."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _functions_of(obj) -> list:
    """The plain functions of a module-level function or class (its own methods, unwrapped)."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    if not isinstance(obj, type):
        return []
    out = []
    for v in vars(obj).values():
        v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
        if isinstance(v, types.FunctionType):
            out.append(v)
    return out


def _uses(obj, defined: dict) -> set[str]:
    """The names of `defined` (a module's own functions and classes) that `obj` uses: in its code,
    and for a class its bases."""
    names = set().union(*(_code_names(f.__code__) for f in _functions_of(obj))) if _functions_of(obj) else set()
    if isinstance(obj, type):
        names |= {b.__name__ for b in obj.__bases__ if defined.get(b.__name__) is b}
    return names & set(defined)


def _reach(starts: list, defined: dict, private: set) -> set[str]:
    seen: set[str] = set()
    todo = [n for obj in starts for n in _uses(obj, defined) & private]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(_uses(defined[n], defined) & private - seen)
    return seen


def private_targets(paths) -> list[tuple[object, str, str]]:
    """(holder, attribute, dotted name) of the private machinery behind the forbidden names of dlo's
    own modules: the module-level `_functions` and `_Classes` that a forbidden name uses (its code, its
    bases; transitively) and no allowed public name of the same module or other dlo module shares, and
    the own methods of those classes (`zero._Sharded.__init__`, `_VocabParallelCrossEntropy.forward`:
    a student's subclass, or `.apply`, reaches them). Without them a student could call the reference
    under its private name. Cached per list of names (the modules are scanned once)."""
    key = tuple(paths)
    if key not in _PRIVATE:
        _PRIVATE[key] = _private_targets(key)
    return _PRIVATE[key]


_PRIVATE: dict[tuple, list] = {}


def _private_targets(paths) -> list[tuple[object, str, str]]:
    by_module: dict[str, list] = {}
    for path in paths:
        owner, attr = _resolve(path)
        module = owner if isinstance(owner, types.ModuleType) else sys.modules.get(getattr(owner, "__module__", ""))
        if module is None or not module.__name__.startswith("dlo.") or module.__name__.startswith("dlo.checks"):
            continue
        if attr == "*":
            by_module.setdefault(module.__name__, []).extend(
                v for a, v in vars(module).items() if not a.startswith("_") and (isinstance(v, type) or callable(v)))
        else:
            by_module.setdefault(module.__name__, []).append(getattr(owner, attr))
    out = []
    for name, forbidden_objs in by_module.items():
        module = sys.modules[name]
        defined = {a: v for a, v in vars(module).items() if isinstance(v, (type, types.FunctionType))
                   and getattr(v, "__module__", None) == name}
        private = {a for a in defined if a.startswith("_") and not a.startswith("__")}
        ids = {id(o) for o in forbidden_objs}
        allowed = [v for a, v in defined.items() if a not in private and id(v) not in ids
                   and not (isinstance(v, type) and any(id(f) in ids for f in _functions_of(v)))]
        shared = _reach(allowed, defined, private) | {a for a in private if _bound_elsewhere(defined[a], name)}
        for a in sorted(_reach(forbidden_objs, defined, private) - shared):
            obj = defined[a]
            out.append((module, a, f"{name}.{a}"))
            if isinstance(obj, type):
                out += [(obj, m, f"{name}.{a}.{m}") for m, v in vars(obj).items()
                        if isinstance(v, (types.FunctionType, staticmethod, classmethod))]
    return out


def _bound_elsewhere(obj, home: str) -> bool:
    """True when another dlo module (not the grader's) imported `obj`: shared machinery, not the answer."""
    for name, module in list(sys.modules.items()):
        if module is None or name == home or not name.startswith("dlo.") or name.startswith("dlo.checks"):
            continue
        try:
            if any(v is obj for v in vars(module).values()):
                return True
        except TypeError:
            continue
    return False


class _Blocked:
    """What a forbidden name is bound to while a check runs: calling it, or using an attribute of it
    (`CheckpointFunction.apply`, `GradScaler.step`), raises ForbiddenCall; so does subclassing it."""

    def __init__(self, path: str, exercise: str, hint: str = ""):
        self.__dlo_forbidden__ = path
        self.__name__ = self.__qualname__ = path.rsplit(".", 1)[-1]
        self._message = (f"{exercise}: {path} is off limits while this check runs: the exercise asks for your own "
                         f"implementation{f' ({hint})' if hint else ''}")

    def __call__(self, *args, **kwargs):
        raise ForbiddenCall(self._message)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ForbiddenCall(self._message)

    def __mro_entries__(self, bases):
        raise ForbiddenCall(self._message)

    def __repr__(self) -> str:
        return f"<{self.__dlo_forbidden__}: off limits in this check>"


def _blocker(path: str, exercise: str, hint: str = "") -> _Blocked:
    return _Blocked(path, exercise, hint)


@contextlib.contextmanager
def forbidden(paths, exercise: str, hint: str = "") -> Iterator[None]:
    """Replace each dotted name in `paths` (and its aliases; "module.*": all its public functions and
    classes) with a function that raises ForbiddenCall; restore on exit."""
    saved, private = [], private_targets(paths)  # found before anything is blocked
    try:
        for path in paths:
            for owner, attr in forbidden_targets(path):
                value = getattr(owner, attr)
                if getattr(value, "__dlo_forbidden__", None):
                    continue  # already blocked (nested checks, or an alias listed twice)
                try:
                    setattr(owner, attr, _blocker(f"{owner.__name__}.{attr}" if attr != path else path,
                                                  exercise, hint))
                except (AttributeError, TypeError):
                    continue  # a read-only holder (a C extension type): its alias elsewhere is blocked
                saved.append((owner, attr, value))
        for owner, attr, label in private:
            raw = vars(owner).get(attr, _ABSENT)  # a class's own staticmethod comes back as one
            if raw is _ABSENT or getattr(raw, "__dlo_forbidden__", None):
                continue
            setattr(owner, attr, _blocker(label, exercise, hint))
            saved.append((owner, attr, raw))
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


# ----------------------------------------------------------------------------- the student's frames first

def grader_files() -> set[str]:
    """The files whose frames are the grader's, not the student's: the checks (this package), the
    sealing, and the launcher that runs a check's ranks."""
    import dlo.distributed

    here = os.path.dirname(os.path.abspath(__file__))
    dist_dir = os.path.dirname(os.path.abspath(dlo.distributed.__file__))
    return {here, os.path.join(os.path.dirname(here), "seal.py")} | {
        os.path.join(dist_dir, f) for f in ("launch.py", "_worker.py", "_spawn.py")}


def is_grader_frame(filename: str, extra: tuple[str, ...] = ()) -> bool:
    path = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
    files = grader_files()
    return path in files or os.path.dirname(path) in files or any(path.endswith(e) for e in extra)


def fold_frames(frames: list, extra: tuple[str, ...] = ()) -> list[str]:
    """Formatted frames (traceback.FrameSummary), the grader's left out: the student's code and the
    libraries it called, then one line saying how many of the grader's frames were hidden."""
    kept = [f for f in frames if not is_grader_frame(f.filename, extra)]
    lines = traceback.format_list(kept)
    hidden = len(frames) - len(kept)
    return lines + ([f"  ({hidden} grader frame{'s' * (hidden != 1)} hidden)\n"] if hidden else [])


_FRAME_LINE = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.*)$')


def fold_traceback_text(text: str, extra: tuple[str, ...] = ()) -> str:
    """A formatted traceback (a rank's, as text) with the exception first, then the frames of the
    student's code (and of the libraries it called), the grader's frames folded into a count:

        ForbiddenCall: zero1: dlo.distributed.zero._Sharded is off limits ...
        in your code (most recent call last):
          File "<cell 12>", line 4, in __init__
            super().__init__(module)
          (4 grader frames hidden)

    Text that is not a traceback comes back as it is."""
    lines = text.rstrip("\n").split("\n")
    if not lines or not lines[0].startswith("Traceback (most recent call last):"):
        return text
    frames: list[list[str]] = []  # [header, source lines...]
    i = 1
    while i < len(lines) and _FRAME_LINE.match(lines[i]):
        frame = [lines[i]]
        i += 1
        while i < len(lines) and lines[i].startswith("    "):
            frame.append(lines[i])
            i += 1
        frames.append(frame)
    error = "\n".join(lines[i:])
    kept = [f for f in frames if not is_grader_frame(_FRAME_LINE.match(f[0])["file"], extra)]
    hidden = len(frames) - len(kept)
    out = [error]
    if kept:
        out.append("in your code (most recent call last):")
        out += [line for f in kept for line in f]
    if hidden:
        out.append(f"  ({hidden} grader frame{'s' * (hidden != 1)} hidden)")
    return "\n".join(out)


def _pruned(tb) -> tuple[object, int]:
    """A traceback chain without the grader's frames, and how many it left out."""
    frames, hidden = [], 0
    while tb is not None:
        if is_grader_frame(tb.tb_frame.f_code.co_filename):
            hidden += 1
        else:
            frames.append(tb)
        tb = tb.tb_next
    new = None
    for t in reversed(frames):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new, hidden


def _fold_exception(exc: BaseException) -> None:
    """The exception a check raises, as a notebook shows it: the test cell's line and the student's
    frames, the grader's folded into a note."""
    if getattr(exc, "__dlo_folded__", False):
        return
    tb, hidden = _pruned(exc.__traceback__)
    if hidden:
        exc.__traceback__ = tb
        with contextlib.suppress(Exception):
            exc.add_note(f"({hidden} grader frame{'s' * (hidden != 1)} hidden)")
    with contextlib.suppress(Exception):
        exc.__dlo_folded__ = True


# ----------------------------------------------------------------------------- plain data across the boundary

SAFE_SCALARS = (int, float, bool, str, bytes, type(None), complex)


def safe_data(obj, what: str = "the result"):
    """`obj` as plain data (tensors, numbers, strings, None, torch dtypes/sizes, lists, tuples and dicts
    of those), else TypeError: only such values may cross from student code to a check. Other numbers
    (numpy's scalars) become Python ints and floats, as the sandbox's wire format makes them."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{what}: a tensor subclass ({type(obj).__name__}) cannot be returned; use a plain tensor")
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
    raise TypeError(f"{what} is a {type(obj).__name__}; a check worker returns plain data only (tensors, numbers, "
                    f"strings, lists, tuples, dicts)")


# ----------------------------------------------------------------------------- the two backends

class DirectSession:
    """The feedback backend: student code runs in this process (and on ranks from `launch`), with the
    check's forbidden names blocked while it runs."""

    def __init__(self, name: str, forbid: tuple[str, ...], hint: str = ""):
        self.name, self.forbid, self.hint = name, tuple(forbid), hint

    def bind(self, obj):
        """A student object as the check will use it: callables (not classes) run with `forbid` active;
        a forbidden reference passed as the answer is the blocker (as the sandbox, which loads it by name)."""
        for path in self.forbid:
            if any(getattr(owner, attr, None) is obj for owner, attr in forbidden_targets(path)):
                return _blocker(path, self.name, self.hint)
        if callable(obj) and not isinstance(obj, type) and self.forbid:
            return _Guarded(obj, self.forbid, self.name, self.hint)
        return obj

    def run(self, worker, args, kwargs):
        return safe_data(run_worker(worker, self.forbid, self.name, args, kwargs, self.hint),
                         f"{self.name}: the worker's result")

    def on_ranks(self, worker, world_size, args, kwargs, timeout, backend, per_rank=None):
        from dlo.distributed.launch import RankError, launch

        stub = next((obj for obj in (*args, *kwargs.values()) if is_stub(obj)), None)
        if stub is not None:  # its first call raises on every rank: say so without starting them
            raise AssertionError(f"{self.name}: {getattr(stub, '__name__', 'the answer')} raised NotImplementedError "
                                 f"on every rank: the exercise is not done yet")
        shards = write_shards(per_rank, world_size)
        try:
            results = launch(run_on_rank, world_size, worker_ref(worker), self.forbid, self.name, self.hint,
                             rank_payload(args, kwargs), shards, backend=backend, timeout=timeout)
        except RankError as e:  # the rank's own message (assertion or exception) is the useful part
            if e.remote_traceback:
                raise AssertionError(f"{self.name}: rank {e.rank} raised "
                                     f"{fold_traceback_text(e.remote_traceback)}") from None
            raise AssertionError(f"{self.name}: {e}") from None
        except TimeoutError as e:
            raise AssertionError(deadlock_message(self.name, e)) from None
        finally:
            if shards is not None:
                shutil.rmtree(shards, ignore_errors=True)
        return [safe_data(r, f"{self.name}: rank {i}'s result") for i, r in enumerate(results)]


_STUB_OPS = {"RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PRECALL", "PUSH_NULL"}  # no effect of their own


def is_stub(obj) -> bool:
    """True for the release's untouched answer: a function whose whole body is `raise
    NotImplementedError()`, or a class whose own __init__ is one (calling it can only raise). Launching
    ranks to watch each raise costs N interpreter starts per check; the verdict is known before."""
    fn = getattr(obj, "_fn", obj)  # a _Guarded student callable
    if isinstance(fn, type):
        fn = fn.__dict__.get("__init__")
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in _STUB_OPS]
    return (len(ops) in (2, 3) and ops[0] == ("LOAD_GLOBAL", "NotImplementedError")
            and ops[-1][0] == "RAISE_VARARGS" and (len(ops) == 2 or ops[1] == ("CALL", 0)))


def deadlock_message(name: str, err: Exception) -> str:
    return (f"{name}: the ranks did not finish ({err}). A deadlock? Every send needs a matching recv on the "
            f"peer, every collective must be called by every rank in the same order; blocking send/recv on all "
            f"ranks at once waits forever: use dist.isend/dist.irecv and wait on both")


def run_worker(worker, forbid, name, args, kwargs, hint=""):
    """A trusted worker run where student code runs (in process: `run_student` of a direct check): the
    check's forbidden names blocked and the grader's modules sealed around it (`dlo.seal`)."""
    with forbidden(forbid, name, hint), sealed():
        return worker(*args, **kwargs)


def worker_ref(worker):
    """A module-level worker as (module, qualname), resolved on the rank (where the grader's modules are
    sealed by the time anything could look them up); any other callable as itself."""
    module, qualname = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "<>")
    importable = module not in (None, "__main__") and "<" not in qualname and module in sys.modules
    return (module, qualname) if importable else worker


def rank_payload(args, kwargs) -> bytes:
    """The worker's arguments (the student's objects among them), pickled apart from the worker: a rank
    unpickles them only once it has blocked the forbidden names and sealed the grader's modules, since
    unpickling a student's object may run the student's code (`__reduce__`, `__init_subclass__`)."""
    from dlo.pickling import dumps

    return dumps((args, kwargs))  # the student's functions keep their cells' names and lines


def write_shards(per_rank, world_size: int) -> str | None:
    """Each rank's own part of a check's case (`on_ranks(..., per_rank=[...])`) in a file of its own,
    in a new private folder (None when there is no per-rank part)."""
    if per_rank is None:
        return None
    import cloudpickle

    if len(per_rank) != world_size:
        raise ValueError(f"per_rank has {len(per_rank)} parts for {world_size} ranks")
    folder = tempfile.mkdtemp(prefix="dlo-shards-")
    for r, part in enumerate(per_rank):
        with open(os.path.join(folder, f"rank-{r}.pkl"), "wb") as f:
            f.write(cloudpickle.dumps(part))
    return folder


def take_shard(folder: str):
    """On a rank: its own part, read and deleted, then a barrier - every rank has taken its part (and
    deleted it) before any student code runs, so no rank's code can read another's."""
    import pickle

    import torch.distributed as dist

    path = os.path.join(folder, f"rank-{dist.get_rank()}.pkl")
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    dist.barrier()
    return pickle.loads(data)


def run_on_rank(worker, forbid, name, hint, payload: bytes, shards: str | None = None):
    """On each rank of `on_ranks` (and of the tests' rank pool): the worker resolved and this rank's
    own part of the case taken (`per_rank`: the worker's first argument), then the check's forbidden
    names blocked, the grader's modules sealed and new threads refused, then the student's objects
    unpickled and the worker run with them."""
    if isinstance(worker, tuple):
        module, qualname = worker
        worker = importlib.import_module(module)
        for part in qualname.split("."):
            worker = getattr(worker, part)
    mine = (take_shard(shards),) if shards is not None else ()
    with forbidden(forbid, name, hint), sealed() as sealing, no_threads(name):
        args, kwargs = sealing.loads(payload)
        return worker(*mine, *args, **kwargs)


_THREAD_STARTERS = (("_thread", "start_new_thread"), ("_thread", "start_new"), ("_thread", "start_joinable_thread"),
                    ("threading", "_start_new_thread"), ("threading", "_start_joinable_thread"))


@contextlib.contextmanager
def no_threads(exercise: str) -> Iterator[None]:
    """Starting a Python thread raises ForbiddenCall inside the block, and a thread that appeared
    anyway fails the check at its end. On a rank the grader counts collectives (`CommCounter`) and
    saved tensors (`SavedTensorMeter`) on the thread that calls the student's code (both are
    thread-local): work moved to another thread would be invisible to them."""
    message = (f"{exercise}: starting a thread is off limits while this check runs on the ranks: the grader "
               f"counts the collectives and the tensors saved for backward on the thread that calls your code; "
               f"run everything there")

    def refuse(*args, **kwargs):
        raise ForbiddenCall(message)

    before = {t.ident for t in threading.enumerate()}
    saved = []
    for module_name, attr in _THREAD_STARTERS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, refuse)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
    new = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    if new:
        raise ForbiddenCall(f"{message} (threads started: {', '.join(new)})")


class _Guarded:
    """A student callable whose calls run with the check's forbidden names blocked."""

    def __init__(self, fn, forbid, name, hint=""):
        self._fn, self._forbid, self._name, self._hint = fn, forbid, name, hint
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        with forbidden(self._forbid, self._name, self._hint), sealed():
            return self._fn(*args, **kwargs)

    def __reduce__(self):  # ranks and workers get the plain function; they block names themselves
        return (_unwrap, (self._fn,))


def _unwrap(fn):
    return fn


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
                    _fold_exception(exc)
                raise
            finally:
                _state.session = outer
        wrapper.forbid = tuple(forbid)
        return wrapper
    return deco


def run_student(worker: Callable, *args, **kwargs):
    """Run the trusted `worker(*args, **kwargs)` where student code runs; plain data comes back."""
    return _session().run(worker, args, kwargs)


def on_ranks(worker: Callable, world_size: int, *args, timeout: float = RANK_TIMEOUT, backend: str = "gloo",
             per_rank: list | None = None, **kwargs) -> list:
    """Run the trusted `worker(*args, **kwargs)` on `world_size` ranks (torch.distributed initialised,
    gloo by default: the checks compare float64 CPU tensors); the per-rank plain-data results.
    `per_rank`: one part of the case per rank, rank r's given as the worker's first argument and
    never seen by the other ranks (each rank holds only its shard, not the whole problem)."""
    if per_rank is None:
        return _session().on_ranks(worker, world_size, args, kwargs, timeout, backend)
    return _session().on_ranks(worker, world_size, args, kwargs, timeout, backend, per_rank=per_rank)


_SECRET = secrets.token_bytes(16)  # drawn once per grading process; never leaves it


def case_seed(seed: int) -> int:
    """The seed a check draws its case from. Under the grader's sandboxed backend: a secret one mixed
    from `seed` and a number drawn in the grading process (the student's code never sees it: the ranks
    get the materialised case, each its own part), so that a case cannot be recomputed where the
    student's code runs. In a notebook's direct checks: `seed` itself (reproducible feedback)."""
    if _backend() is DirectSession:
        return seed
    return int.from_bytes(hashlib.sha256(_SECRET + str(seed).encode()).digest()[:4], "big")
