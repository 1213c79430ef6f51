"""The two directions of the grader's channel, and why they differ.

Trusted side -> sandbox: cloudpickle. The sandbox may unpickle anything the grader sends (the grader
wrote it), so requests carry workers (module-level functions, pickled by reference), the check's
inputs (tensors with their `.grad`, modules, generators) and two kinds of stand-ins: `Ref` for the
student's objects living in the sandbox, `Callback` for trusted callables the student's code calls
back (they stay on the trusted side and are called over the channel). That direction is
`dlo.grading.wire_request`; this module is the frames, and the direction back.

Sandbox -> trusted side: never a pickle. A message is a JSON skeleton (numbers, strings, bytes, None,
lists, tuples, dicts, dtypes, sizes, devices) plus the raw bytes of its tensors, each described by
dtype, shape and offset and rebuilt with `torch.frombuffer`: no unpickler runs at all (stricter and
faster than `torch.load(weights_only=True)`). A student object that is none of these crosses as a
handle number (`{"h": id}`), never as the object. Decoding is strict: an unknown tag is an error.

Frames on both directions: a 4-byte big-endian length, then the payload.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys

import torch

FRAME = struct.Struct(">I")
MAX_FRAME = 2 ** 31 - 1
MAX_DEPTH = 64  # nesting of a value; deeper is refused (and a cycle ends here too)


class ChannelClosed(EOFError):
    """The other end of a channel went away in the middle of a frame or before one."""


# ----------------------------------------------------------------------------- frames

def write_frame(fd: int, payload: bytes) -> None:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"message of {len(payload)} bytes is too large for the grader's channel")
    data = memoryview(FRAME.pack(len(payload)) + payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> bytes:
    (n,) = FRAME.unpack(read_exact(fd, FRAME.size))
    return read_exact(fd, n)


# ----------------------------------------------------------------------------- tensors as bytes

def tensor_bytes(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, raw bytes) of a dense tensor (on the CPU, contiguous)."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype).removeprefix("torch."), list(t.shape), raw


def tensor_from_bytes(dtype: str, shape, raw: bytes) -> torch.Tensor:
    """The inverse of tensor_bytes; ValueError for anything inconsistent (the bytes may be a student's)."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(dt, torch.dtype) or not isinstance(shape, list) \
            or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 16:
        raise ValueError("malformed message: bad tensor description")
    numel = 1
    for n in shape:
        numel *= n
    if numel * torch.empty((), dtype=dt).element_size() != len(raw):
        raise ValueError("malformed message: tensor size does not match its bytes")
    if not numel:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)


# ----------------------------------------------------------------------------- sandbox -> trusted

class Unsafe(TypeError):
    """A value that may not cross from the sandbox as data (and no handle was allowed)."""

    student_side = True  # the student's value: not the grader's fault (`frames.grader_fault`)


class Encoder:
    """A value as (JSON skeleton, tensors). `handle(obj)` gives a handle id for a non-plain object;
    None (the default) makes such an object an `Unsafe` error."""

    def __init__(self, handle=None):
        self.tensors: list[torch.Tensor] = []
        self.handle = handle

    def skel(self, obj, depth: int = 0):
        if depth > MAX_DEPTH:
            raise Unsafe("the value is nested too deeply (or refers to itself)")
        d = depth + 1
        if obj is None or type(obj) in (bool, str):
            return obj
        if type(obj) is int:
            return obj if abs(obj) < 2 ** 63 else {"i": str(obj)}
        if type(obj) is float:
            return obj
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            self.tensors.append(obj.detach().cpu())
            return {"t": len(self.tensors) - 1, "rg": bool(obj.requires_grad),
                    "P": type(obj) is torch.nn.Parameter}
        if type(obj) is list:
            return [self.skel(x, d) for x in obj]
        if type(obj) is tuple:
            return {"T": [self.skel(x, d) for x in obj]}
        if type(obj) is dict:
            return {"D": [[self.skel(k, d), self.skel(v, d)] for k, v in obj.items()]}
        if isinstance(obj, torch.dtype):
            return {"dt": str(obj).removeprefix("torch.")}
        if type(obj) is torch.Size:
            return {"S": [int(x) for x in obj]}
        if type(obj) is torch.device:
            return {"dev": str(obj)}
        if type(obj) is bytes:
            return {"b": base64.b64encode(obj).decode()}
        if type(obj) is complex:
            return {"c": [obj.real, obj.imag]}
        plain = _numpy_plain(obj)
        if plain is not None:
            return self.skel(plain, d)
        if self.handle is None:
            raise Unsafe(type(obj).__name__)
        return {"h": self.handle(obj), "ty": type(obj).__name__[:80]}


