"""Autograder checks for Day 8's pruning exercises (4: magnitude masks, gradual sparsity, a pruned layer pair;
5: 2:4 masks), re-exported by `dlo.checks.day8`, with the random matrices the Day 8 checks draw.

As in `dlo.checks.day8`: shapes and settings drawn from `seed`; where several answers are equally right (which
weight to drop among equal magnitudes, in a layer or in a 2:4 group) the checks test the defining property; the
pruned layer pair runs in a worker that records its new layers; the library references are off limits while the
student's code runs.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from dlo import prune
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import assert_close, fmt, ok, same

# torch's pruning, every module of it: the magnitude pruners of torch.nn.utils.prune (LnStructured picks the rows
# to keep), and torch.ao.pruning's sparsifiers (WeightNormSparsifier makes unstructured and 2:4 masks), schedulers
# (CubicSL is Zhu & Gupta's cubic) and structured pruners, which a red team called for points, 2026-12-02
PRUNING = ("torch.nn.utils.prune.*", "torch.ao.pruning.**")


def random_matrix(rng: random.Random, gen: torch.Generator, cols_multiple: int = 1) -> torch.Tensor:
    """A weight of odd rows and columns (columns a multiple of `cols_multiple`) at a scale of 0.01, 1 or 30."""
    rows = rng.choice([1, 3, 5, 7, 11])
    cols = cols_multiple * rng.choice([3, 4, 5, 7, 9])
    return torch.randn(rows, cols, generator=gen) * rng.choice([0.01, 1.0, 30.0])


# ----------------------------------------------------------------------------- exercise 4

@check(forbid=("dlo.prune.magnitude_masks", "dlo.prune._smallest_mask", *PRUNING))
def check_magnitude_masks(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(weights: dict[str, Tensor], sparsity, scope) -> dict[str, bool mask]` (True = kept)."""
    name, cs = "magnitude_masks", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        scope = ("global", "layer")[t % 2]
        sparsity = rng.choice([0.2, 0.5, 0.75, 0.9] if t != 1 else [0.2, 0.75, 0.9])
        weights = {f"w{i}": random_matrix(rng, gen) for i in range(rng.choice([2, 3]))}
        if t == 1:  # layer-wise: one tensor where round() is the ceiling of sparsity * n, one where it is the floor
            for key, above in (("up", True), ("down", False)):
                n = next(n for n in range(2, 20) if (above and (sparsity * n) % 1 > 0.5 + 1e-6)
                         or (not above and 1e-6 < (sparsity * n) % 1 < 0.5 - 1e-6))
                weights[key] = torch.randn(1, n, generator=gen)
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
            if abs(pruned - sparsity * a.numel()) > 0.5 + 1e-9:  # round(), either way at an exact .5
                raise AssertionError(f"{name}: pruned {pruned} of {a.numel()} weights in {keys}; expected "
                                     f"round({sparsity} * {a.numel()}) = {round(sparsity * a.numel())}, "
                                     f"not floor or ceil ({fmt(hp)})")
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


