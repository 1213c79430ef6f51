"""Autograder checks for Day 8 (quantization, pruning, 2:4 sparsity, distillation).

Each `check_<exercise>(fn, ..., seed=0, trials=...)` draws odd shapes and settings from `seed`, runs
the student's function and the dlo reference (dlo.quant, dlo.prune, dlo.distill; torch's own
F.kl_div / F.cross_entropy underneath) and raises AssertionError saying what to fix, or prints one
"ok" line. Where several answers are equally right (rounding exact ties, which weight to drop among
equal magnitudes) the checks test the defining property instead of one particular output.

Functions returning tensors are called directly (`dlo.grading.api`: inputs made here, plain data
back); the ones whose result must be differentiated or is a module (fake quantization, the
distillation loss, the pruned layer pair) run in workers that record outputs and gradients.
While the student's code runs, the library references of each exercise are off limits.
The pruning and 2:4 checks (exercises 4 and 5) live in `dlo.checks.day8_prune`, the SmoothQuant exercise's in
`dlo.checks.day8_smooth`; both are re-exported here.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from dlo import distill, quant
from dlo.checks.day8_prune import (  # noqa: F401 (the notebook calls them from here)
    check_gradual_sparsity,
    check_magnitude_masks,
    check_mask_2to4,
    check_prune_linear_pair,
    random_matrix,
)
from dlo.checks.day8_smooth import check_smoothing_factors  # noqa: F401 (the notebook calls it from here)
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import assert_close, expect_value_error, fmt, name_slip, ok, same

RTOL, ATOL = 1e-5, 1e-6  # float32 references: correct code agrees to a few ulps
CALIBRATION_RTOL = 1e-10  # calibrate_range works in float64: float32's interpolation is off by ~1e-7
# torch's quantization that does an exercise's work under names no one lists: its observers and fake quantizers,
# the scale helpers, and the decomposed quantize ops (Python operators: registered when their module imports,
# which blocking the module's names does first); a red team's quantize and fake_quant, 2026-12-02
TORCH_QUANT = ("torch.ao.quantization.observer.*", "torch.ao.quantization.fake_quantize.*",
               "torch.ao.quantization.utils.*", "torch.ao.quantization.fx._decomposed.*", "quantized_decomposed::*")
# the library's Triton quantizer by its kernel and helpers, not only its launcher: a red team launched
# _quantize_kernel itself in Triton's interpreter (TRITON_INTERPRET=1, InterpretedFunction(kernel.fn)), 2026-12-02;
# compile_cases hands the kernel out too
TRITON_QUANT = ("dlo.kernels.quantize._quantize_kernel", "dlo.kernels.quantize._codes",
                "dlo.kernels.quantize._round_half_even", "dlo.kernels.quantize.compile_cases")
# torch's test suite (torch.testing._internal) holds references of its quantizers and fake quantizer (a red team's
# fake_quant called common_quantized's, expecttest stubbed, 2026-12-02): running any of its modules is refused in every
# check (dlo.grading.identity's audit hook), whatever the route of the import
QUANT = ("dlo.quant.quantize", "dlo.quant.dequantize", "dlo.quant.group_view", "dlo.quant.quantize_affine",
         "dlo.quant.dequantize_affine", "dlo.quant.scale_zero_point", "dlo.quant.fake_quantize_tensor",
         "dlo.kernels.quantize.quantize_weight", "dlo.kernels.quantize.quantize_ref",
         "dlo.kernels.quantize.dequantize_weight", *TRITON_QUANT, "torch.quantize_per_tensor",
         "torch.quantize_per_channel", "aten::quantize_per_*", "aten::*fake_quant*",  # torch's quantizers, at dispatch
         *TORCH_QUANT)
# a fake quantizer is a quantizer and a dequantizer: all of QUANT, and the fake ones
FAKE_QUANT = ("dlo.quant.fake_quant", "dlo.quant.FakeQuantSTE", "torch.fake_quantize_per_tensor_affine",
              "torch.fake_quantize_per_channel_affine", *QUANT)
OBSERVERS = ("dlo.quant.MinMaxObserver", "dlo.quant.PercentileObserver", "dlo.quant.quantiles",
             "dlo.quant._make_observer", "dlo.quant.OBSERVERS", *TORCH_QUANT)


# ----------------------------------------------------------------------------- exercise 1

@check(forbid=QUANT)
def check_quantize(quantize_fn, dequantize_fn, seed: int = 0, trials: int = 6) -> None:
    """`quantize_fn(x, bits, granularity, group_size) -> (q, scale)` symmetric, scale (R|1, n_groups);
    `dequantize_fn(q, scale) -> x_hat`. Against dlo.quant.quantize(..., symmetric=True)."""
    name, cs = "quantize", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        bits = (8, 4)[t % 2] if t < 4 else rng.choice([2, 3, 5, 6])  # q_max = 2^(b-1) - 1 for any width
        granularity = ("tensor", "channel", "group")[t % 3]
        G = rng.choice([4, 8])
        x = random_matrix(rng, gen, cols_multiple=8)
        if granularity != "tensor" and x.shape[0] > 1:
            x[rng.randrange(x.shape[0])] = 0.0  # an all-zero channel must not divide by zero
        hp = dict(bits=bits, granularity=granularity, group_size=G, x_shape=tuple(x.shape))
        q, scale = quantize_fn(x.clone(), bits, granularity, G)
        q_ref, s_ref, _ = quant.quantize(x, bits, granularity, G, symmetric=True)
        if bits not in (8, 4) and not same(scale, s_ref, rtol=RTOL, atol=ATOL):
            raise AssertionError(f"{name}: scale wrong at bits={bits}: q_max = 2^(bits-1) - 1 = {2 ** (bits - 1) - 1} "
                                 f"for every bit width, not only 127 (int8) and 7 (int4) ({fmt(hp)})")
        assert_close(name, "scale", scale, s_ref, hp, rtol=RTOL, atol=ATOL)
        q = torch.as_tensor(q)
        if tuple(q.shape) != tuple(x.shape):
            raise AssertionError(f"{name}: codes have shape {tuple(q.shape)}, expected x's shape {tuple(x.shape)}: "
                                 f"reshape the grouped codes back ({fmt(hp)})")
        q_max = 2 ** (bits - 1) - 1
        if q.float().abs().max() > q_max:
            raise AssertionError(f"{name}: codes reach {q.float().abs().max():.0f} but {bits}-bit symmetric codes "
                                 f"lie in [-{q_max}, {q_max}]: clamp after rounding ({fmt(hp)})")
        # Codes may differ only at exact .5 ties (x / s vs x * (1 / s) can land either side).
        y = (quant.group_view(x, granularity, G) / torch.where(s_ref > 0, s_ref, 1.0)[..., None]).reshape(x.shape)
        near_tie = ((y - y.floor()) - 0.5).abs() < 1e-3
        diff = (q.float() != q_ref.float()) & ~near_tie
        if diff.any():
            i = int(torch.nonzero(diff.flatten())[0])
            raise AssertionError(f"{name}: codes differ from round(x / scale) ({fmt(hp)}): at flat index {i} expected "
                                 f"{q_ref.flatten()[i].item()}, got {q.flatten()[i].item()} "
                                 f"(x={x.flatten()[i].item():.6g}); use round-to-nearest, not floor/trunc")
        x_hat = dequantize_fn(q_ref.clone(), s_ref.clone())  # int8 codes, as dlo.quant stores them
        if not isinstance(x_hat, torch.Tensor) or x_hat.dtype != torch.float32:
            got = x_hat.dtype if isinstance(x_hat, torch.Tensor) else type(x_hat).__name__
            raise AssertionError(f"{name}: dequantize_symmetric returned {got} for int8 codes and a float32 scale; "
                                 f"return float32 (e.g. q.float() * scale), whatever the codes' dtype ({fmt(hp)})")
        assert_close(name, "dequantize(q, scale)", x_hat, quant.dequantize(q_ref, s_ref), hp, rtol=RTOL, atol=ATOL)
    ragged = random_matrix(rng, gen, cols_multiple=8)[:, :-3]  # 8k - 3 columns: no group size of 4 or 8 divides them
    G = rng.choice([4, 8])
    expect_value_error(name, lambda: quantize_fn(ragged.clone(), 8, "group", G),
                       f"group_size={G} does not divide the {ragged.shape[1]} columns: refuse it, never pad or "
                       f"truncate the last group (x_shape={tuple(ragged.shape)})")
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 2

@check(forbid=OBSERVERS)
def check_calibrate_range(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(batches, method, percentile) -> (lo, hi)`: min-max, or the (100-p, p) percentiles of all values."""
    name, cs = "calibrate_range", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        method = ("minmax", "percentile")[t % 2]
        pct = rng.choice([99.0, 99.9, 95.0])
        batches = [torch.randn(rng.choice([3, 5]), 17, generator=gen) * 2 + 0.5 for _ in range(rng.choice([2, 3]))]
        batches[0][0, 0] = 60.0  # one outlier: min-max follows it, the percentile ignores it
        hp = dict(method=method, percentile=pct, batches=len(batches))
        out = fn([b.clone() for b in batches], method, pct)
        if not (isinstance(out, tuple) and len(out) == 2 and all(type(v) is float for v in out)):
            got = type(out).__name__ + (f" of {[type(v).__name__ for v in out]}" if isinstance(out, tuple) else "")
            raise AssertionError(f"{name}: return a tuple (lo, hi) of two Python floats, got {got}: convert a 0-d "
                                 f"tensor with float(t) or t.item() ({fmt(hp)})")
        values = torch.cat([b.flatten() for b in batches]).double()
        want = ((values.min(), values.max()) if method == "minmax" else
                quant.quantiles(values, [1 - pct / 100, pct / 100]))
        for what, got, w in zip(("lo", "hi"), out, want):
            _float64_close(name, what, got, float(w), hp)
    ok(name, f"{trials} trials, seed={seed}")


