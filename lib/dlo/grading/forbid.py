"""What student code may not call while a check runs: the forbidden references and new threads.

`check(forbid=...)` lists dotted names (the library references and torch functions that solve the
exercise; "module.*" for every public function and class of a module; "aten::_fused_adamw*" for torch
operators). While student code runs under the check, `forbidden(paths, exercise)` blocks them three ways:

- by name: each is replaced by a blocker that raises `ForbiddenCall`, under that name and every other
  module attribute bound to the same object, and so are the private helpers only the forbidden objects
  use (`dlo.grading.targets`): the message a student who calls the reference by name reads;
- by identity: the functions that implement them (wrapped ones, a class's methods, those helpers) run
  a blocker whoever holds them, and making or running a copy of their code is refused
  (`dlo.grading.identity`: clones, `__wrapped__`, pickling by value, `exec`, reload);
- at dispatch: the torch operators among them raise whatever Python object reached them
  (`dlo.grading.ops`: `torch._C._VariableFunctions._fused_adamw_`, `torch.ops.aten...`).

`for_good` (the sandboxed runner's session child, the ranks of a launch: processes that end with the
check) blocks for the rest of the process, where nothing can undo it; otherwise everything is restored
on exit. `no_threads` refuses new Python threads on a check's ranks. This runs where the student's code
runs (the kernel of a direct check, the sandboxed runner, the ranks), so the seal leaves it open
(`dlo.grading.seal.OPEN`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

from dlo.grading import bytecode, identity, noexec, ops
from dlo.grading.seal import is_sealed_now, sealed
from dlo.grading.targets import forbidden_targets, private_targets, resolve

__all__ = ["SERIALISED_CODE", "ForbiddenCall", "Guarded", "blocker", "forbidden", "forbidden_targets", "no_threads",
           "plan", "private_targets", "resolve"]


class ForbiddenCall(AssertionError):
    """A check's forbidden reference was called by the student's code."""


_ABSENT = object()


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


def blocker(path: str, exercise: str, hint: str = "") -> _Blocked:
    return _Blocked(path, exercise, hint)


# Off limits in every check: TorchScript and exported programs run code that is no Python code object, so neither
# names, burning nor the audit hook see a reference in them. A red team scripted and traced Day 8's references
# where no check ran, kept the serialised bytes in a global and loaded them at call time (7 + 5 points, 2026-12-02).
# A student's exercise needs none of them; the compiled path the course teaches is torch.compile.
SERIALISED_CODE = ("torch.jit.script", "torch.jit.trace", "torch.jit.trace_module", "torch.jit.load",
                   "torch.jit.freeze", "torch.jit.CompilationUnit", "torch._C.import_ir_module",
                   "torch._C.import_ir_module_from_buffer", "torch._C._import_ir_module_from_package",
                   "torch._C._jit_script_compile", "torch._C._jit_script_class_compile",
                   "torch._C._create_function_from_trace", "torch._C._create_function_from_trace_with_dict",
                   "torch.export.load", "torch.package.PackageImporter")


class Plan:
    """What blocking one check's `forbid` list takes, found before anything is blocked (`plan`): the
    functions to burn with their blockers, their code (`bytecode.Codes`), the operators to refuse. Every
    list also blocks `SERIALISED_CODE`."""

    def __init__(self, paths: tuple[str, ...], exercise: str, hint: str):
        paths = (*paths, *(p for p in SERIALISED_CODE if p not in paths))
        self.names = [p for p in paths if not ops.is_op_pattern(p)]
        self.private = private_targets(tuple(self.names))
        objects = []  # (object, label) of every forbidden name, alias and private helper
        for path in self.names:
            for owner, attr in forbidden_targets(path):
                if isinstance(owner, type) and attr not in vars(owner):
                    continue  # inherited (`CopyToTensorParallel.apply`): the base class's, blocked by name only
                objects.append((vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr), path))
        objects += [(vars(owner).get(attr), label) for owner, attr, label in self.private]
        self.burn, seen, implemented = [], set(), []
        for obj, label in objects:
            for fn in identity.implementations(obj):
                if id(fn) not in seen:
                    seen.add(id(fn))
                    name = f"{fn.__module__}.{fn.__qualname__}"
                    self.burn.append((fn, blocker(name, exercise, hint)))
                    if not hasattr(fn, "__wrapped__"):  # a decorator's code is generic: what it wraps is the answer
                        implemented.append((fn, label))
        self.codes = bytecode.Codes((identity.original(fn), label) for fn, label in implemented)
        self.originals = frozenset(id(fn) for fn, _ in self.burn)
        bound = [op for obj, _ in objects if (op := ops.op_of(obj))]
        patterns = [p for p in paths if ops.is_op_pattern(p)] + bound
        self.ops = sorted({op for p in patterns for op in ops.matching(p)})


_PLANS: dict[tuple, Plan] = {}


def plan(paths, exercise: str, hint: str = "") -> Plan:
    """The check's Plan (cached: the sandboxed runner finds it once, before forking each session)."""
    key = (tuple(paths), exercise, hint)
    if key not in _PLANS:
        _PLANS[key] = Plan(tuple(paths), exercise, hint)
    return _PLANS[key]


_PROTECTED: dict[int, frozenset] = {}


