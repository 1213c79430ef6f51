"""The Day 1 autograder checks accept correct solutions and reject stubs, plausible mistakes and the
library's own references.

Every wrong implementation below is one slip away from a correct one (the kind of bug a student
makes); a check that let one of them through would hand out points for a wrong answer. The correct
versions are written out here, as a student writes them: the library references are off limits
while a check runs (calling one fails with ForbiddenCall, tested below).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import dlo.optim
from dlo import lr_finder, schedules
from dlo.checks import day1
from dlo.grading.forbid import ForbiddenCall
from dlo.optim import reference, utils


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- correct, as a student writes them

def sgd_ok(param, grad, buf, *, lr, momentum=0.9, weight_decay=0.0, dampening=0.0, nesterov=False):
    d = grad + weight_decay * param
    if momentum == 0:  # plain SGD: no buffer
        param.sub_(lr * d)
        return None
    buf = d.clone() if buf is None else buf.mul_(momentum).add_(d, alpha=1 - dampening)
    param.sub_(lr * (d + momentum * buf if nesterov else buf))
    return buf


def adamw_ok(param, grad, m, v, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    param.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(lr * (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps))


def warmup_ok(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
    return warmup_divides_by_zero(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps,
                                  min_lr=min_lr, start_factor=start_factor)


def warmup_divides_by_zero(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    """Right for every valid input; warmup_steps == total_steps is not refused (ZeroDivisionError at the end)."""
    if step < warmup_steps:
        return base_lr * (start_factor + (1 - start_factor) * step / warmup_steps)
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def one_cycle_ok(step, *, max_lr, total_steps, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    lo, peak = max_lr / div_factor, pct_start * total_steps - 1
    end = lo / final_div_factor
    if step <= peak:
        return max_lr + 0.5 * (lo - max_lr) * (1 + math.cos(math.pi * step / peak))
    return end + 0.5 * (max_lr - end) * (1 + math.cos(math.pi * (step - peak) / (total_steps - 1 - peak)))


def _total_norm(grads, norm_type):
    if norm_type == math.inf:
        return torch.stack([g.abs().max() for g in grads]).max()
    return torch.stack([g.norm(norm_type) for g in grads]).norm(norm_type)


def clip_ok(parameters, max_norm, norm_type=2.0):
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = _total_norm(grads, norm_type)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def accum_ok(model, loss_fn, x, y, micro_batches):
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=x.dtype)
    for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xc), yc) * (len(xc) / len(x))
        loss.backward()
        total += loss.detach()
    return total


# ----------------------------------------------------------------------------- wrong optimizer steps

def sgd_dampened_first_step(param, grad, buf, *, lr, momentum=0.9, weight_decay=0.0, dampening=0.0,
                            nesterov=False):
    d = grad + weight_decay * param
    buf = (1 - dampening) * d if buf is None else buf.mul_(momentum).add_((1 - dampening) * d)
    param.sub_(lr * (d + momentum * buf if nesterov else buf))
    return buf


def sgd_buffer_at_momentum_0(param, grad, buf, *, lr, momentum=0.9, weight_decay=0.0, dampening=0.0,
                             nesterov=False):
    """Keeps a (dampened) buffer even at momentum=0, as the momentum formula read literally does."""
    d = grad + weight_decay * param
    buf = d.clone() if buf is None else buf.mul_(momentum).add_(d, alpha=1 - dampening)
    param.sub_(lr * (d + momentum * buf if nesterov else buf))
    return buf


def sgd_no_nesterov(param, grad, buf, *, nesterov=False, **hp):
    return sgd_ok(param, grad, buf, nesterov=False, **hp)


def sgd_new_tensor(param, grad, buf, **hp):
    """Updates a copy: the caller's param never moves."""
    return sgd_ok(param.clone(), grad, buf, **hp)


def sgd_mutates_grad(param, grad, buf, *, weight_decay=0.0, **hp):
    grad.add_(weight_decay * param)
    return sgd_ok(param, grad, buf, weight_decay=0.0, **hp)


def adam_l2(param, grad, m, v, step, *, weight_decay=1e-2, **hp):
    """Adam with L2 regularisation: the decay goes through the moments (not decoupled)."""
    adamw_ok(param, grad + weight_decay * param, m, v, step, weight_decay=0.0, **hp)