def _float64_close(name: str, what: str, got: float, want: float, hp: dict) -> None:
    """got == want to float64's precision; an error of float32's size names the dtype the text rules out."""
    assert_close(name, what, got, want, hp, rtol=1e-4, atol=1e-5)
    if abs(got - want) > CALIBRATION_RTOL * abs(want):
        raise AssertionError(f"{name}: {what} = {got!r} is {want!r} to float32's precision only (relative error "
                             f"{abs(got / want - 1):.2g}): compute in float64 (e.g. torch.cat(...).double()), "
                             f"whatever the batches' dtype, as the exercise says ({fmt(hp)})")


# ----------------------------------------------------------------------------- exercise 3

def _fake_quant_worker(fn, x, scale, bits: int, g) -> dict:
    """Forward through the student's fake quantization, then backward of <y, g>: output and x.grad."""
    x1 = x.clone().requires_grad_()
    y = fn(x1, scale, bits)
    out = {"y": y.detach() if isinstance(y, torch.Tensor) else None,
           "requires_grad": isinstance(y, torch.Tensor) and y.requires_grad}
    if out["requires_grad"]:
        (y * g).sum().backward()
        out["grad"] = x1.grad
    return out


@check(forbid=FAKE_QUANT)
def check_fake_quant_ste(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(x, scale, bits) -> x_hat`: symmetric fake quantization whose gradient is the clipped STE."""
    name, cs = "fake_quant_ste", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        bits = (8, 4)[t % 2]
        x = torch.randn(rng.choice([3, 7]), rng.choice([5, 9]), generator=gen, dtype=torch.float64)
        scale = torch.tensor(rng.choice([0.05, 0.2, 0.5]) * 8 / 2 ** (bits - 1), dtype=torch.float64)
        q_max = 2 ** (bits - 1) - 1  # x / S = +-(q_max + 1/4) rounds to +-q_max: inside, gradient 1; q_max + 3/4: 0
        x.view(-1)[torch.randperm(x.numel(), generator=gen)[:3]] = torch.tensor(
            [q_max + 0.25, -q_max - 0.25, q_max + 0.75], dtype=torch.float64) * scale
        hp = dict(bits=bits, scale=scale.item())
        g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        got = run_student(_fake_quant_worker, fn, x, scale, bits, g)
        x2 = x.clone().requires_grad_()
        y_ref = quant.fake_quant(x2, scale, bits=bits)
        assert_close(name, "forward", got["y"], y_ref, hp, rtol=RTOL, atol=ATOL)
        if not got["requires_grad"]:
            raise AssertionError(f"{name}: the output does not require grad; build it from x with torch ops "
                                 f"or a torch.autograd.Function ({fmt(hp)})")
        (y_ref * g).sum().backward()
        band = ((x / scale).abs() > q_max) & ((x / scale).abs() < q_max + 0.5)
        if isinstance(got.get("grad"), torch.Tensor) and got["grad"].shape == x.shape and torch.equal(
                got["grad"], torch.where(band, 0.0, x2.grad)) and band.any():
            raise AssertionError(f"{name}: gradient 0 where |x / scale| is in (q_max, q_max + 1/2): those values "
                                 f"round to +-q_max, inside the range; the STE mask tests round(x / S), not x / S "
                                 f"({fmt(hp)})")
        assert_close(name, "gradient w.r.t. x (STE: grad where not clipped, 0 outside)", got["grad"], x2.grad, hp,
                     rtol=RTOL, atol=ATOL)
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 6

def _distill_worker(fn, s, t, y, temperature: float, lam: float) -> dict:
    """The student's loss and its gradients w.r.t. the student and the teacher logits."""
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss = fn(s1, t1, y, temperature, lam)
    out = {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss if isinstance(loss, float) else None}
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    return {**out, "grad_s": s1.grad, "grad_t": t1.grad}


@check(forbid=("dlo.distill.distillation_loss", "dlo.distill.distill_step", "dlo.distill.train_distill"))
def check_distillation_loss(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(student_logits, teacher_logits, targets, temperature, lam) -> scalar` =
    T^2 KL(softmax(t/T) || softmax(s/T)) (batch mean) + lam CE(s, y); gradients must reach the student only."""
    name, cs = "distillation_loss", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t_ in range(trials):
        B, C = rng.choice([3, 8]), rng.choice([4, 10])
        # at T = 2 (and 4), T^2 = 2^T (and 2T): the first trial's temperature tells them apart
        T, lam = rng.choice([1.0, 3.0] if t_ == 0 else [1.0, 2.0, 4.0]), rng.choice([0.0, 0.5, 1.0])
        s = torch.randn(B, C, generator=gen, dtype=torch.float64) * 2
        t = torch.randn(B, C, generator=gen, dtype=torch.float64) * 2
        y = torch.randint(0, C, (B,), generator=gen)
        hp = dict(B=B, classes=C, temperature=T, lam=lam)
        got = run_student(_distill_worker, fn, s, t, y, T, lam)
        want = distill.distillation_loss(s, t, y, T, lam)
        if not same(got["loss"], want, rtol=1e-7, atol=1e-10):  # name the factor if it is a known wrong one
            soft, ce = distill.distillation_loss(s, t, y, T, 0.0) / T ** 2, lam * F.cross_entropy(s, y)
            factors = {}  # factor -> its spellings (at T = 1, 2^T and 2T are both 2)
            for k, v in (("2^T", 2 ** T), ("2T", 2 * T), ("T", T), ("nothing", 1.0)):
                factors.setdefault(v, []).append(k)
            name_slip(name, got["loss"], {f"the soft KL term is scaled by {' or '.join(k)}, not by T^2": soft * v + ce
                                          for v, k in factors.items()}, hp, want)
        assert_close(name, "loss", got["loss"], want, hp, rtol=1e-7, atol=1e-10)
        s2 = s.clone().requires_grad_()
        distill.distillation_loss(s2, t, y, T, lam).backward()
        assert_close(name, "gradient w.r.t. the student logits", got["grad_s"], s2.grad, hp, rtol=1e-7, atol=1e-10)
        if got["grad_t"] is not None and got["grad_t"].abs().max() > 0:
            raise AssertionError(f"{name}: gradient flows into the teacher logits; detach them ({fmt(hp)})")
    ok(name, f"{trials} trials, seed={seed}")
