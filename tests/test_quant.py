"""dlo.quant: affine quantization round trips, granularities, bad input, STE gradients, observers, PTQ/QAT."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlo import quant


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("granularity,G", [("tensor", 0), ("channel", 0), ("group", 8)])
def test_round_trip_bound(granularity, G, bits, symmetric):
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(bits)) * 3
    q, s, z = quant.quantize(x, bits, granularity, G or 128, symmetric)
    q_min, q_max = quant.qrange(bits, symmetric)
    assert q.dtype == torch.int8 and q.min() >= q_min and q.max() <= q_max
    assert s.shape == {"tensor": (1, 1), "channel": (7, 1), "group": (7, 3)}[granularity]
    err = (x - quant.dequantize(q, s, z)).abs()
    bound = quant.group_view(torch.ones_like(x), granularity, G or 128) * (s / 2)[..., None]
    assert (err <= bound.reshape(x.shape) * (1 + 1e-4) + 1e-7).all()  # min-max: nothing is clipped


def test_finer_granularity_is_more_accurate():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 16)[:, None]
    errs = [(x - quant.fake_quantize_tensor(x, 4, g, 16)).pow(2).mean() for g in ("tensor", "channel", "group")]
    assert errs[0] > errs[1] > errs[2]


def test_zero_and_bad_input():
    x = torch.zeros(3, 8)
    for symmetric in (True, False):
        q, s, z = quant.quantize(x, 8, "channel", symmetric=symmetric)
        assert (s == 0).all() and torch.equal(quant.dequantize(q, s, z), x)
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="must divide"):
        quant.quantize(torch.randn(2, 10), 8, "group", 4)
    with pytest.raises(ValueError, match="granularity"):
        quant.quantize(torch.randn(2, 10), 8, "row")


def test_asymmetric_zero_is_exact_and_range_used():
    x = torch.rand(4, 32) * 5 + 1  # all positive: asymmetric uses the whole code range
    q, s, z = quant.quantize(x, 8, "tensor", symmetric=False)
    assert q.min() >= -128 and q.max() == 127
    x = torch.rand(4, 32, generator=torch.Generator().manual_seed(0)) * 6 - 0.3  # 0 inside, off-centre
    x[1, 5] = 0.0
    for granularity in ("tensor", "channel"):
        q, s, z = quant.quantize(x, 8, granularity, symmetric=False)
        assert quant.dequantize(q, s, z)[1, 5] == 0.0  # an integer zero-point: 0 (padding, ReLU) is exact


def test_ste_gradient():
    x = torch.tensor([-3.0, -0.4, 0.2, 0.9, 5.0], requires_grad=True)
    scale = torch.tensor(0.1)
    y = quant.fake_quant(x, scale, bits=4)  # codes clip at +-7: range [-0.7, 0.7]
    assert torch.allclose(y, torch.tensor([-0.7, -0.4, 0.2, 0.7, 0.7]))
    y.sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]  # identity inside the range, zero where clamped


def test_percentile_clips_outlier():
    data = torch.cat([torch.linspace(-1, 1, 10_000), torch.tensor([100.0])])
    mm, pct = quant.MinMaxObserver(), quant.PercentileObserver(99.0)
    for obs in (mm, pct):
        obs.update(data[:5000])
        obs.update(data[5000:])
    assert mm.range()[1] == 100.0
    assert pct.range()[1] < 1.0 and pct.range()[0] > -1.0
    with pytest.raises(RuntimeError, match="no data"):
        quant.MinMaxObserver().range()


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_quantiles_match_torch_quantile(n):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n))
    qs = [0.0, 0.001, 0.25, 0.5, 0.999, 1.0]
    assert torch.equal(quant.quantiles(v, qs), torch.quantile(v.double(), torch.tensor(qs, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quant.quantiles(v, [1.5])


def test_percentile_observer_at_the_full_profiles_calibration_size():
    # Day 8's full profile calibrates on 32 batches x 256 images x 3072 inputs: 25M values, over
    # torch.quantile's 2^24 limit ("quantile() input tensor is too large")
    obs = quant.PercentileObserver(99.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(32):
        obs.update(torch.rand(256, 3072, generator=g))
    assert sum(v.numel() for v in obs.values) == 32 * 256 * 3072 > 2 ** 24
    lo, hi = obs.range()
    assert abs(lo.item() - 0.001) < 1e-3 and abs(hi.item() - 0.999) < 1e-3  # uniform on [0, 1)


def test_ptq_and_qat_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(64, 16)
    qm = quant.quantize_model(model, 8, "group", 8, act_bits=8, calib_batches=[x[:32], x[32:]])
    assert isinstance(qm[0], quant.QuantLinear) and qm[0].act_scale > 0
    assert qm[0].observer is None and qm[2].observer is None  # frozen: forward now quantizes
    s, z = quant.scale_zero_point(x.min(), x.max(), 8, symmetric=False)  # min-max over both batches
    assert qm[0].act_scale == s and qm[0].act_zero == z

    def by_hand(layer, inp):
        inp = quant.fake_quant(inp, layer.act_scale, layer.act_zero, 8, symmetric=False)
        return F.linear(inp, quant.dequantize(layer.qweight, layer.scale), layer.bias)
    assert torch.equal(qm(x), by_hand(qm[2], torch.relu(by_hand(qm[0], x))))
    assert (qm(x) - model(x)).abs().max() < 0.05  # 8-bit weights and activations: small error
    assert quant.model_nbytes(qm) < quant.model_nbytes(model) / 2  # 1 byte + 4/8 byte of scale per weight
    q4 = quant.quantize_model(model, 4, "channel")
    assert q4[0].observer is None  # weights only: no activation calibration
    assert q4[0].nbytes() == 32 * 16 // 2 + 32 * 4 + 32 * 4
    qat = quant.prepare_qat(model, 4, "channel")
    assert type(model[0]) is nn.Linear  # the original is untouched
    out = qat(x)
    assert torch.allclose(out, q4(x), atol=1e-5)  # same fake-quantized weights
    out.sum().backward()
    assert qat[0].weight.grad is not None and qat[0].weight.grad.abs().sum() > 0


def test_quant_linear_observer_choice():
    layer = nn.Linear(8, 4)
    assert type(quant.QuantLinear(layer, act_bits=8).observer) is quant.MinMaxObserver
    obs = quant.QuantLinear(layer, act_bits=8, observer="percentile", percentile=99.0).observer
    assert type(obs) is quant.PercentileObserver and obs.percentile == 99.0
    with pytest.raises(ValueError, match="observer must be one of"):
        quant.quantize_model(nn.Sequential(layer), act_bits=8, calib_batches=[], observer="mse")
