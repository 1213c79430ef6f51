"""Forbidden torch operators refused at dispatch, whatever Python object reached them.

A torch operator has many holders: `torch._fused_adamw_`, `torch._C._VariableFunctions._fused_adamw_`,
`torch.ops.aten._fused_adamw_.default`, a tensor method, `torch.library.get_kernel`. All of them end in
the dispatcher, so a check's forbidden operators are refused there: for each, a kernel that raises
`ForbiddenCall` is registered on every dispatch key that computes it (CPU, CUDA, Meta, the composite
keys), in front of torch's own. Other operators, and so honest code written with the same primitives
(plain tensor ops, foreach ops), never meet it.

A check names operators in its `forbid` list as `"aten::_fused_adamw*"` (a shell pattern over the
operator's name, every overload included); a forbidden name that is itself an operator's Python binding
(`torch._fused_sgd_`, `torch.nn.functional.scaled_dot_product_attention`) blocks that operator too.
`refused(ops, message, for_good=True)` (a process that runs the student's code until it ends: the
runner's session child, a launch's ranks) registers the kernels and leaks their registration, so that no
Python object can give torch's kernel back. A check that ends before its process does (a notebook's
immediate feedback, the tests) refuses them with a dispatch mode instead (`Refusing`, popped by
`release`): the dispatcher's own tables are never touched there, because undoing a registration does not
undo everything torch derived from it (after one, FakeTensorMode kept running the refusing kernel as the
operator's meta kernel: a notebook's later `dlo plan` failed).
"""

from __future__ import annotations

import fnmatch
import functools
import re
import types
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KEYS = ("CPU", "CUDA", "XPU", "MPS", "Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
        "CompositeImplicitAutograd")


def is_op_pattern(path: str) -> bool:
    """"aten::_fused_sgd*" names operators; a dotted name ("torch.optim.SGD") names a Python object."""
    return "::" in path


def op_of(obj) -> str | None:
    """The aten operator a torch builtin binds (`torch._fused_sgd_` -> "aten::_fused_sgd_"), else None."""
    if not isinstance(obj, types.BuiltinFunctionType) or not str(getattr(obj, "__module__", "") or "").startswith(
            "torch"):
        return None
    name = obj.__name__
    return f"aten::{name}" if torch._C._dispatch_has_kernel(f"aten::{name}") else None


_MATCHES: dict[str, tuple[str, ...]] = {}


def matching(pattern: str) -> tuple[str, ...]:
    """The registered operators (with their overloads, "aten::_fused_adamw_.tensor_lr") whose name,
    without the overload, matches `pattern` (cached: the list of operators is read once)."""
    if pattern not in _MATCHES:
        names = torch._C._dispatch_get_all_op_names()
        name_matches = re.compile(fnmatch.translate(pattern)).match  # fnmatchcase's regex, without its per-call wrapper
        _MATCHES[pattern] = tuple(sorted(n for n in names if name_matches(n.split(".", 1)[0])))
    return _MATCHES[pattern]


def _refuse(error, message, *args, **kwargs):
    raise error(message)


def _message(op: str, exercise: str, hint: str) -> str:
    return (f"{exercise}: the torch operator {op} is off limits while this check runs: the exercise asks for your "
            f"own implementation{f' ({hint})' if hint else ''}")


class Refusing(TorchDispatchMode):
    """Refuses `ops` (names with their overloads) while it is entered: every operator a tensor operation
    dispatches passes through it, whatever Python object reached the operator."""

    def __init__(self, ops, error, exercise: str, hint: str = ""):
        super().__init__()
        self.ops, self.error, self.exercise, self.hint = frozenset(ops), error, exercise, hint

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in self.ops:
            raise self.error(_message(name, self.exercise, self.hint))
        return func(*args, **(kwargs or {}))


def refused(ops: list[str], error, exercise: str, hint: str = "", for_good: bool = False):
    """Refuse each operator in `ops` (names with their overloads) with `error`: `for_good`, a kernel that
    raises registered on each dispatch key torch computes it on, for the rest of the process (None
    returned: nothing in Python holds the registration); otherwise a `Refusing` mode, entered here, that
    `release` pops."""
    if not ops:
        return None
    if not for_good:
        mode = Refusing(ops, error, exercise, hint)
        mode.__enter__()
        return mode
    modules = {}  # one library fragment per namespace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
        for op in ops:
            ns, name = op.split("::", 1)
            if ns not in modules:
                modules[ns] = torch._C._dispatch_library("IMPL", ns, "")
            kernel = functools.partial(_refuse, error, _message(op, exercise, hint))
            for key in KEYS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
                    modules[ns].impl(name, key, kernel)
    import ctypes

    for module in modules.values():  # never freed: torch's kernels stay behind ours
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(module))
    return None


def release(registration) -> None:
    """The operators of a `refused(..., for_good=False)` given back (its mode popped)."""
    if registration is not None:
        registration.__exit__(None, None, None)
