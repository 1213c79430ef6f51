"""dlo.smoothquant: calibration, the factors, folding (float model unchanged), W8A8 on the int8 GEMM
(the Triton kernel under the interpreter here) and the error it removes on injected outliers."""

import pytest
import torch
from torch import nn

from dlo import claims as C
from dlo import smoothquant as sq
from dlo.experiments import day8_smooth as S
from dlo.experiments.day5_data import build
from dlo.kernels import int8_gemm
from dlo.models.llama import LlamaConfig


def tiny_llama(seed=0):
    return build(LlamaConfig.from_name("tiny"), "cpu", seed).eval()


def tokens(seed, n=2, B=2, T=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (B, T), generator=g) for _ in range(n)]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_act_absmax_is_the_per_channel_max_over_all_tokens_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    batches = [torch.randn(4, 6, 5) for _ in range(3)]
    stats = sq.act_absmax(model, batches, ["0", "2"])
    x = torch.cat([b.reshape(-1, 5) for b in batches])
    assert torch.equal(stats["0"], x.abs().amax(0))
    with torch.no_grad():
        assert torch.allclose(stats["2"], torch.relu(model[0](x)).abs().amax(0))
    with pytest.raises(ValueError, match="nn.Linear"):
        sq.act_absmax(model, batches, ["1"])
    with pytest.raises(ValueError, match="no batch"):
        sq.act_absmax(model, [], ["0"])


def test_smoothing_factors_follow_eq4_and_balance_the_ranges_at_alpha_half():
    g = torch.Generator().manual_seed(1)
    a, w = torch.rand(11, generator=g) * 50 + 0.1, torch.rand(11, generator=g) + 0.01
    for alpha in (0.0, 0.3, 0.5, 0.8, 1.0):
        s = sq.smoothing_factors(a, w, alpha)
        assert torch.allclose(s, a ** alpha / w ** (1 - alpha), rtol=1e-5)
    s = sq.smoothing_factors(a, w, 0.5)
    assert torch.allclose(a / s, w * s, rtol=1e-5)  # the same max on both sides: sqrt(max|X| max|W|)
    z = sq.smoothing_factors(torch.tensor([0.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 4.0]), 0.5)
    assert z[:2].tolist() == [1.0, 1.0] and z[2].item() == pytest.approx(3 ** 0.5 / 2)
    with pytest.raises(ValueError, match="alpha"):
        sq.smoothing_factors(a, w, 1.5)
    with pytest.raises(ValueError, match="same 1-D shape"):
        sq.smoothing_factors(a, w[:5], 0.5)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8])
def test_smoothing_and_injection_leave_the_float_model_unchanged(alpha):
    model, x = tiny_llama(), tokens(0)
    injected = tiny_llama()
    sq.inject_outliers_(injected, [1, 5], 80.0)
    smoothed = sq.smooth_llama(injected, x, alpha)
    with torch.no_grad():
        ref = model(x[0])
        assert rel(injected(x[0]), ref) < 1e-5 and rel(smoothed(x[0]), ref) < 1e-5
    stats = sq.act_absmax(injected, x, ["layers.0.attention.wq"])["layers.0.attention.wq"]
    assert sq.outlier_stats(stats)["> 6x median"] == 2  # the two injected channels, nothing else