def adamw_no_bias_correction(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_((1 - beta1) * grad)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    param.sub_(lr * m / (v.sqrt() + eps))


def adamw_eps_inside_sqrt(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_((1 - beta1) * grad)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    param.sub_(lr * (m / (1 - beta1 ** step)) / torch.sqrt(v / (1 - beta2 ** step) + eps))


def adamw_decay_after_update(param, grad, m, v, step, *, lr, weight_decay, **hp):
    adamw_ok(param, grad, m, v, step, lr=lr, weight_decay=0.0, **hp)
    param.mul_(1 - lr * weight_decay)


def _lamb(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay, bias_correction=True,
          trust_on_adam=False, zero_fallback=True):
    m.mul_(beta1).add_((1 - beta1) * grad)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    r = (m / bc1) / ((v / bc2).sqrt() + eps)
    u = r + weight_decay * param
    w_norm, u_norm = param.norm().item(), (r if trust_on_adam else u).norm().item()
    trust = w_norm / u_norm if (w_norm > 0 and u_norm > 0) or not zero_fallback else 1.0
    param.sub_(lr * trust * u)
    return trust


def lamb_no_bias_correction(*a, **kw):
    return _lamb(*a, bias_correction=False, **kw)


def lamb_trust_on_adam_direction(*a, **kw):
    return _lamb(*a, trust_on_adam=True, **kw)


def lamb_no_zero_fallback(*a, **kw):
    return _lamb(*a, zero_fallback=False, **kw)


def lamb_returns_nothing(*a, **kw):
    _lamb(*a, **kw)


# Each wrong variant must fail for its own reason: `match` is the part of the message that names it.

@pytest.mark.parametrize("fn,match", [(sgd_dampened_first_step, r"param after step 1 differs.*dampening=0.1"),
                                      (sgd_no_nesterov, r"param after step 1 differs.*nesterov=True"),
                                      (sgd_new_tensor, "param did not change"),
                                      (sgd_buffer_at_momentum_0, r"with momentum=0 there is no momentum buffer.*"
                                                                 r"return None, got Tensor"),
                                      (sgd_mutates_grad, "grad tensor was modified")])
def test_sgd_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_sgd_momentum_step(fn, seed=0)


@pytest.mark.parametrize("fn,match", [(adam_l2, r"exp_avg \(m\) after step 1 differs"),
                                      (adamw_no_bias_correction, r"param after step 1 \(decoupled decay"),
                                      (adamw_eps_inside_sqrt, r"param after step 1 \(decoupled decay"),
                                      (adamw_decay_after_update, r"param after step 1 \(decoupled decay")])
def test_adamw_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_adamw_step(fn, seed=0)


@pytest.mark.parametrize("fn,match", [(lamb_no_bias_correction, "param after step 1 differs"),
                                      (lamb_trust_on_adam_direction, "returned trust ratio at step 2"),
                                      (lamb_no_zero_fallback, r"returned trust ratio at step 1 .*zero_init=True"),
                                      (lamb_returns_nothing, "must return the trust ratio as a float")])
def test_lamb_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_lamb_step(fn, seed=0)


def test_lamb_wrong_variants_agree_with_reference_when_fixed():
    """_lamb (the base of the wrong variants) is an independent LAMB: each variant is one slip off."""
    day1.check_lamb_step(_lamb, seed=0)
    day1.check_lamb_step(_lamb, seed=1)


# ----------------------------------------------------------------------------- wrong schedules

def warmup_off_by_one(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if step < warmup_steps:
        return base_lr * (start_factor + (1 - start_factor) * (step + 1) / warmup_steps)
    return warmup_ok(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr,
                     start_factor=start_factor)


def cosine_over_total(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    """Decays over total_steps instead of total_steps - warmup_steps."""
    if step < warmup_steps:
        return base_lr * (start_factor + (1 - start_factor) * step / warmup_steps)
    return min_lr + (base_lr - min_lr) * (1 + math.cos(math.pi * (step - warmup_steps) / total_steps)) / 2


def one_cycle_peak_off(step, *, max_lr, total_steps, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    lo, peak = max_lr / div_factor, pct_start * total_steps  # torch peaks at pct_start * total - 1
    end = lo / final_div_factor
    if step <= peak:
        return lo + (max_lr - lo) * (1 - math.cos(math.pi * step / peak)) / 2
    return end + (max_lr - end) * (1 + math.cos(math.pi * (step - peak) / (total_steps - 1 - peak))) / 2


def one_cycle_linear(step, *, max_lr, total_steps, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    lo, peak = max_lr / div_factor, pct_start * total_steps - 1
    if step <= peak:
        return lo + (max_lr - lo) * step / peak
    return max_lr + (lo / final_div_factor - max_lr) * (step - peak) / (total_steps - 1 - peak)


def one_cycle_tensor(step, **kw):
    return torch.tensor([one_cycle_ok(step, **kw)] * 2)


def warmup_returns_at_step_0(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    """Refuses the bad input only where it would divide by zero, not before any work."""
    if step < warmup_steps:
        return base_lr * (start_factor + (1 - start_factor) * step / warmup_steps)
    return warmup_ok(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr,
                     start_factor=start_factor)


@pytest.mark.parametrize("fn,match", [(warmup_off_by_one, r"wrong lr at step 0 .*warmup_steps=14"),
                                      (warmup_divides_by_zero, r"leaves no step for the cosine \(step \d+\): raise "
                                                               r"ValueError, got ZeroDivisionError"),
                                      (warmup_returns_at_step_0, r"\(step 0\): raise ValueError, got a return value"),
                                      (cosine_over_total, r"wrong lr at step 15 .*warmup_steps=14")])
def test_warmup_cosine_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_warmup_cosine(fn, seed=0)


@pytest.mark.parametrize("fn,match", [(one_cycle_peak_off, r"wrong lr at step 1 "),
                                      (one_cycle_linear, r"wrong lr at step 1 "),
                                      (one_cycle_tensor, "must return a float, got Tensor")])
def test_one_cycle_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_one_cycle(fn, seed=0)


# ----------------------------------------------------------------------------- wrong LR range tests

def _range_test(step_fn, *, min_lr=1e-7, max_lr=10.0, num_steps=100, beta=0.98, diverge=4.0,
                bias_correction=True, keep_last=False, decade=10.0, prefix_slope=False, one_step=False):
    if num_steps < 2 and not one_step:
        raise ValueError("num_steps must be >= 2: the exponent i / (num_steps - 1)")
    lrs, losses, smoothed, avg, best = [], [], [], 0.0, math.inf
    for i in range(num_steps):
        lr = min_lr * (max_lr / min_lr) ** (i / (num_steps - 1))
        loss = float(step_fn(lr))
        if not math.isfinite(loss):
            break
        avg = beta * avg + (1 - beta) * loss
        smooth = avg / (1 - beta ** (i + 1)) if bias_correction else avg
        if smooth > diverge * best and not keep_last:
            break
        lrs.append(lr), losses.append(loss), smoothed.append(smooth)
        if smooth > diverge * best:
            break
        best = min(best, smooth)
    if not lrs:
        raise ValueError("no point kept: the first loss is not finite")
    lo = int(np.argmin(smoothed))
    if prefix_slope:  # np.gradient over the points before the minimum only: its last point is one-sided
        slope = np.gradient(smoothed[:lo], np.log10(lrs[:lo])) if lo > 1 else np.zeros(lo)
    else:
        slope = np.gradient(smoothed, np.log10(lrs))[:lo]
    lr_min = lrs[int(np.argmin(slope))] if lo > 0 else lrs[0]
    return lr_finder.LRFinderResult(lrs=lrs, losses=losses, smoothed=smoothed, lr_max=lrs[lo] / decade, lr_min=lr_min)


def range_test_no_bias_correction(step_fn, **kw):
    return _range_test(step_fn, bias_correction=False, **kw)


def range_test_keeps_diverging_point(step_fn, **kw):
    return _range_test(step_fn, keep_last=True, **kw)


def range_test_lr_max_at_minimum(step_fn, **kw):
    return _range_test(step_fn, decade=1.0, **kw)


def range_test_prefix_slope(step_fn, **kw):
    return _range_test(step_fn, prefix_slope=True, **kw)


def range_test_one_step(step_fn, **kw):
    """No guard for num_steps=1: 0 / 0 in the exponent (issue 34: the text did not say)."""
    return _range_test(step_fn, one_step=True, **kw)


def range_test_empty_result(step_fn, **kw):
    """Returns an empty result when no point is kept, instead of refusing."""
    try:
        return _range_test(step_fn, **kw)
    except ValueError:
        return lr_finder.LRFinderResult(lrs=[], losses=[], smoothed=[], lr_max=math.nan, lr_min=math.nan)


def range_test_ignores_nan(step_fn, *, min_lr=1e-7, max_lr=10.0, num_steps=100, **kw):
    def finite(lr):
        loss = step_fn(lr)
        return loss if math.isfinite(loss) else 1.0
    return _range_test(finite, min_lr=min_lr, max_lr=max_lr, num_steps=num_steps, **kw)


def test_range_test_wrong_variants_agree_with_reference_when_fixed():
    """_range_test (the base of the wrong variants) is itself right: each variant is one slip off."""
    day1.check_lr_range_test(_range_test, seed=0)


@pytest.mark.parametrize("fn,match", [(range_test_no_bias_correction, r"step_fn was called 4 times.*trial=0"),
                                      (range_test_keeps_diverging_point, r"result\.lrs .*has shape \(32,\)"),
                                      (range_test_lr_max_at_minimum, r"result\.lr_max"),
                                      (range_test_ignores_nan, r"step_fn was called 53 times.*trial=1"),
                                      (range_test_prefix_slope, r"result\.lr_min .*every kept point"),
                                      (range_test_empty_result, r"first loss is nan: no point is kept.*raise "
                                                                r"ValueError, got a return value"),
                                      (range_test_one_step, r"num_steps=1 .*needs num_steps >= 2.*raise ValueError, "
                                                            r"got ZeroDivisionError")])
def test_lr_range_test_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_lr_range_test(fn, seed=0)


# ----------------------------------------------------------------------------- wrong clipping / accumulation

def clip_no_eps(parameters, max_norm, norm_type=2.0):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _total_norm(grads, float(norm_type))
    for g in grads:
        g.mul_(torch.clamp(max_norm / total, max=1.0))
    return total


def clip_per_parameter(parameters, max_norm, norm_type=2.0):
    norms = [clip_ok([p], max_norm, norm_type) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_iterates_twice(parameters, max_norm, norm_type=2.0):
    """Breaks on model.parameters(): a generator is empty the second time."""
    total = _total_norm([p.grad for p in parameters if p.grad is not None], norm_type)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def clip_returns_after(parameters, max_norm, norm_type=2.0):
    params = list(parameters)
    clip_ok(params, max_norm, norm_type)
    return _total_norm([p.grad for p in params if p.grad is not None], norm_type)


def clip_stacks_nothing(parameters, max_norm, norm_type=2.0):
    """Right whenever some parameter has a gradient; torch.stack([]) fails when none has."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _total_norm(grads, norm_type)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def clip_none_when_no_grad(parameters, max_norm, norm_type=2.0):
    params = list(parameters)
    return clip_ok(params, max_norm, norm_type) if any(p.grad is not None for p in params) else None


def accum_no_division(model, loss_fn, x, y, micro_batches):
    """Back-propagates each chunk's mean unweighted (k times too large a gradient); the loss is right."""
    model.zero_grad()
    total = 0.0
    for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xc), yc)
        loss.backward()
        total += loss.detach() * len(xc) / len(x)
    return total


def accum_mean_of_means(model, loss_fn, x, y, micro_batches):
    """Divides each chunk's mean by k: right only when all chunks have the same size."""
    model.zero_grad()
    total = 0.0
    for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xc), yc) / micro_batches
        loss.backward()
        total += loss.detach()
    return total


def accum_whole_batch(model, loss_fn, x, y, micro_batches):
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


def accum_no_zero_grad(model, loss_fn, x, y, micro_batches):
    total = 0.0
    for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xc), yc) * (len(xc) / len(x))
        loss.backward()
        total += loss.detach()
    return total


@pytest.mark.parametrize("fn,match", [(clip_no_eps, r"after clipping .*max abs error"),
                                      (clip_per_parameter, r"after clipping .*trial=0\): max abs error"),
                                      (clip_iterates_twice, r"after clipping .*trial=1"),  # the generator trial
                                      (clip_returns_after, r"returned total norm \(before clipping\)"),
                                      (clip_stacks_nothing, r"no parameter has a gradient, return torch.tensor\(0.0\), "
                                                           r"got RuntimeError: stack expects a non-empty"),
                                      (clip_none_when_no_grad, r"no parameter has a gradient, return "
                                                               r"torch.tensor\(0.0\).*got None")])
def test_clip_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_clip_grad_norm(fn, seed=0)


@pytest.mark.parametrize("fn,match", [(accum_no_division, r"0\.weight\.grad \(weight each micro-batch"),
                                      (accum_mean_of_means, r"returned loss \(mean over the whole batch\)"),
                                      (accum_whole_batch, r"forward passes on micro-batches .*saw sizes \[31\]"),
                                      (accum_no_zero_grad, r"0\.weight\.grad \(weight each micro-batch")])
def test_accumulation_rejects_wrong(fn, match):
    with pytest.raises(AssertionError, match=match):
        day1.check_accumulate_gradients(fn, seed=0)


# ----------------------------------------------------------------------------- reference passes, stub fails

CHECKS = [
    (day1.check_sgd_momentum_step, sgd_ok),
    (day1.check_adamw_step, adamw_ok),
    (day1.check_lamb_step, _lamb),
    (day1.check_warmup_cosine, warmup_ok),
    (day1.check_one_cycle, one_cycle_ok),
    (day1.check_lr_range_test, _range_test),
    (day1.check_clip_grad_norm, clip_ok),
    (day1.check_accumulate_gradients, accum_ok),
]
LIBRARY = [reference.sgd_momentum_step, reference.adamw_step, reference.lamb_step, schedules.warmup_cosine,
           schedules.one_cycle, lr_finder.lr_range_test, utils.clip_grad_norm, utils.accumulate_gradients]
IDS = [c.__name__.removeprefix("check_") for c, _ in CHECKS]


@pytest.mark.parametrize("check,ref", CHECKS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_passes(check, ref, seed, capsys):
    check(ref, seed=seed)
    out = capsys.readouterr().out.strip()
    assert out.endswith(f"seed={seed})") and ": ok (" in out


@pytest.mark.parametrize("check,ref", CHECKS, ids=IDS)
def test_stub_fails(check, ref):
    with pytest.raises(NotImplementedError):
        check(stub, seed=0)


def test_failure_message_names_hyperparameters():
    with pytest.raises(AssertionError, match=r"adamw_step: .*lr=.*weight_decay=.*max abs error"):
        day1.check_adamw_step(adam_l2, seed=0)


# ----------------------------------------------------------------------------- the library's references are off limits

@pytest.mark.parametrize("check,ref", [(c, r) for (c, _), r in zip(CHECKS, LIBRARY)], ids=IDS)
def test_library_reference_is_refused(check, ref):
    with pytest.raises(ForbiddenCall, match="off limits while this check runs: the exercise asks for your own"):
        check(ref, seed=0)


def adamw_via_torch(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    p = param.detach().clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    p.grad = grad.clone()
    opt.step()
    param.copy_(p.detach())


def adamw_via_reexport(param, grad, m, v, step, **hp):
    dlo.optim.adamw_step(param, grad, m, v, step, **hp)  # the same function under another name


def clip_via_torch(parameters, max_norm, norm_type=2.0):
    return torch.nn.utils.clip_grad.clip_grad_norm_(list(parameters), max_norm, norm_type)  # the defining module


@pytest.mark.parametrize("check,fn", [(day1.check_adamw_step, adamw_via_torch),
                                      (day1.check_adamw_step, adamw_via_reexport),
                                      (day1.check_clip_grad_norm, clip_via_torch)])
def test_torch_and_aliases_are_refused(check, fn):
    adamw, clip = torch.optim.AdamW, torch.nn.utils.clip_grad_norm_
    with pytest.raises(ForbiddenCall, match="off limits"):
        check(fn, seed=0)
    # restored: the same objects again (a blocker left behind is named like what it replaced)
    assert torch.optim.AdamW is adamw and torch.nn.utils.clip_grad_norm_ is clip
    assert dlo.optim.adamw_step is reference.adamw_step


# ----------------------------------------------------------------------------- the same checks, sandboxed

@pytest.mark.parametrize("check,ref", CHECKS, ids=IDS)
def test_reference_passes_sandboxed(sandbox, check, ref, capsys):
    """The grader's path: the student's function in the runner, the comparison here."""
    sandbox.run(check, ref, seed=1)
    assert ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("check,fn,exc,match", [
    (day1.check_adamw_step, adam_l2, AssertionError, r"exp_avg \(m\) after step 1 differs"),
    (day1.check_sgd_momentum_step, sgd_new_tensor, AssertionError, "param did not change"),
    (day1.check_sgd_momentum_step, sgd_mutates_grad, AssertionError, "grad tensor was modified"),
    (day1.check_clip_grad_norm, clip_iterates_twice, AssertionError, r"after clipping .*trial=1"),
    (day1.check_lr_range_test, range_test_ignores_nan, AssertionError, r"step_fn was called \d+ times.*trial=\d"),
    (day1.check_one_cycle, one_cycle_tensor, AssertionError, "must return a float, got Tensor"),
    (day1.check_accumulate_gradients, accum_whole_batch, AssertionError, r"saw sizes \[\d+\]"),
    (day1.check_warmup_cosine, warmup_divides_by_zero, AssertionError, "raise ValueError, got ZeroDivisionError"),
    (day1.check_lr_range_test, range_test_empty_result, AssertionError, "no point is kept.*got a return value"),
    (day1.check_sgd_momentum_step, sgd_buffer_at_momentum_0, AssertionError, "no momentum buffer"),
    (day1.check_adamw_step, reference.adamw_step, ForbiddenCall, "off limits"),
    (day1.check_adamw_step, adamw_via_reexport, ForbiddenCall, "off limits"),
    (day1.check_warmup_cosine, stub, NotImplementedError, None)])
def test_wrong_fails_sandboxed(sandbox, check, fn, exc, match):
    with pytest.raises(exc, match=match):
        sandbox.run(check, fn, seed=0)


def lamb_tensor_norms(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    """Norms kept as 0-d tensors and the ratio returned as one (issue 34: the text now says both are fine)."""
    m.mul_(beta1).add_((1 - beta1) * grad)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    u = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps) + weight_decay * param
    w_norm, u_norm = param.norm(), u.norm()
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else torch.ones((), dtype=param.dtype)
    param.sub_(lr * trust * u)
    return trust


def test_lamb_accepts_tensor_norms():
    day1.check_lamb_step(lamb_tensor_norms, seed=0)
    day1.check_lamb_step(lamb_tensor_norms, seed=1, trials=10)


# ----------------------------------------------------------------------------- red team

def accum_hook_bait(model, loss_fn, x, y, micro_batches):
    """Micro-batch forwards under no_grad for the forward hook; the work is one whole-batch model.forward
    (past nn.Module.__call__ and its hooks) and one backward: no memory saved."""
    with torch.no_grad():
        for xc in x.tensor_split(micro_batches):
            model(xc)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model.forward(x), y)
    loss.backward()
    return loss.detach()


def accum_cat_then_whole(model, loss_fn, x, y, micro_batches):
    """Right micro-batch forwards for the hook, then the chunks put back together for one whole-batch pass."""
    model.zero_grad(set_to_none=True)
    chunks = x.tensor_split(micro_batches)
    with torch.no_grad():
        for xc in chunks:
            model(xc)
    loss = loss_fn(torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(
        torch.cat(chunks), model[0].weight, model[0].bias)), model[2].weight, model[2].bias), y)
    loss.backward()
    return loss.detach()


def accum_one_backward(model, loss_fn, x, y, micro_batches):
    """Micro-batch forwards, the weighted losses summed, one backward: every micro-batch's graph alive."""
    model.zero_grad(set_to_none=True)
    total = sum(loss_fn(model(xc), yc) * (len(xc) / len(x))
                for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)))
    total.backward()
    return total.detach()


