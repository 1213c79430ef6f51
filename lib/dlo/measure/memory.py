"""Memory in bytes, one unit everywhere: saved tensors on any device, the CUDA allocator's peak on GPUs
(part of `dlo.measure`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dlo.measure.timing import sync, time_fn

# ----------------------------------------------------------------------------- memory

def tensors_in(x) -> list[Tensor]:
    """The tensors in x: a tensor, or (nested) tuples and lists of them among other values; in order.
    Not pytree's tree_flatten: its recursive helper leaves a reference cycle per call, garbage that a
    tracemalloc measure (Day 2's FlashAttention check) would count until the collector runs."""
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors_in(item)]
    return []


def storage_key(t: Tensor) -> int:
    """Identity of t's storage (the C++ StorageImpl's address): the same for every view of one buffer,
    distinct for distinct buffers also on the meta device, where every data pointer is 0."""
    return t.untyped_storage()._cdata


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Counts the bytes autograd keeps for backward while the context is active.

    Every saved tensor passes through the pack hook; a storage is counted once however many ops save
    it (or views of it), and is released when the last graph node holding it frees it. Parameters'
    storages (listed in `exclude`) are not activations and are skipped. `bytes` is the current total,
    `peak` its maximum, including tensors saved again by recomputation during backward. What it
    saved is freed with the graph, backpropagated or not (`saved_bytes(..., backward=False)`).

    Storages are told apart by identity, not by address, so tensors without memory count too: on the
    meta device (or under FakeTensorMode) the meter gives the bytes a real run would save, from the
    shapes alone. That is how `dlo plan` sizes the activations of full-size models on a CPU.

    `ignore(t)` True: a saved tensor that is not an activation (a check's exemption, e.g. an RNG state to
    replay), not counted. `made` adds up every storage counted since the context began, freed or not: what
    the forwards saved in all, where `bytes` is what is held now.
    """

    def __init__(self, exclude=(), ignore: Callable[[Tensor], bool] | None = None):
        self.skip = {storage_key(p) for p in exclude}
        self.ignore = ignore
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.dtypes: dict[int, torch.dtype] = {}
        self.bytes = self.peak = self.made = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.bytes -= self.sizes.pop(key)
            del self.refs[key], self.dtypes[key]

    def _pack(self, t: Tensor):
        # keep a detached alias (same storage, no grad_fn): an output saved by its own node (exp, softmax)
        # would otherwise hold that node through its grad_fn, a cycle through C++ that Python's collector
        # cannot see, and a forward that is never backpropagated would keep its whole graph alive
        held = _Held(t.detach())
        key = storage_key(t)
        if key in self.skip or (self.ignore is not None and key not in self.refs and self.ignore(t)):
            return held
        if key not in self.refs:
            self.refs[key], self.sizes[key], self.dtypes[key] = 0, t.untyped_storage().nbytes(), t.dtype
            self.bytes += self.sizes[key]
            self.made += self.sizes[key]
            self.peak = max(self.peak, self.bytes)
        self.refs[key] += 1
        weakref.finalize(held, self._release, key)
        return held

    def bytes_by_dtype(self) -> dict[str, int]:
        """The storages held now, bytes per dtype name ("float32", ...)."""
        out: dict[str, int] = {}
        for key, nbytes in self.sizes.items():
            name = str(self.dtypes[key]).removeprefix("torch.")
            out[name] = out.get(name, 0) + nbytes
        return out

    @staticmethod
    def _unpack(held: _Held) -> Tensor:
        return held.tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class AllocationMeter(TorchDispatchMode):
    """Counts the bytes of the tensors torch operators allocate while the context is active: `bytes`
    held now, `peak` their maximum. The CPU's measure of a forward's working memory (the CUDA
    allocator's counters have no CPU counterpart), autograd or not, on any device.

    Every operator's outputs pass through the mode; a storage is counted when first seen as an
    output and released when the last tensor seen holding it dies (views share their base's
    storage). A storage first seen as an operator's input existed before the block (the inputs, the
    parameters) and is not counted. Memory that no torch operator allocates (a Triton kernel's
    on-chip tiles, the interpreter's numpy arrays, a library's scratch space) is not seen.
    """

    def __init__(self):
        super().__init__()
        self.before: set[int] = set()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.bytes = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.bytes -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and storage_key(t) not in self.refs:
                self.before.add(storage_key(t))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor) or storage_key(t) in self.before:
                continue
            key = storage_key(t)
            if key not in self.refs:
                self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.bytes += self.sizes[key]
                self.peak = max(self.peak, self.bytes)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def allocated_peak(fn: Callable[[], object]) -> int:
    """Peak bytes of the tensors torch operators allocate during one call of `fn()` (beyond what
    existed before), its result included while it is held: `AllocationMeter`."""
    with AllocationMeter() as meter:
        fn()
    return meter.peak


@dataclass
class PeakMemory:
    """What `peak_memory` found: `bytes` and which measure it is (`kind`)."""

    kind: str = ""
    bytes: int = 0


@contextlib.contextmanager
def peak_memory(device=None, exclude=()):
    """Peak memory of the block, in bytes. On CUDA: torch.cuda.max_memory_allocated (weights, grads,
    optimizer state and activations; the peak counter is reset on entry). Elsewhere: the peak of
    the bytes autograd saved for backward (activations only; `exclude` the parameters)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = PeakMemory()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        result.kind = "cuda max_memory_allocated"
        try:
            yield result
        finally:
            sync(device)
            result.bytes = torch.cuda.max_memory_allocated(device)
    else:
        result.kind = "saved-tensor peak"
        with SavedTensorMeter(exclude=exclude) as meter:
            try:
                yield result
            finally:
                result.bytes = meter.peak