@pytest.mark.parametrize("act", ["tensor", "token"])
def test_w8a8_linear_runs_the_int8_gemm_and_matches_its_reference(monkeypatch, device, act):
    torch.manual_seed(0)
    lin = nn.Linear(24, 20).to(device)
    x = torch.randn(3, 5, 24, device=device)
    layer = sq.W8A8Linear(lin, x.abs().reshape(-1, 24).amax(0), act, kernel=True)
    calls = []
    real = int8_gemm.int8_gemm
    monkeypatch.setattr(int8_gemm, "int8_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = layer(x)
        layer.kernel = False
        y_ref = layer(x)
        assert rel(y, lin(x)) < 0.02
    assert calls and y.shape == (3, 5, 20)
    assert torch.allclose(y, y_ref, atol=1e-5)


def test_smoothing_removes_the_w8a8_error_of_injected_outliers():
    model, calib = tiny_llama(), tokens(0)
    injected = tiny_llama()
    sq.inject_outliers_(injected, [3, 17, 40], 60.0)
    x = tokens(1, n=1)[0]
    with torch.no_grad():
        ref = model(x)
        clean = rel(sq.quantize_llama(model, calib)(x), ref)
        naive = rel(sq.quantize_llama(injected, calib)(x), ref)
        smooth = rel(sq.quantize_llama(sq.smooth_llama(injected, calib, 0.5), calib)(x), ref)
    assert naive > 3 * smooth and naive > 3 * clean


def test_quantize_llama_modes_and_bad_input():
    model, calib = tiny_llama(), tokens(0, n=1)
    w16 = sq.quantize_llama(model, calib, "w8a16")
    assert all(type(m) is not nn.Linear for n, m in w16.named_modules() if n.startswith("layers."))
    assert type(w16.output) is nn.Linear  # the tied head stays in float
    with pytest.raises(ValueError, match="mode"):
        sq.quantize_llama(model, calib, "w4a4")
    with pytest.raises(ValueError, match="act"):
        sq.W8A8Linear(nn.Linear(4, 4), torch.ones(4), act="channel")


def test_experiment_tables_and_claims_on_a_cut_down_run(monkeypatch):
    monkeypatch.setitem(S.LM, "batch", 2)
    monkeypatch.setitem(S.LM, "seq_len", 8)
    for k, v in (("steps", 2), ("train", 2), ("calib", 1), ("eval", 3)):
        monkeypatch.setitem(S.LM, k, v)
    res = S.run(0, "cpu")
    assert all(r["> 6x median"] == len(S.OUTLIER_CHANNELS) for r in res["outliers injected"] if r["input of"] != "w2")
    rows = S.table(res, "injected outliers")
    assert [r["variant"] for r in rows][:3] == ["fp32", "W8A16 (weight-only)", "W8A8 per-tensor"]
    assert rows[0]["rel. logit error"] < 1e-5
    claims = S.claims(res)
    assert len(claims) == 8 and all(c.measured is not None for c in claims if "released LLM" not in c.claim)
    # the injected case demonstrates the mechanism: shown with its numbers, never counted as evidence
    injected = [c for c in claims if "injected" in c.claim]
    assert len(injected) == 4 and all(c.verdict == C.BY_CONSTRUCTION and c.measured is not None for c in injected)
    assert not any("injected" in c.claim for c in C.evidence(claims))
    assert res["outlier features"]["features"] == []  # LLM.int8()'s criterion: nothing in a 64-wide model


def test_outlier_features_are_llm_int8s_criterion():
    """|x| >= 6 in >= 6% of the tokens of >= 25% of the inputs of wq and w1 (Dettmers et al. 2022, Sec. 4.1):
    the injected channels (60x: every token above 6) are flagged and nothing else; a random model has none."""
    model, x = tiny_llama(), tokens(2, n=2, B=4, T=16)
    assert S.outlier_features(model, x) == {"features": [], "inputs": 4, "tokens": 128}
    sq.inject_outliers_(model, [3, 40], 60.0)
    assert S.outlier_features(model, x)["features"] == [3, 40]
    sq.inject_outliers_(model, [9], 6.0 / 60.0 / 10)  # a channel shrunk: never flagged
    assert S.outlier_features(model, x)["features"] == [3, 40]


def test_the_real_outlier_row_needs_the_weights():
    row = S.real_outlier_claim(None)
    assert row.verdict == C.NOT_MEASURABLE and "weights_dir" in row.why
    row = S.real_outlier_claim({"features": [7, 1415], "inputs": 56, "tokens": 2048, "model": "28 layers"})
    assert row.verdict == C.AGREES and row.measured.value == 2
    assert S.real_outlier_claim({"features": [], "inputs": 56, "tokens": 2048, "model": "m"}).verdict == C.DISAGREES


def test_real_outliers_read_a_released_checkpoint_and_its_tokens(tmp_path, monkeypatch):
    """A Hugging Face folder (a tiny Llama with one 60x channel, standing in for Llama 3.2 3B) and data_dir's
    tokens.npy: the feature is found through the same loading and criterion as at the full profile, and
    Day 8's preflight refuses, in one line before any work, a weights_dir without the tokens it needs."""
    from dlo.config import resolve
    from dlo.data.layout import DataError
    from tests.data.folders import write_cifar_release, write_tokens
    from tests.models.test_llama import tiny_model, write_hf_checkpoint

    monkeypatch.setitem(S.REAL, "batches", 1)
    monkeypatch.setitem(S.REAL, "seq_len", 32)
    model = tiny_model(seed=0)
    sq.inject_outliers_(model, [5], 60.0)
    weights, data = tmp_path / "weights", tmp_path / "data"
    write_hf_checkpoint(model, weights, shards=1)
    write_cifar_release(data)
    with pytest.raises(DataError, match="no tokens.npy"):
        resolve("day8_quantization_pruning", profile="tiny", data_dir=str(data), weights_dir=str(weights))
    with pytest.raises(ValueError, match="needs data_dir holding tokens.npy"):
        resolve("day8_quantization_pruning", profile="tiny", weights_dir=str(weights))
    write_tokens(data, n=4096, vocab=model.config.vocab_size)
    run = resolve("day8_quantization_pruning", profile="tiny", device="cpu", data_dir=str(data),
                  weights_dir=str(weights))
    assert S.real_outliers(resolve("day8_quantization_pruning", profile="tiny", device="cpu")) is None
    found = S.real_outliers(run)
    assert found["features"] == [5] and found["inputs"] == 2 * model.config.n_layers and found["tokens"] == 4 * 32
