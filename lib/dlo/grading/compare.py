"""The comparisons every day's checks share, and the one line a passing check prints.

`assert_close(name, what, got, want, where)` explains the first mismatch (shape, max error, expected vs
got at one index); `assert_number` accepts a number or a one-element tensor; `ok(name, detail)` prints
the success line; `odd_shape` and `rand` draw the odd-sized random inputs the checks use. They run
where the check runs (the trusted side under `dlo grade`, the notebook's kernel in a direct check) and
in workers, so the seal leaves this module open (`dlo.grading.seal.OPEN`).
"""

from __future__ import annotations

import math
import random
from numbers import Real

import torch

from dlo.measure.process import growth

DTYPE = torch.float64
RTOL, ATOL = 1e-9, 1e-12  # float64: correct code agrees to ~1e-15; slips show at >= 1e-7

# ----------------------------------------------------------------------------- messages and comparisons

def fmt(where) -> str:
    """A check's context for a message: a dict of hyper-parameters or a string."""
    if isinstance(where, dict):
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in where.items())
    return str(where)


def ok(name: str, detail: str) -> None:
    """The one line a passing check prints."""
    print(f"{name}: ok ({detail})")


def assert_close(name: str, what: str, got, want, where=None, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    """got == want elementwise within atol + rtol * |want| (in float64), else AssertionError naming
    the first worst mismatch. `got` may be a tensor, a number or a list of numbers; nan counts as an
    infinite error; an expected infinity is matched by the same infinity only (no error), nothing else; a
    missing value or a wrong shape is named as such."""
    ctx = f" ({fmt(where)})" if where not in (None, "", {}) else ""
    if got is None:
        raise AssertionError(f"{name}: {what} is None; expected a value{ctx}")
    try:
        got_t = torch.as_tensor(got).detach().to("cpu", DTYPE)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{name}: {what} is a {type(got).__name__}, expected a tensor or number{ctx}") from None
    want_t = torch.as_tensor(want).detach().to("cpu", DTYPE)
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{name}: {what} has shape {tuple(got_t.shape)}, expected {tuple(want_t.shape)}{ctx}")
    err = (got_t - want_t).abs().nan_to_num(math.inf).masked_fill(got_t == want_t, 0.0)  # inf == inf: no error
    bad = (err > atol + rtol * want_t.abs()) | (want_t.isinf() & (got_t != want_t))  # rtol * inf allows anything
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err, -1.0).flatten()))
        raise AssertionError(
            f"{name}: {what} differs from the reference{ctx}: max abs error {err.max():.3g} "
            f"(tolerance {atol:g} + {rtol:g}*|expected|); e.g. at flat index {i}: expected "
            f"{want_t.flatten()[i].item():.10g}, got {got_t.flatten()[i].item():.10g}")


def need_dtype(name: str, what: str, got, dtype: torch.dtype, where, of: str = "") -> None:
    """AssertionError unless `got` is a tensor of `dtype` (`of`: whose dtype that is, for the message)."""
    short = str(dtype).removeprefix("torch.")
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: {what} must be a {short} tensor, got {type(got).__name__} ({fmt(where)})")
    if got.dtype != dtype:
        raise AssertionError(f"{name}: {what} is {str(got.dtype).removeprefix('torch.')}, expected {of}{short} "
                             f"({fmt(where)})")


def assert_held(name: str, before, after, limit: int, what: str, where=None, *, peak: bool = True) -> None:
    """The kernel's count of the student's process (`dlo.grading.api.student_memory`, before and after one
    call) against `limit` bytes of growth: at its peak during the call, or (`peak=False`) still resident after
    it. `what` is what holding that much means ("a (T, T) score matrix"). A process started meanwhile fails
    too (its memory is not the process's)."""
    if after.child_ticks > before.child_ticks or after.below > before.below:
        raise AssertionError(f"{name}: your code started a process while the grader measured its memory (the "
                             f"kernel's count of your process); compute in the process that calls it ({fmt(where)})")
    grew, exact = growth(before, after) if peak else (after.rss - before.rss, True)
    if grew <= limit:
        return
    mib = f"{grew / 2 ** 20:.0f} MiB"
    how = f"grew by {mib} during" if peak else f"stayed {mib} higher after"
    raise AssertionError(
        f"{name}: your process's resident memory {how} the call, as the kernel counts it (outside your code), over "
        f"the {limit / 2 ** 20:.0f} MiB allowed: that is {what} ({fmt(where)})" if exact else
        f"{name}: before the call your process had already held {mib} more than at its start (the kernel's high "
        f"water mark), so the grader cannot tell what the call held: over the {limit / 2 ** 20:.0f} MiB allowed "
        f"({fmt(where)})")


def assert_number(name: str, what: str, got, where=None) -> float:
    """`got` as a float (a one-element tensor is accepted), else AssertionError."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, Real) or isinstance(got, bool):
        ctx = f" ({fmt(where)})" if where else ""
        raise AssertionError(f"{name}: {what} must be a number, got {type(got).__name__}{ctx}")
    return float(got)


def expect_value_error(name: str, call, what: str) -> None:
    """call() must raise ValueError (bad input refused before any work): say what it did instead."""
    try:
        got = call()
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 - the student's error, named in the message
        raise AssertionError(f"{name}: {what}: raise ValueError, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"{name}: {what}: raise ValueError, got a return value {got!r}")


def odd_shape(rng: random.Random) -> tuple[int, ...]:
    """A 1-3 dimensional shape of odd sizes (nothing divides evenly; 1 appears)."""
    dims = rng.choice([1, 2, 3])
    return tuple(rng.choice([1, 3, 5, 7, 11, 13]) for _ in range(dims - 1)) + (rng.choice([3, 7, 17, 33]),)


def rand(shape, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype) * scale


def same(got, want, rtol: float = 1e-6, atol: float = 1e-9) -> bool:
    """got equals want (shapes and values, nan and inf where want has them), never raising: what a check
    uses to tell which wrong answer a student's result reproduces (`name_slip`)."""
    try:
        g = torch.as_tensor(got).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    w = torch.as_tensor(want).detach().to("cpu", torch.float64)
    return g.shape == w.shape and bool(torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True))


def name_slip(name: str, got, slips: dict, where, want=None) -> None:
    """AssertionError naming the first slip (a message -> its wrong result) that `got` reproduces, of those
    that differ from the right answer `want` on this case (all of them when `want` is None)."""
    for message, wrong in slips.items():
        if same(got, wrong) and (want is None or not same(wrong, want)):
            raise AssertionError(f"{name}: {message} ({fmt(where)})")
