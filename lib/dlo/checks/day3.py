"""Autograder checks for Day 3 (activation checkpointing, offload, exact resume of training state).

References: plain autograd without checkpointing (same seed, hence the same dropout masks),
`dlo.activation_ckpt` for the saved-memory accounting, and an uninterrupted training run for the
resume check. Checkpointing replays the very same float operations, so gradients must agree exactly
(in float64, tolerance 0); resumed losses must be bit-identical.

The student's Function, hooks and training-state code run inside autograd graphs and training loops,
so each check runs that part in a worker (`dlo.grading.api.run_student`) on modules and inputs made
here; the worker records outputs, gradients, saved bytes and losses, and the references (plain
autograd, an uninterrupted run) are computed here, where the comparison happens. (The day's three
exercises, one section each; an every-k-th-block policy is the text's, not an exercise: it only
copied the rule the text gives.) Beyond the numbers, each check looks at what the exercise is for:
the checkpoint's forward keeps no activation (saved for backward or not; saved-tensor hooks, which
could hide them, are off limits; under `dlo grade`, a large case's memory after the forward also read by the
kernel from outside the student's process, which no rewritten meter hides: `_kept`) and backward calls fn
again; pack lets the original tensor go and holds all of it in host memory (`dlo.checks.day3_offload`); the resume's
load runs in another process than the save (`dlo.checks.day3_resume`); both re-exported here.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from dlo.checks.day3_offload import case_device, check_offload_hooks  # noqa: F401 (the notebook calls it here)
from dlo.checks.day3_resume import check_resume
from dlo.checks.saved import HOOKS, GuardedMeter
from dlo.grading.api import case_seed, check, run_student, student_memory
from dlo.grading.compare import DTYPE, assert_held, ok
from dlo.measure import AllocationMeter
from dlo.measure.process import steady_malloc

CHECKPOINTS = ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential",
               "torch.utils.checkpoint.CheckpointFunction", "dlo.activation_ckpt.CheckpointFunction",
               "dlo.activation_ckpt.checkpoint")
KEPT_HIDDEN = 4096  # the large case's hidden width: batch x 4096 float64 activations, 64 MiB for ~2k samples


def _block(rng: random.Random, d: int, p: float, hidden: int | None = None) -> nn.Module:
    hidden = hidden or rng.choice([5, 9, 17])
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Dropout(p), nn.Linear(hidden, d))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in (x, *module.parameters())]


def _same(g: torch.Tensor, w: torch.Tensor, tol: float) -> bool:
    return torch.equal(g, w) if tol == 0 else g.shape == w.shape and torch.allclose(g, w, rtol=tol, atol=tol)


def _compare(name: str, what: str, got: list, want: list, hp: dict, tol: float = 0.0) -> None:
    if not isinstance(got, list) or len(got) != len(want):
        n = len(got) if isinstance(got, list) else 0
        raise AssertionError(f"{name}: returned {n} of {len(want)} {what}s (the input's, then each parameter's): the "
                             f"grader got no {what} to compare for the rest ({hp})")
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or not _same(g, w, tol):
            err = "missing (None)" if g is None else f"max abs error {(g - w).abs().max().item():.3g}"
            where = "the input" if i == 0 else f"parameter {i - 1}"
            raise AssertionError(f"{name}: {what} of {where} differs from no checkpointing ({hp}): {err}. "
                                 f"Recompute with the RNG state saved in forward (dropout must draw the same mask)"
                                 f" and back-propagate grad_outputs through the recomputed outputs")


# ----------------------------------------------------------------------------- Checkpoint autograd.Function

# saved-tensor hooks of the student's own would hide from the meter what forward keeps: off limits in the
# exercise (the class's methods are blocked whoever holds them: save_on_cpu's too; dlo.checks.saved)


def _replayed_rng(args):
    """Whether a saved tensor is an RNG state taken just before the forward (the CPU's, or a CUDA device's
    among the args): the state to replay (ctx.save_for_backward(torch.get_rng_state(), *args)), not an
    activation; the meter does not count it."""
    cuda = sorted({a.device.index or 0 for a in args if a.is_cuda})
    states = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda)]
    return lambda t: t.dtype == torch.uint8 and any(t.shape == s.shape and t.device == s.device and torch.equal(t, s)
                                                    for s in states)


def _checkpoint_worker(Checkpoint, block, x, gate, two_inputs: bool, seed: int, grad_out, mark=None) -> dict:
    """Forward through the student's Function (saved bytes and the tensors it made and kept metered, fn's
    calls counted), the caller's RNG draw, backward (fn's calls counted: the recomputation); the output, the
    gradients and the RNG stream after backward. `mark`, the grader's (a callback under `dlo grade`), is called
    just before the forward and just after it: the kernel's count of this process, read there."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    inner = (lambda a, g: block(a) * g) if two_inputs else block
    calls = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def fn(*a):
        calls[phase[0]] += 1
        return inner(*a)
    args = (x, gate) if two_inputs else (x,)
    torch.manual_seed(seed)
    if mark is not None:  # the kernel counts this forward (`_kept`): malloc returns large blocks at free from now on
        steady_malloc()
        mark()
    with GuardedMeter(block.parameters(), _replayed_rng(args)) as meter, AllocationMeter() as made:
        y = Checkpoint.apply(fn, *args)
    if mark is not None:
        mark()
    out = {"type": type(y).__name__, "grad_fn": isinstance(y, torch.Tensor) and y.grad_fn is not None,
           "saved": meter.bytes, "inputs": sum(a.untyped_storage().nbytes() for a in args)}
    if not out["grad_fn"] or meter.bytes > out["inputs"]:
        return out
    out["kept"] = made.bytes - y.untyped_storage().nbytes()  # made in forward, alive beside the output
    out["y"] = y.detach()
    torch.randn_like(y)  # the reference's draw of grad_out: backward must not rewind the caller's RNG
    phase[0] = "backward"
    y.backward(grad_out)
    return {**out, "calls": calls, "grads": _grads(block, x), "after": torch.rand(4, device=x.device)}