# _schedule_slips: its "no clamp" slip is the schedule itself between begin_step and end_step, and this module is
# loaded where the student's code runs (the pruned pair's worker; reachable through gc): off limits there
@check(forbid=("dlo.prune.gradual_sparsity", "dlo.checks.day8_prune._schedule_slips", *PRUNING))
def check_gradual_sparsity(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(step, final_sparsity, begin_step, end_step, initial_sparsity) -> float`: the cubic of Zhu & Gupta
    derived from s(0) = s_i, s(1) = s_f, s'(1) = s''(1) = 0; a wrong value is named by the slip it matches."""
    name, rng = "gradual_sparsity", random.Random(case_seed(seed))
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


def _prune_pair_worker(fn, fc1, fc2, n_keep: int) -> dict:
    """The student's two new layers: their types, weights and biases (compared by the check, never their forward,
    which a subclass could route through the original layers)."""
    new1, new2 = fn(fc1, fc2, n_keep)
    return {"layers": [{"linear": isinstance(m, nn.Linear), "type": type(m).__name__,
                        "shape": list(m.weight.shape) if isinstance(m, nn.Linear) else None,
                        "weight": m.weight.detach().clone() if isinstance(m, nn.Linear) else None,
                        "bias": m.bias.detach().clone() if isinstance(m, nn.Linear) and m.bias is not None else None}
                       for m in (new1, new2)]}


@check(forbid=("dlo.prune.prune_linear_pair", "dlo.prune.prune_mlp_channels", *PRUNING))
def check_prune_linear_pair(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(fc1, fc2, n_keep) -> (new_fc1, new_fc2)`: keep the n_keep hidden units with the largest
    L2 row norm of fc1; the new layers must be really smaller and compute the same thing on them."""
    name, rng = "prune_linear_pair", random.Random(case_seed(seed))
    for _ in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        d_in, hidden, d_out = rng.choice([3, 6]), rng.choice([7, 12]), rng.choice([2, 5])
        n_keep = rng.randrange(1, hidden)
        fc1, fc2 = nn.Linear(d_in, hidden).double(), nn.Linear(hidden, d_out).double()
        hp = dict(d_in=d_in, hidden=hidden, d_out=d_out, n_keep=n_keep)
        got = run_student(_prune_pair_worker, fn, fc1, fc2, n_keep)
        want1, want2 = prune.prune_linear_pair(fc1, fc2, n_keep)
        if not isinstance(got.get("layers"), list) or len(got["layers"]) != 2:
            n = len(got["layers"]) if isinstance(got.get("layers"), list) else 0
            raise AssertionError(f"{name}: returned {n} of 2 new layers (new fc1, new fc2): the grader got no layer "
                                 f"to check for the rest ({fmt(hp)})")
        for layer, want, label in zip(got["layers"], (want1, want2), ("new fc1", "new fc2")):
            if not layer["linear"] or tuple(layer["shape"]) != tuple(want.weight.shape):
                shape = tuple(layer["shape"]) if layer["linear"] else layer["type"]
                raise AssertionError(f"{name}: {label} should be an nn.Linear with weight {tuple(want.weight.shape)}, "
                                     f"got {shape}: build new, smaller layers ({fmt(hp)})")
        w1, w1_ref = got["layers"][0]["weight"], want1.weight.detach()
        if not same(w1, w1_ref, rtol=0, atol=0) and same(w1.sort(dim=0).values, w1_ref.sort(dim=0).values, 0, 0):
            raise AssertionError(f"{name}: new fc1 holds the right hidden units in another order: keep them in their "
                                 f"original order (sort the kept indices) ({fmt(hp)})")
        for layer, want, label in zip(got["layers"], (want1, want2), ("new fc1", "new fc2")):
            if layer["weight"].dtype != want.weight.dtype:
                raise AssertionError(f"{name}: {label} is {layer['weight'].dtype}, the layers given are "
                                     f"{want.weight.dtype}: build the new ones in their dtype ({fmt(hp)})")
            for what in ("weight", "bias"):
                assert_close(name, f"{label}.{what}", layer[what], getattr(want, what).detach(), hp, rtol=0, atol=0)
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exercise 5

# the library's Triton 2:4 by its kernel and helper, not only its launcher: a red team launched _sparse24_kernel itself
# in Triton's interpreter, 2026-12-02; compile_cases hands the kernel out too
TRITON_24 = ("dlo.kernels.sparse24._sparse24_kernel", "dlo.kernels.sparse24._beats",
             "dlo.kernels.sparse24.compile_cases")


@check(forbid=("dlo.prune.mask_2to4", "dlo.prune.is_2to4", "dlo.kernels.sparse24.sparse24",
               "dlo.kernels.sparse24.sparse24_ref", "dlo.kernels.sparse24.decompress24", *TRITON_24,
               "torch.sparse.to_sparse_semi_structured", "aten::_sparse_semi_structured*", "aten::_cslt_*",
               *PRUNING))
def check_mask_2to4(mask_fn, valid_fn, seed: int = 0, trials: int = 4) -> None:
    """`mask_fn(w) -> bool mask` keeping the 2 largest |w| of each 4 along the last dim;
    `valid_fn(mask) -> bool`, True when no group of 4 keeps more than 2."""
    name, cs = "mask_2to4", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        w = random_matrix(rng, gen, cols_multiple=4)
        hp = dict(w_shape=tuple(w.shape))
        m = torch.as_tensor(mask_fn(w.clone())).bool()
        assert_close(name, "mask", m.float(), prune.mask_2to4(w).float(), hp, rtol=0, atol=0)
        if valid_fn(prune.mask_2to4(w)) is not True:
            raise AssertionError(f"{name}: is_2to4 rejected a valid 2:4 mask ({fmt(hp)})")
        row, col = rng.randrange(w.shape[0]), 4 * rng.randrange(w.shape[1] // 4)  # any group, not only the first
        for n_kept in (3, 4):  # 3 is the near miss a "< 4" or "!= 4" test lets through
            bad = prune.mask_2to4(w).clone()
            dropped = col + torch.nonzero(~bad[row, col:col + 4]).flatten()
            bad[row, dropped[:n_kept - 2]] = True
            if valid_fn(bad) is not False:
                raise AssertionError(f"{name}: is_2to4 accepted a mask with {n_kept} kept values in the group of 4 at "
                                     f"row {row}, columns {col}..{col + 3}: check every group ({fmt(hp)})")
        if t == 0 and w.numel() >= 8:  # 3 kept in one group, 1 in another: 50% overall, still no 2:4 pattern
            shifted = prune.mask_2to4(w).clone().reshape(-1, 4)
            i, j = rng.sample(range(shifted.shape[0]), 2)
            shifted[i] = True
            shifted[i, 0] = False
            shifted[j] = False
            shifted[j, 0] = True
            if valid_fn(shifted.reshape(w.shape)) is not False:
                raise AssertionError(f"{name}: is_2to4 accepted a mask with 3 kept in one group of 4 and 1 in another "
                                     f"(50% overall): the rule holds for each group, not on average ({fmt(hp)})")
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
        _check_float_masks(valid_fn, prune.mask_2to4(w), row, col, hp)
    ragged = torch.zeros(2, 6, dtype=torch.bool)  # 12 values: reshape(-1, 4) works, yet rows of 6 have no 2:4 groups
    if valid_fn(ragged) is not False:
        raise AssertionError(f"{name}: is_2to4 accepted a mask whose last dimension (6) is not a multiple of 4: no "
                             f"2:4 pattern there, return False (mask shape (2, 6))")
    _check_mask_cases(mask_fn, rng, gen)
    ok(name, f"{trials} trials, seed={seed}")


def _check_mask_cases(mask_fn, rng: random.Random, gen: torch.Generator) -> None:
    """mask_2to4 on a 3-D weight (groups along the last dimension, whatever the rank) with tied |w|: any 2 of
    the largest |w| of each group are right (which of equal values is kept is not the exercise)."""
    w3 = (torch.randint(0, 3, (2, rng.choice([1, 3]), 8), generator=gen)
          * (torch.randint(0, 2, (2, 1, 8), generator=gen) * 2 - 1)).float()  # |w| in {0, 1, 2}: ties in most groups
    w3[0, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 2.0, 0.0, -2.0])  # ties at the top and at the bottom
    hp = dict(w_shape=tuple(w3.shape))
    try:
        m = torch.as_tensor(mask_fn(w3.clone())).bool()
    except Exception as e:  # noqa: BLE001 - the student's error, named in the message
        raise AssertionError(f"mask_2to4: failed on a 3-D weight ({type(e).__name__}: {e}): group 4 consecutive "
                             f"values of the last dimension, whatever the rank ({fmt(hp)})") from None
    want = prune.mask_2to4(w3)
    kept = lambda mask: (w3.abs() * mask).reshape(-1, 4).sort(-1).values  # noqa: E731 - each group's kept |w|
    if m.shape == want.shape and not torch.equal(m, want) and bool((m.reshape(-1, 4).sum(-1) == 2).all()) and \
            torch.equal(kept(m), kept(want)):
        return  # another of the equal |w| kept in some group: as right as the reference's choice
    assert_close("mask_2to4", "mask of a 3-D weight", m.float(), want.float(), hp, rtol=0, atol=0)


def _check_float_masks(valid_fn, mask: torch.Tensor, row: int, col: int, hp: dict) -> None:
    """is_2to4 on a pruned float weight: it counts the entries != 0, whatever their values (a sum of the
    values is no count: 3 and -2 kept sum to 1, three of 0.5, -0.25 and 0.25 to 0.5)."""
    kept = mask * torch.tensor([3.0, -2.0, 3.0, -2.0]).repeat(mask.shape[-1] // 4)  # 2 kept per group, float
    if valid_fn(kept) is not True:
        raise AssertionError(f"is_2to4: rejected a pruned float weight with 2 non-zeros per group (values 3 and -2): "
                             f"count the entries != 0 of a mask of any dtype, do not sum its values ({fmt(hp)})")
    three = kept.clone()
    three[row, col:col + 4] = torch.tensor([0.5, -0.25, 0.25, 0.0])
    if valid_fn(three) is not False:
        raise AssertionError(f"is_2to4: accepted a float weight with 3 non-zeros (0.5, -0.25, 0.25) in one group of 4: "
                             f"count the entries != 0 of a mask of any dtype, do not sum its values ({fmt(hp)})")
