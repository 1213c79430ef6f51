"""What a forbidden name stands for: the objects a check's `forbid` list names, and where else they are bound.

`resolve` finds the holder of a dotted name; `forbidden_targets` every (holder, attribute) bound to the
same object (re-exports such as `dlo.optim.adamw_step`, the defining module such as
`torch.optim.adamw.AdamW`; "module.*" for every public function and class of a module, "package.**" of the
package and every submodule of it that imports; "aten::name*"
for the Python packets of the torch operators a pattern matches, `torch.ops.aten.name`);
`private_targets` the private machinery only forbidden objects use. `dlo.grading.forbid` blocks them
all. Runs where the student's code runs, before anything is blocked, so the seal leaves it open.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types

from dlo.grading import ops
from dlo.grading.identity import kernel_function
from dlo.grading.seal import PACKAGES


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
    if path.endswith(".**"):
        return [pair for module in submodules(path[:-3]) for pair in forbidden_targets(f"{module}.*")]
    if ops.is_op_pattern(path):  # the operators' Python packets; the operators themselves: ops.refused
        import torch

        return [(getattr(torch.ops, ns), name) for ns, name in dict.fromkeys(
            tuple(op.split(".", 1)[0].split("::", 1)) for op in ops.matching(path))]
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


_SUBMODULES: dict[str, tuple[str, ...]] = {}


def submodules(package: str) -> tuple[str, ...]:
    """`package` and every module under it that imports (one that needs a package this machine lacks, as
    torch.ao.pruning's Lightning callbacks, is nobody's way in): a name list misses a module it does not know
    (a red team reached torch.ao.pruning's sparsifiers and schedulers while a check named only
    torch.nn.utils.prune, 2026-12-02). Cached per process."""
    if package not in _SUBMODULES:
        root, found = importlib.import_module(package), [package]
        for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + ".", onerror=lambda name: None):
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - any import error: a module that cannot load holds nothing to call
                continue
            found.append(info.name)
        _SUBMODULES[package] = tuple(found)
    return _SUBMODULES[package]


# package -> (the names of the modules looked at so far, id(value) -> [(module, attribute)]): one index per
# process, extended with the modules imported since, instead of a scan of every module per forbidden name
_INDEX: dict[str, tuple[set, dict]] = {}


def _aliases(package: str, obj) -> list[tuple[object, str]]:
    """Every (module, attribute) of `package` bound to `obj`."""
    seen, by_id = _INDEX.setdefault(package, (set(), {}))
    for name in sys.modules.keys() - seen:  # the modules imported since the last call (a set difference in C)
        seen.add(name)
        module = sys.modules.get(name)
        if module is None or not (name == package or name.startswith(package + ".")) \
                or name.startswith(PACKAGES):  # the grader's own namespaces keep their references
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            by_id.setdefault(id(value), []).append((module, attr))
    # still bound there: the index holds ids, and a freed object's id may be another's now
    return [(m, a) for m, a in by_id.get(id(obj), ()) if vars(m).get(a) is obj]


def _code_names(code) -> set[str]:
    """The global and attribute names a code object (and the functions nested in it) mentions."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _functions_of(obj) -> list:
    """The plain functions of a module-level function, Triton kernel or class (its own methods, unwrapped)."""
    obj = kernel_function(obj) or obj
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
        if ops.is_op_pattern(path) or path.endswith(".**"):  # torch's: dlo's private machinery is not under them
            continue
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
        defined = {a: v for a, v in vars(module).items() if (isinstance(v, (type, types.FunctionType))
                                                              or kernel_function(v) is not None)
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
