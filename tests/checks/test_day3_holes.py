"""A red team's Day 3 cheats that scored (2026-12-02): each now fails its check with a message naming the mistake,
and the solution notebook still passes every changed check.

1. Checkpoint: activations kept after the forward, hidden from the kernel's count by a "ballast" allocated in an
   earlier call and freed during the large case (the count was after minus just before the forward): the large
   case is now also held to a reading taken before the student's objects loaded in the session (`day3._baseline`).
   Kept here as numpy arrays, which no tensor meter sees (the red team's graph was hidden from them by a thread,
   now refused, or by rewriting them).
2. Offload: pack returned an uninitialised host buffer of the right size; unpack took the original from the
   worker's frame (`want`) or found it with gc. The tensors now reach the worker in a `day3_offload.Parcel`, each handed
   to pack as the one tensor with its values in the process, unpack's result is compared on the trusted side, and
   pack's host tensors must hold the values (a digest of each, compared there).
3. Resume: load_training_state replayed the interrupted run from the case (its seed) taken from the caller's frame
   or with gc, saving nothing; or reset the given model under the constant initialisation seed. The load half now
   gets only what a restarted job knows (the data's seed, its own seed, the steps left), and the first half's
   weights start from a secret seed only the save's rank sees.

The cheats are a student's cells (`tests.student_cell`), shipped to the sandbox by value, as a notebook's.
"""

from __future__ import annotations

import re

import pytest
import torch

from dlo.checks import day3
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell


@pytest.fixture(scope="module")
def solution():
    return load_solution("day3_checkpointing")


def cell(source: str):
    return student_cell(source, "day3_holes_student", torch=torch)


# ----------------------------------------------------------------------------- 1: a ballast freed in the forward

BALLAST = '''
import numpy as np

_BALLAST = []


class Checkpoint(torch.autograd.Function):
    """A checkpoint by the meters (inputs saved, fn recomputed), but the large case keeps ~160 MiB beside it as
    numpy arrays (stand-ins for a graph hidden from the meters), while a 192 MiB ballast allocated at the first
    call is freed: the process is lower after the forward than just before it."""

    @staticmethod
    def forward(ctx, fn, *args):
        if not _BALLAST:
            _BALLAST.append(np.ones(192 * 2 ** 17))  # 192 MiB, touched
        ctx.fn = fn
        ctx.save_for_backward(*args)
        ctx.rng = torch.get_rng_state()
        with torch.no_grad():
            out = fn(*args)
        if args[0].shape[0] > 1000:
            _BALLAST.clear()
            ctx.hidden = [np.ones(80 * 2 ** 17) for _ in range(2)]  # 160 MiB kept past the forward
        return out

    @staticmethod
    def backward(ctx, grad_output):
        args = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(*args)
        torch.autograd.backward(out, grad_output)
        return (None, *[a.grad for a in args])
'''


@pytest.mark.trust
def test_a_ballast_freed_in_the_forward_hides_nothing(sandbox):
    """The reading just before the forward held the ballast (the old bound: after minus before, passed); the one
    before the student's objects loaded did not."""
    with pytest.raises(AssertionError, match=re.escape("more than before any of your code was loaded in it")):
        sandbox.run(day3.check_checkpoint_function, cell(BALLAST).Checkpoint, seed=0, device="cpu")


# ----------------------------------------------------------------------------- 2: offload without a copy

OFFLOAD_FRAME = '''
import sys


def _caller(name):
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return None
        if f.f_code.co_name == name:
            return f
        f = f.f_back
    return None


def pack(t):
    """No copy: a host buffer of the right size, left uninitialised; the values come back from elsewhere."""
    if _caller("_packed") is not None:
        return t.device, torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8)
    return t


def unpack(packed):
    f = _caller("_offload_worker")
    if f is not None and isinstance(packed, tuple):  # any tensor the worker holds with t's shape and dtype
        for v in f.f_locals.values():
            if isinstance(v, torch.Tensor) and v.device == packed[0]:
                return v
        return packed[1]
    return packed
'''

