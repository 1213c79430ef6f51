"""What student code may not call while a check runs: the forbidden references and new threads.

`check(forbid=...)` lists dotted names (the library references and torch functions that solve the
exercise; "module.*" for every public function and class of a module). While student code runs under
the check, `forbidden(paths, exercise)` replaces each by a blocker that raises `ForbiddenCall`, under
that name and under every other module attribute of the same package bound to the same object
(re-exports such as `dlo.optim.adamw_step`, the defining module such as `torch.optim.adamw.AdamW`),
and the private helpers only the forbidden objects use (`private_targets`). `no_threads` refuses new
Python threads on a check's ranks. This runs where the student's code runs (the kernel of a direct
check, the sandboxed runner, the ranks), so the seal leaves it open (`dlo.grading.seal.OPEN`). (Just over 300
lines: what a forbidden name stands for and how it is blocked are read together.)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Iterator

from dlo.grading.seal import PACKAGES, sealed


class ForbiddenCall(AssertionError):
    """A check's forbidden reference was called by the student's code."""


_ABSENT = object()


def resolve(path: str):
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
    owner, attr = resolve(path)
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
                    or name.startswith(PACKAGES):  # the grader's own namespaces keep their references
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
        owner, attr = resolve(path)
        module = owner if isinstance(owner, types.ModuleType) else sys.modules.get(getattr(owner, "__module__", ""))
        if module is None or not module.__name__.startswith("dlo.") or module.__name__.startswith(PACKAGES):
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
        if module is None or name == home or not name.startswith("dlo.") or name.startswith(PACKAGES):
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


def blocker(path: str, exercise: str, hint: str = "") -> _Blocked:
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
                    setattr(owner, attr, blocker(f"{owner.__name__}.{attr}" if attr != path else path,
                                                  exercise, hint))
                except (AttributeError, TypeError):
                    continue  # a read-only holder (a C extension type): its alias elsewhere is blocked
                saved.append((owner, attr, value))
        for owner, attr, label in private:
            raw = vars(owner).get(attr, _ABSENT)  # a class's own staticmethod comes back as one
            if raw is _ABSENT or getattr(raw, "__dlo_forbidden__", None):
                continue
            setattr(owner, attr, blocker(label, exercise, hint))
            saved.append((owner, attr, raw))
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)



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


class Guarded:
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

