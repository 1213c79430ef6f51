"""Autograder check for Day 2's bf16 rounding exercise (`check_round_to_bf16`, re-exported by
`dlo.checks.day2`, whose name the test cell calls).

The reference is torch's own cast, `x.to(torch.bfloat16).float()`, compared bit for bit (nans with
isnan). The exercise is that cast written by hand on the bits, so the student's function runs in a
worker (`dlo.grading.api.run_student`) under a TorchDispatchMode that refuses every operator that
makes or reads a bfloat16 tensor (`_NoBf16`), whatever Python object reached it. numpy has no bf16
(ml_dtypes, which adds one, is not installed).

A dispatch mode is the calling thread's, and code can step out of it: a red team ran torch's cast under
`_disable_current_modes()` and in a new thread. So the worker refuses new threads (`no_threads`), the one-line
ways out that a tensor's repr does not need are forbidden (`dlo.checks.saved.MODES`), and the watch must have
seen the work: an operator reading x, and one making the tensor returned (`_NoBf16.seen`). Left open: torch's cast
done past the watch (the modes popped as a repr pops them) and then copied by an operator it sees.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dlo.checks.saved import MODES
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok
from dlo.grading.forbid import ForbiddenCall, no_threads


def _bf16_probe(gen: torch.Generator, n: int) -> torch.Tensor:
    """Random fp32 values plus the hard cases: exact ties (even and odd), carries into the exponent,
    overflow to inf, subnormals, signed zeros, inf and nan."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    bits = (torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32) << 16)  # bf16 values
    ties = (bits | 0x8000).view(torch.float32)  # exactly half-way between two bf16 neighbours
    special = torch.tensor([0.0, -0.0, 1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895e38, -3.4e38, 1e-40, -2e-45,
                            math.inf, -math.inf, math.nan, 1.9999999, 255.99, 2.0 ** -126])
    # nans with every mantissa bit set (0x7FFFFFFF is the nan a GPU's arithmetic returns): the rounding
    # carry runs into the sign bit unless nan is left alone
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FFF8000], dtype=torch.int32).view(torch.float32)
    return torch.cat([x, ties[torch.isfinite(ties)], special, nans])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _NoBf16(TorchDispatchMode):
    """Refuses every operator that reads or makes a bfloat16 tensor while the student's rounding runs:
    torch's cast (`.to`, `.bfloat16()`, a copy into a bf16 buffer, autocast) is the check's reference,
    whatever Python object reached it. The first one is recorded too, should the student's code catch
    the error. It also records what it saw of the work (`seen`): whether an operator read the input `x`
    (its memory), and the tensors operators made in memory of their own (not a view or an in-place write
    of one of their inputs), kept alive until the end so that no other tensor takes their place."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.what, self.x, self.read_x, self.made = "", _storage(x), False, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in, flat_out = tree_flatten((args, kwargs))[0], tree_flatten(out)[0]
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in flat_in + flat_out):
            self.what = self.what or f"aten.{func.overloadpacket.__name__}"
            raise RuntimeError(f"round_to_bf16: {self.what} made or read a bfloat16 tensor; the exercise is that "
                               f"cast, written by hand on the bits")
        inputs = {_storage(t) for t in flat_in if isinstance(t, torch.Tensor)}
        self.read_x = self.read_x or self.x in inputs
        for t in flat_out:
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                self.made[_storage(t)] = t
        return out

    def seen(self, got) -> str:
        """"" if the watch saw the work; else what it missed."""
        if not self.read_x:
            return "no torch operator read the input x"
        if isinstance(got, torch.Tensor) and _storage(got) != self.x and _storage(got) not in self.made:
            return "no torch operator made the tensor returned"
        return ""


THREADS = "starting a thread"  # `no_threads`'s refusal


def _bf16_worker(fn, xs: list) -> list:
    """The student's rounding of each x under `_NoBf16`, no new thread allowed (`no_threads`: the watch is the
    calling thread's): what it returned, whether x changed, the bf16 operator it reached or the thread it
    started (if any; the last trial run then), what the watch missed of the work (`_NoBf16.seen`). One worker
    for every trial: each call of one costs the grader's seal (`dlo.grading.seal`), ten times the rounding."""
    out = []
    for x in xs:
        before, thread = x.clone(), ""
        mode = _NoBf16(x)
        try:
            with no_threads("round_to_bf16"), mode:
                try:
                    got = fn(x)
                except Exception as exc:
                    if not mode.what and not (isinstance(exc, ForbiddenCall) and THREADS in str(exc)):
                        raise
                    thread, got = "" if mode.what else str(exc), None
        except ForbiddenCall as exc:  # a thread still running at the end
            if THREADS not in str(exc):
                raise
            thread, got = str(exc), None
        out.append({"got": got, "bf16": mode.what, "thread": bool(thread), "unseen": mode.seen(got),
                    "changed": not torch.equal(x.view(torch.int32), before.view(torch.int32))})
        del mode
        if out[-1]["bf16"] or thread:
            break
    return out


