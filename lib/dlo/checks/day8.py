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
The SmoothQuant exercise's check lives in `dlo.checks.day8_smooth` and is re-exported here.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from dlo import distill, prune, quant
from dlo.checks.day8_smooth import check_smoothing_factors  # noqa: F401 (the notebook calls it from here)
from dlo.grading.api import check, run_student
from dlo.grading.compare import assert_close, expect_value_error, fmt, ok

RTOL, ATOL = 1e-5, 1e-6  # float32 references: correct code agrees to a few ulps
CALIBRATION_RTOL = 1e-10  # calibrate_range works in float64: float32's interpolation is off by ~1e-7
QUANT = ("dlo.quant.quantize", "dlo.quant.dequantize", "dlo.quant.group_view", "dlo.quant.quantize_affine",
         "dlo.quant.dequantize_affine", "dlo.quant.scale_zero_point", "dlo.quant.fake_quantize_tensor",
         "dlo.kernels.quantize.quantize_weight", "dlo.kernels.quantize.quantize_ref",
         "dlo.kernels.quantize.dequantize_weight", "torch.quantize_per_tensor", "torch.quantize_per_channel",
         "aten::quantize_per_*", "aten::*fake_quant*")  # torch's quantizers, at dispatch
FAKE_QUANT = ("dlo.quant.fake_quant", "dlo.quant.FakeQuantSTE", "dlo.quant.fake_quantize_tensor",
              "torch.fake_quantize_per_tensor_affine", "torch.fake_quantize_per_channel_affine", "aten::*fake_quant*")
OBSERVERS = ("dlo.quant.MinMaxObserver", "dlo.quant.PercentileObserver", "dlo.quant.quantiles",
             "dlo.quant._make_observer", "dlo.quant.OBSERVERS", "torch.ao.quantization.observer.MinMaxObserver",
             "torch.ao.quantization.observer.PerChannelMinMaxObserver")


def _matrix(rng: random.Random, gen: torch.Generator, cols_multiple: int = 1) -> torch.Tensor:
    rows = rng.choice([1, 3, 5, 7, 11])
    cols = cols_multiple * rng.choice([3, 4, 5, 7, 9])
    return torch.randn(rows, cols, generator=gen) * rng.choice([0.01, 1.0, 30.0])


# ----------------------------------------------------------------------------- exercise 1

@check(forbid=QUANT)
def check_quantize(quantize_fn, dequantize_fn, seed: int = 0, trials: int = 6) -> None:
    """`quantize_fn(x, bits, granularity, group_size) -> (q, scale)` symmetric, scale (R|1, n_groups);
    `dequantize_fn(q, scale) -> x_hat`. Against dlo.quant.quantize(..., symmetric=True)."""
    name, rng, gen = "quantize", random.Random(seed), torch.Generator().manual_seed(seed)
    for t in range(trials):
        bits = (8, 4)[t % 2]
        granularity = ("tensor", "channel", "group")[t % 3]
        G = rng.choice([4, 8])
        x = _matrix(rng, gen, cols_multiple=8)
        if granularity != "tensor" and x.shape[0] > 1:
            x[rng.randrange(x.shape[0])] = 0.0  # an all-zero channel must not divide by zero
        hp = dict(bits=bits, granularity=granularity, group_size=G, x_shape=tuple(x.shape))
        q, scale = quantize_fn(x.clone(), bits, granularity, G)
        q_ref, s_ref, _ = quant.quantize(x, bits, granularity, G, symmetric=True)
        assert_close(name, "scale", scale, s_ref, hp, rtol=RTOL, atol=ATOL)
        q = torch.as_tensor(q)
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
    ragged = _matrix(rng, gen, cols_multiple=8)[:, :-3]  # 8k - 3 columns: no group size of 4 or 8 divides them
    G = rng.choice([4, 8])
    expect_value_error(name, lambda: quantize_fn(ragged.clone(), 8, "group", G),
                       f"group_size={G} does not divide the {ragged.shape[1]} columns: refuse it, never pad or "
                       f"truncate the last group (x_shape={tuple(ragged.shape)})")
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 2

