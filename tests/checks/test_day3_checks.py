"""The Day 3 autograder checks accept the dlo reference and reject stubs and plausible mistakes."""

from __future__ import annotations

import random
import re
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from dlo import activation_ckpt as ac
from dlo import checkpoint as ck
from dlo.checks import day3
from dlo.grading.forbid import ForbiddenCall

# check_resume runs the save on a rank of its own: this module's students reach it by value, as a notebook's
# do (importing this module there would read the checks, which are sealed where student code runs)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
                                           ("python", "resumed losses differ .* from step 10 on"),
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
    """The resume check saves on a rank of its own, which says a stub is not done before starting."""
    rank = check is day3.check_resume
    with pytest.raises(AssertionError if rank else NotImplementedError, match="not done yet" if rank else None):
        check(*bad, seed=0)


@pytest.mark.parametrize("check,fns", [(day3.check_checkpoint_function, (Reference,)),
                                       (day3.check_offload_hooks, (ac.offload_pack, ac.offload_unpack)),
                                       (day3.check_resume, (save_ref, load_ok))],
                         ids=["checkpoint_function", "offload", "resume"])
def test_library_is_refused(check, fns):
    """The resume check's save runs on a rank, whose ForbiddenCall comes back as the rank's error."""
    with pytest.raises(AssertionError if check is day3.check_resume else ForbiddenCall, match="off limits"):
        check(*fns, seed=0)


@pytest.mark.parametrize("check,ref,bad", CHECKS, ids=IDS)
def test_reference_passes_sandboxed(sandbox, check, ref, bad, capsys):
    sandbox.run(check, *ref, seed=1)
    assert ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("check,fns,match", [
    (day3.check_checkpoint_function, (_make_checkpoint(restore_rng=False),), "gradient of the input differs"),
    (day3.check_offload_hooks, (pack_keeps_tensor, unpack_ok), "pack kept the original tensor"),
    (day3.check_resume, (_save_without("numpy"), load_lenient), r"resumed losses differ .* from step \d+ on")],
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


# ----------------------------------------------------------------------------- red team

class CheckpointHiddenGraph(torch.autograd.Function):
    """No recomputation: fn's ordinary graph built in forward under identity saved-tensor hooks of its own
    (the innermost hooks win: the check's meter saw nothing), kept on ctx and backpropagated in backward."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ctx.out = fn(*ctx.inputs)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        torch.autograd.backward(ctx.out, grad_output)
        return (None, *[t.grad if t.requires_grad else None for t in ctx.inputs])


class CheckpointKeptGraph(CheckpointHiddenGraph):
    """The same graph kept on ctx, without hooks."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
        with torch.enable_grad():
            ctx.out = fn(*ctx.inputs)
        return ctx.out.detach()


class CheckpointCtxActivations(torch.autograd.Function):
    """Activations made in forward kept as ctx attributes (not saved for backward: the saved-bytes meter
    misses them); backward calls fn for show and back-propagates through a graph rebuilt from them."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.save_for_backward(*args)
        with torch.no_grad():
            out = fn(*args)
        ctx.acts = [out * 1.0 for _ in range(8)]  # stand-ins for the block's inner activations
        return out

    @staticmethod
    def backward(ctx, grad_output):
        args = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*args)
        torch.autograd.backward(out, grad_output)
        return (None, *[a.grad for a in args])


class CheckpointNoRecompute(torch.autograd.Function):
    """Saves the inputs, never calls fn in backward (zero gradients): caught before the gradients compare."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_output):
        return (None, *[torch.zeros_like(a) if a.requires_grad else None for a in ctx.saved_tensors])


class CheckpointRngSaved(torch.autograd.Function):
    """Honest: the CPU RNG state saved with ctx.save_for_backward next to the inputs (not an activation)."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.save_for_backward(torch.get_rng_state(), *args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_output):
        state, *saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        torch.autograd.backward(out, grad_output)
        return (None, *[t.grad if t.requires_grad else None for t in inputs])


def pack_hides_original(t):
    """A 1-element host tensor for the check to see, the original hidden in an object that is no container."""
    from types import SimpleNamespace

    return torch.zeros(1), SimpleNamespace(t=t)


def unpack_hidden(packed):
    return packed[1].t


_KEPT: list = []


def pack_keeps_global(t):
    """A real host copy, and the original kept in a module global (its device memory never freed)."""
    _KEPT.append(t)
    return pack_ok(t)


def pack_clone_in_global(t):
    """A 1-element host tensor to show; a copy kept on t's device in a module global (nothing offloaded)."""
    _KEPT.append(t.clone())
    return t.device, torch.zeros(1), len(_KEPT) - 1


def unpack_clone_in_global(packed):
    return _KEPT[packed[2]]


_STASH: dict = {}


def save_in_memory(path, *, model, optimizer, scheduler, scaler, loader, step):
    """An empty file; the state kept in a module global of the saving process."""
    open(path, "wb").close()
    _STASH["state"] = {k: v for k, v in _state(model, optimizer, scheduler, scaler, loader, step).items()}


def load_in_memory(path, *, model, optimizer, scheduler, scaler, loader):
    state = _STASH["state"]
    for obj, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler"),
                     (loader, "loader")):
        obj.load_state_dict(state[key])
    _set_rng(state["rng"])
    return state["step"]


RED_TEAM = [
    (day3.check_checkpoint_function, (CheckpointHiddenGraph,), "saved_tensors_hooks is off limits"),
    (day3.check_checkpoint_function, (CheckpointKeptGraph,), "bytes for backward but the inputs are only"),
    (day3.check_checkpoint_function, (CheckpointCtxActivations,), "forward made and kept"),
    (day3.check_checkpoint_function, (CheckpointNoRecompute,), "backward did not call fn"),
    (day3.check_offload_hooks, (pack_hides_original, unpack_hidden), "pack kept the original tensor (same storage)"),
    (day3.check_offload_hooks, (pack_keeps_global, unpack_ok), "pack kept the original tensor alive"),
    (day3.check_offload_hooks, (pack_clone_in_global, unpack_clone_in_global), "host tensors hold 4 bytes"),
]


@pytest.mark.parametrize("check,fns,phrase", RED_TEAM, ids=[f[0].__name__ for _, f, _ in RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_right_only_where_the_check_looks_fails(check, fns, phrase, seed):
    """Red team (Day 3): each passed the checks at seeds 0..19 before its case was added, except two kept
    beside them: CheckpointKeptGraph (guards the meter's own hooks) and CheckpointNoRecompute (named for
    what it skips, not for the gradients that follow from it)."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(*fns, seed=seed, device="cpu")


def test_resume_from_memory_fails():
    """Red team: the state kept in the saving process's memory, an empty file: the load runs elsewhere."""
    with pytest.raises(AssertionError, match=re.escape("load_training_state raised KeyError: 'state'; the save ran "
                                                       "in another process")):
        day3.check_resume(save_in_memory, load_in_memory, seed=0)


@pytest.mark.parametrize("seed", range(3))
def test_checkpoint_accepts_the_rng_state_among_the_saved_tensors(seed):
    """An RNG state saved with ctx.save_for_backward is no activation (was: "forward kept 5104 bytes")."""
    day3.check_checkpoint_function(CheckpointRngSaved, seed=seed, device="cpu")


def test_resume_takes_any_case_seed():
    """Graded, a check draws its case from a secret 32-bit seed (`case_seed`), and the runs' RNG seeds come from
    the case, within numpy's 2**32 - 1 whatever the seed (they were seed * 10 + t: past it for a large seed)."""
    day3.check_resume(save_ok, load_ok, seed=2 ** 32 - 1, trials=1)