def saved_bytes(forward: Callable[[], Tensor], *, exclude=(), backward: bool = True) -> dict:
    """What autograd saves for one forward (and backward) of `forward()`, which returns a tensor.

    Keys: "saved_bytes" (held at the end of forward: the activations), "saved_tensors" (storages),
    "by_dtype" ({dtype name: bytes} at the end of forward) and, with `backward`, "peak_saved_bytes"
    (the maximum over forward and backward, which includes what recomputation saves again). A
    non-scalar output is backpropagated as its sum. `exclude`: the parameters and buffers.
    """
    with SavedTensorMeter(exclude=exclude) as meter:
        out = forward()
        after, count, by_dtype = meter.bytes, len(meter.sizes), meter.bytes_by_dtype()
        if backward:
            (out if out.dim() == 0 else out.sum()).backward()
    del out  # the graph, and what it saved, goes with the output
    return {"saved_bytes": after, "saved_tensors": count, "by_dtype": by_dtype, "peak_saved_bytes": meter.peak}


def measure_step(step: Callable[[], object], *, device=None, exclude=(), warmup: int = 1, reps: int = 3) -> dict:
    """Median time and peak memory of a training step `step()` (forward, backward, maybe optimizer).

    Keys: "time_s" (median over `reps` timed calls after `warmup` untimed ones), "spread" (see
    Timing), "reps", "peak_bytes" and "peak_kind" (`peak_memory` of one more call: CUDA's
    max_memory_allocated, else the saved-tensor peak, leaving out `exclude`).
    """
    timing = time_fn(step, device=device, warmup=warmup, reps=reps)
    with peak_memory(device, exclude=exclude) as peak:
        step()
    return {"time_s": timing.median_s, "spread": timing.spread, "reps": timing.n, "peak_bytes": peak.bytes,
            "peak_kind": peak.kind}


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors' elements (parameters, gradients, optimizer state...)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (Adam: exp_avg + exp_avg_sq + step)."""
    return sum(tensor_bytes(s.values()) for s in optimizer.state.values())
