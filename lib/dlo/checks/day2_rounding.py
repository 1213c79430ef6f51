"""Autograder check for Day 2's bf16 rounding exercise (`check_round_to_bf16`, re-exported by
`dlo.checks.day2`, whose name the test cell calls).

The reference is torch's own cast, `x.to(torch.bfloat16).float()`, compared bit for bit (nans with
isnan). The exercise is that cast written by hand on the bits, so the student's function runs in a
worker (`dlo.grading.api.run_student`) under a TorchDispatchMode that refuses every operator that
makes or reads a bfloat16 tensor (`_NoBf16`), whatever Python object reached it. numpy has no bf16
(ml_dtypes, which adds one, is not installed).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok


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


class _NoBf16(TorchDispatchMode):
    """Refuses every operator that reads or makes a bfloat16 tensor while the student's rounding runs:
    torch's cast (`.to`, `.bfloat16()`, a copy into a bf16 buffer, autocast) is the check's reference,
    whatever Python object reached it. The first one is recorded too, should the student's code catch
    the error."""

    def __init__(self):
        super().__init__()
        self.what = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
               for t in tree_flatten((args, kwargs, out))[0]):
            self.what = self.what or f"aten.{func.overloadpacket.__name__}"
            raise RuntimeError(f"round_to_bf16: {self.what} made or read a bfloat16 tensor; the exercise is that "
                               f"cast, written by hand on the bits")
        return out


def _bf16_worker(fn, xs: list) -> list:
    """The student's rounding of each x under `_NoBf16`: what it returned, whether x changed, the bf16
    operator it reached (if any; the last trial run then). One worker for every trial: each call of
    one costs the grader's seal (`dlo.grading.seal`), ten times the rounding."""
    out = []
    for x in xs:
        before = x.clone()
        with _NoBf16() as mode:
            try:
                got = fn(x)
            except Exception:
                if not mode.what:
                    raise
                got = None
        out.append({"got": got, "bf16": mode.what,
                    "changed": not torch.equal(x.view(torch.int32), before.view(torch.int32))})
        if mode.what:
            break
    return out


@check()
def check_round_to_bf16(fn, seed: int = 0, trials: int = 3, n: int = 4099) -> None:
    """`fn(x: fp32 tensor) -> fp32 tensor` of the values rounded to bf16, round-to-nearest-even, compared
    bit for bit with x.to(torch.bfloat16).float(), except nans, compared with isnan: torch turns every
    nan into one bf16 nan (0x7FC0), the bit trick keeps its payload, and either is right. No bfloat16
    tensor may be made or read while `fn` runs (`_NoBf16`): that cast is what the exercise writes."""
    name, gen = "round_to_bf16", torch.Generator().manual_seed(case_seed(seed))
    xs = [_bf16_probe(gen, n) for _ in range(trials)]
    for t, (x, res) in enumerate(zip(xs, run_student(_bf16_worker, fn, xs))):
        if res["bf16"]:
            raise AssertionError(f"{name}: {res['bf16']} made or read a bfloat16 tensor: torch's cast is the check's "
                                 f"reference, the exercise writes it by hand (x.view(torch.int32), add 0x7FFF + bit "
                                 f"16, clear the low 16 bits)")
        got = res["got"]
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float32 or got.shape != x.shape:
            raise AssertionError(f"{name}: return an fp32 tensor of shape {tuple(x.shape)}, got "
                                 f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}")
        if res["changed"]:
            raise AssertionError(f"{name}: the input was modified; work on a copy (x.view(torch.int32) shares memory)")
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
