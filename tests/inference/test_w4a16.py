"""W4A16 linears in the decode loop (dlo.inference.w4a16): Day 8's format and reference, Day 9's split-K kernel at
decode and Day 8's kernel at prefill (the interpreter on a CPU), a Llama's projections swapped and decoded."""

import pytest
import torch
from torch import nn

from dlo.experiments.day9 import make_model
from dlo.inference import w4a16
from dlo.inference.kv_cache import KVCache, forward_cached, generate
from dlo.inference.w4a16 import W4A16Linear, linear_bytes, quantize_linears
from dlo.quant import QuantLinear


def _linear(K=176, N=40, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=False)


def test_reference_is_day8s_quantized_linear():
    """The same codes and scales as Day 8's QuantLinear (symmetric int4, groups of 88 for 176 inputs), the same y
    up to bf16 rounding (Day 8's layer multiplies in bf16, the reference accumulates in fp32)."""
    linear = _linear()
    x = torch.randn(3, 5, 176).to(torch.bfloat16)
    ours = W4A16Linear(linear, impl="reference")
    day8 = QuantLinear(linear, bits=4, granularity="group", group_size=88)
    assert ours.scale.shape == (40, 2) and ours.packed.shape == (40, 88)
    y, y8 = ours(x), day8(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y8.float(), atol=2 * 2 ** -7 * y8.float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("tokens,kernel", [(1, "w4a16_decode"), (16, "w4a16_decode"), (17, "weight_only_matmul")])
def test_kernel_impl_dispatches_decode_and_prefill(monkeypatch, tokens, kernel, device):
    """At most 16 rows (a decode step) go to the split-K kernel, more (a prefill) to Day 8's kernel; both equal
    the reference."""
    linear = _linear().to(device)
    calls = []
    for name in ("w4a16_decode", "weight_only_matmul"):
        real = getattr(w4a16, name)
        monkeypatch.setattr(w4a16, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    x = torch.randn(1, tokens, 176, generator=torch.Generator().manual_seed(tokens)).to(device, torch.bfloat16)
    y = W4A16Linear(linear, impl="kernel")(x)
    y_ref = W4A16Linear(linear, impl="reference")(x)
    assert calls == [kernel]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2 * 2 ** -7 * y_ref.float().abs().max().item(), rtol=0)


def test_bad_input():
    with pytest.raises(ValueError, match="impl must be one of"):
        W4A16Linear(_linear(), impl="fast")
    with pytest.raises(ValueError, match="bias-free"):
        W4A16Linear(nn.Linear(64, 8))
    with pytest.raises(TypeError, match=r"bf16 or fp16 activations .*model.to\(torch.bfloat16\)"):
        W4A16Linear(_linear(), impl="reference")(torch.randn(2, 176))


def test_a_llama_decodes_with_w4a16_projections():
    """Every block's seven projections swapped (in a copy), embeddings and output kept; the cached decode of
    the W4A16 model gives the logits of the bf16 model whose weights are the dequantized codes."""
    model = make_model("tiny", 0, "cpu", "bfloat16")
    q = quantize_linears(model, impl="reference")
    swapped = [m for m in q.layers.modules() if isinstance(m, W4A16Linear)]
    assert len(swapped) == 7 * len(q.layers) and isinstance(q.output, nn.Linear)
    assert not any(isinstance(m, W4A16Linear) for m in model.modules())  # the original is untouched
    sizes = linear_bytes(q)
    assert sizes["dense"] == 0 and sizes["W4A16"] < linear_bytes(model)["dense"] / 3
    # the same model with each projection's weight replaced by its dequantized codes, as Day 8's reference has it
    dequantized = quantize_linears(model, impl="reference")
    for part in [m for m in dequantized.layers.modules() if any(isinstance(c, W4A16Linear) for c in m.children())]:
        for name, layer in list(part.named_children()):
            if isinstance(layer, W4A16Linear):
                lin = nn.Linear(layer.in_features, layer.out_features, bias=False).to(torch.bfloat16)
                probe = torch.eye(layer.in_features, dtype=torch.bfloat16)  # x = I gives W_hat^T
                lin.weight.data = layer(probe).T.contiguous()
                setattr(part, name, lin)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    logits = [forward_cached(m, prompt, KVCache.for_model(m, 2, 8)) for m in (q, dequantized)]
    torch.testing.assert_close(logits[0].float(), logits[1].float(), atol=0.05 * logits[1].float().abs().max().item(),
                               rtol=0)
    assert generate(q, prompt, 4).shape == (2, 10)