OFFLOAD_GC = '''
import gc
import sys


def _fp(t):
    return hash(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def pack(t):
    """No copy kept: an empty host buffer of the right size and a fingerprint of the values."""
    if t.requires_grad:
        return t
    return t.device, t.dtype, tuple(t.shape), _fp(t), torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8)


def unpack(packed):
    """The still-live original found with gc; and then the grader's record of pack's host tensors rewritten (through
    the worker's frame) with the digest of what was found, so that only the original's reach decides."""
    if isinstance(packed, torch.Tensor):
        return packed
    device, dtype, shape, fp, buf = packed
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.dtype == dtype and tuple(o.shape) == shape and o.device == device \\
                and o.data_ptr() != buf.data_ptr() and _fp(o) == fp:
            f = sys._getframe(1)
            while f is not None and f.f_code.co_name != "_offload_worker":
                f = f.f_back
            if f is not None:
                digest = f.f_globals["_digest"]
                f.f_locals["trials"][-1]["host_values"] = [[str(o.dtype), digest(o.cpu())]]
            return o
    return buf.view(dtype).reshape(shape) if buf.numel() else buf
'''

UNPACK_ZEROS = '''
def pack(t):
    return t.device, torch.empty(t.shape, dtype=t.dtype).copy_(t)


def unpack(packed):
    return torch.zeros_like(packed[1], device=packed[0])
'''

NO_COPY = "none of the host tensors pack returned holds the tensor's values"


def test_offload_without_a_copy_fails():
    """pack's host tensors are compared with the values (a digest here): an empty buffer of the right size fails,
    whatever unpack finds. (The gc variant is judged in the sandbox only: a notebook's check holds its tensors in
    the notebook's own process.)"""
    c = cell(OFFLOAD_FRAME)
    with pytest.raises(AssertionError, match=re.escape(NO_COPY)):
        day3.check_offload_hooks(c.pack, c.unpack, seed=0, device="cpu")


def test_offload_compares_unpack_s_values_here():
    c = cell(UNPACK_ZEROS)
    with pytest.raises(AssertionError, match=re.escape("has t's device, dtype and shape but other values")):
        day3.check_offload_hooks(c.pack, c.unpack, seed=0, device="cpu")


@pytest.mark.trust
@pytest.mark.parametrize("source", [OFFLOAD_FRAME, OFFLOAD_GC], ids=["frame", "gc"])
def test_offload_original_is_out_of_reach_sandboxed(sandbox, source):
    """In the grader's session nothing but pack's result holds a tensor's values when unpack runs: neither the
    worker's frame nor gc finds the original (in a notebook's own check, the check's own tensors are in the same
    process: not judged), so a rewritten record of pack's host tensors cannot follow a found one."""
    c = cell(source)
    with pytest.raises(AssertionError, match=re.escape(NO_COPY)):
        sandbox.run(day3.check_offload_hooks, c.pack, c.unpack, seed=0, device="cpu")


def test_offload_accepts_host_copies_of_any_exact_form():
    """A host copy in another dtype that loses nothing (bfloat16 as float32) and the bytes in a uint8 buffer pass
    the values' comparison."""
    widened = cell('''
def pack(t):
    return t.device, t.dtype, t.to("cpu", torch.float64 if t.is_floating_point() else t.dtype, copy=True)


def unpack(packed):
    device, dtype, host = packed
    return host.to(device, dtype)
''')
    raw = cell('''
def pack(t):
    buf = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8)
    buf.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return t.device, t.dtype, tuple(t.shape), buf


def unpack(packed):
    device, dtype, shape, buf = packed
    return buf.view(dtype).reshape(shape).to(device)
''')
    for c in (widened, raw):
        day3.check_offload_hooks(c.pack, c.unpack, seed=1, device="cpu")


# ----------------------------------------------------------------------------- 3: resume without a file

