"""dlo.awq: the fold keeps the float model, alpha = 0 is RTN exactly, the search never does worse than
RTN on its calibration data, it beats RTN on outlier channels, and the W4A16 kernel runs its weights;
zero-point int4 (round trip, exact cases, llm-awq's formula) and the clipping search."""

import pytest
import torch
from torch import nn

from dlo import awq, quant
from dlo.experiments import day8_awq as A
from dlo.experiments import day8_smooth as S
from dlo.kernels import quantize as kq
from dlo.kernels import weight_only_matmul as wom
from tests.test_smoothquant import rel, tiny_llama, tokens


def layer_with_outliers(seed=0, channels=(3, 17, 40, 51), factor=60.0):
    """A 64 -> 48 Linear and 256 input tokens whose `channels` are `factor` x larger, with the weight's
    columns divided by `factor` (inject_outliers_'s pattern: the same function, salient inputs)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) / 8)
    x = torch.randn(256, 64, generator=g)
    with torch.no_grad():
        lin.weight[:, list(channels)] /= factor
    x[:, list(channels)] *= factor
    return lin, x


def test_group_size_is_128_or_the_largest_divisor_below():
    assert [awq.group_size(k) for k in (64, 176, 4096, 11008, 7)] == [64, 88, 128, 128, 7]
    with pytest.raises(ValueError, match=">= 1"):
        awq.group_size(0)


def test_the_fold_keeps_the_float_model():
    model, calib = tiny_llama(), tokens(0)
    scaled, report = awq.awq_llama(model, calib, n_grid=5)
    assert len(report["scales"]) == 3 * len(model.layers) and report["clip"] == []
    with torch.no_grad():
        x = tokens(1, n=1)[0]
        assert torch.allclose(scaled(x), model(x), rtol=1e-4, atol=1e-5)


def test_alpha_zero_is_round_to_nearest_exactly():
    lin, x = layer_with_outliers()
    s = awq.awq_scales(x, 0.0)
    assert torch.equal(s, torch.ones(64))
    w = lin.weight.detach()
    assert torch.equal(awq.rtn(w * s) / s, awq.rtn(w))
    mse = (x @ awq.rtn(w).T - x @ w.T).pow(2).mean().item()
    assert awq.quantized_error(x, [lin], s) == pytest.approx(mse, rel=1e-5)
    # and the deployed layer holds the same weights as RTN
    assert torch.equal(quant.QuantLinear(lin, 4, "group", 64).weight_hat(), awq.rtn(w))


@pytest.mark.parametrize("seed,symmetric", [(0, True), (1, True), (2, False)])
def test_the_search_never_beats_rtn_by_losing(seed, symmetric):
    g = torch.Generator().manual_seed(seed)
    lins = [nn.Linear(32, 24) for _ in range(2)]
    x = torch.randn(128, 32, generator=g) * torch.rand(32, generator=g) * 5
    found = awq.search_alpha(x, lins, n_grid=7, symmetric=symmetric)
    assert 0.0 in found.errors and found.errors[found.alpha] <= found.rtn_error
    assert found.errors[found.alpha] == min(found.errors.values())
    rtn = sum(layer_mse(x, lin.weight.detach(), awq.rtn(lin.weight.detach(), symmetric)) for lin in lins) / 2
    assert found.rtn_error == pytest.approx(rtn, rel=1e-5)  # alpha = 0: RTN with this quantizer
    _, report = awq.awq_llama(tiny_llama(seed), tokens(seed), n_grid=4, symmetric=symmetric)
    assert all(r["AWQ error"] <= r["RTN error"] for r in report["scales"])


def test_awq_beats_rtn_on_outlier_channels():
    lin, x = layer_with_outliers()
    found = awq.search_alpha(x, [lin])
    assert found.alpha > 0.5 and found.errors[found.alpha] < 0.5 * found.rtn_error
    # the same on held-out tokens of the same distribution, through the fold and the deployed layer
    _, x_new = layer_with_outliers(seed=1)
    ref = lin(x_new).detach()
    w4 = quant.QuantLinear(lin, 4, "group", 64)
    scaled = nn.Linear(64, 48, bias=False)
    scaled.weight.data.copy_(lin.weight.detach() * found.s)
    w4_awq = quant.QuantLinear(scaled, 4, "group", 64)
    with torch.no_grad():
        assert rel(w4_awq(x_new / found.s), ref) < 0.7 * rel(w4(x_new), ref)


def test_the_w4a16_kernel_runs_awq_weights(device):
    lin, x = layer_with_outliers()
    found = awq.search_alpha(x, [lin], n_grid=5)
    layer = quant.QuantLinear(_with_weight(lin.weight.detach() * found.s), 4, "group", 64)
    xs = (x[:8] / found.s).to(device, torch.bfloat16)
    packed, scale = kq.pack_int4(layer.qweight).to(device), layer.scale.to(device)
    y = wom.weight_only_matmul(xs, packed, scale, bits=4)
    with torch.no_grad():
        expect = layer.to(device)(xs.float())
    assert torch.allclose(y.float(), expect, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- zero points (asymmetric int4)

def test_zero_point_int4_round_trip_is_llm_awqs_quantizer():
    w = torch.randn(48, 176, generator=torch.Generator().manual_seed(0)) * 0.1
    G = awq.group_size(176)
    q, S, z = quant.quantize(w, 4, "group", G, symmetric=False)
    g = w.reshape(48, 176 // G, G)
    lo, hi = g.amin(-1), g.amax(-1)
    assert (lo < 0).all() and (hi > 0).all()  # so the widening to contain 0 changes nothing here
    # llm-awq's pseudo_quantize_tensor (zero_point=True), its codes 0..15 = ours + 8
    assert torch.allclose(S, (hi - lo) / 15)
    assert torch.equal(z + 8, torch.round(-lo / S)) and ((z + 8 >= 0) & (z + 8 <= 15)).all()
    assert q.min() + 8 >= 0 and q.max() + 8 <= 15
    assert torch.equal(q.float().reshape(g.shape) + 8, (torch.round(g / S[..., None]) + z[..., None] + 8).clamp(0, 15))
    w_hat = quant.dequantize(q, S, z)
    assert torch.equal(awq.rtn(w, symmetric=False), w_hat)
    bound = S.repeat_interleave(G, dim=1) / 2
    assert ((w - w_hat).abs() <= bound * (1 + 1e-5) + 1e-9).all()  # min-max: nothing is clipped
    assert (w - w_hat).pow(2).mean() < (w - awq.rtn(w)).pow(2).mean()  # 16 levels over [min, max], not 15 over +-max


def test_zero_point_int4_exact_cases():
    S, zero = 2.0 ** -4, 5  # an exactly representable step and an unsigned zero point in [0, 15]
    on_grid = S * (torch.arange(16.0).repeat(4) - zero)  # every code once per 16: min and max set S, z exactly
    row = on_grid[torch.randperm(64, generator=torch.Generator().manual_seed(0))][None]
    q, s, z = quant.quantize(row, 4, "group", 64, symmetric=False)
    assert s.item() == S and z.item() + 8 == zero and torch.equal(quant.dequantize(q, s, z), row)
    for c in (0.0, 1.875, -0.75, 3.0):  # constant groups whose value is a code (c = +-15 S)
        const = torch.full((2, 64), c)
        assert torch.equal(awq.rtn(const, symmetric=False), const)
    # any constant: the group stays constant, at most one float rounding off (S = c / 15, then 15 S)
    c = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 3
    out = awq.rtn(c[:, None].expand(500, 64).contiguous(), symmetric=False)
    assert (out == out[:, :1]).all() and torch.allclose(out[:, 0], c, rtol=2 ** -23, atol=0)


def test_quant_linear_keeps_zero_points():
    lin, x = layer_with_outliers()
    asym, sym = quant.QuantLinear(lin, 4, "group", 64, symmetric=False), quant.QuantLinear(lin, 4, "group", 64)
    assert "zero" in asym.state_dict() and "zero" not in sym.state_dict()
    assert torch.equal(asym.weight_hat(), awq.rtn(lin.weight.detach(), symmetric=False))
    assert asym.nbytes() == sym.nbytes() + 48 // 2  # one 4-bit zero point per group


# ----------------------------------------------------------------------------- the clipping search

def layer_mse(x, w, w_hat):
    return (x @ w_hat.T - x @ w.T).pow(2).mean().item()


def test_clip_ratio_one_is_no_clipping():
    lin, x = layer_with_outliers()
    w = lin.weight.detach().clone()
    found = awq.search_clip(x, w, symmetric=False, ratios=[1.0])
    assert (found.ratio == 1).all() and torch.equal(found.max_val, w.abs().amax(1, keepdim=True))
    awq.clip_(lin, found.max_val)
    assert torch.equal(lin.weight.detach(), w)
    assert torch.equal(found.error, found.unclipped_error)
    # with one group per row, the objective of a row is that row's output MSE
    per_row = (x @ awq.rtn(w, symmetric=False).T - x @ w.T).pow(2).mean(0)
    assert torch.allclose(found.error[:, 0], per_row, rtol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_clip_search_never_raises_the_calibration_error(seed, symmetric):
    g = torch.Generator().manual_seed(seed)
    for cols in (64, 176):  # one group per row (the layer's MSE), then two (each group's part of the output)
        w = torch.randn(24, cols, generator=g) * torch.rand(cols, generator=g)
        x = torch.randn(96, cols, generator=g) * torch.rand(cols, generator=g) * 3
        found = awq.search_clip(x, w, symmetric)
        assert found.ratio.min() >= 0.55 - 1e-6 and (found.error <= found.unclipped_error).all()
        lin = _with_weight(w)
        awq.clip_(lin, found.max_val)
        clipped = awq.rtn(lin.weight.detach(), symmetric)
        assert (lin.weight.detach().abs() <= w.abs()).all()
        if cols == 64:
            assert layer_mse(x, w, clipped) <= layer_mse(x, w, awq.rtn(w, symmetric)) * (1 + 1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clipping_helps_on_a_planted_outlier(symmetric):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * 0.05
    w[:, 7] = 1.0  # one large weight per row sets every row's step ...
    x = torch.randn(256, 64, generator=g)
    x[:, 7] *= 1e-3  # ... on an input that barely matters: clipping it costs little, the finer step gains
    found = awq.search_clip(x, w, symmetric)
    assert (found.ratio < 1).all() and found.error.sum() < 0.5 * found.unclipped_error.sum()
    lin = _with_weight(w)
    awq.clip_(lin, found.max_val)
    assert layer_mse(x, w, awq.rtn(lin.weight.detach(), symmetric)) < 0.5 * layer_mse(x, w, awq.rtn(w, symmetric))


def test_awq_llama_clips_all_but_wq_and_wk():
    model, calib = tiny_llama(), tokens(0)
    plain, _ = awq.awq_llama(model, calib, n_grid=3, symmetric=False)
    clipped, report = awq.awq_llama(model, calib, n_grid=3, symmetric=False, clip=True)
    assert [(r["layer"], r["linear"]) for r in report["clip"]] == [
        (str(i), n) for i in range(len(model.layers)) for n in ("wv", "wo", "w1", "w2", "w3")]
    assert all(r["clip / no clip"] <= 1.0 for r in report["clip"])
    same = {n: torch.equal(p, dict(clipped.named_parameters())[n]) for n, p in plain.named_parameters()}
    assert all(same[n] for n in same if n.endswith(("wq.weight", "wk.weight")) or "norm" in n)
    assert not all(same.values())


def _with_weight(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


def test_bad_input():
    lin, x = layer_with_outliers()
    with pytest.raises(ValueError, match="alpha"):
        awq.awq_scales(x, 1.5)
    with pytest.raises(ValueError, match="n_grid"):
        awq.search_alpha(x, [lin], n_grid=1)
    with pytest.raises(ValueError, match="nn.Linear"):
        awq.layer_inputs(tiny_llama(), tokens(0), ["layers.0.attention_norm"])
    with pytest.raises(ValueError, match="no batch"):
        awq.layer_inputs(tiny_llama(), [], ["layers.0.attention.wq"])
    with pytest.raises(ValueError, match="seeds"):
        A.run([0, 0], "cpu")
    with pytest.raises(ValueError, match="max_shrink"):
        awq.clip_ratios(20, 1.0)
    with pytest.raises(ValueError, match="start with 1.0"):
        awq.search_clip(x, lin.weight, ratios=[0.9, 1.0])
    with pytest.raises(ValueError, match="share"):
        awq.search_clip(x[:, :32], lin.weight)


def test_experiment_on_a_cut_down_run(monkeypatch):
    for k, v in (("batch", 2), ("seq_len", 8), ("steps", 2), ("train", 2), ("calib", 1), ("eval", 3)):
        monkeypatch.setitem(S.LM, k, v)
    res = A.run([0], "cpu", n_grid=3, tokens=8)
    assert [(r["case"], r["variant"]) for r in A.table(res)][:3] == [
        ("as trained", "fp32"), ("as trained", "W4 RTN sym"), ("as trained", "W4 RTN asym")]
    assert len(A.table(res)) == 2 * 6 and len(A.differences(res)) == 2 * len(A.COMPARISONS)
    assert len(A.alpha_table(res)) == 2 * 3 * 2 and len(A.clip_table(res)) == 2 * 5 * 2
    claims = A.claims(res)
    # one seed: no interval; the injected case is a demonstration (alpha = 1 undoes the injection), never evidence
    assert [c.verdict for c in claims if "injected" not in c.claim][:3] == ["not measurable here"] * 3
    assert all(c.verdict == "by construction" for c in claims[4:])
    (inj,) = [c for c in claims if "injected" in c.claim]
    assert inj.verdict == "by construction" and "alpha = 1" in inj.why and inj.measured is not None
    assert res["runs"][0]["fold error"] < 1e-5
    # the differences are the scores' own: the clipped variant against its unclipped copy, seed 0
    sc = res["runs"][0]["scores"]["as trained"]
    ppl = {v: sum(sc[v]["ppl"]) / len(sc[v]["ppl"]) for v in ("fp32", "W4 AWQ asym", "W4 AWQ asym + clip")}
    assert A.gain(res, "as trained", "W4 AWQ asym + clip", "W4 AWQ asym") == [
        pytest.approx((ppl["W4 AWQ asym"] - ppl["W4 AWQ asym + clip"]) / ppl["fp32"])]
