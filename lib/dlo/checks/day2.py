"""Autograder checks for Day 2 (mixed precision): autocast step, dynamic loss scaler, bf16 rounding.

References are torch's own: torch.autocast + torch.amp.GradScaler("cpu") (through dlo.amp.train_step)
for the training step, GradScaler step by step for the loss scaler, and `tensor.to(torch.bfloat16)`
for rounding (which the student's rounding may not reach: `day2_rounding`). Models are tiny MLPs on CPU,
where autocast supports both bf16 and fp16.

The training step and the scaler run in workers (`dlo.grading.api.run_student`) that build the model
from the seed, run the student's code and record what it did step by step (output dtype, loss,
scale, gradients the optimizer saw, parameters); the references run here and the comparison too.

Here: the precision exercises; the bf16 rounding is `dlo.checks.day2_rounding`, the accounting one
(FLOPs, MFU, bytes per parameter) `dlo.checks.day2_accounting` and the FlashAttention forward
`dlo.checks.day2_attention`, all re-exported here, the day's one checks module (`dlo.registry`).
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from dlo.checks.day2_accounting import check_flops_accounting
from dlo.checks.day2_attention import check_flash_attention
from dlo.checks.day2_rounding import check_round_to_bf16
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import assert_close, fmt, ok

# Student and reference run the same fp32 / low-precision ops in the same order, so they agree to
# the last bit in practice; 1e-6 relative still tolerates a different but equivalent op order.
RTOL, ATOL = 1e-6, 1e-7
# the trial on a GPU: cuBLAS may pick other kernels for the student's step and the reference's (not checked on
# hardware yet); a hard-coded autocast('cpu') fails there on the first Linear's dtype, not on these
GPU_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _mlp(seed: int, d_in: int, hidden: int, n_cls: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, n_cls))


# ----------------------------------------------------------------------------- autocast training step

def _extra_device() -> str | None:
    """A device other than the CPU to run one more trial on, where there is one: autocast there must
    follow the data (`torch.autocast(x.device.type)`), which a CPU-only trial cannot tell from "cpu"."""
    return "cuda" if torch.cuda.is_available() else None


def _autocast_worker(fn, sub: int, dims: tuple, lr: float, dtype, scaled: bool, stale: list, data: list,
                     device: str = "cpu") -> list:
    """Train the student's step on a fresh MLP (the reference's start) on `device` with stale grads
    pre-filled; per step: the first Linear's output dtype, the returned loss, the scale and the
    parameters, on the CPU (an exception after the first step ends the run, recorded: the steps before
    it are compared first). {"absent": device} where the student's side has no such device (a jail without
    it): the check accepts that for a device other than the CPU only (`_step_records`)."""
    if device != "cpu" and not torch.cuda.is_available():
        return {"absent": device}
    model = _mlp(sub, *dims).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 24, growth_interval=2) if scaled else None
    for p, g in zip(model.parameters(), stale):
        p.grad = g.to(device, copy=True)  # stale grads of an earlier step
    seen, out = [], []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    for s, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        try:
            got = fn(model, opt, x, y, dtype=dtype, scaler=scaler)
        except Exception as exc:  # after a first step: the earlier steps are compared first, then this is reported
            if s == 0:
                raise
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            break
        loss = got.detach().cpu() if isinstance(got, torch.Tensor) else None
        loss_ok = isinstance(got, torch.Tensor) and not got.requires_grad and got.numel() == 1
        out.append({"seen": seen[-1:], "param_dtypes": [p.dtype for p in model.parameters()],
                    "loss": loss, "loss_ok": loss_ok,
                    "scale": float(scaler.get_scale()) if scaled else None,
                    "params": [[n, p.detach().cpu().clone()] for n, p in model.named_parameters()]})
    return out


STEP_KEYS = {"seen": list, "param_dtypes": list, "loss_ok": bool, "params": list}


def _step_records(name: str, got, device: str, steps: int, n_params: int, where: dict) -> list | None:
    """The worker's reply, held to what `_autocast_worker` sends whatever came back: a record of every step (or
    of the steps up to one that raised, ending with {"error": ...}); None only for {"absent": device} on a
    device other than the CPU, where the student's side has no such device. Anything else (no reply, a short
    one, a record missing its fields) fails: the comparison below reads every step it is given, and only those."""
    if device != "cpu" and type(got) is dict and got == {"absent": device}:
        return None
    if type(got) is not list or not got:
        raise AssertionError(f"{name}: no record of the training steps came back from where your code ran (got "
                             f"{type(got).__name__}); the check compares every step ({fmt(where)})")
    *done, last = got
    ended = type(last) is dict and set(last) == {"error"} and type(last["error"]) is str  # a step raised
    whole = done + ([] if ended else [last])
    if len(whole) == (len(got) - 1 if ended else steps) and len(got) <= steps and whole and all(
            type(rec) is dict and all(type(rec.get(k)) is v for k, v in STEP_KEYS.items())
            and len(rec["params"]) == len(rec["param_dtypes"]) == n_params
            and isinstance(rec.get("loss"), torch.Tensor if rec["loss_ok"] else (torch.Tensor, type(None)))
            for rec in whole):
        return got
    raise AssertionError(f"{name}: the record of the training steps that came back is incomplete or malformed "
                         f"({len(got)} entries for {steps} steps); the check compares every step ({fmt(where)})")


@check(forbid=("dlo.amp.train_step", "dlo.amp.amp_step", "dlo.amp.train_amp", "dlo.amp.precision_step"))
def check_autocast_train_step(fn, seed: int = 0, trials: int = 4, steps: int = 3) -> None:
    """`fn(model, optimizer, x, y, *, dtype, scaler=None) -> loss` vs dlo.amp.train_step. Even trials:
    bf16 without a scaler; odd trials: fp16 with torch.amp.GradScaler("cpu"), whose large initial
    scale makes the first step overflow (it must be skipped). Stale grads are pre-filled. Where a GPU
    is there, one more trial runs on it (`_extra_device`)."""
    from dlo.amp import train_step

    name, rng = "autocast_train_step", random.Random(case_seed(seed))
    devices = ["cpu"] * trials + [d for d in [_extra_device()] if d]
    for t, device in enumerate(devices):
        dtype = torch.bfloat16 if t % 2 == 0 else torch.float16
        d_in, hidden = rng.choice([5, 7, 11]), rng.choice([13, 17])
        n_cls, batch = rng.choice([3, 4]), rng.choice([9, 15])
        sub = rng.randrange(10 ** 6)
        ref = _mlp(sub, d_in, hidden, n_cls).to(device)
        lr = 10 ** rng.uniform(-3, -1.5)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
        ref_scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 24, growth_interval=2) if t % 2 else None
        gen = torch.Generator().manual_seed(sub)
        stale = [torch.randn(p.shape, generator=gen) for p in ref.parameters()]  # stale grads of an earlier step
        data = [(torch.randn(batch, d_in, generator=gen), torch.randint(0, n_cls, (batch,), generator=gen))
                for _ in range(steps)]
        got_steps = run_student(_autocast_worker, fn, sub, (d_in, hidden, n_cls), lr, dtype, t % 2 == 1,
                                copy.deepcopy(stale), copy.deepcopy(data), device)  # copies: see check_loss_scaler
        got_steps = _step_records(name, got_steps, device, steps, len(stale), dict(trial=t, device=device))
        if got_steps is None:  # the GPU the check sees is not the student's
            devices.pop()
            continue
        for s, ((x, y), got) in enumerate(zip(data, got_steps), 1):
            hp = dict(dtype=str(dtype).removeprefix("torch."), scaler=ref_scaler is not None, step=s, lr=lr,
                      **({} if device == "cpu" else {"device": device}))
            want = train_step(ref, ref_opt, x.to(device), y.to(device), dtype=dtype, scaler=ref_scaler).cpu()
            if "error" in got:
                raise AssertionError(f"{name}: step {s} raised {got['error']} ({fmt(hp)})")
            if got["seen"] != [dtype]:
                raise AssertionError(f"{name}: the first Linear produced {got['seen'] or 'nothing'}, expected {dtype}; "
                                     f"run the forward pass inside torch.autocast(x.device.type, dtype=dtype) "
                                     f"({fmt(hp)})")
            if any(d != torch.float32 for d in got["param_dtypes"]):
                raise AssertionError(f"{name}: parameters must stay fp32 master weights; autocast casts on the fly, "
                                     f"do not call model.to(dtype) / model.half() ({fmt(hp)})")
            if not got["loss_ok"]:
                raise AssertionError(f"{name}: return the loss as a detached one-element tensor ({fmt(hp)})")
            assert_close(name, "returned loss (unscaled mean cross-entropy)", got["loss"].float(), want, hp,
                         rtol=RTOL, atol=ATOL)
            if ref_scaler is not None and got["scale"] != ref_scaler.get_scale():
                raise AssertionError(f"{name}: scale after step {s} is {got['scale']}, expected "
                                     f"{ref_scaler.get_scale()}: use scaler.scale(loss).backward(), "
                                     f"scaler.step(optimizer), scaler.update() ({fmt(hp)})")
            for (pname, p), r in zip(got["params"], ref.parameters()):
                assert_close(name, f"{pname} after step {s} (zero the grads first; with a scaler, step through it "
                                   f"so an overflowing step is skipped)", p, r.detach().cpu(), hp,
                         **({"rtol": RTOL, "atol": ATOL} if device == "cpu" else GPU_TOL))
    ok(name, f"{len(devices)} trials, seed={seed}")


# ----------------------------------------------------------------------------- dynamic loss scaler

def _scaler_run(scaler, model: nn.Module, data: list, inject: dict, unscale_first: bool, lr: float) -> list:
    """Per step: (scale after update, grads seen by the optimizer or None if skipped, params)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    grads_seen: list = []
    orig_step = opt.step

    def recording_step(*args, **kwargs):
        grads_seen.append([p.grad.detach().clone() for p in model.parameters()])
        return orig_step(*args, **kwargs)
    opt.step = recording_step
    out = []
    for s, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if s in inject:
            model[2].weight.grad.view(-1)[inject[s][0]] = inject[s][1]
        if unscale_first:
            scaler.unscale_(opt)  # e.g. to clip the true gradients before the step
        n_before = len(grads_seen)
        scaler.step(opt)
        scaler.update()
        grads = grads_seen[-1] if len(grads_seen) > n_before else None
        scale = scaler.get_scale()
        out.append((float(scale.item() if isinstance(scale, torch.Tensor) else scale), grads,
                    [p.detach().clone() for p in model.parameters()]))
    return out


