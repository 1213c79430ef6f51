"""Autograder check for Day 3's CPU offload hooks (exercise 2), re-exported by `dlo.checks.day3`.

`pack(t)` must move t into host memory and let the device copy go; `unpack` must bring it back. The tensors
reach the student's worker in a `Parcel`, so that when unpack runs nothing in the student's process holds
t's values but pack's result; what pack's host tensors hold is sent back as digests, what unpack gave back
as values, and both are compared here with the originals (which never leave this side).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import random
import weakref

import torch
from torch import nn

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import DTYPE, ok
from dlo.measure import reachable_tensors

OFFLOAD = ("dlo.activation_ckpt.offload_pack", "dlo.activation_ckpt.offload_unpack", "dlo.activation_ckpt.cpu_offload",
           "torch.autograd.graph.save_on_cpu")


def case_device(device=None) -> torch.device:
    """`device` if given, else CUDA when present (where offload and the CUDA RNG matter), else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Parcel:
    """Tensors for a worker that takes them out (`take`). The request that brought them holds only this box,
    emptied then: once the worker lets a tensor go, nothing in the student's process holds its values (a list
    among the worker's arguments stays in the request, which the session's frames and gc reach)."""

    def __init__(self, items: list):
        self.items = list(items)

    def take(self) -> list:
        items, self.items = self.items, []
        return items


def _digest(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's elements as bytes, in order: whether a tensor holds given values, without
    holding them (a host copy, or its bytes in a uint8 buffer, has the original's)."""
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _packed(pack, src: torch.Tensor, dev: str) -> tuple[object, dict]:
    """pack(x), x a copy of `src` on `dev` (the caller hands over its only reference to `src`, let go here: then
    pack's x is the one tensor in this process with these values), and what pack's result holds: the tensors it
    reaches, whether one is x's memory, a digest of each host tensor (`_digest`: compared with the values on the
    trusted side), and whether x's memory outlives x (pack kept it somewhere else: a global, a closure)."""
    x = src.to(dev, copy=True)
    del src
    alive = weakref.ref(x.untyped_storage())
    ptr, nbytes = x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()
    xdev, before = x.device, device_allocated(x.device)  # x's own block included
    meta = [str(x.device), str(x.dtype), list(x.shape)]  # what unpack's result must be besides the values
    packed = pack(x)
    if xdev.type == "cuda":  # a non_blocking copy into pinned memory (allowed) has landed before it is read
        torch.cuda.synchronize(xdev)
    held = reachable_tensors(packed)
    host = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in held if h.device.type == "cpu"}
    obs = {"n_held": len(held), "devices": [str(h.device) for h in held], "nbytes": nbytes,
           "same_storage": any(h.untyped_storage().data_ptr() == ptr for h in held), "host_bytes": sum(host.values()),
           "host_values": [[str(h.dtype), _digest(h)] for h in held if h.device.type == "cpu"][:16], "meta": meta}
    del x, held
    if alive() is not None:
        gc.collect()  # a reference cycle of pack's own, not yet collected
    obs["kept"] = alive() is not None
    # x's block is free now: what the device holds beyond `before` less x is what pack put there
    # (a clone kept in a global, unpack's fast path), which a reachable-tensor walk of `packed` cannot see
    obs["device_kept"] = max(0, device_allocated(xdev) - before + nbytes) if xdev.type == "cuda" else 0
    return packed, obs


def device_allocated(dev: torch.device) -> int:
    """Bytes the caching allocator has handed out on a CUDA device (0 elsewhere), after its work."""
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)  # a non_blocking copy out of x finishes before x's block counts as free
    return torch.cuda.memory_allocated(dev)


