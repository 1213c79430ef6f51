"""Autograder checks for Day 1, the training loop around the optimizer: LR schedules, the LR range
test and gradient clipping (exercises after the optimizer steps of `dlo.checks.day1`, which re-exports
them: the test cells call `dlo.checks.day1.check_<exercise>`); gradient accumulation is
`dlo.checks.day1_accum`.

The conventions are those of `dlo.checks.day1` (float64, odd shapes, seeded draws, one "ok" line).
References: the torch LR schedulers, `dlo.lr_finder.lr_range_test` (torch has no LR range test) and
torch.nn.utils.clip_grad_norm_. The schedules run in workers (`run_student`) that only record what the
student's code did.
"""

from __future__ import annotations

import math
import random
from numbers import Real

import torch

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import DTYPE, assert_close, expect_value_error, fmt, odd_shape, ok, rand
from dlo.schedules import torch_scheduler_lrs

SCHEDULES = ("torch.optim.lr_scheduler.*", "dlo.schedules.*", "dlo.schedules._cos_anneal")
CLIPPING = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_norm", "torch.nn.utils.get_total_norm",
            "torch.nn.utils.clip_grads_with_norm_", "dlo.optim.utils.clip_grad_norm", "dlo.optim.utils.grad_norm",
            "dlo.optim.utils._total_norm")


# ----------------------------------------------------------------------------- LR schedules

SCHEDULE_RTOL = 1e-6  # torch's recursive schedulers drift ~1e-15 from the closed forms


def _schedule_worker(fn, kw: dict, n: int) -> list:
    """The student's lr at steps 0..n-1 (a value that is not a number or tensor comes back as its type name)."""
    out = []
    for step in range(n):
        got = fn(step, **kw)
        out.append(got if isinstance(got, (Real, torch.Tensor)) and not isinstance(got, bool)
                   else ("type", type(got).__name__))
    return out


def _check_schedule(name: str, fn, kw: dict, want: list[float]) -> None:
    """Every step, boundaries included, to SCHEDULE_RTOL (every step's lr must come back: a short reply is none)."""
    lrs = run_student(_schedule_worker, fn, kw, len(want))
    if not isinstance(lrs, list) or len(lrs) != len(want):
        n = len(lrs) if isinstance(lrs, list) else 0
        raise AssertionError(f"{name}: returned {n} of {len(want)} steps' lrs: the grader got no lr for a step "
                             f"({fmt(kw)})")
    for step, (got, w) in enumerate(zip(lrs, want)):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, Real):
            kind = got[1] if isinstance(got, tuple) else type(got).__name__
            raise AssertionError(f"{name}: must return a float, got {kind} at step {step} ({fmt(kw)})")
        if not abs(got - w) <= 1e-12 + SCHEDULE_RTOL * abs(w):
            raise AssertionError(f"{name}: wrong lr at step {step} ({fmt(kw)}): expected {w:.10g}, got {got:.10g} "
                                 f"(abs error {abs(got - w):.3g}); step is 0-based")