def _scaler_worker(cls, hp: dict, sub: int, dims: tuple, data: list, inject: dict, unscale_first: bool,
                   lr: float) -> list:
    """The student's scaler (built here, from its class) on a fresh MLP: per step, see `_scaler_run`."""
    return _scaler_run(cls(**hp), _mlp(sub, *dims), data, inject, unscale_first, lr)


def _misuse_worker(cls) -> dict:
    """The student's scaler misused as GradScaler refuses to be: `unscale_` twice, then `step` twice,
    before `update()`; and the type `get_scale()` returns. {what: True if it raised RuntimeError}."""
    model = _mlp(0, 5, 7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler, out = cls(), {}
    for what, first, again in (("unscale_", scaler.unscale_, scaler.unscale_), ("step", scaler.step, scaler.step)):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(torch.ones(2, 5)), torch.tensor([0, 1]))).backward()
        first(opt)
        try:
            again(opt)
            out[what] = False
        except RuntimeError:
            out[what] = True
        if what == "unscale_":
            scaler.step(opt)
        scaler.update()
    out["get_scale"] = type(scaler.get_scale()).__name__
    return out


def _check_misuse(name: str, cls) -> None:
    got = run_student(_misuse_worker, cls)
    if type(got) is not dict or type(got.get("unscale_")) is not bool or type(got.get("step")) is not bool \
            or type(got.get("get_scale")) is not str:
        raise AssertionError(f"{name}: the record of the misuse trial (unscale_ and step twice before update()) that "
                             f"came back from where your code ran is incomplete or malformed")
    for what in ("unscale_", "step"):
        if not got[what]:
            raise AssertionError(f"{name}: a second {what}(optimizer) before update() must raise RuntimeError, as "
                                 f"GradScaler's does (a second unscale_ would divide the gradients by S twice)")
    if got["get_scale"] != "float":
        raise AssertionError(f"{name}: get_scale() returned a {got['get_scale']}; return the scale as a Python float")