def _offload_worker(pack, unpack, parcel: Parcel, seed: int, dev: str) -> dict:
    """pack/unpack on each tensor (stopping at the first pack that goes wrong: what went wrong), then the
    gradients of a small model trained under saved_tensors_hooks(pack, unpack). The tensors come in a
    `Parcel`: each is handed to pack as the one tensor with its values here, and unpack runs when nothing but
    pack's result holds them; what unpack gives back is compared on the trusted side (this worker holds no
    expected value)."""
    srcs, trials, backs = parcel.take(), [], []
    del parcel
    while srcs:
        packed, obs = _packed(pack, srcs.pop(0), dev)
        trials.append(obs)
        if (not obs["n_held"] or any(not d.startswith("cpu") for d in obs["devices"]) or obs["same_storage"]
                or obs["kept"] or obs["host_bytes"] < obs["nbytes"] or obs["device_kept"] >= obs["nbytes"] / 2):
            return {"trials": trials, "backs": backs}
        back = unpack(packed)
        del packed
        obs["back"] = [str(getattr(back, "device", None)), str(getattr(back, "dtype", None)),
                       list(getattr(back, "shape", ()))]
        if not isinstance(back, torch.Tensor) or obs["back"] != obs["meta"]:  # its values: judged on the trusted side
            return {"trials": trials, "backs": backs}
        backs.append(back.detach().to("cpu", copy=True).as_subclass(torch.Tensor)
                     if isinstance(back, torch.Tensor) else None)
        del back
    model, x = _offload_model(seed, torch.device(dev))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(x).pow(2).sum().backward()
    return {"trials": trials, "backs": backs, "grads": [p.grad for p in model.parameters()]}


def _offload_model(seed: int, dev: torch.device):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3)).to(dev, DTYPE)
    return model, torch.randn(5, 7, device=dev, dtype=DTYPE)


def _holds(values, x: torch.Tensor) -> bool:
    """Whether one of pack's host tensors (`values`: [dtype, digest] each, `_packed`) held x's values: its bytes
    (a copy, or a uint8 buffer of x's bytes), or x converted to its dtype where that loses nothing."""
    if not isinstance(values, list):
        return False
    for item in values:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            continue
        dtype, digest = getattr(torch, item[0].removeprefix("torch."), None), item[1]
        if digest == _digest(x):
            return True
        if isinstance(dtype, torch.dtype) and dtype != x.dtype:
            with contextlib.suppress(RuntimeError, TypeError):
                y = x.to(dtype)
                if torch.equal(y.to(x.dtype), x) and digest == _digest(y):
                    return True
    return False


