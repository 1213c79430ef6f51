"""dlo.amp: the dynamic loss scaler against torch.amp.GradScaler, the autocast step, the saved-bytes
counter on a model small enough to count by hand, and the precision-mode helpers."""

import math

import pytest
import torch
from torch import nn

from dlo.amp import (
    DynamicLossScaler,
    float_formats,
    grad_log2_magnitudes,
    precision_mode,
    precision_step,
    saved_activation_bytes,
    train_amp,
    train_step,
)
from dlo.measure import measure_step

INJECT = {2: math.inf, 3: math.nan, 7: -math.inf}  # step -> value written into one gradient


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def run_scaler(scaler, device, steps=10, unscale_first=False):
    """Per step: (scale after update, params after step, whether the optimizer stepped), on `device`."""
    model = tiny_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        x, y = torch.randn(9, 7, generator=gen).to(device), torch.randint(0, 3, (9,), generator=gen).to(device)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        if s in INJECT:
            model[2].weight.grad[1, 2] = INJECT[s]
        if unscale_first:
            scaler.unscale_(opt)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        out.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()], moved))
    return out


@pytest.mark.parametrize("use_kernel", [True, False])  # True: the Triton kernel (interpreted on CPU)
@pytest.mark.parametrize("unscale_first", [False, True])
def test_scaler_matches_grad_scaler(use_kernel, unscale_first, device):
    hp = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = run_scaler(DynamicLossScaler(**hp, use_kernel=use_kernel), device, unscale_first=unscale_first)
    want = run_scaler(torch.amp.GradScaler(device.type, **hp), device, unscale_first=unscale_first)
    scales = [s for s, _, _ in want]
    assert len(set(scales)) > 2  # the run both backs off and grows
    for step, ((s1, p1, m1), (s2, p2, m2)) in enumerate(zip(ours, want)):
        assert s1 == s2, f"scale after step {step}: {s1} vs GradScaler {s2}"
        assert m1 == m2 == (step not in INJECT), f"step {step}: stepped={m1}, GradScaler stepped={m2}"
        # The same fp32 operations in the same order: equal up to fp32 rounding of 1/S * g.
        torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_scaler_growth_stops_at_fp32_max():
    scaler = DynamicLossScaler(init_scale=2.0 ** 127, growth_interval=1)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(p.sum() * 0).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 127  # 2^128 overflows fp32: the scale stays


def test_scaler_misuse_raises():
    scaler, p = DynamicLossScaler(), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(RuntimeError, match="before any scale"):
        scaler.unscale_(opt)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicLossScaler(growth_factor=0.5)


def test_disabled_scaler_is_plain_training():
    scaler, p = DynamicLossScaler(enabled=False), nn.Parameter(torch.ones(2))
    loss = p.sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0


def test_saved_activation_bytes_counted_by_hand():
    model, x = tiny_model(), torch.randn(3, 7)  # Linear(7, 5), Tanh, Linear(5, 3); x needs no grad
    # fp32: Linear1 keeps x (3*7*4 = 84 B) for the weight grad; Tanh keeps its output (3*5*4 = 60 B),
    # the same tensor Linear2 keeps as its input (counted once). Weights are parameters: left out.
    assert saved_activation_bytes(model, x) == {"total": 144, "tensors": 2, "by_dtype": {"float32": 144}}
    # bf16 autocast: x cast to bf16 (42 B); Tanh's bf16 output (30 B); Linear2 also needs the grad of
    # its input, so it keeps its bf16 weight copy (3*5*2 = 30 B). Linear1's copy is not needed: x has no grad.
    bf16 = saved_activation_bytes(model, x, dtype=torch.bfloat16)
    assert bf16 == {"total": 102, "tensors": 3, "by_dtype": {"bfloat16": 102}}


def test_train_step_keeps_fp32_master_weights():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 7), torch.randint(0, 3, (8,))
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = model[0].weight.detach().clone()
    loss = train_step(model, opt, x, y, dtype=torch.bfloat16)
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32 and not loss.requires_grad
    assert model[0].weight.dtype == torch.float32 and not torch.equal(before, model[0].weight)


def test_train_amp_with_scaler_counts_skips():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 7), torch.randint(0, 3, (8,)))]
    scaler = DynamicLossScaler(init_scale=2.0 ** 24, growth_interval=100)
    hist = train_amp(model, opt, batches, steps=8, device="cpu", dtype=torch.float16, scaler=scaler,
                     progress=False)
    # dL/dlogits ~ 0.1, times 2^24, is far above the fp16 max 65504: the fp16 backward overflows,
    # the step is skipped and S halves, until the scaled gradients fit.
    assert hist["scale"][0] == 2.0 ** 23 and 1 <= hist["skipped"] < 8
    assert hist["scale"][-1] == 2.0 ** (24 - hist["skipped"]) and len(hist["loss"]) == 8


@pytest.mark.parametrize("make_scaler", [lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=100),
                                         lambda: DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=100)],
                         ids=["GradScaler", "DynamicLossScaler"])
def test_train_amp_counts_skips_of_any_scaler(make_scaler):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    bad = torch.randn(8, 7, generator=gen)
    bad[3, 4] = math.inf  # an injected inf: loss and gradients are not finite, the step must be skipped
    batches = [(torch.randn(8, 7, generator=gen), torch.randint(0, 3, (8,), generator=gen)),
               (bad, torch.randint(0, 3, (8,), generator=gen))]
    hist = train_amp(model, opt, batches, steps=5, device="cpu", scaler=make_scaler(), progress=False)
    assert hist["skipped"] == 2  # steps 1 and 3 see the inf batch
    assert hist["scale"] == [2.0 ** 8, 2.0 ** 7, 2.0 ** 7, 2.0 ** 6, 2.0 ** 6]


def test_grad_log2_magnitudes():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([0.0, 0.25, -8.0, 2.0 ** -30])
    assert grad_log2_magnitudes([p]).tolist() == [-2.0, 3.0, -30.0]


def test_precision_mode_restores_flags():
    old = torch.backends.cuda.matmul.allow_tf32
    with precision_mode("tf32") as dtype:
        assert dtype is None and torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == old
    with precision_mode("bf16") as dtype:
        assert dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision mode"):
        with precision_mode("fp8"):
            pass


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_precision_step_trains_and_is_measured(mode):
    torch.manual_seed(0)
    batch = (torch.randn(8, 7), torch.randint(0, 3, (8,)))
    step = precision_step(tiny_model, batch, mode=mode, device="cpu", lr=1e-2)
    first = step().item()
    row = measure_step(step, device="cpu", warmup=0, reps=2)
    assert row["time_s"] > 0 and row["reps"] == 2 and row["peak_kind"] == "saved-tensor peak"
    assert row["peak_bytes"] > 0 and math.isfinite(first) and step().item() < first  # it does train


def test_float_formats_layout():
    rows = {r["format"]: r for r in float_formats()}
    # Storage widths from torch itself; tf32 has no dtype: NVIDIA documents it as 19 bits (1 + 8 + 10).
    bits = {"fp32": torch.finfo(torch.float32).bits, "fp16": torch.finfo(torch.float16).bits,
            "bf16": torch.finfo(torch.bfloat16).bits, "tf32": 19}
    assert all(1 + rows[f]["exponent"] + rows[f]["mantissa"] == b for f, b in bits.items())
    assert rows["fp16"]["max"] == 65504.0
    assert rows["bf16"]["max"] == rows["fp32"]["max"] * (1 - 2 ** -8) / (1 - 2 ** -24)