def _scaler_records(name: str, got, steps: int, n_params: int, where: dict) -> None:
    """The worker's reply held to what `_scaler_run` sends, whatever came back: one (scale, gradients or None,
    parameters) per step, every step, each list one tensor per parameter. The comparison reads what it is given:
    a short record would compare fewer steps (a red team's scaler emptied the worker's list of batches)."""
    def tensors(ts) -> bool:  # one tensor per parameter
        return type(ts) in (list, tuple) and len(ts) == n_params and all(isinstance(x, torch.Tensor) for x in ts)

    def whole(rec) -> bool:
        return type(rec) in (list, tuple) and len(rec) == 3 and type(rec[0]) in (float, int) \
            and (rec[1] is None or tensors(rec[1])) and tensors(rec[2])

    if type(got) not in (list, tuple) or len(got) != steps or not all(whole(rec) for rec in got):
        count = len(got) if type(got) in (list, tuple) else type(got).__name__
        raise AssertionError(f"{name}: the record of the {steps} steps that came back from where your scaler ran is "
                             f"incomplete or malformed ({count} entries): every step is compared; do not touch the "
                             f"check's data or records ({fmt(where)})")


SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.amp.grad_scaler.GradScaler",
           "torch._amp_foreach_non_finite_check_and_unscale_", "torch._amp_update_scale_", "dlo.amp.DynamicLossScaler",
           "dlo.kernels.amp_unscale.amp_unscale_", "dlo.kernels.amp_unscale.amp_unscale_ref",
           "aten::_amp_update_scale*", "aten::_amp_foreach_non_finite_check_and_unscale*")  # GradScaler's kernels


