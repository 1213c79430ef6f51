"""The grader's own modules, out of reach where student code runs.

`dlo.checks` holds the checks, their references and their test benches (the model a check builds, the
worker that runs the student's code); `dlo.grading` the runtime that grades with them, its trusted side
among it (the sandboxed backend, the jail, the test cells). Where student code runs while a check
judges it - the grading kernel, the sandboxed runner, the ranks of an on-ranks check, and a direct
check's call into the student's function - both packages are *sealed*:

- every `dlo.checks` and `dlo.grading` module except the few the student's side runs on (`OPEN`: the
  check API, the comparisons, the forbidden names machinery, the frames folding, the wire format, the
  runner, this seal; no reference in them) is replaced in `sys.modules`, and as the `dlo.checks` /
  `dlo.grading` attribute of `dlo`, by a placeholder: `import dlo.checks.day5` still works (the
  notebook's import cell), but any attribute of it raises AttributeError naming what is off limits
  (`dlo.checks.day5.memory_per_rank is the grader's...`);
- a finder first on `sys.meta_path` gives the same placeholder for a sealed module not imported yet,
  so `importlib.import_module`, `__import__`, `importlib.reload` and `sys.modules` lookups all meet the
  placeholder, never the module.

The trusted code that runs beside the student's (a check's worker, already loaded) keeps its module's
globals: sealing hides names, it does not unload anything. `sealed()` is a context (restored on exit:
a direct check in a notebook, the tests' ranks); `seal()` is for good (the grading kernel). What the
grader itself must unpickle while sealed (requests, a worker by reference) goes through
`Sealing.loads`, which resolves sealed names from the real modules.

Not a wall against everything: the source files stay readable, and a student who dismantles the
finder or walks the interpreter's frames and objects can reach what Python can reach. That is why
the checks also keep the answers off the student's side (a secret seed, each rank its own shard).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import pickle
import sys
import types
from collections.abc import Iterator

PACKAGES = ("dlo.checks", "dlo.grading")
# what the student's side runs on (the kernel of a direct check, the sandboxed runner, the ranks): no reference
# in them; every other dlo.grading module is the trusted side's (the sandboxed backend, the jail, the test cells)
OPEN = tuple(f"dlo.grading.{m}" for m in ("api", "bytecode", "compare", "forbid", "frames", "identity",
                                          "jail_runner", "jail_session", "meter", "noexec", "ops", "ranks", "seal",
                                          "targets", "wire", "wire_request"))


def is_sealed(name: str) -> bool:
    """True for a module name that sealing hides: the package and its modules, but OPEN."""
    # a check seals around every call of the student's function and each seal reads all of sys.modules
    # (some 2000 names): most of them are ruled out by one C call, not two generators
    if not name.startswith(PACKAGES):
        return False
    return any(name == p or name.startswith(p + ".") for p in PACKAGES) and not any(
        name == m or name.startswith(m + ".") for m in OPEN)


def message(name: str) -> str:
    return (f"{name} is the grader's (the checks, their references and test benches): off limits where your "
            f"code runs while it is graded; write your own implementation")


class Placeholder(types.ModuleType):
    """What a sealed module's name gives: importable, every attribute off limits (AttributeError, so
    that introspection such as hasattr or pickle's lookups treats it as absent)."""

    def __init__(self, name: str):
        super().__init__(name, f"{name} is the grader's: off limits here")
        # what `from dlo.checks.day5 import x` names in its ImportError ("cannot import name 'x' from ...")
        self.__file__ = "the grader's module: off limits while your code is graded"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if isinstance(sys.modules.get(full), Placeholder) or (not is_sealed(full) and full in sys.modules):
            return sys.modules[full]  # dlo.checks.day5 (a placeholder too), dlo.grading.wire (open)
        raise AttributeError(message(full))

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (the grader's: off limits here)>"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path while sealed: a sealed name not in sys.modules becomes a placeholder."""

    def __init__(self, package_path: dict[str, list[str]]):
        self.package_path = package_path

    def find_spec(self, fullname, path=None, target=None):
        if not is_sealed(fullname):
            return None
        package = fullname in PACKAGES
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=package)
        if package:  # OPEN modules are found below it as usual
            spec.submodule_search_locations = list(self.package_path[fullname])
        return spec

    def create_module(self, spec):
        return Placeholder(spec.name)

    def exec_module(self, module):
        pass


def _package_path(package: str) -> list[str]:
    module = sys.modules.get(package)
    path = getattr(module, "__path__", None) if not isinstance(module, Placeholder) else None
    if path is None:
        spec = importlib.machinery.PathFinder.find_spec(package, sys.modules["dlo"].__path__)
        path = spec.submodule_search_locations if spec else []
    return list(path)


class Sealing:
    """The state of one seal: the real modules it hid (for the grader's own unpickling), and how to undo it."""

    def __init__(self):
        import dlo

        self.dlo = dlo
        self.real = {n: m for n, m in list(sys.modules.items()) if m is not None and is_sealed(n)}
        self.finder = _Finder({p: _package_path(p) for p in PACKAGES})
        self.saved_attr = {p: dlo.__dict__.get(_attr(p), _MISSING) for p in PACKAGES}
        self.before = set(sys.modules)

    def enter(self) -> Sealing:
        sys.meta_path.insert(0, self.finder)
        for name in self.real:
            placeholder = Placeholder(name)
            if name in PACKAGES:
                placeholder.__path__ = list(self.finder.package_path[name])
            sys.modules[name] = placeholder
        for package in PACKAGES:
            if package not in sys.modules:
                importlib.import_module(package)  # through the finder: a placeholder package
            setattr(self.dlo, _attr(package), sys.modules[package])
        return self

    def exit(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)
        for name in [n for n in list(sys.modules) if n not in self.before and is_sealed(n)]:
            del sys.modules[name]  # placeholders made while sealed
        sys.modules.update(self.real)
        for package, saved in self.saved_attr.items():
            if saved is _MISSING:
                self.dlo.__dict__.pop(_attr(package), None)
            else:
                setattr(self.dlo, _attr(package), saved)

    def find_class(self, module: str, name: str):
        """A global of the grader's pickle: sealed names from the real modules."""
        if module in self.real:
            obj = self.real[module]
            for part in name.split("."):
                obj = getattr(obj, part)
            return obj
        return None

    def loads(self, data: bytes):
        """Unpickle what the grader sent (a request, a worker by reference) while sealed."""
        return _Unpickler(io.BytesIO(data), self).load()


_MISSING = object()


def _attr(package: str) -> str:
    """The attribute of `dlo` a sealed package is bound to ("dlo.checks" -> "checks")."""
    return package.split(".", 1)[1]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, sealing: Sealing):
        super().__init__(file)
        self.sealing = sealing

    def find_class(self, module, name):
        found = self.sealing.find_class(module, name)
        return found if found is not None else super().find_class(module, name)


def is_sealed_now() -> bool:
    """True while the grader's modules are sealed in this process (by `sealed` or `seal`)."""
    return all(isinstance(sys.modules.get(p), Placeholder) for p in PACKAGES)


@contextlib.contextmanager
def sealed() -> Iterator[Sealing]:
    """The grader's modules sealed inside the block (restored on exit); the Sealing, for the grader's own loads."""
    sealing = Sealing().enter()
    try:
        yield sealing
    finally:
        sealing.exit()


def seal() -> Sealing:
    """The grader's modules sealed for the rest of this process (the grading kernel, a runner's session)."""
    return Sealing().enter()