def protected() -> frozenset:
    """The grader's own functions (checks, runtime, meters), whose code and defaults a student may not
    change while a check runs (cached per count of imported modules)."""
    n = len(sys.modules)
    if n not in _PROTECTED:
        _PROTECTED.clear()
        _PROTECTED[n] = identity.protected_codes(("dlo.grading.", "dlo.checks.", "dlo.measure."))
    return _PROTECTED[n]


@contextlib.contextmanager
def forbidden(paths, exercise: str, hint: str = "", for_good: bool = False) -> Iterator[None]:
    """Block every forbidden reference of `paths` by name, identity and dispatch (see the module's
    docstring) inside the block; restored on exit unless `for_good`."""
    found = plan(paths, exercise, hint)  # found before anything is blocked
    saved, burned, state, registration, key = [], [], None, None, None
    try:
        _block_names(found, exercise, hint, saved)
        burned = identity.burn(found.burn)
        registration = ops.refused(found.ops, ForbiddenCall, exercise, hint, for_good)
        if for_good:
            identity.arm_for_good(found.codes, protected(), ForbiddenCall, exercise)
            _no_new_programs()
        else:
            state = identity.arm(found.codes, frozenset(), ForbiddenCall, exercise)
        key = _enter_guard(found, exercise, hint)
        yield
    finally:
        _leave_guard(key)
        if not for_good:
            identity.disarm(state, burned)
            ops.release(registration)
            for owner, attr, value in reversed(saved):
                setattr(owner, attr, value)


_NO_EXEC: list[str | None] = []  # this process's filter: installed once (None), or why it could not be


def _no_new_programs() -> None:
    """For good, no program started from here (`noexec`): a fresh interpreter has none of the blocks above. Where
    the kernel cannot refuse, the reason is printed once (the grader's log), and the checks go on."""
    if not _NO_EXEC:
        _NO_EXEC.append(noexec.deny_exec())
        if _NO_EXEC[0]:
            print(f"dlo.grading: {_NO_EXEC[0]}", file=sys.stderr)


_guard = threading.local()  # `active`: how many `forbidden` blocks of each (plan, exercise, hint) this thread is in


def _enter_guard(found: Plan, exercise: str, hint: str) -> tuple:
    key = (id(found), exercise, hint)
    _active()[key] += 1
    return key


def _leave_guard(key: tuple | None) -> None:
    if key is not None:
        _active()[key] -= 1


def _active() -> collections.Counter:
    if not hasattr(_guard, "active"):
        _guard.active = collections.Counter()
    return _guard.active


def guarding(paths, exercise: str, hint: str = "") -> bool:
    """True inside a `forbidden` block of the same check on this thread (a worker `api.run_worker` runs,
    a launch's rank): its names are blocked, its code and operators refused, already."""
    return _active()[(id(plan(paths, exercise, hint)), exercise, hint)] > 0


def _block_names(found: Plan, exercise: str, hint: str, saved: list) -> None:
    for path in found.names:
        for owner, attr in forbidden_targets(path):
            value = getattr(owner, attr)
            if getattr(value, "__dlo_forbidden__", None):
                continue  # already blocked (nested checks, or an alias listed twice)
            try:
                setattr(owner, attr, blocker(f"{owner.__name__}.{attr}" if attr != path else path, exercise, hint))
            except (AttributeError, TypeError):
                continue  # a read-only holder (a C extension type): its alias elsewhere is blocked
            saved.append((owner, attr, value))
    for owner, attr, label in found.private:
        raw = vars(owner).get(attr, _ABSENT)  # a class's own staticmethod comes back as one
        if raw is _ABSENT or getattr(raw, "__dlo_forbidden__", None):
            continue
        setattr(owner, attr, blocker(label, exercise, hint))
        saved.append((owner, attr, raw))


_THREAD_STARTERS = (("_thread", "start_new_thread"), ("_thread", "start_new"), ("_thread", "start_joinable_thread"),
                    ("threading", "_start_new_thread"), ("threading", "_start_joinable_thread"))


@contextlib.contextmanager
def no_threads(exercise: str, where: str = " on the ranks") -> Iterator[None]:
    """Starting a Python thread raises ForbiddenCall inside the block, and a thread that appeared
    anyway fails the check at its end. The grader counts collectives (`CommCounter`), saved tensors
    (`SavedTensorMeter`) and operators (its dispatch modes) on the thread that calls the student's code
    (all thread-local): work moved to another thread would be invisible to them (a red team's Day 3 kept a
    whole graph so, 2026-12-02). Used on the ranks and, for good, in the sandbox's session child."""
    message = (f"{exercise}: starting a thread is off limits while this check runs{where}: the grader counts the "
               f"collectives, the tensors saved for backward and the operators on the thread that calls your code; "
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


class Guarded:
    """A student callable whose calls run with the check's forbidden names blocked."""

    def __init__(self, fn, forbid, name, hint=""):
        self._fn, self._forbid, self._name, self._hint = fn, forbid, name, hint
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        if guarding(self._forbid, self._name, self._hint) and is_sealed_now():
            # called by a worker that already runs guarded and sealed (`api.run_worker`): blocking and sealing
            # again per call cost ~1 ms each (a schedule check calls the student's function once per step)
            return self._fn(*args, **kwargs)
        with forbidden(self._forbid, self._name, self._hint), sealed():
            return self._fn(*args, **kwargs)

    def __reduce__(self):  # ranks and workers get the plain function; they block names themselves
        return (_unwrap, (self._fn,))


def _unwrap(fn):
    return fn