@check(forbid=SCALERS)
def check_loss_scaler(cls, seed: int = 0, trials: int = 4, steps: int = 12) -> None:
    """`cls(init_scale, growth_factor, backoff_factor, growth_interval)` with scale / unscale_ / step /
    update / get_scale, compared with torch.amp.GradScaler("cpu") on the same model, data and injected
    inf / nan gradients, after every step. Odd trials call unscale_() before step() (which then must
    not unscale again). One optimizer per scaler; a second unscale_ or step before update() must raise
    RuntimeError, and get_scale() returns a Python float (`_check_misuse`)."""
    name, rng = "loss_scaler", random.Random(case_seed(seed))
    for t in range(trials):
        hp = dict(init_scale=2.0 ** rng.randint(4, 16), growth_factor=rng.choice([2.0, 4.0]),
                  backoff_factor=rng.choice([0.5, 0.25]), growth_interval=rng.randint(2, 4))
        unscale_first = t % 2 == 1
        d_in, n_cls, sub, lr = rng.choice([5, 9]), rng.choice([3, 4]), rng.randrange(10 ** 6), 10 ** rng.uniform(-3, -1)
        gen = torch.Generator().manual_seed(sub)
        data = [(torch.randn(11, d_in, generator=gen), torch.randint(0, n_cls, (11,), generator=gen))
                for _ in range(steps)]
        bad = rng.sample(range(1, steps - 2), 3)  # never the last steps: growth after a skip is seen too
        inject = {s: (rng.randrange(n_cls * 7), v) for s, v in zip(bad, (math.inf, math.nan, -math.inf))}
        want = _scaler_run(torch.amp.GradScaler("cpu", **hp), _mlp(sub, d_in, 7, n_cls), data, inject, unscale_first,
                           lr)
        # the student's side gets copies: in a notebook's own check it shares the process (a red team's scaler
        # emptied the worker's list of batches, the check's own then)
        got = run_student(_scaler_worker, cls, hp, sub, (d_in, 7, n_cls), copy.deepcopy(data), dict(inject),
                          unscale_first, lr)
        _scaler_records(name, got, steps, len(want[0][2]), dict(hp, trial=t))
        for s, ((g_scale, g_grads, g_params), (w_scale, w_grads, w_params)) in enumerate(zip(got, want)):
            where = dict(hp, step=s, injected=inject.get(s, (0, "none"))[1], unscale_first=unscale_first)
            if (g_grads is None) != (w_grads is None):
                raise AssertionError(f"{name}: at step {s} the optimizer step was "
                                     f"{'skipped' if g_grads is None else 'taken'}, expected "
                                     f"{'skipped (a gradient is inf or nan)' if w_grads is None else 'taken'} "
                                     f"({fmt(where)})")
            if g_grads is not None:
                for i, (a, b) in enumerate(zip(g_grads, w_grads)):
                    assert_close(name, f"gradient {i} seen by optimizer.step() (divided by the scale exactly once)",
                                 a, b, where, rtol=RTOL, atol=ATOL)
            if g_scale != w_scale:
                raise AssertionError(f"{name}: scale after update() of step {s} is {g_scale:g}, expected {w_scale:g} "
                                     f"(backoff on inf/nan and reset the count; grow after growth_interval clean "
                                     f"steps in a row) ({fmt(where)})")
            for i, (a, b) in enumerate(zip(g_params, w_params)):
                assert_close(name, f"parameter {i} after step {s}", a, b, where, rtol=RTOL, atol=ATOL)
    _check_misuse(name, cls)  # after the arithmetic: its mistakes are the ones to hear of first
    ok(name, f"{trials} trials, seed={seed}")


__all__ = ["check_autocast_train_step", "check_flash_attention", "check_flops_accounting", "check_loss_scaler",
           "check_round_to_bf16"]
