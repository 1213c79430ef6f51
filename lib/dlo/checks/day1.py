"""Autograder checks for Day 1 (optimizers, schedules, LR finder, clipping, accumulation).

Each `check_<exercise>(fn, seed=0, trials=...)` draws odd shapes and hyper-parameters from `seed`,
runs the student's `fn` and a trusted reference on identical copies, and raises AssertionError with
what to fix (hyper-parameters, step, max abs error, expected vs got) or prints one "ok" line.
References are torch itself (torch.optim.SGD/AdamW, the torch LR schedulers,
torch.nn.utils.clip_grad_norm_, one full-batch backward) except for LAMB and the LR range test,
which torch lacks: there `dlo.optim.reference.lamb_step` and `dlo.lr_finder.lr_range_test` are used.
Everything runs in float64 so that any correct formula agrees to ~1e-15 and the tolerances
(1e-9 relative) still catch small slips such as eps inside the square root or a missing 1e-6.

The checks follow `dlo.grading.api`: the student's function is called on inputs made here (in-place
updates come back), the schedules and the accumulation run in workers that only record what the
student's code did, and while it runs the references that would solve the exercise are off limits.

Here: the optimizer steps (SGD with momentum, AdamW, LAMB); the training loop around them
(schedules, LR range test, clipping) is `dlo.checks.day1_training`, the gradient accumulation
`dlo.checks.day1_accum`, both re-exported here, the day's one checks module (`dlo.registry`) whose
names the test cells call.
"""

from __future__ import annotations

import math
import random
from numbers import Real

import torch

from dlo.checks.day1_accum import check_accumulate_gradients
from dlo.checks.day1_training import (
    check_clip_grad_norm,
    check_lr_range_test,
    check_one_cycle,
    check_warmup_cosine,
)
from dlo.grading.api import case_seed, check
from dlo.grading.compare import DTYPE, assert_close, fmt, odd_shape, ok, rand

ADAM = ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.adamw.adamw", "torch.optim.adam.adam",
        "torch.optim.adam._single_tensor_adam", "torch.optim.adam._multi_tensor_adam", "torch.optim.adam._fused_adam",
        "torch._fused_adamw_", "torch._fused_adam_", "dlo.optim.reference.adamw_step", "dlo.optim.FusedAdamW",
        "dlo.kernels.fused_adamw.fused_adamw_", "dlo.kernels.fused_adamw.fused_adamw_ref",
        "aten::_fused_adam*")  # the fused kernels (Adam and AdamW), through any holder: refused at dispatch
SGD = ("torch.optim.SGD", "torch.optim.sgd.sgd", "torch.optim.sgd._single_tensor_sgd",
       "torch.optim.sgd._multi_tensor_sgd", "torch.optim.sgd._fused_sgd", "torch._fused_sgd_",
       "dlo.optim.reference.sgd_momentum_step", "aten::_fused_sgd*")
LAMB = ("dlo.optim.reference.lamb_step", "dlo.optim.LAMB")


def _stepped_in_place(name: str, what: str, before: torch.Tensor, after: torch.Tensor, hp: dict) -> None:
    if torch.equal(before, after):
        raise AssertionError(f"{name}: {what} did not change; the update must be done in place "
                             f"(param.add_(...), param.mul_(...), or param.copy_(new)) ({fmt(hp)})")


def _unchanged(name: str, grad: torch.Tensor, grad_before: torch.Tensor, hp: dict) -> None:
    if not torch.equal(grad, grad_before):
        raise AssertionError(f"{name}: the grad tensor was modified; compute with `grad + ...` "
                             f"instead of `grad.add_(...)` ({fmt(hp)})")


# ----------------------------------------------------------------------------- optimizer steps

