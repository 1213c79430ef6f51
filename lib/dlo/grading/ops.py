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
`refused(ops, message)` registers the kernels: `for_good` (a process that runs the student's code until
it ends) leaks their registration, so that no Python object can give torch's kernel back; otherwise the
returned handle's deletion (`release`) restores torch's kernels.
"""

from __future__ import annotations

import fnmatch
import functools
import types
import warnings

import torch

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
        _MATCHES[pattern] = tuple(sorted(n for n in names if fnmatch.fnmatchcase(n.split(".", 1)[0], pattern)))
    return _MATCHES[pattern]


def _refuse(error, message, *args, **kwargs):
    raise error(message)


def refused(ops: list[str], error, exercise: str, hint: str = "", for_good: bool = False):
    """Register, for each operator in `ops` (names with their overloads), a kernel that raises
    `error` on each dispatch key torch computes it on. Returns the registration (None when `for_good`:
    then it lives as long as the process, and nothing in Python holds it)."""
    if not ops:
        return None
    modules = {}  # one library fragment per namespace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
        for op in ops:
            ns, name = op.split("::", 1)
            if ns not in modules:
                modules[ns] = torch._C._dispatch_library("IMPL", ns, "")
            message = (f"{exercise}: the torch operator {op} is off limits while this check runs: the exercise "
                       f"asks for your own implementation{f' ({hint})' if hint else ''}")
            kernel = functools.partial(_refuse, error, message)
            for key in KEYS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
                    modules[ns].impl(name, key, kernel)
    if not for_good:
        return list(modules.values())
    import ctypes

    for module in modules.values():  # never freed: torch's kernels stay behind ours
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(module))
    return None


def release(registration) -> None:
    """Torch's own kernels back (a registration of `refused` undone)."""
    for module in registration or ():
        module.reset()
