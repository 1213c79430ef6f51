"""Trusted side -> sandbox: a request is cloudpickle, with the grader's stand-ins.

The sandbox may unpickle anything the grader sends (the grader wrote it; see `dlo.grading.wire` for
why the direction back is never a pickle). Requests carry workers (module-level functions, pickled by
reference), the check's inputs (tensors as raw bytes with their `.grad`, modules, generators as
`OneShot` lists) and two kinds of stand-ins: `Ref` for the student's objects living in the sandbox,
`Callback` for trusted callables the student's code calls back (they stay on the trusted side and are
called over the channel). The runner unpickles them while sealed, so the seal leaves this module open.
"""

from __future__ import annotations

import io
import pickle
import sys
import types

import torch

from dlo import pickling
from dlo.grading.wire import tensor_bytes, tensor_from_bytes


class Ref:
    """A student object in the sandbox: ("cap", path of its capture file) or ("obj", handle id)."""

    def __init__(self, kind: str, key):
        self.kind, self.key = kind, key


class Callback:
    """A trusted callable, called back over the channel by the sandbox (`call_back` is set there)."""

    call_back = None  # (callback, args, kwargs) -> result, installed by the runner's session

    def __init__(self, cid: int, name: str):
        self.cid, self.name = cid, name
        self.__name__ = self.__qualname__ = name.rsplit(".", 1)[-1]

    def __call__(self, *args, **kwargs):
        if Callback.call_back is None:  # pickled on to a rank: only the session's own process can call back
            raise RuntimeError(f"{self.name} is the grader's function: it can be called from the check's process, "
                               f"not from its ranks (pass data to on_ranks workers)")
        return Callback.call_back(self, args, kwargs)

    def __repr__(self):
        return f"<the grader's {self.name}>"


class OneShot:
    """A generator argument, materialised on the trusted side: iterates once, like the generator."""

    def __init__(self, items: list):
        self.items = items
        self._it = iter(items)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __reduce__(self):
        return (OneShot, (self.items,))


def _tensor(data, requires_grad, grad, param):
    t = torch.nn.Parameter(data, requires_grad=requires_grad) if param else data.requires_grad_(requires_grad)
    t.grad = grad
    return t


def _fast_tensor(dtype, shape, raw, requires_grad, grad, param):
    return _tensor(tensor_from_bytes(dtype, shape, raw), requires_grad, grad, param)


def by_reference(fn) -> bool:
    """True when `fn` can be imported by name (module-level, not __main__, not a lambda or closure)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or module not in sys.modules:
        return False
    obj = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


class RequestPickler(pickling.Pickler):
    """cloudpickle with the grader's stand-ins: `encode_ref(obj)` maps a handle to a Ref (or None),
    `callback(fn)` registers a trusted callable and returns its Callback."""

    def __init__(self, file, encode_ref, callback):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._encode_ref, self._callback = encode_ref, callback

    def reducer_override(self, obj):
        ref = self._encode_ref(obj)
        if ref is not None:
            return (Ref, (ref.kind, ref.key))
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided and obj.device.type == "cpu":
            # raw bytes (torch's own pickling saves each storage through torch.save: far slower), and the
            # .grad that pickle would drop
            return (_fast_tensor, (*tensor_bytes(obj), obj.requires_grad, obj.grad, type(obj) is torch.nn.Parameter))
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.grad is not None:
            # pickle drops .grad; send it beside the data (a detached tensor has no grad: no recursion)
            return (_tensor, (obj.detach(), obj.requires_grad, obj.grad, type(obj) is torch.nn.Parameter))
        if isinstance(obj, (types.FunctionType, types.MethodType)) and not by_reference(obj) \
                and not isinstance(getattr(obj, "__self__", None), (type, types.ModuleType)):
            return (Callback, (self._callback(obj).cid, getattr(obj, "__qualname__", "callback")))
        return super().reducer_override(obj)


def dump_request(obj, encode_ref=lambda o: None, callback=None) -> bytes:
    buf = io.BytesIO()
    RequestPickler(buf, encode_ref, callback or _no_callbacks).dump(obj)
    return buf.getvalue()


def _no_callbacks(fn):
    raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} cannot be sent to the sandbox here")