@check(forbid=CHECKPOINTS + HOOKS, hint="write the Function: save the inputs, recompute fn in backward; "
                                               "saved-tensor hooks would hide from the check what forward keeps")
def check_checkpoint_function(Checkpoint, seed: int = 0, trials: int = 4, device=None) -> None:
    """`Checkpoint.apply(fn, *args)`: same output, input and parameter grads as fn(*args), dropout
    included; saves no more than the inputs (an RNG state aside), keeps no other tensor it made, calls fn
    again in backward (the recomputation); leaves the caller's RNG stream as it found it. Saved-tensor
    hooks are off limits. Runs on `device` (default: CUDA when available, else CPU)."""
    name, cs, dev = "checkpoint_function", case_seed(seed), case_device(device)  # cs: a secret seed when graded
    rng = random.Random(cs)
    # under `dlo grade`: the session's memory once torch has run the large case's operations there and before
    # anything of the student's was loaded in it (`_baseline`): no allocation of the student's precedes it
    base = _baseline() if student_memory() is not None else None
    for t in range(trials + 1):
        d, p = rng.choice([3, 6, 11]), rng.choice([0.2, 0.5])
        hp = dict(trial=t, features=d, dropout=p, batch=rng.choice([1, 4, 7]), two_inputs=t % 2 == 1)
        if t == trials:  # the case whose memory the kernel counts (`_kept`): 64 MiB per activation of fn
            hp.update(features=16, batch=rng.choice([2039, 2047, 2053]), two_inputs=False)
        # the large case on the CPU, where its activations are the process's memory (a GPU's are not)
        d, marks, on = hp["features"], [], torch.device("cpu") if t == trials else dev
        block = _block(rng, d, p, KEPT_HIDDEN if t == trials else None).to(on, DTYPE).train()
        x = torch.randn(hp["batch"], d, device=on, dtype=DTYPE, requires_grad=True)
        gate = torch.rand(hp["batch"], d, device=on, dtype=DTYPE)  # an input that needs no grad
        fn = (lambda a, g, block=block: block(a) * g) if hp["two_inputs"] else block
        args = (x, gate) if hp["two_inputs"] else (x,)
        run_seed = rng.randrange(2 ** 63)  # the trial's torch seed: drawn from cs, which stays here
        torch.manual_seed(run_seed)
        want_y = fn(*args)
        grad_out = torch.randn_like(want_y)  # a draw between forward and backward, as a training loop may make
        want_y.backward(grad_out)
        want, want_after = [g.cpu() for g in _grads(block, x)], torch.rand(4, device=on).cpu()
        # a callback under `dlo grade` (it runs here); none in a notebook's check, where the count is not judged
        counted = t == trials and student_memory() is not None
        mark = (lambda marks=marks: marks.append(student_memory())) if counted else None
        got = run_student(_checkpoint_worker, Checkpoint, block, x, gate, hp["two_inputs"], run_seed, grad_out, mark)
        if not got["grad_fn"]:
            raise AssertionError(f"{name}: Checkpoint.apply must return a tensor with a grad_fn ({hp}); got "
                                 f"{got['type']}{' without grad_fn' if got['type'] == 'Tensor' else ''}")
        if got["saved"] > got["inputs"]:
            raise AssertionError(f"{name}: forward kept {got['saved']} bytes for backward but the inputs are only "
                                 f"{got['inputs']}: run fn under torch.no_grad() and save only the inputs ({hp})")
        if got["kept"] > got["inputs"]:
            raise AssertionError(f"{name}: forward made and kept {got['kept']} bytes of tensors besides its output "
                                 f"(the inputs are {got['inputs']}): keep no activation, not even as a ctx "
                                 f"attribute; backward recomputes them ({hp})")
        if not got["calls"]["backward"]:
            raise AssertionError(f"{name}: backward did not call fn: checkpointing recomputes fn(*inputs) in backward "
                                 f"(with grad enabled) and back-propagates through that recomputation ({hp})")
        # the large case's sums over ~2k rows take another order with another thread count (the grader's and the
        # sandbox's may differ): 1e-12 there, where a wrong dropout mask errs by O(0.1)
        tol = 1e-12 if t == trials else 0.0
        if not _same(got["y"].cpu(), want_y.detach().cpu(), tol):
            raise AssertionError(f"{name}: forward output differs from fn(*args) ({hp})")
        _compare(name, "gradient", [None if g is None else g.cpu() for g in got["grads"]], want, hp, tol)
        if not torch.equal(got["after"].cpu(), want_after):
            raise AssertionError(f"{name}: after backward the global RNG is in another state than without "
                                 f"checkpointing: restore the saved state inside torch.random.fork_rng() ({hp})")
        if counted:
            _kept(name, marks, base, hp)
    ok(name, f"{trials + 1} trials, seed={seed}")


