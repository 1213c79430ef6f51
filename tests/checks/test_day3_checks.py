"""The Day 3 autograder checks accept the dlo reference and reject stubs and plausible mistakes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dlo import activation_ckpt as ac
from dlo import checkpoint as ck
from dlo.checks import day3
from dlo.grading.forbid import ForbiddenCall


def stub(*args, **kwargs):
    raise NotImplementedError()


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        raise NotImplementedError()


class Reference:
    """The library's CheckpointFunction behind the exercise's `apply(fn, *args)` signature (off limits)."""

    @staticmethod
    def apply(fn, *args):
        return ac.CheckpointFunction.apply(fn, True, *args)


class CheckpointOk(torch.autograd.Function):
    """The exercise as a student writes it (CPU and CUDA RNG saved and replayed)."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn, ctx.cpu_rng = fn, torch.get_rng_state()
        ctx.devices = sorted({a.device.index for a in args if a.is_cuda})
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_output):
        args = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.cpu_rng)
            for d, state in zip(ctx.devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            with torch.enable_grad():
                out = ctx.fn(*args)
        torch.autograd.backward(out, grad_output)
        return (None, *[a.grad for a in args])


def _make_checkpoint(restore_rng=True, fork=True, save_output=False):
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, *args):
            ctx.fn, ctx.rng = fn, torch.get_rng_state()
            with torch.no_grad():
                out = fn(*args)
            ctx.save_for_backward(*args, *([out] if save_output else []))
            ctx.n = len(args)
            return out

        @staticmethod
        def backward(ctx, grad):
            args = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors[:ctx.n]]
            with torch.random.fork_rng(devices=[], enabled=fork):
                if restore_rng:
                    torch.set_rng_state(ctx.rng)
                with torch.enable_grad():
                    out = ctx.fn(*args)
            torch.autograd.backward(out, grad)
            return (None, *[a.grad for a in args])
    return Wrong


# The wrong Checkpoints (and their base) save and replay only the CPU RNG, so they run on the CPU: on
# CUDA dropout draws from the CUDA generator and even the base would fail. Each wrong variant must fail
# for its own reason: `match` is the part of the message that names it.

@pytest.mark.parametrize("cls,match", [(_make_checkpoint(restore_rng=False), "gradient of the input differs"),
                                       (_make_checkpoint(fork=False), "global RNG is in another state"),
                                       (_make_checkpoint(save_output=True), "forward kept 96 bytes for backward")],
                         ids=["no_rng", "no_fork", "saves_output"])
def test_checkpoint_function_rejects_wrong(cls, match):
    with pytest.raises(AssertionError, match=match):
        day3.check_checkpoint_function(cls, seed=0, device="cpu")


def test_checkpoint_function_wrong_base_is_right():
    day3.check_checkpoint_function(_make_checkpoint(), seed=0, device="cpu")


def pack_keeps_tensor(t):
    return t


def pack_cpu_view(t):
    return t.device, t.cpu()  # on a CPU tensor .cpu() is the same storage: nothing is offloaded


def pack_ok(t):
    host = torch.empty(t.shape, dtype=t.dtype)
    host.copy_(t)
    return t.device, host


def unpack_ok(packed):
    device, host = packed
    return host.to(device)


def unpack_loses_dtype(packed):
    device, host = packed
    return host.to(device, torch.float32)


# On the CPU, where pack_cpu_view's t.cpu() returns the same storage (on CUDA it is a real offload).
@pytest.mark.parametrize("pack,unpack,match", [(pack_keeps_tensor, lambda t: t, "pack kept the original tensor"),
                                               (pack_cpu_view, unpack_ok, "pack kept the original tensor"),
                                               (pack_ok, unpack_loses_dtype,
                                                r"unpack\(pack\(t\)\) must equal t .*got cpu, torch\.float32")])
def test_offload_rejects_wrong(pack, unpack, match):
    with pytest.raises(AssertionError, match=match):
        day3.check_offload_hooks(pack, unpack, seed=0, device="cpu")


def _state(model, optimizer, scheduler, scaler, loader, step):
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "loader": loader.state_dict(),
            "rng": rng}


def _set_rng(rng):
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def save_ok(path, *, model, optimizer, scheduler, scaler, loader, step):
    torch.save(_state(model, optimizer, scheduler, scaler, loader, step), path)


def load_ok(path, *, model, optimizer, scheduler, scaler, loader):
    state = torch.load(path, weights_only=False)
    for obj, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler"),
                     (loader, "loader")):
        obj.load_state_dict(state[key])
    _set_rng(state["rng"])
    return state["step"]


