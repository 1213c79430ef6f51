"""What a rank holds: the bytes of the tensor storages an object reaches (`held_bytes`), and of every tensor
alive in the process (`live_bytes`).

Both run in the same process as the code they measure (a student's ZeRO engine, on its rank), so they read
through the C-level functions captured when this module is imported, before any student code runs:
replacing `torch.Tensor.untyped_storage`, `gc.get_referents` or `builtins.isinstance` afterwards changes
nothing here, and a tensor subclass cannot declare itself data-free (that is asked of its storage).
`live_bytes` is the check on `held_bytes`: an engine that keeps state where the walk from it does not go
(a class attribute, a module global) holds it all the same, and a check that compares the process's growth
with what the engine reaches sees it (`dlo.checks.day5_memory`).

`live_bytes` costs what the process has made since it started, not its whole heap: a rank forked from
the launcher's fork server freezes what it inherited (`gc.freeze`, `dlo.distributed._worker`: torch and the
checks, some 300k objects), which then stays out of every collection and of `gc.get_objects`. Nothing of a
check's is frozen there, and the growth between two calls is the same; what would hide a tensor from it
is a later freeze, so a canary made at the first call must still be young, else everything is unfrozen
and walked (0.6 s a call on a rank, against 0.02).
"""

from __future__ import annotations

import gc
import itertools
import types

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _wrapper

# captured at import: the walk never looks these names up again
_TensorBase, _StorageBase = torch._C.TensorBase, torch._C.StorageBase
_storage = _TensorBase.untyped_storage
_nbytes, _data_ptr = _StorageBase.nbytes, _StorageBase.data_ptr
_cdata = _StorageBase._cdata.__get__
_grad, _is_leaf, _is_meta = _TensorBase.grad.__get__, _TensorBase.is_leaf.__get__, _TensorBase.is_meta.__get__
_referents, _objects, _collect = gc.get_referents, gc.get_objects, gc.collect
_freeze_count, _unfreeze = gc.get_freeze_count, gc.unfreeze
_type, _issubclass, _id, _sum, _set, _list, _map = type, issubclass, id, sum, set, list, map
_compress = itertools.compress
_FUNCTION, _METHOD = types.FunctionType, types.MethodType
# a subclass's methods go through __torch_function__, which looks the method up by name on torch.Tensor (where
# it can be replaced): the walks run with that turned off, so every call is the C function captured above
_plain = torch._C.DisableTorchFunctionSubclass
_NOT_FOLLOWED = (type, types.ModuleType, str, bytes, int, float, bool, complex, type(None))


def _is_tensor(obj) -> bool:
    return _issubclass(_type(obj), _TensorBase)  # type() cannot be faked by a __class__ property


def _add(storages: dict, t) -> None:
    s = _storage(t)
    try:
        _data_ptr(s)
    except RuntimeError:  # a wrapper (a DTensor) has no data of its own: its local shard is a tensor of its own
        return
    if _is_meta(t) and _wrapper(t):  # on meta no storage has data: there the class says (no memory to hide)
        return
    storages[_cdata(s)] = _nbytes(s)  # asked of the storage, not of the class: a subclass cannot opt out


def held_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` through Python references:
    attributes, containers, closures and defaults of functions (hooks), bound methods, a leaf's
    `.grad`, a DTensor's local shard. What an object such as a sharded training engine holds, its
    model states, independent of the device (meta tensors count their size). A storage viewed by
    several tensors counts once, with its current size (a freed FSDP-style buffer counts 0).
    Modules, classes and functions' globals are not followed (`live_bytes` sees what they hold);
    tensors only autograd holds (the activations saved for backward) are not reachable from Python
    and do not count."""
    storages = {}
    with _plain():
        for t in _walk(roots):
            _add(storages, t)
    return _sum(storages.values())


def reachable_tensors(*roots) -> list:
    """The tensors reachable from `roots` by `held_bytes`' walk (each once), for a check that asks more of
    them than their bytes (Day 3: where pack's result keeps its copy)."""
    with _plain():
        return _walk(roots)


def _walk(roots) -> list:
    seen, found, stack = _set(), [], _list(roots)
    while stack:
        obj = stack.pop()
        if _issubclass(_type(obj), _NOT_FOLLOWED) or _id(obj) in seen:
            continue
        seen.add(_id(obj))
        if _is_tensor(obj):
            found.append(obj)
            grad = _grad(obj) if _is_leaf(obj) else None
            if grad is not None:
                stack.append(grad)
        if _type(obj) is _FUNCTION:
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(obj.__defaults__ or ())
        elif _type(obj) is _METHOD:
            stack.append(obj.__self__)
        else:
            stack.extend(_referents(obj))
    return found


class _Canary:
    """Made young at `live_bytes`' first call: frozen since only if someone called gc.freeze() after it."""


_canary: _Canary | None = None


def _young() -> list:
    """Every object the collector tracks outside the frozen generation, garbage collected first; all of
    them (unfrozen) when something was frozen after the canary."""
    global _canary
    if _canary is None:
        _canary = _Canary()
    _collect()
    objects = _objects()
    if _freeze_count() and _id(_canary) not in _set(_map(_id, objects)):
        _unfreeze()  # a freeze after the first call could hide what was made since: walk everything
        _collect()
        objects = _objects()
    return objects


def live_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process that Python can see (the
    garbage collector tracks every tensor object), with their gradients; what only autograd's C++ side
    holds does not count, nor does what was frozen before the first call (see the module's text).
    Garbage is collected first (a cycle waiting for the collector is not kept).
    Take it before and after: the growth is what was kept, wherever it was kept."""
    objects = _young()
    # the tensors picked in C (type() of each object, the tensor types among them): no Python loop over all
    tensor_kinds = _set(k for k in _set(_map(_type, objects)) if _issubclass(k, _TensorBase))
    storages = {}
    with _plain():
        for obj in _compress(objects, _map(tensor_kinds.__contains__, _map(_type, objects))):
            _add(storages, obj)
            grad = _grad(obj) if _is_leaf(obj) else None
            if grad is not None:
                _add(storages, grad)
    return _sum(storages.values())