@check(forbid=SGD)
def check_sgd_momentum_step(fn, seed: int = 0, trials: int = 5, steps: int = 4) -> None:
    """`fn(param, grad, buf, *, lr, momentum, weight_decay, dampening, nesterov) -> buf` vs torch.optim.SGD.
    Trial 2 has momentum=0: plain SGD, no buffer (None returned, dampening unused), as torch keeps none."""
    name, cs = "sgd_momentum_step", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        nesterov = t % 2 == 1
        hp = dict(lr=10 ** rng.uniform(-3, -0.5), momentum=rng.choice([0.5, 0.9, 0.95]),
                  weight_decay=rng.choice([0.0, 1e-3, 0.05]), dampening=0.0 if nesterov else rng.choice([0.0, 0.1]),
                  nesterov=nesterov)
        if t == 2:
            hp.update(momentum=0.0, dampening=0.1)  # a dampened buffer would scale the step by 0.9
        shape = odd_shape(rng)
        param = rand(shape, gen)
        ref = param.clone().requires_grad_(True)
        opt = torch.optim.SGD([ref], foreach=False, **hp)
        buf = None
        for s in range(1, steps + 1):
            grad = rand(shape, gen)
            ref.grad = grad.clone()
            opt.step()
            before, grad_before = param.clone(), grad.clone()
            buf = fn(param, grad, buf, **hp)
            where = dict(hp, step=s, shape=shape)
            if hp["momentum"] == 0 and buf is not None:
                raise AssertionError(f"{name}: with momentum=0 there is no momentum buffer (plain SGD: param -= "
                                     f"lr * d, dampening unused, torch.optim.SGD stores none): return None, got "
                                     f"{type(buf).__name__} ({fmt(where)})")
            _stepped_in_place(name, "param", before, param, where)
            _unchanged(name, grad, grad_before, where)
            assert_close(name, f"param after step {s}", param, ref.detach(), where)
            if hp["momentum"] == 0:
                continue
            if not isinstance(buf, torch.Tensor):
                raise AssertionError(f"{name}: must return the momentum buffer (a tensor), got {type(buf).__name__}")
            assert_close(name, f"returned momentum buffer after step {s}", buf,
                         opt.state[ref]["momentum_buffer"], where)
    ok(name, f"{trials} trials, seed={seed}")


def _adam_trial(rng: random.Random, gen: torch.Generator):
    hp = dict(lr=10 ** rng.uniform(-3, -1), beta1=rng.choice([0.8, 0.9]), beta2=rng.choice([0.99, 0.999]),
              eps=10 ** rng.uniform(-8, -3), weight_decay=rng.choice([0.0, 0.01, 0.1]))
    shape = odd_shape(rng)
    grad_scale = 10 ** rng.uniform(-3, 0)  # small grads make the eps placement visible
    return hp, shape, rand(shape, gen), grad_scale


@check(forbid=ADAM)
def check_adamw_step(fn, seed: int = 0, trials: int = 5, steps: int = 4) -> None:
    """`fn(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay)` vs torch.optim.AdamW."""
    name, cs = "adamw_step", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for _ in range(trials):
        hp, shape, param, grad_scale = _adam_trial(rng, gen)
        ref = param.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                weight_decay=hp["weight_decay"], foreach=False, fused=False)
        m, v = torch.zeros_like(param), torch.zeros_like(param)
        for s in range(1, steps + 1):
            grad = rand(shape, gen, grad_scale)
            ref.grad = grad.clone()
            opt.step()
            before, grad_before = param.clone(), grad.clone()
            fn(param, grad, m, v, s, **hp)
            where = dict(hp, step=s, shape=shape)
            _stepped_in_place(name, "param", before, param, where)
            _unchanged(name, grad, grad_before, where)
            assert_close(name, f"exp_avg (m) after step {s}", m, opt.state[ref]["exp_avg"], where)
            assert_close(name, f"exp_avg_sq (v) after step {s}", v, opt.state[ref]["exp_avg_sq"], where)
            assert_close(name, f"param after step {s} (decoupled decay on the weights before the update? "
                               f"bias correction? eps outside the sqrt?)", param, ref.detach(), where)
    ok(name, f"{trials} trials, seed={seed}")