@check(forbid=OBSERVERS)
def check_calibrate_range(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(batches, method, percentile) -> (lo, hi)`: min-max, or the (100-p, p) percentiles of all values."""
    name, rng, gen = "calibrate_range", random.Random(seed), torch.Generator().manual_seed(seed)
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
    name, rng, gen = "fake_quant_ste", random.Random(seed), torch.Generator().manual_seed(seed)
    for t in range(trials):
        bits = (8, 4)[t % 2]
        x = torch.randn(rng.choice([3, 7]), rng.choice([5, 9]), generator=gen, dtype=torch.float64)
        scale = torch.tensor(rng.choice([0.05, 0.2, 0.5]) * 8 / 2 ** (bits - 1), dtype=torch.float64)
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
        assert_close(name, "gradient w.r.t. x (STE: grad where not clipped, 0 outside)", got["grad"], x2.grad, hp,
                     rtol=RTOL, atol=ATOL)
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 4

@check(forbid=("dlo.prune.magnitude_masks", "dlo.prune._smallest_mask", "torch.nn.utils.prune.*"))
def check_magnitude_masks(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(weights: dict[str, Tensor], sparsity, scope) -> dict[str, bool mask]` (True = kept)."""
    name, rng, gen = "magnitude_masks", random.Random(seed), torch.Generator().manual_seed(seed)
    for t in range(trials):
        scope = ("global", "layer")[t % 2]
        sparsity = rng.choice([0.2, 0.5, 0.75, 0.9])
        weights = {f"w{i}": _matrix(rng, gen) for i in range(rng.choice([2, 3]))}
        hp = dict(scope=scope, sparsity=sparsity, shapes=[tuple(w.shape) for w in weights.values()])
        masks = fn({k: w.clone() for k, w in weights.items()}, sparsity, scope)
        if set(masks) != set(weights):
            raise AssertionError(f"{name}: returned keys {sorted(masks)}, expected {sorted(weights)} ({fmt(hp)})")
        masks = {k: torch.as_tensor(m).bool() for k, m in masks.items()}
        for k, w in weights.items():
            if masks[k].shape != w.shape:
                raise AssertionError(f"{name}: mask {k} has shape {tuple(masks[k].shape)}, expected {tuple(w.shape)}")
        groups = [list(weights)] if scope == "global" else [[k] for k in weights]
        for keys in groups:
            a = torch.cat([weights[k].abs().flatten() for k in keys])
            m = torch.cat([masks[k].flatten() for k in keys])
            pruned = int((~m).sum())
            if abs(pruned - sparsity * a.numel()) >= 1:
                raise AssertionError(f"{name}: pruned {pruned} of {a.numel()} weights in {keys}; expected "
                                     f"round({sparsity} * {a.numel()}) ({fmt(hp)})")
            if 0 < pruned < a.numel() and a[m].min() < a[~m].max():
                where = "over all layers together" if scope == "global" else "within each layer"
                raise AssertionError(f"{name}: a kept |w|={a[m].min():.4g} is smaller than a pruned "
                                     f"|w|={a[~m].max():.4g} in {keys}: rank by magnitude |w| {where} ({fmt(hp)})")
    ok(name, f"{trials} trials, seed={seed}")


def _schedule_slips(step: int, s_f: float, t0: int, t1: int, s_i: float) -> dict[str, float]:
    """What the plausible wrong derivations of Exercise 5 give at `step`, each named by its mistake."""
    raw = (step - t0) / (t1 - t0)
    p = min(max(raw, 0.0), 1.0)
    return {"a linear schedule: its slope at p = 1 is not 0; s'(1) = s''(1) = 0 calls for (1 - p)^3":
            s_i + (s_f - s_i) * p,
            "(1 - p)^2: s''(1) is then not 0; the conditions call for (1 - p)^3": s_f + (s_i - s_f) * (1 - p) ** 2,
            "p^3 instead of (1 - p)^3: that starts slowly and lands steeply, the opposite of the conditions":
            s_i + (s_f - s_i) * p ** 3,
            "no clamp: s_i before begin_step and s_f after end_step": s_f + (s_i - s_f) * (1 - raw) ** 3}


@check(forbid=("dlo.prune.gradual_sparsity",))
def check_gradual_sparsity(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(step, final_sparsity, begin_step, end_step, initial_sparsity) -> float`: the cubic of Zhu & Gupta
    derived from s(0) = s_i, s(1) = s_f, s'(1) = s''(1) = 0; a wrong value is named by the slip it matches."""
    name, rng = "gradual_sparsity", random.Random(seed)
    for _ in range(trials):
        s_f, s_i = rng.choice([0.5, 0.8, 0.95]), rng.choice([0.0, 0.1])
        t0 = rng.choice([0, 5, 17])
        t1 = t0 + rng.choice([10, 33])
        for step in sorted({0, t0, t0 + 1, (t0 + t1) // 2, t1 - 1, t1, t1 + 7}):
            hp = dict(step=step, final=s_f, begin=t0, end=t1, initial=s_i)
            got, want = float(fn(step, s_f, t0, t1, s_i)), prune.gradual_sparsity(step, s_f, t0, t1, s_i)
            if abs(got - want) > 1e-12 + 1e-9 * abs(want):
                for slip, value in _schedule_slips(step, s_f, t0, t1, s_i).items():
                    if abs(got - value) <= 1e-9:
                        raise AssertionError(f"{name}: {got:.6g} where the schedule gives {want:.6g}, as {slip} "
                                             f"would ({fmt(hp)})")
            assert_close(name, "sparsity", got, want, hp, rtol=1e-9, atol=1e-12)
    ok(name, f"{trials} trials, seed={seed}")


def _prune_pair_worker(fn, fc1, fc2, n_keep: int, x) -> dict:
    """The student's two new layers: their types, weight shapes, and what the pair computes on x."""
    new1, new2 = fn(fc1, fc2, n_keep)
    layers = [{"linear": isinstance(m, nn.Linear), "type": type(m).__name__,
               "shape": list(m.weight.shape) if isinstance(m, nn.Linear) else None} for m in (new1, new2)]
    if not all(layer["linear"] for layer in layers):
        return {"layers": layers}
    with torch.no_grad():
        return {"layers": layers, "y": new2(torch.relu(new1(x)))}


@check(forbid=("dlo.prune.prune_linear_pair", "dlo.prune.prune_mlp_channels", "torch.nn.utils.prune.ln_structured"))
def check_prune_linear_pair(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(fc1, fc2, n_keep) -> (new_fc1, new_fc2)`: keep the n_keep hidden units with the largest
    L2 row norm of fc1; the new layers must be really smaller and compute the same thing on them."""
    name, rng = "prune_linear_pair", random.Random(seed)
    for _ in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        d_in, hidden, d_out = rng.choice([3, 6]), rng.choice([7, 12]), rng.choice([2, 5])
        n_keep = rng.randrange(1, hidden)
        fc1, fc2 = nn.Linear(d_in, hidden).double(), nn.Linear(hidden, d_out).double()
        hp = dict(d_in=d_in, hidden=hidden, d_out=d_out, n_keep=n_keep)
        x = torch.randn(4, d_in, dtype=torch.float64)
        got = run_student(_prune_pair_worker, fn, fc1, fc2, n_keep, x)
        want1, want2 = prune.prune_linear_pair(fc1, fc2, n_keep)
        for layer, want, label in zip(got["layers"], (want1, want2), ("new fc1", "new fc2")):
            if not layer["linear"] or tuple(layer["shape"]) != tuple(want.weight.shape):
                shape = tuple(layer["shape"]) if layer["linear"] else layer["type"]
                raise AssertionError(f"{name}: {label} should be an nn.Linear with weight {tuple(want.weight.shape)}, "
                                     f"got {shape}: build new, smaller layers ({fmt(hp)})")
        with torch.no_grad():
            assert_close(name, "output of the pruned pair", got["y"], want2(torch.relu(want1(x))), hp,
                         rtol=1e-9, atol=1e-12)
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 5

@check(forbid=("dlo.prune.mask_2to4", "dlo.prune.is_2to4", "dlo.kernels.sparse24.sparse24",
               "dlo.kernels.sparse24.sparse24_ref", "dlo.kernels.sparse24.decompress24",
               "torch.sparse.to_sparse_semi_structured", "aten::_sparse_semi_structured*", "aten::_cslt_*"))
def check_mask_2to4(mask_fn, valid_fn, seed: int = 0, trials: int = 4) -> None:
    """`mask_fn(w) -> bool mask` keeping the 2 largest |w| of each 4 along the last dim;
    `valid_fn(mask) -> bool`, True when no group of 4 keeps more than 2."""
    name, rng, gen = "mask_2to4", random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(trials):
        w = _matrix(rng, gen, cols_multiple=4)
        hp = dict(w_shape=tuple(w.shape))
        m = torch.as_tensor(mask_fn(w.clone())).bool()
        assert_close(name, "mask", m.float(), prune.mask_2to4(w).float(), hp, rtol=0, atol=0)
        if valid_fn(prune.mask_2to4(w)) is not True:
            raise AssertionError(f"{name}: is_2to4 rejected a valid 2:4 mask ({fmt(hp)})")
        row = rng.randrange(w.shape[0])
        for n_kept in (3, 4):  # 3 is the near miss a "< 4" or "!= 4" test lets through
            bad = prune.mask_2to4(w).clone()
            dropped = torch.nonzero(~bad[row, :4]).flatten()
            bad[row, dropped[:n_kept - 2]] = True
            if valid_fn(bad) is not False:
                raise AssertionError(f"{name}: is_2to4 accepted a mask with {n_kept} kept values in one group of 4 "
                                     f"({fmt(hp)})")
        ragged = w[:, :w.shape[1] - 2].clone()  # a last dimension 2 short of a multiple of 4
        try:
            mask_fn(ragged)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: mask_2to4 accepted a last dimension of {ragged.shape[-1]}, not a multiple "
                                 f"of 4; raise ValueError saying so (w_shape={tuple(ragged.shape)})")
        sparser = torch.zeros_like(bad)
        sparser[..., ::4] = True  # 1 of 4 kept: still allowed by the hardware
        if valid_fn(sparser) is not True:
            raise AssertionError(f"{name}: is_2to4 rejected a mask with 1 kept per group; at most 2 is the rule")
        _check_float_masks(valid_fn, prune.mask_2to4(w), row, hp)
    ok(name, f"{trials} trials, seed={seed}")


def _check_float_masks(valid_fn, mask: torch.Tensor, row: int, hp: dict) -> None:
    """is_2to4 on a pruned float weight: it counts the entries != 0, whatever their values (a sum of the
    values is no count: 3 and -2 kept sum to 1, three of 0.5, -0.25 and 0.25 to 0.5)."""
    kept = mask * torch.tensor([3.0, -2.0, 3.0, -2.0]).repeat(mask.shape[-1] // 4)  # 2 kept per group, float
    if valid_fn(kept) is not True:
        raise AssertionError(f"is_2to4: rejected a pruned float weight with 2 non-zeros per group (values 3 and -2): "
                             f"count the entries != 0 of a mask of any dtype, do not sum its values ({fmt(hp)})")
    three = kept.clone()
    three[row, :4] = torch.tensor([0.5, -0.25, 0.25, 0.0])
    if valid_fn(three) is not False:
        raise AssertionError(f"is_2to4: accepted a float weight with 3 non-zeros (0.5, -0.25, 0.25) in one group of 4: "
                             f"count the entries != 0 of a mask of any dtype, do not sum its values ({fmt(hp)})")


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
    name, rng, gen = "distillation_loss", random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(trials):
        B, C = rng.choice([3, 8]), rng.choice([4, 10])
        T, lam = rng.choice([1.0, 2.0, 4.0]), rng.choice([0.0, 0.5, 1.0])
        s = torch.randn(B, C, generator=gen, dtype=torch.float64) * 2
        t = torch.randn(B, C, generator=gen, dtype=torch.float64) * 2
        y = torch.randint(0, C, (B,), generator=gen)
        hp = dict(B=B, classes=C, temperature=T, lam=lam)
        got = run_student(_distill_worker, fn, s, t, y, T, lam)
        want = distill.distillation_loss(s, t, y, T, lam)
        assert_close(name, "loss", got["loss"], want, hp, rtol=1e-7, atol=1e-10)
        s2 = s.clone().requires_grad_()
        distill.distillation_loss(s2, t, y, T, lam).backward()
        assert_close(name, "gradient w.r.t. the student logits", got["grad_s"], s2.grad, hp, rtol=1e-7, atol=1e-10)
        if got["grad_t"] is not None and got["grad_t"].abs().max() > 0:
            raise AssertionError(f"{name}: gradient flows into the teacher logits; detach them ({fmt(hp)})")
    ok(name, f"{trials} trials, seed={seed}")
