"""dlo.awq: the fold keeps the float model, alpha = 0 is RTN exactly, the search never does worse than
RTN on its calibration data, it beats RTN on outlier channels, and the W4A16 kernel runs its weights."""

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
    assert len(report) == 3 * len(model.layers)
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_search_never_beats_rtn_by_losing(seed):
    g = torch.Generator().manual_seed(seed)
    lins = [nn.Linear(32, 24) for _ in range(2)]
    x = torch.randn(128, 32, generator=g) * torch.rand(32, generator=g) * 5
    found = awq.search_alpha(x, lins, n_grid=7)
    assert 0.0 in found.errors and found.errors[found.alpha] <= found.rtn_error
    assert found.errors[found.alpha] == min(found.errors.values())
    _, report = awq.awq_llama(tiny_llama(seed), tokens(seed), n_grid=4)
    assert all(r["AWQ error"] <= r["RTN error"] for r in report)


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


def test_experiment_on_a_cut_down_run(monkeypatch):
    for k, v in (("batch", 2), ("seq_len", 8), ("steps", 2), ("train", 2), ("calib", 1), ("eval", 3)):
        monkeypatch.setitem(S.LM, k, v)
    res = A.run([0], "cpu", n_grid=3, tokens=8)
    assert [(r["case"], r["variant"]) for r in A.table(res)][:2] == [("as trained", "fp32"), ("as trained", "W4 RTN")]
    assert len(A.alpha_table(res)) == 2 * 3 * 2
    claims = A.claims(res)
    assert [c.verdict for c in claims[:2]] == ["not measurable here"] * 2  # one seed: no interval
    assert all(c.verdict == "by construction" for c in claims[2:])
    assert res["runs"][0]["fold error"] < 1e-5