@check(forbid=SCHEDULES)
def check_warmup_cosine(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(step, *, base_lr, warmup_steps, total_steps, min_lr, start_factor)` vs torch
    SequentialLR(LinearLR, CosineAnnealingLR) at every step 0..total_steps. Trial 1 has no warmup. Then
    warmup_steps >= total_steps (no step left for the cosine: a division by zero) must raise ValueError,
    at step 0 as at the last step. A negative warmup_steps is not passed: all 5 independent solutions of
    tests/harness/test_similarity_calibration.py accept it (a caller's slip, not the exercise's point)."""
    sch = torch.optim.lr_scheduler
    name, rng = "warmup_cosine", random.Random(case_seed(seed))
    for t in range(trials):
        total = rng.randint(9, 61)
        kw = dict(base_lr=10 ** rng.uniform(-4, 0), warmup_steps=0 if t == 1 else rng.randint(1, total // 2),
                  total_steps=total, start_factor=rng.choice([0.01, 0.1, 0.25]))
        kw["min_lr"] = rng.choice([0.0, kw["base_lr"] * 0.05])
        warm = kw["warmup_steps"]

        def make(opt, kw=kw, warm=warm, total=total):
            return sch.SequentialLR(opt, [sch.LinearLR(opt, kw["start_factor"], 1.0, total_iters=warm),
                                          sch.CosineAnnealingLR(opt, T_max=total - warm, eta_min=kw["min_lr"])],
                                    milestones=[warm])
        _check_schedule(name, fn, kw, torch_scheduler_lrs(make, kw["base_lr"], total + 1))
    total = rng.randint(9, 61)
    for warm, step in ((total, total), (total, 0), (total + 3, 1)):
        kw = dict(base_lr=0.1, warmup_steps=warm, total_steps=total, min_lr=0.0, start_factor=0.1)
        expect_value_error(name, lambda kw=kw, step=step: fn(step, **kw), f"warmup_steps={warm} >= "
                            f"total_steps={total} leaves no step for the cosine (step {step})")
    ok(name, f"{trials} trials, seed={seed}")


@check(forbid=SCHEDULES)
def check_one_cycle(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(step, *, max_lr, total_steps, pct_start, div_factor, final_div_factor)` vs torch OneCycleLR
    (anneal_strategy="cos", three_phase=False) at every step 0..total_steps-1."""
    name, rng = "one_cycle", random.Random(case_seed(seed))
    for _ in range(trials):
        kw = dict(max_lr=10 ** rng.uniform(-3, 0), total_steps=rng.randint(11, 97),
                  pct_start=rng.choice([0.1, 0.25, 0.3, 0.45]), div_factor=rng.choice([10.0, 25.0]),
                  final_div_factor=rng.choice([1e2, 1e4]))

        def make(opt, kw=kw):
            return torch.optim.lr_scheduler.OneCycleLR(opt, anneal_strategy="cos", three_phase=False,
                                                       cycle_momentum=False, **kw)
        _check_schedule(name, fn, kw, torch_scheduler_lrs(make, kw["max_lr"], kw["total_steps"]))
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- LR range test

def _regression_step_fn(seed: int):
    """One SGD step of a noisy least-squares problem: loss falls, then explodes past lr = 2/L (~0.05)."""
    gen = torch.Generator().manual_seed(seed)
    a, w_true = 4 * torch.randn(64, 9, generator=gen, dtype=DTYPE), torch.randn(9, generator=gen, dtype=DTYPE)
    b = a @ w_true + 0.1 * torch.randn(64, generator=gen, dtype=DTYPE)
    w = torch.zeros(9, dtype=DTYPE)

    def step_fn(lr: float) -> float:
        idx = torch.randint(0, 64, (16,), generator=gen)
        r = a[idx] @ w - b[idx]  # (16,)
        loss = 0.5 * float((r * r).mean())
        w.sub_(lr * (a[idx].T @ r) / 16)
        return loss
    return step_fn


def _curve_step_fn(seed: int, bad_at: int, bad: float):
    """A noisy U-shaped loss(lr) that returns `bad` (nan or inf) at call `bad_at` (-1: never)."""
    rng, calls = random.Random(seed), [0]

    def step_fn(lr: float) -> float:
        calls[0] += 1
        if calls[0] - 1 == bad_at:
            return bad
        return (2.0 / (1.0 + 300 * lr) + (lr / 0.3) ** 2) * (1 + 0.05 * rng.uniform(-1, 1))
    return step_fn


def _recording(step_fn, log: list):
    def wrapped(lr):
        log.append(float(lr))
        return step_fn(lr)
    return wrapped


# beta = 0: smoothed = loss. Falls 4 -> 3 -> 1 into its minimum 0.9 (point 11), then blows up at point 14. The
# slope over every kept point is steepest at point 9 (central: (1 - 4) / 2 per step), the slope of the
# prefix before the minimum at point 10 (its one-sided end: 1 - 3): the two readings give different lr_min.
V_CURVE = [5.0] * 8 + [4.0, 3.0, 1.0, 0.9, 1.2, 2.5, 5.0, 5.0]


def _replay_step_fn(losses: list[float]):
    """A step_fn that returns `losses` in order (then nan)."""
    it = iter(losses)
    return lambda lr: next(it, math.nan)


def _check_range_case(name: str, fn, make, kw: dict, where: dict) -> None:
    """fn against dlo.lr_finder.lr_range_test on two fresh copies of the step_fn `make()` builds."""
    from dlo.lr_finder import lr_range_test

    calls_ref, calls = [], []
    want = lr_range_test(_recording(make(), calls_ref), **kw)
    got = fn(_recording(make(), calls), **kw)
    if len(calls) != len(calls_ref):
        raise AssertionError(f"{name}: step_fn was called {len(calls)} times, expected {len(calls_ref)} "
                             f"(stop when the loss is not finite or smoothed > diverge * best) ({fmt(where)})")
    assert_close(name, "lrs passed to step_fn (geometric from min_lr to max_lr)", calls, calls_ref, where)
    for field in ("lrs", "losses", "smoothed"):
        if not hasattr(got, field):
            raise AssertionError(f"{name}: the result has no field {field!r}; return dlo.lr_finder.LRFinderResult")
        assert_close(name, f"result.{field} (the diverging point is not kept)", list(getattr(got, field)),
                     list(getattr(want, field)), where)
    assert_close(name, "result.lr_max (lr at min smoothed loss / 10)", got.lr_max, want.lr_max, where)
    assert_close(name, "result.lr_min (steepest descent of smoothed vs log10 lr: np.gradient over every kept "
                       "point, then its argmin before the minimum)", got.lr_min, want.lr_min, where)


@check(forbid=("dlo.lr_finder.lr_range_test", "dlo.lr_finder.suggest_lrs"))
def check_lr_range_test(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(step_fn, *, min_lr, max_lr, num_steps, beta, diverge) -> LRFinderResult` vs dlo.lr_finder.
    Even trials train a least-squares model until it diverges; trials 1, 5, ... inject nan/inf into a
    U-shaped curve, trials 3, 7, ... let that curve blow up (the smoothed-loss stop). Then two fixed
    cases: `V_CURVE` (the slope is taken over every kept point, not over the prefix before the minimum)
    and a first loss that is not finite (no point kept: ValueError); num_steps=1 refused (ValueError, before
    any step: the exponent i / (num_steps - 1) needs two). The student's function calls
    `step_fn`, which stays with the grader (each call comes back to it)."""
    name, rng = "lr_range_test", random.Random(case_seed(seed))
    for t in range(trials):
        kw = dict(min_lr=10 ** rng.uniform(-6, -4), max_lr=rng.choice([1.0, 3.0, 10.0]),
                  num_steps=rng.choice([41, 57, 83]), beta=rng.choice([0.9, 0.98]), diverge=rng.choice([3.0, 4.0]))
        sub = rng.randrange(10 ** 6)
        if t % 2 == 0:
            make = lambda sub=sub: _regression_step_fn(sub)  # noqa: E731
        else:
            bad_at = rng.randint(kw["num_steps"] // 3, kw["num_steps"] // 2) if t % 4 == 1 else -1
            bad = rng.choice([math.nan, math.inf])
            make = lambda sub=sub, bad_at=bad_at, bad=bad: _curve_step_fn(sub, bad_at, bad)  # noqa: E731
        _check_range_case(name, fn, make, kw, dict(kw, trial=t))
    kw = dict(min_lr=1e-4, max_lr=1.0, num_steps=len(V_CURVE), beta=0.0, diverge=4.0)
    _check_range_case(name, fn, lambda: _replay_step_fn(V_CURVE), kw, dict(kw, curve="V_CURVE"))
    for bad in (math.nan, math.inf):
        calls: list = []
        expect_value_error(name, lambda bad=bad, calls=calls: fn(_recording(_replay_step_fn([bad, 1.0]), calls), **kw),
                            f"the first loss is {bad}: no point is kept, there is no curve to read")
        if len(calls) != 1:
            raise AssertionError(f"{name}: the first loss is {bad}: stop at once (step_fn called {len(calls)} times)")
    calls = []  # one step: the exponent i / (num_steps - 1) divides by zero; refuse before any step
    expect_value_error(name, lambda: fn(_recording(_replay_step_fn([1.0]), calls), **dict(kw, num_steps=1)),
                       "num_steps=1 (lr_i's exponent i / (num_steps - 1) needs num_steps >= 2)")
    if calls:
        raise AssertionError(f"{name}: num_steps=1 is refused before any step (step_fn called {len(calls)} times)")
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- clipping

@check(forbid=CLIPPING)
def check_clip_grad_norm(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(parameters, max_norm, norm_type=2.0) -> total_norm` vs torch.nn.utils.clip_grad_norm_. Odd trials
    pass a generator (like model.parameters()); some params have no grad; total norms are small so
    that a missing 1e-6 in max_norm / (total + 1e-6) shows. Last, parameters none of which has a
    gradient: tensor(0.) returned, nothing changed."""
    name, cs = "clip_grad_norm", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        norm_type = [2.0, 2.0, math.inf, 1.0, 2.0, 3.0][t % 6]
        params = [torch.nn.Parameter(rand(odd_shape(rng), gen)) for _ in range(rng.randint(2, 5))]
        for i, p in enumerate(params):
            p.grad = None if i == 1 else rand(p.shape, gen, 10 ** rng.uniform(-4, -2))
        refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for r, p in zip(refs, params):
            r.grad = None if p.grad is None else p.grad.clone()
        total = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type))
        max_norm = total * rng.choice([0.3, 0.7]) if t != 2 else total * 2.0  # trial 2: no clipping needed
        hp = dict(max_norm=max_norm, norm_type=norm_type, trial=t)
        want = torch.nn.utils.clip_grad_norm_(refs, max_norm, norm_type=norm_type)
        got = fn((p for p in params) if t % 2 else params, max_norm, norm_type=norm_type)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{name}: must return the total norm as a tensor, got {type(got).__name__}")
        assert_close(name, "returned total norm (before clipping)", got, want, hp)
        for i, (p, r) in enumerate(zip(params, refs)):
            if r.grad is None:
                if p.grad is not None:
                    raise AssertionError(f"{name}: a parameter without grad got one; skip grad=None ({fmt(hp)})")
                continue
            assert_close(name, f"grad of parameter {i} after clipping (in place, coef = max_norm/(total+1e-6) "
                               f"clamped at 1)", p.grad, r.grad, hp)
    for norm_type in (2.0, math.inf):  # no parameter has a gradient: torch returns tensor(0.) and changes nothing
        params = [torch.nn.Parameter(rand(odd_shape(rng), gen)) for _ in range(2)]
        hp = dict(max_norm=1.0, norm_type=norm_type, grads="all None")
        try:
            got = fn((p for p in params), 1.0, norm_type=norm_type)
        except Exception as e:  # noqa: BLE001 - the student's error, named in the message
            raise AssertionError(f"{name}: when no parameter has a gradient, return torch.tensor(0.0), got "
                                 f"{type(e).__name__}: {e} ({fmt(hp)})") from None
        if not isinstance(got, torch.Tensor) or got.numel() != 1 or got.item() != 0.0:
            raise AssertionError(f"{name}: when no parameter has a gradient, return torch.tensor(0.0) (the norm of "
                                 f"no gradients, as clip_grad_norm_), got {got!r} ({fmt(hp)})")
        if any(p.grad is not None for p in params):
            raise AssertionError(f"{name}: a parameter without grad got one; skip grad=None ({fmt(hp)})")
    ok(name, f"{trials} trials, seed={seed}")