RESUME_REPLAY = '''
import gc
import random
import sys

import numpy as np
import torch.nn.functional as F


def save_training_state(path, *, model, optimizer, scheduler, scaler, loader, step):
    """Writes nothing."""
    return None


def _step(model, optimizer, scheduler, scaler, loader):  # the training step, as the check's source shows it
    x, y = next(loader)
    x = x + 0.05 * torch.from_numpy(np.random.standard_normal(x.shape)).float()
    if random.random() < 0.5:
        x = x.flip(1)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()


def _case(i):
    """The interrupted run's case (its RNG seed, its weights' seed, where it was cut): from a caller's frame or
    any list gc finds."""
    f = sys._getframe(2)
    while f is not None:
        for v in f.f_locals.values():
            if type(v) is list and len(v) > i and all(type(d) is dict and "seed" in d and "cut" in d for d in v):
                return v[i]
        f = f.f_back
    for o in gc.get_objects():
        if type(o) is list and len(o) > i and all(type(d) is dict and "seed" in d and "cut" in d for d in o):
            return o[i]
    return None


def load_training_state(path, *, model, optimizer, scheduler, scaler, loader):
    """Reads nothing: replays the interrupted run on the given (fresh) objects."""
    r = _case(int(str(path).rsplit("state-", 1)[1].split(".")[0]))
    if r is None:
        raise LookupError("no case to replay")
    random.seed(r["seed"])
    np.random.seed(r["seed"])
    torch.manual_seed(r.get("init", 1))  # the first job's model was built right after torch.manual_seed(init)
    for m in model:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for _ in range(r["cut"]):
        _step(model, optimizer, scheduler, scaler, loader)
    return r["cut"]
'''

RESUME_OWN_INIT = RESUME_REPLAY.replace('''    r = _case(int(str(path).rsplit("state-", 1)[1].split(".")[0]))
    if r is None:
        raise LookupError("no case to replay")
    random.seed(r["seed"])
    np.random.seed(r["seed"])
    torch.manual_seed(r.get("init", 1))''', '''    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(1)  # the constant the first job's weights were once made from''').replace(
    'range(r["cut"])', "range(3)").replace('return r["cut"]', "return 3")


@pytest.mark.trust
def test_resume_replayed_from_the_case_fails_sandboxed(sandbox):
    """The load's process holds no interrupted run's seed (neither in a frame nor anywhere gc finds it)."""
    c = cell(RESUME_REPLAY)
    with pytest.raises(AssertionError, match=re.escape("load_training_state raised LookupError: no case to replay")):
        sandbox.run(day3.check_resume, c.save_training_state, c.load_training_state, seed=0)


def test_resume_replayed_from_the_old_constant_init_fails():
    """The first job's weights come from a secret seed now: resetting the given model under the old constant
    (torch.manual_seed(1)) and replaying gives other losses, named as a resume's wrong state."""
    c = cell(RESUME_OWN_INIT)
    with pytest.raises(AssertionError, match=r"returned step 3, expected \d+|resumed losses differ"):
        day3.check_resume(c.save_training_state, c.load_training_state, seed=0)


def test_resume_wrong_step_is_named(solution):
    def load_off_by_one(path, **objects):
        return solution.load_training_state(path, **objects) + 1

    with pytest.raises(AssertionError, match=r"load_training_state returned step \d+, expected \d+"):
        day3.check_resume(solution.save_training_state, load_off_by_one, seed=0)


# ----------------------------------------------------------------------------- the solution

def test_the_solution_passes_the_changed_checks(solution):
    for seed in (0, 1):
        day3.check_checkpoint_function(solution.Checkpoint, seed=seed, device="cpu")
        day3.check_offload_hooks(solution.pack, solution.unpack, seed=seed, device="cpu")
        day3.check_resume(solution.save_training_state, solution.load_training_state, seed=seed)


@pytest.mark.trust
def test_the_solution_passes_sandboxed(sandbox, solution, capsys):
    sandbox.run(day3.check_checkpoint_function, solution.Checkpoint, seed=0, device="cpu")
    sandbox.run(day3.check_offload_hooks, solution.pack, solution.unpack, seed=0, device="cpu")
    sandbox.run(day3.check_resume, solution.save_training_state, solution.load_training_state, seed=0)
    out = capsys.readouterr().out
    assert all(f"{n}: ok" in out for n in ("checkpoint_function", "offload_hooks", "resume"))