def _warm_worker(block: nn.Module, x: torch.Tensor) -> bool:
    """The large case's operations, forward and backward, run once in the session before anything of the
    student's is loaded there (no student object among this request's arguments): what torch makes at its
    first operations (thread pools, kernels' buffers) is then in the baseline read after it (`_baseline`).
    Large blocks are returned at free from here on (`steady_malloc`): what stays resident is what is alive."""
    steady_malloc()
    block(x).sum().backward()
    return True


def _baseline():
    """The kernel's count of the check's session after `_warm_worker`, before the student's objects load in it
    (under `dlo grade` the session is the check's own process, and the warm-up is its first request). Memory
    the student's code allocates later (in an earlier trial, at loading) and frees during the large case's
    forward lowers the reading just before that forward, never this one: the large case's memory after its
    forward is held to both (`_kept`)."""
    block = _block(random.Random(0), 16, 0.5, KEPT_HIDDEN).to(DTYPE).train()
    run_student(_warm_worker, block, torch.zeros(2053, 16, dtype=DTYPE, requires_grad=True))
    return student_memory()


def _kept(name: str, marks: list, base, hp: dict) -> None:
    """The kernel's count of the student's process just before and just after the large case's forward, read
    outside it under `dlo grade` (`student_memory`, called back from the worker): fn's activations kept for
    backward (each batch x KEPT_HIDDEN float64, ~64 MiB) stay resident, however the meters were rewritten;
    a checkpoint keeps its inputs and output (~0.25 MiB). Half an activation is allowed above the reading
    before the forward, and one above `base`, read before the student's objects loaded (`_baseline`): a
    "ballast" allocated earlier and freed during the forward hides kept activations from the first, not
    from the second."""
    if len(marks) != 2:
        raise AssertionError(f"{name}: the grader's memory readings around your forward did not both run ({hp})")
    one = hp["batch"] * KEPT_HIDDEN * DTYPE.itemsize
    assert_held(name, *marks, one // 2, f"more than half of one of fn's activations ({one / 2 ** 20:.0f} MiB) "
                f"kept after the forward: keep only the inputs, recompute fn in backward", hp, peak=False)
    grew = marks[1].rss - base.rss
    if grew > one:
        raise AssertionError(f"{name}: after the forward your process held {grew / 2 ** 20:.0f} MiB more than "
                             f"before any of your code was loaded in it, as the kernel counts it (outside your code), "
                             f"over the {one / 2 ** 20:.0f} MiB allowed (one of fn's activations): fn's activations "
                             f"kept after the forward, or memory your code holds beside them; keep only the inputs, "
                             f"recompute fn in backward ({hp})")


__all__ = ["check_checkpoint_function", "check_offload_hooks", "check_resume"]