def save_ref(path, *, model, optimizer, scheduler, scaler, loader, step):
    """The library's (off limits)."""
    ck.save_atomic(ck.training_state(model, optimizer, scheduler, scaler, loader, step=step), path)


def _save_without(*skip):
    def save(path, *, model, optimizer, scheduler, scaler, loader, step):
        state = _state(model, optimizer, scheduler, scaler, loader, step)
        if "numpy" in skip:
            state["rng"]["numpy"] = np.random.RandomState(0).get_state()
        if "python" in skip:
            state["rng"]["python"] = random.Random(0).getstate()
        for key in ("scheduler", "scaler", "loader"):
            if key in skip:
                state[key] = None
        torch.save(state, path)
    return save


def load_lenient(path, *, model, optimizer, scheduler, scaler, loader):
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for obj, key in ((scheduler, "scheduler"), (scaler, "scaler"), (loader, "loader")):
        if state[key] is not None:
            obj.load_state_dict(state[key])
    _set_rng(state["rng"])
    return state["step"]


@pytest.mark.parametrize("missing,match", [("numpy", "resumed losses differ .* from step 8 on"),
                                           ("python", "resumed losses differ .* from step 8 on"),
                                           ("scheduler", "resumed losses differ .* from step 10 on"),
                                           ("scaler", "the AMP scaler's scale after the resumed run"),
                                           ("loader", "resumed losses differ .* from step 8 on")])
def test_resume_rejects_missing_state(missing, match):
    with pytest.raises(AssertionError, match=match):
        day3.check_resume(_save_without(missing), load_lenient, seed=0)


def test_resume_lenient_base_is_right():
    day3.check_resume(_save_without(), load_lenient, seed=0)


CHECKS = [
    (day3.check_checkpoint_function, (CheckpointOk,), (Stub,)),
    (day3.check_offload_hooks, (pack_ok, unpack_ok), (stub, stub)),
    (day3.check_resume, (save_ok, load_ok), (stub, stub)),
]
IDS = [c.__name__.removeprefix("check_") for c, _, _ in CHECKS]


@pytest.mark.parametrize("check,ref,bad", CHECKS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_passes(check, ref, bad, seed, capsys):
    check(*ref, seed=seed)
    out = capsys.readouterr().out.strip()
    assert out.endswith(f"seed={seed})") and ": ok (" in out


@pytest.mark.parametrize("check,ref,bad", CHECKS, ids=IDS)
def test_stub_fails(check, ref, bad):
    with pytest.raises(NotImplementedError):
        check(*bad, seed=0)


@pytest.mark.parametrize("check,fns", [(day3.check_checkpoint_function, (Reference,)),
                                       (day3.check_offload_hooks, (ac.offload_pack, ac.offload_unpack)),
                                       (day3.check_resume, (save_ref, load_ok))],
                         ids=["checkpoint_function", "offload", "resume"])
def test_library_is_refused(check, fns):
    with pytest.raises(ForbiddenCall, match="off limits"):
        check(*fns, seed=0)


@pytest.mark.parametrize("check,ref,bad", CHECKS, ids=IDS)
def test_reference_passes_sandboxed(sandbox, check, ref, bad, capsys):
    sandbox.run(check, *ref, seed=1)
    assert ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("check,fns,match", [
    (day3.check_checkpoint_function, (_make_checkpoint(restore_rng=False),), "gradient of the input differs"),
    (day3.check_offload_hooks, (pack_keeps_tensor, unpack_ok), "pack kept the original tensor"),
    (day3.check_resume, (_save_without("numpy"), load_lenient), "resumed losses differ .* from step 8 on")],
    ids=["checkpoint_function", "offload", "resume"])
def test_wrong_fails_sandboxed(sandbox, check, fns, match):
    with pytest.raises(AssertionError, match=match):
        sandbox.run(check, *fns, seed=0)


def test_no_exercise_only_copies_the_rule_the_text_gives():
    """Issue 34: checkpoint_every (blocks 0, k, 2k, ...) copied a rule given in full; it is the text's now."""
    assert not hasattr(day3, "check_checkpoint_every")


def save_atomic_by_hand(path, *, model, optimizer, scheduler, scaler, loader, step):
    """A temporary file in the same folder, renamed over `path` (issue 34: the text says atomic or not)."""
    import os

    tmp = f"{path}.tmp"
    torch.save(_state(model, optimizer, scheduler, scaler, loader, step), tmp)
    os.replace(tmp, path)


def test_resume_accepts_a_plain_or_an_atomic_save():
    day3.check_resume(save_ok, load_ok, seed=1)
    day3.check_resume(save_atomic_by_hand, load_ok, seed=1)