def _numpy_plain(obj):
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        return torch.from_numpy(obj.copy())
    return None


def encode(value, handle=None) -> bytes:
    """`value` as a message: header length, JSON header (skeleton and tensor table), tensor bytes."""
    enc = Encoder(handle)
    skel = enc.skel(value)
    table, chunks, offset = [], [], 0
    for t in enc.tensors:
        dtype, shape, raw = tensor_bytes(t)
        table.append([dtype, shape, offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps({"v": skel, "T": table}, allow_nan=True).encode()
    return FRAME.pack(len(head)) + head + b"".join(chunks)


class Decoder:
    """The inverse of Encoder, for data that may come from a student: only json and
    `tensor_from_bytes` run; `make_handle(id, type_name)` builds the trusted side's handle."""

    def __init__(self, tensors: list, make_handle=None):
        self.tensors, self.make_handle = tensors, make_handle

    def value(self, s, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("malformed message: nested too deeply")
        d = depth + 1
        if s is None or type(s) in (bool, int, float, str):
            return s
        if type(s) is list:
            return [self.value(x, d) for x in s]
        if type(s) is not dict or len(s) not in (1, 2, 3):
            raise ValueError("malformed message")
        if "t" in s:
            t = self.tensors[_index(s["t"], len(self.tensors))]
            if s.get("P") is True:
                return torch.nn.Parameter(t, requires_grad=s.get("rg") is True)
            return t.requires_grad_(True) if s.get("rg") is True and (t.is_floating_point() or t.is_complex()) else t
        if "T" in s:
            return tuple(self.value(x, d) for x in _list(s["T"]))
        if "D" in s:
            out = {}
            for pair in _list(s["D"]):
                k, v = _list(pair)
                key = self.value(k, d)
                if isinstance(key, (list, dict, torch.Tensor)):
                    raise ValueError("malformed message: unhashable key")
                out[key] = self.value(v, d)
            return out
        if "i" in s:
            return int(_str(s["i"]))
        if "dt" in s:
            dtype = getattr(torch, _str(s["dt"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError("malformed message: unknown dtype")
            return dtype
        if "S" in s:
            return torch.Size([int(x) for x in _list(s["S"])])
        if "dev" in s:
            return torch.device(_str(s["dev"]))
        if "b" in s:
            return base64.b64decode(_str(s["b"]))
        if "c" in s:
            re, im = _list(s["c"])
            return complex(float(re), float(im))
        if "h" in s:
            if self.make_handle is None:
                raise ValueError("malformed message: a handle where none may be")
            return self.make_handle(_index(s["h"], 2 ** 62), _str(s.get("ty", "object")))
        raise ValueError("malformed message: unknown tag")


def _index(x, n: int) -> int:
    if type(x) is not int or not 0 <= x < n:
        raise ValueError("malformed message: bad index")
    return x


def _list(x) -> list:
    if type(x) is not list:
        raise ValueError("malformed message: expected a list")
    return x


def _str(x) -> str:
    if type(x) is not str:
        raise ValueError("malformed message: expected a string")
    return x


def decode(data: bytes, make_handle=None):
    """A message from the sandbox, rebuilt from JSON and raw tensor bytes only (no unpickler)."""
    if len(data) < FRAME.size:
        raise ValueError("malformed message: too short")
    (n,) = FRAME.unpack(data[:FRAME.size])
    head, blob = data[FRAME.size:FRAME.size + n], data[FRAME.size + n:]
    if len(head) != n:
        raise ValueError("malformed message: truncated")
    header = json.loads(head)
    if type(header) is not dict or set(header) != {"v", "T"} or type(header["T"]) is not list:
        raise ValueError("malformed message: bad header")
    tensors = []
    for entry in header["T"]:
        dtype, shape, offset, n = _list(entry)
        if type(offset) is not int or type(n) is not int or not 0 <= offset <= offset + n <= len(blob):
            raise ValueError("malformed message: tensor bytes out of range")
        tensors.append(tensor_from_bytes(dtype, shape, blob[offset:offset + n]))
    return Decoder(tensors, make_handle).value(header["v"])