@check(forbid=MODES)
def check_round_to_bf16(fn, seed: int = 0, trials: int = 3, n: int = 4099) -> None:
    """`fn(x: fp32 tensor) -> fp32 tensor` of the values rounded to bf16, round-to-nearest-even, compared
    bit for bit with x.to(torch.bfloat16).float(), except nans, compared with isnan: torch turns every
    nan into one bf16 nan (0x7FC0), the bit trick keeps its payload, and either is right. No bfloat16
    tensor may be made or read while `fn` runs (`_NoBf16`): that cast is what the exercise writes. The watch
    is the calling thread's: no new thread, no way out of it (`MODES`), and it must have seen the work (an
    operator reading x, and one making the tensor returned; numpy is welcome in between)."""
    name, gen = "round_to_bf16", torch.Generator().manual_seed(case_seed(seed))
    xs = [_bf16_probe(gen, n) for _ in range(trials)]
    results = _results(name, run_student(_bf16_worker, fn, [x.clone() for x in xs]), trials)  # copies: a notebook's
    # own check shares the process with the student's code
    for t, (x, res) in enumerate(zip(xs, results)):
        if res["bf16"]:
            raise AssertionError(f"{name}: {res['bf16']} made or read a bfloat16 tensor: torch's cast is the check's "
                                 f"reference, the exercise writes it by hand (x.view(torch.int32), add 0x7FFF + bit "
                                 f"16, clear the low 16 bits)")
        if res["thread"]:
            raise AssertionError(f"{name}: your function started a thread; the grader watches torch's operators on "
                                 f"the thread that calls it (torch's cast there is refused): round on that thread")
        got = res["got"]
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float32 or got.shape != x.shape:
            raise AssertionError(f"{name}: return an fp32 tensor of shape {tuple(x.shape)}, got "
                                 f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}")
        if res["changed"]:
            raise AssertionError(f"{name}: the input was modified; work on a copy (x.view(torch.int32) shares memory)")
        if res["unseen"]:
            raise AssertionError(f"{name}: {res['unseen']} while the grader watched your function: the rounding ran "
                                 f"where its watch of torch's operators does not see it (a dispatch mode popped or "
                                 f"disabled); write it with torch operators on x (x.view(torch.int32), ...)")
        want = x.to(torch.bfloat16).float()
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        if not same.all():
            i = int((~same).nonzero()[0])
            bits = x[i].view(torch.int32).item() & 0xFFFFFFFF
            raise AssertionError(f"{name}: trial {t}: x = {x[i].item()!r} (bits 0x{bits:08x}) "
                                 f"should round to {want[i].item()!r}, got {got[i].item()!r}; add half an ulp "
                                 f"(0x7FFF + the lowest kept bit, for ties to even) before clearing the low 16 bits"
                                 f"{'; a nan must stay nan: leave it as it is' if x[i].isnan() else ''}")
    ok(name, f"{trials} trials, seed={seed}")


RESULT_KEYS = {"bf16": str, "thread": bool, "unseen": str, "changed": bool}


def _results(name: str, got, trials: int) -> list:
    """The worker's reply held to what `_bf16_worker` sends, whatever came back: a record of every trial, or
    of the trials up to one that reached a bf16 operator or a thread. A shorter reply would compare fewer
    trials."""
    def whole(res) -> bool:
        return type(res) is dict and all(type(res.get(k)) is v for k, v in RESULT_KEYS.items()) and "got" in res

    if type(got) is list and got and all(whole(r) for r in got) and (
            len(got) == trials or (len(got) < trials and (got[-1]["bf16"] or got[-1]["thread"]))):
        return got
    count = len(got) if type(got) is list else type(got).__name__
    raise AssertionError(f"{name}: the record of the {trials} trials that came back from where your function ran is "
                         f"incomplete or malformed ({count} entries); every trial is compared")