def accum_backwards_after(model, loss_fn, x, y, micro_batches):
    """Every forward first, then one backward per loss: the same memory as one backward."""
    model.zero_grad(set_to_none=True)
    losses = [loss_fn(model(xc), yc) * (len(xc) / len(x))
              for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches))]
    for loss in losses:
        loss.backward()
    return sum(loss.detach() for loss in losses)


def accum_chunk(model, loss_fn, x, y, micro_batches):
    """Honest: torch.chunk (chunks of ceil(B/k), maybe fewer than k) and index tensors."""
    model.zero_grad()
    total = torch.zeros((), dtype=x.dtype)
    for idx in torch.arange(len(x)).chunk(micro_batches):
        loss = loss_fn(model(x[idx]), y[idx]) * (len(idx) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def _whole_batch(model, loss_fn, x, y):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model.forward(x), y)
    loss.backward()
    return loss.detach()


def _bait(model, x, micro_batches):
    """The forwards and backwards the hooks count, with a zero gradient (nothing added to .grad)."""
    for xc in x.tensor_split(micro_batches):
        out = model(xc)
        out.backward(torch.zeros_like(out))


def accum_modes_disabled(model, loss_fn, x, y, micro_batches):
    """Round 15: the whole batch with every dispatch mode popped (the check's watch too), as a tensor's repr
    pops them; then bait for the hooks."""
    with torch.utils._python_dispatch._disable_current_modes():
        loss = _whole_batch(model, loss_fn, x, y)
    _bait(model, x, micro_batches)
    return loss