@check(forbid=LAMB + ADAM)
def check_lamb_step(fn, seed: int = 0, trials: int = 5, steps: int = 3) -> None:
    """`fn(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay) -> trust` vs
    dlo.optim.reference.lamb_step (You et al. 2019, Alg. 2). Trial 0 starts from a zero tensor (a bias):
    its norm is 0 so the trust ratio must fall back to 1; a last case has zero gradients and weight_decay=0
    (||u|| = 0: the ratio falls back to 1 there too, and the param stays)."""
    from dlo.optim.reference import lamb_step

    name, cs = "lamb_step", case_seed(seed)  # a secret seed when graded

    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        hp, shape, param, grad_scale = _adam_trial(rng, gen)
        hp["eps"] = 10 ** rng.uniform(-8, -4)
        if t == 0:
            param.zero_()
        ref, m_ref, v_ref = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
        m, v = torch.zeros_like(param), torch.zeros_like(param)
        for s in range(1, steps + 1):
            grad = rand(shape, gen, grad_scale)
            trust_ref = lamb_step(ref, grad.clone(), m_ref, v_ref, s, **hp)
            before, grad_before = param.clone(), grad.clone()
            trust = fn(param, grad, m, v, s, **hp)
            where = dict(hp, step=s, shape=shape, zero_init=t == 0)
            # The trust ratio first: with a zero param and no fallback to 1 it is 0, the param does not
            # move, and the message must name the ratio (the cause), not the missing in-place update.
            if isinstance(trust, torch.Tensor) and trust.numel() == 1:
                trust = trust.item()
            if not isinstance(trust, Real):
                raise AssertionError(f"{name}: must return the trust ratio as a float, got {type(trust).__name__}")
            assert_close(name, f"returned trust ratio at step {s} (||param|| / ||update||, 1.0 if a norm is 0)",
                         float(trust), float(trust_ref), where)
            _stepped_in_place(name, "param", before, param, where)
            _unchanged(name, grad, grad_before, where)
            assert_close(name, f"exp_avg (m) after step {s}", m, m_ref, where)
            assert_close(name, f"exp_avg_sq (v) after step {s}", v, v_ref, where)
            assert_close(name, f"param after step {s}", param, ref, where)
    _lamb_zero_update(fn, name, rng, gen)
    ok(name, f"{trials} trials, seed={seed}")


def _lamb_zero_update(fn, name: str, rng: random.Random, gen: torch.Generator) -> None:
    """Zero gradients and weight_decay=0: the update u is 0 (||u|| = 0) while ||param|| > 0. The trust
    ratio must fall back to 1 there too (||param|| / 0 is inf, times u = 0 a nan step), and the param stays."""
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=10 ** rng.uniform(-8, -4), weight_decay=0.0)
    shape = odd_shape(rng)
    param, m, v = rand(shape, gen), torch.zeros(shape, dtype=DTYPE), torch.zeros(shape, dtype=DTYPE)
    want = param.clone()
    for s in (1, 2):
        trust = fn(param, torch.zeros(shape, dtype=DTYPE), m, v, s, **hp)
        where = dict(hp, step=s, shape=shape, grad="all zero")
        if isinstance(trust, torch.Tensor) and trust.numel() == 1:
            trust = trust.item()
        if not isinstance(trust, Real) or not math.isfinite(trust) or not param.isfinite().all():
            raise AssertionError(f"{name}: with zero gradients and weight_decay=0 the update u is 0: ||u|| = 0 must "
                                 f"fall back to a trust ratio of 1 like ||param|| = 0, got trust {trust!r} "
                                 f"({fmt(where)})")
        assert_close(name, f"returned trust ratio at step {s} (||u|| = 0: 1.0)", float(trust), 1.0, where)
        assert_close(name, f"param after step {s} (u = 0: no change)", param, want, where)


__all__ = ["check_accumulate_gradients", "check_adamw_step", "check_clip_grad_norm", "check_lamb_step",
           "check_lr_range_test", "check_one_cycle", "check_sgd_momentum_step", "check_warmup_cosine"]
