"""The Day 2 autograder checks accept correct solutions and reject stubs and plausible mistakes."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from dlo.amp import DynamicLossScaler, train_step
from dlo.checks import day2
from dlo.grading.forbid import ForbiddenCall


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- autocast step

def step_ok(model, optimizer, x, y, *, dtype, scaler=None):
    """Written out, not dlo.amp.train_step (the check's own reference): what a student writes."""
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = F.cross_entropy(model(x), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.detach().float()


def step_no_autocast(model, optimizer, x, y, *, dtype, scaler=None):
    return step_ok(model, optimizer, x, y, dtype=None, scaler=scaler)


def step_pure_low_precision(model, optimizer, x, y, *, dtype, scaler=None):
    model.to(dtype)
    return F.cross_entropy(model(x.to(dtype)), y).detach()


def step_ignores_scaler(model, optimizer, x, y, *, dtype, scaler=None):
    return step_ok(model, optimizer, x, y, dtype=dtype, scaler=None)


def step_no_update(model, optimizer, x, y, *, dtype, scaler=None):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # scaler.update() forgotten: the scale never backs off
    return loss.detach()


def step_no_zero_grad(model, optimizer, x, y, *, dtype, scaler=None):
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def step_returns_scaled(model, optimizer, x, y, *, dtype, scaler=None):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaled = scaler.scale(loss) if scaler is not None else loss
    scaled.backward()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return scaled.detach()


def test_autocast_step_accepts_reference(capsys):
    day2.check_autocast_train_step(step_ok)
    day2.check_autocast_train_step(step_ok, seed=3)
    assert "ok" in capsys.readouterr().out


# Each wrong variant must fail for its own reason: `match` is the part of the message that names it.

@pytest.mark.parametrize("wrong,match", [(step_no_autocast, r"run the forward pass inside torch\.autocast"),
                                         (step_pure_low_precision, "parameters must stay fp32 master weights"),
                                         (step_ignores_scaler, r"scale after step 1 is 16777216\.0, expected 8388608"),
                                         (step_no_update, r"scale after step 1 is 16777216\.0, expected 8388608"),
                                         (step_no_zero_grad, r"after step 1 \(zero the grads first"),
                                         (step_returns_scaled, r"returned loss \(unscaled mean cross-entropy\)")])
def test_autocast_step_rejects(wrong, match):
    with pytest.raises(AssertionError, match=match):
        day2.check_autocast_train_step(wrong)


def test_autocast_step_stub():
    with pytest.raises(NotImplementedError):
        day2.check_autocast_train_step(stub)


# ----------------------------------------------------------------------------- loss scaler

class HostScaler:
    """A from-scratch scaler with python floats, the kind a student writes: must pass."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s, self.gf, self.bf, self.gi = init_scale, growth_factor, backoff_factor, growth_interval
        self.good, self.found_inf, self.unscaled, self.stepped = 0, False, False, False

    def scale(self, loss):
        return loss * self.s

    def unscale_(self, optimizer):
        if self.unscaled:
            raise RuntimeError("unscale_() has already been called since the last update()")
        inv = 1.0 / self.s
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.found_inf |= not bool(torch.isfinite(p.grad).all())
                    p.grad.mul_(inv)
        self.unscaled = True

    def step(self, optimizer):
        if self.stepped:
            raise RuntimeError("step() has already been called since the last update()")
        self.stepped = True
        if not self.unscaled:
            self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()

    def update(self):
        if self.found_inf:
            self.s, self.good = self.s * self.bf, 0
        else:
            self.good += 1
            if self.good == self.gi:
                self.s, self.good = self.s * self.gf, 0
        self.found_inf, self.unscaled, self.stepped = False, False, False

    def get_scale(self):
        return self.s


class NeverGrows(HostScaler):
    def update(self):
        self.s *= self.bf if self.found_inf else 1.0
        self.found_inf, self.unscaled, self.stepped = False, False, False


class KeepsCountAfterOverflow(HostScaler):
    def update(self):
        if self.found_inf:
            self.s *= self.bf  # the clean-step counter is not reset
        else:
            self.good += 1
            if self.good % self.gi == 0:
                self.s *= self.gf
        self.found_inf, self.unscaled, self.stepped = False, False, False


class GrowsOneLate(HostScaler):
    def update(self):
        if not self.found_inf and self.good == self.gi:
            self.s, self.good = self.s * self.gf, 0
            self.found_inf, self.unscaled, self.stepped = False, False, False
            return
        if not self.found_inf:
            self.good += 1
            self.found_inf, self.unscaled, self.stepped = False, False, False
            return
        super().update()


class InfOnly(HostScaler):
    """Misses nan: checks isinf instead of isfinite."""

    def unscale_(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.found_inf |= bool(torch.isinf(p.grad).any())
                p.grad.mul_(1.0 / self.s)
        self.unscaled = True


class UnscalesTwice(HostScaler):
    def step(self, optimizer):
        self.unscaled = False
        super().step(optimizer)


class SilentOnMisuse(HostScaler):
    """Lets a second unscale_ divide by S again, and a second step step again."""

    def unscale_(self, optimizer):
        self.unscaled = False
        super().unscale_(optimizer)

    def step(self, optimizer):
        self.stepped = False
        super().step(optimizer)


class TensorScale(HostScaler):
    def get_scale(self):
        return torch.tensor(self.s)


class NoSkip(HostScaler):
    def step(self, optimizer):
        if not self.unscaled:
            self.unscale_(optimizer)
        optimizer.step()


def test_loss_scaler_accepts_host_version(capsys):
    day2.check_loss_scaler(HostScaler)
    day2.check_loss_scaler(HostScaler, seed=5)
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,match", [(NeverGrows, r"scale after update\(\) of step 2 is 1024, expected 4096"),
                                         (KeepsCountAfterOverflow, r"scale after update\(\) of step 7 is 4096, "
                                                                   r"expected 1024"),
                                         (GrowsOneLate, r"scale after update\(\) of step 2 is 1024, expected 4096"),
                                         (InfOnly, r"step was taken, expected skipped .*injected=nan"),
                                         (UnscalesTwice, "divided by the scale exactly once"),
                                         (NoSkip, r"step was taken, expected skipped .*injected=-inf"),
                                         (SilentOnMisuse, r"a second unscale_\(optimizer\) before update\(\) must "
                                                          r"raise RuntimeError"),
                                         (TensorScale, "get_scale.. returned a Tensor; return the scale as a Python "
                                                       "float")])
def test_loss_scaler_rejects(wrong, match):
    with pytest.raises(AssertionError, match=match):
        day2.check_loss_scaler(wrong)


def test_loss_scaler_stub():
    with pytest.raises(NotImplementedError):
        day2.check_loss_scaler(stub)


# ----------------------------------------------------------------------------- bf16 rounding

def round_ok(x):
    bits = x.view(torch.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32
    return torch.where(x.isnan(), x, bits.view(torch.float32))


def round_loses_nan(x):
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)


def round_truncate(x):
    return (x.view(torch.int32) & -65536).view(torch.float32)


def round_half_up(x):
    return ((x.view(torch.int32) + 0x8000) & -65536).view(torch.float32)


def round_in_place(x):
    bits = x.view(torch.int32)
    bits.add_(0x7FFF + ((bits >> 16) & 1)).bitwise_and_(-65536)
    return x


def round_via_fp16(x):
    return x.half().float()


def round_canonical_nan(x):
    """torch's answer for nans (one bf16 nan, 0x7FC0): nans are compared with isnan, so it passes too."""
    return torch.where(x.isnan(), torch.tensor(math.nan), round_ok(x))


def round_int64(x):
    """The same bits in int64, unsigned, then back: another honest way around the sign bit."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    return torch.where(x.isnan(), x, bits.view(torch.float32))


def round_numpy(x):
    import numpy as np

    bits = x.numpy().view(np.uint32).astype(np.uint64)
    bits = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    return torch.where(x.isnan(), x, torch.from_numpy(bits.view(np.float32).copy()))


def test_round_to_bf16_accepts(capsys):
    day2.check_round_to_bf16(round_ok)
    day2.check_round_to_bf16(round_canonical_nan, seed=3)
    for seed in range(3):
        day2.check_round_to_bf16(round_int64, seed=seed)
        day2.check_round_to_bf16(round_numpy, seed=seed)
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,match", [(round_truncate, "should round to -303104.0, got -301056.0"),
                                         (round_half_up, r"bits 0x06608000\) should round to"),  # a tie
                                         (round_in_place, "the input was modified"),
                                         (round_via_fp16, "should round to -9437184.0, got -inf"),
                                         (round_loses_nan, "bits 0x7fffffff.*got -0.0; .*a nan must stay nan"),
                                         (lambda x: x.clone(), "should round to -9437184.0, got -9444229.0")])
def test_round_to_bf16_rejects(wrong, match):
    with pytest.raises(AssertionError, match=match):
        day2.check_round_to_bf16(wrong)


def test_round_to_bf16_stub():
    with pytest.raises(NotImplementedError):
        day2.check_round_to_bf16(stub)


# ----------------------------------------------------------------------------- references off limits, and sandboxed

class ScalerViaTorch(HostScaler):
    def __init__(self, **hp):
        self.inner = torch.amp.GradScaler("cpu", **hp)

    def scale(self, loss):
        return self.inner.scale(loss)

    def unscale_(self, optimizer):
        self.inner.unscale_(optimizer)

    def step(self, optimizer):
        self.inner.step(optimizer)

    def update(self):
        self.inner.update()

    def get_scale(self):
        return self.inner.get_scale()


@pytest.mark.parametrize("check,fn", [(day2.check_autocast_train_step, train_step),
                                      (day2.check_loss_scaler, DynamicLossScaler),
                                      (day2.check_loss_scaler, ScalerViaTorch)])
def test_references_are_refused(check, fn):
    with pytest.raises(ForbiddenCall, match="off limits"):
        check(fn)


@pytest.mark.parametrize("check,fn", [(day2.check_autocast_train_step, step_ok), (day2.check_loss_scaler, HostScaler),
                                      (day2.check_round_to_bf16, round_ok)])
def test_correct_passes_sandboxed(sandbox, check, fn, capsys):
    sandbox.run(check, fn, seed=1)
    assert ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("check,fn,exc,match", [
    (day2.check_autocast_train_step, step_pure_low_precision, AssertionError, "must stay fp32 master weights"),
    (day2.check_loss_scaler, InfOnly, AssertionError, r"step was taken, expected skipped .*injected=nan"),
    (day2.check_round_to_bf16, round_in_place, AssertionError, "the input was modified"),
    (day2.check_loss_scaler, ScalerViaTorch, ForbiddenCall, "off limits")])
def test_wrong_fails_sandboxed(sandbox, check, fn, exc, match):
    with pytest.raises(exc, match=match):
        sandbox.run(check, fn)


# ----------------------------------------------------------------------------- FLOPs, MFU and bytes per parameter

def matmul_params_ok(model):
    """Written out, not dlo.accounting.matmul_params: what a student writes."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and (id(p) not in tables or id(p) in linears))


def matmul_params_with_tables(model):  # counts looked-up embedding tables too
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def matmul_params_linears_only(model):  # misses raw projection parameters (nn.MultiheadAttention's in_proj)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _size(dtype):
    return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()


def bytes_ok(param_dtype, optimizer, master_dtype=None):
    """Derived: weights and gradients at the parameters' width, the master copy at its own, and the state
    at the width of what the optimizer steps (the master copy when there is one)."""
    p, m = _size(param_dtype), _size(master_dtype)
    return 2 * p + m + {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] * (m or p)


def bytes_from_the_table(param_dtype, optimizer, master_dtype=None):
    """Issue 34: the old exercise's table copied (fp32, mixed, bf16 by name): no row for float16 without a
    master copy or for float64."""
    row = {(torch.float32, None): "fp32", (torch.bfloat16, torch.float32): "mixed", (torch.bfloat16, None): "bf16",
           (torch.float16, torch.float32): "mixed"}.get((param_dtype, master_dtype), "fp32")
    w, g, master, state = {"fp32": (4, 4, 0, 4), "mixed": (2, 2, 4, 4), "bf16": (2, 2, 0, 2)}[row]
    return w + g + master + {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] * state


def bytes_state_at_weights(param_dtype, optimizer, master_dtype=None):
    p, m = _size(param_dtype), _size(master_dtype)
    return 2 * p + m + {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] * p


OK4 = (matmul_params_ok, bytes_ok)


def test_flops_accounting_accepts(capsys):
    day2.check_flops_accounting(*OK4)
    day2.check_flops_accounting(*OK4, seed=1, trials=2)
    assert ": ok (" in capsys.readouterr().out


def test_flops_accounting_asks_for_no_formula_the_text_gives_in_full():
    """6N + 12 l h s and MFU are written out in section 5: copying them was busywork (issue 34), so the
    exercise is matmul_params (which weights a token multiplies through) and the bytes of model state."""
    import inspect

    assert list(inspect.signature(day2.check_flops_accounting).parameters)[:2] == ["matmul_params",
                                                                                   "training_bytes_per_param"]


@pytest.mark.parametrize("i,wrong,match", [
    (0, matmul_params_with_tables, "looked-up (embedding )?table counted"),
    (0, matmul_params_linears_only, "matmul_params = "),
    (1, lambda p, o, master_dtype=None: bytes_ok(p, o), "master copy left out"),
    (1, lambda p, o, master_dtype=None: bytes_ok(p, "adamw", master_dtype), "two state values for every optimizer"),
    (1, bytes_state_at_weights, "state at the weights' width"),
    (1, bytes_from_the_table, r"training_bytes_per_param\(torch.float16, 'sgd', master_dtype=None\) = 8, expected 4")])
def test_flops_accounting_rejects(i, wrong, match):
    fns = list(OK4)
    fns[i] = wrong
    with pytest.raises(AssertionError, match=match):
        day2.check_flops_accounting(*fns)


def test_flops_accounting_stub_and_references():
    with pytest.raises(NotImplementedError):
        day2.check_flops_accounting(stub, *OK4[1:])
    from dlo.accounting import matmul_params, training_bytes_per_param

    def via_the_accountant(param_dtype, optimizer, master_dtype=None):
        from dlo.accounting import copy_widths, model_state_bytes
        return model_state_bytes(1, optimizer, copy_widths(param_dtype, master_dtype))["total"]

    for i, ref in ((0, matmul_params), (1, training_bytes_per_param), (1, via_the_accountant)):
        fns = list(OK4)
        fns[i] = ref
        with pytest.raises(ForbiddenCall, match="off limits"):
            day2.check_flops_accounting(*fns, trials=1)


def test_flops_accounting_sandboxed(sandbox, capsys):
    sandbox.run(day2.check_flops_accounting, *OK4, trials=1)
    assert ": ok (" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="looked-up (embedding )?table counted"):
        # graded, the cases come from a secret seed: trial 1 (untied, a position table) shows the tables whatever it is
        sandbox.run(day2.check_flops_accounting, matmul_params_with_tables, *OK4[1:], trials=2)


# ----------------------------------------------------------------------------- red team

def round_by_cast(x):
    return x.to(torch.bfloat16).float()  # the check's reference: no bits touched


def round_by_copy(x):
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    out.copy_(x)
    return out.float()


def matmul_params_measured(model):
    """N read off FlopCounterMode (the check's own measurement), not the rule: 2 FLOPs per weight and token."""
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(idx)
    return sum(v for op, v in fc.get_flop_counts()["Global"].items() if "bmm" not in str(op)) // (2 * idx.numel())


def bytes_master_always_fp32(param_dtype, optimizer, master_dtype=None):
    p, k = _size(param_dtype), {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer]
    return 2 * p + k * p if master_dtype is None else 2 * p + 4 + 4 * k  # "master and state are fp32"


RED_TEAM = [
    (day2.check_round_to_bf16, (round_by_cast,), "made or read a bfloat16 tensor: torch's cast is the check's"),
    (day2.check_round_to_bf16, (round_by_copy,), "made or read a bfloat16 tensor"),
    (day2.check_flops_accounting, (matmul_params_measured, bytes_ok), "not FLOPs or use: both count"),
    (day2.check_flops_accounting, (matmul_params_ok, bytes_master_always_fp32), "at fp32's 4 bytes?"),
]


@pytest.mark.parametrize("check,fns,phrase", RED_TEAM, ids=[f[0].__name__ for _, f, _ in RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_red_team_fails(check, fns, phrase, seed):
    """Red team (Day 2): each passed its check at every seed before its case was added."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(*fns, seed=seed)


def test_autocast_step_runs_one_more_trial_where_a_gpu_is(monkeypatch, capsys):
    """A GPU adds a trial on it (where autocast("cpu") hard-coded leaves the forward in fp32); mocked with
    the CPU as the extra device, which runs the same path."""
    monkeypatch.setattr(day2, "_extra_device", lambda: "cpu")
    day2.check_autocast_train_step(step_ok, trials=2)
    assert "3 trials" in capsys.readouterr().out


def step_autocast_cpu(model, optimizer, x, y, *, dtype, scaler=None):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=dtype):  # not x.device.type: on a GPU the forward stays fp32
        loss = F.cross_entropy(model(x), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hard-coded device shows on a GPU only")
def test_autocast_step_rejects_a_hard_coded_cpu_on_a_gpu():
    with pytest.raises(AssertionError, match=r"first Linear produced \[torch.float32\].*device=cuda"):
        day2.check_autocast_train_step(step_autocast_cpu, trials=1)


def test_red_team_fails_sandboxed(sandbox):
    """The bf16 refusal runs where the student's code runs: in the jail too."""
    with pytest.raises(AssertionError, match="made or read a bfloat16 tensor"):
        sandbox.run(day2.check_round_to_bf16, round_by_cast)