def accum_stack_popped(model, loss_fn, x, y, micro_batches):
    """Round 15: the watch popped off torch's dispatch stack by hand for the whole batch, pushed back after."""
    modes = [torch._C._pop_torch_dispatch_stack(None) for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        loss = _whole_batch(model, loss_fn, x, y)
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_dispatch_stack(mode)
    _bait(model, x, micro_batches)
    return loss


def accum_pop_temporarily(model, loss_fn, x, y, micro_batches):
    with torch.utils._python_dispatch._pop_mode_temporarily():
        loss = _whole_batch(model, loss_fn, x, y)
    _bait(model, x, micro_batches)
    return loss


def accum_dispatch_disabled(model, loss_fn, x, y, micro_batches):
    with torch._C._DisableTorchDispatch():
        loss = _whole_batch(model, loss_fn, x, y)
    _bait(model, x, micro_batches)
    return loss


def accum_bait_then_hidden(model, loss_fn, x, y, micro_batches):
    """Round 15: bait with a real gradient (garbage in .grad), then the whole batch past the watch over it."""
    for xc in x.tensor_split(micro_batches):
        model(xc).sum().backward()
    with torch.utils._python_dispatch._disable_current_modes():
        return _whole_batch(model, loss_fn, x, y)


def _hidden_grads(model, loss_fn, x, y):
    with torch.utils._python_dispatch._disable_current_modes():
        loss = loss_fn(model.forward(x), y)
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def accum_grads_assigned(model, loss_fn, x, y, micro_batches):
    """Round 15: the gradients taken past the watch (no accumulation into .grad) and assigned; the hooks fed
    by micro-batch forwards whose gradient stops at the output."""
    loss, grads = _hidden_grads(model, loss_fn, x, y)
    for xc in x.tensor_split(micro_batches):
        out = model(xc)
        torch.autograd.grad(out.sum(), out)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    return loss


def accum_zero_backwards_assigned(model, loss_fn, x, y, micro_batches):
    """Round 15: as above, the bait's backward run through the layers with a zero gradient."""
    loss, grads = _hidden_grads(model, loss_fn, x, y)
    model.zero_grad(set_to_none=True)
    _bait(model, x, micro_batches)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    return loss


def lamb_no_zero_update_fallback(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    """Falls back to 1 for ||param|| = 0 only: with zero grads and weight_decay=0, ||u|| = 0 gives inf."""
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    u = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps) + weight_decay * param
    w_norm = param.norm()
    trust = (w_norm / u.norm()).item() if w_norm > 0 else 1.0
    param.sub_(lr * trust * u)
    return trust


RED_TEAM = [
    (day1.check_accumulate_gradients, accum_hook_bait, "addmm read"),
    (day1.check_accumulate_gradients, accum_cat_then_whole, "cat read"),
    (day1.check_accumulate_gradients, accum_one_backward, "backward came after the next micro-batch's forward"),
    (day1.check_accumulate_gradients, accum_backwards_after, "backward came after the next micro-batch's forward"),
    (day1.check_lamb_step, lamb_no_zero_update_fallback, "||u|| = 0 must fall back to a trust ratio of 1"),
    (day1.check_accumulate_gradients, accum_modes_disabled, "was accumulated while the grader's watch was off torch's "
                                                            "dispatch stack: the backward ran outside torch's"),
    (day1.check_accumulate_gradients, accum_stack_popped, "was accumulated while the grader's watch was off"),
    (day1.check_accumulate_gradients, accum_bait_then_hidden, "was accumulated while the grader's watch was off"),
    (day1.check_accumulate_gradients, accum_pop_temporarily, "_pop_mode_temporarily is off limits"),
    (day1.check_accumulate_gradients, accum_dispatch_disabled, "torch._C._DisableTorchDispatch is off limits"),
    (day1.check_accumulate_gradients, accum_grads_assigned, "multiply-adds in the backwards, the model's Linear layers "
                                                            "take"),
    (day1.check_accumulate_gradients, accum_zero_backwards_assigned, "output got an all-zero gradient"),
]


@pytest.mark.parametrize("check,fn,phrase", RED_TEAM, ids=[f.__name__ for _, f, _ in RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_right_only_where_the_check_looks_fails(check, fn, phrase, seed):
    """Red team (Day 1): each passed the checks at seeds 0..19 before its case was added (round 15: the
    whole batch past the dispatch watch, before the work-seen rules and `dlo.checks.saved.MODES`)."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(fn, seed=seed)


@pytest.mark.parametrize("fn,exc,match", [
    (accum_modes_disabled, AssertionError, "accumulated while the grader's watch was off"),
    (accum_pop_temporarily, ForbiddenCall, "_pop_mode_temporarily is off limits")])
def test_red_team_fails_sandboxed(sandbox, fn, exc, match):
    """The watch's hooks and the forbidden ways out of it hold in the jail too."""
    with pytest.raises(exc, match=match):
        sandbox.run(day1.check_accumulate_gradients, fn, seed=0)


@pytest.mark.parametrize("seed", range(3))
def test_accumulation_accepts_chunk_and_index_tensors(seed):
    day1.check_accumulate_gradients(accum_chunk, seed=seed)


def accum_autograd_grad(model, loss_fn, x, y, micro_batches):
    """Honest: torch.autograd.grad per micro-batch, the weighted gradients summed into .grad by hand."""
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xc, yc in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xc), yc)
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            g = g * (len(xc) / len(x))
            p.grad = g if p.grad is None else p.grad + g
        total += loss.item() * len(xc) / len(x)
    return torch.tensor(total, dtype=x.dtype)


def accum_scaled_after(model, loss_fn, x, y, micro_batches):
    """Honest: each micro-batch's summed loss back-propagated, printed, .grad divided by B once at the end
    through .data (old style)."""
    for p in model.parameters():
        p.grad = None
    total = torch.zeros((), dtype=x.dtype)
    for xc, yc in zip(torch.split(x, -(-len(x) // micro_batches)), torch.split(y, -(-len(x) // micro_batches))):
        loss = loss_fn(model(xc), yc, reduction="sum")
        loss.backward()
        print("micro-batch loss", loss)  # a tensor's repr pops the dispatch modes while it prints
        total += loss.detach()
    for p in model.parameters():
        p.grad.data.div_(len(x))
    return total / len(x)


@pytest.mark.parametrize("honest", [accum_autograd_grad, accum_scaled_after])
@pytest.mark.parametrize("seed", range(3))
def test_accumulation_accepts_other_honest_loops(honest, seed):
    day1.check_accumulate_gradients(honest, seed=seed)