@check(forbid=OFFLOAD)
def check_offload_hooks(pack, unpack, seed: int = 0, trials: int = 4, device=None) -> None:
    """`pack(t)` returns a host-memory copy (plus whatever unpack needs); `unpack(pack(t))` gives t back
    on its device with its dtype and values; a model trained under the hooks gets identical grads.
    Tensors live on `device` (default: CUDA when available, else CPU). When unpack runs, nothing in the
    student's process holds t's values but pack's result (`Parcel`); they are compared here."""
    name, cs = "offload_hooks", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    dev = case_device(device)
    xs, cases = [], []
    for t in range(trials):
        shape = tuple(rng.choice([1, 3, 7, 13]) for _ in range(rng.choice([1, 2, 3])))
        dtype = [torch.float32, torch.float64, torch.bfloat16, torch.int64][t % 4]
        xs.append((torch.randn(shape, generator=gen) * 10).to(dtype))
        cases.append((shape, dtype))
    model_seed = rng.randrange(2 ** 31)  # the model's: cs, from which the tensors follow, stays here
    got = run_student(_offload_worker, pack, unpack, Parcel(xs), model_seed, str(dev))
    trials_got = got.get("trials") if isinstance(got, dict) else None
    backs = got.get("backs") if isinstance(got, dict) else None
    n = len(trials_got) if isinstance(trials_got, list) else 0
    if n > len(cases) or not all(isinstance(obs, dict) for obs in trials_got or []):
        raise AssertionError(f"{name}: the grader got {n} records of pack for {len(cases)} tensors")
    want_dev = str(torch.empty(0, device=dev).device)  # "cuda:0" for "cuda", as a tensor's device reads
    for t, ((shape, dtype), obs) in enumerate(zip(cases, trials_got)):
        if not obs["n_held"]:
            raise AssertionError(f"{name}: pack returned no tensor (shape {shape}, {dtype})")
        if any(not d.startswith("cpu") for d in obs["devices"]):
            raise AssertionError(f"{name}: pack must keep the tensor in host memory (.to('cpu')), got devices "
                                 f"{obs['devices']}")
        if obs["same_storage"]:
            raise AssertionError(f"{name}: pack kept the original tensor (same storage): make a copy in host "
                                 f"memory so the device memory can be freed, e.g. torch.empty(..., device='cpu')"
                                 f".copy_(t)")
        if obs["kept"]:
            raise AssertionError(f"{name}: pack kept the original tensor alive (its memory outlived the caller's "
                                 f"reference: held in a global, a closure or an object pack made): return only the "
                                 f"host copy and what unpack needs, so that the device memory can be freed")
        if obs["device_kept"] >= obs["nbytes"] / 2:
            raise AssertionError(f"{name}: after pack the device still holds {obs['device_kept']} bytes more than "
                                 f"before, the tensor had {obs['nbytes']}: pack kept a copy on the device (a clone "
                                 f"in a global or a closure); offloading must free the device memory (shape "
                                 f"{shape}, {dtype})")
        if obs["host_bytes"] < obs["nbytes"]:
            raise AssertionError(f"{name}: pack's host tensors hold {obs['host_bytes']} bytes, the tensor has "
                                 f"{obs['nbytes']}: copy all of it to host memory (shape {shape}, {dtype})")
        if not _holds(obs.get("host_values"), xs[t]):
            raise AssertionError(f"{name}: none of the host tensors pack returned holds the tensor's values (shape "
                                 f"{shape}, {dtype}): pack must copy t into host memory (an empty buffer of the "
                                 f"right size is not a copy), and unpack bring that copy back")
        b_dev, b_dtype, b_shape = obs.get("back") or [None, None, []]
        if obs.get("back") == obs.get("meta") and not (isinstance(backs, list) and t < len(backs)):
            k = len(backs) if isinstance(backs, list) else 0  # the worker recorded a tensor it did not send
            raise AssertionError(f"{name}: returned {k} of {len(cases)} tensors' records of what unpack gave back: "
                                 f"the grader got nothing to compare with t for the rest")
        back = backs[t] if isinstance(backs, list) and t < len(backs) else None
        if not (isinstance(back, torch.Tensor) and b_dev == want_dev and back.dtype == dtype
                and tuple(back.shape) == shape):
            got_dtype = back.dtype if isinstance(back, torch.Tensor) else b_dtype
            got_shape = tuple(back.shape) if isinstance(back, torch.Tensor) else tuple(b_shape or ())
            raise AssertionError(f"{name}: unpack(pack(t)) must equal t on {dev} with dtype {dtype} and "
                                 f"shape {shape}; got {b_dev}, {got_dtype}, {got_shape}")
        if not torch.equal(back, xs[t]):
            raise AssertionError(f"{name}: unpack(pack(t)) has t's device, dtype and shape but other values (shape "
                                 f"{shape}, {dtype}): unpack must bring back the values pack copied; when it "
                                 f"runs, nothing but pack's result holds them")
    if n < len(cases):  # every tensor passed (else the loop above named the first failure): a short reply is none
        raise AssertionError(f"{name}: returned {n} of {len(cases)} tensors' records of pack and unpack: the grader "
                             f"got nothing to check for the rest")
    model, x = _offload_model(model_seed, dev)
    model(x).pow(2).sum().backward()
    want = [p.grad.cpu() for p in model.parameters()]
    grads = got.get("grads")
    if not isinstance(grads, list) or len(grads) != len(want):
        raise AssertionError(f"{name}: returned {len(grads) if isinstance(grads, list) else 0} of {len(want)} "
                             f"gradients of the model trained under saved_tensors_hooks(pack, unpack)")
    if not all(g is not None and torch.equal(g.cpu(), w) for g, w in zip(got["grads"], want)):
        raise AssertionError(f"{name}: gradients under saved_tensors_hooks(pack, unpack) differ from plain autograd")
    ok(name, f"{trials} trials, seed={seed}")
