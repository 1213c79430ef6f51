"""dlo.activation_memory: Korthikanti et al.'s per-layer accounting, and the same accounting applied to
our Block checked byte for byte against the saved-tensor meter (CPU: masks of the activation's dtype)."""

import pytest
import torch

from dlo.activation_ckpt import checkpoint
from dlo.activation_memory import (
    TERMS,
    dropout_mask_bytes,
    korthikanti_layer_bytes,
    layer_terms,
    layernorm_stat_bytes,
    small_terms,
)
from dlo.measure import saved_bytes
from dlo.models.transformer import Block


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (64, 8, 64, 4), (7, 3, 10, 5)])
def test_the_terms_sum_to_the_papers_closed_form(s, b, h, a):
    assert sum(layer_terms(s, b, h, a).values()) == korthikanti_layer_bytes(s, b, h, a)
    assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)  # eq. 1
    assert sum(layer_terms(s, b, h, a, selective=True).values()) == korthikanti_layer_bytes(s, b, h, a, selective=True)
    assert korthikanti_layer_bytes(s, b, h, a, selective=True) == 34 * s * b * h


def test_the_papers_parts():  # attention 11 sbh + 5 as^2b, MLP 19 sbh, the two LayerNorms 4 sbh (16-bit)
    t = layer_terms(1, 1, 1, 1)  # s = b = h = a = 1: each term's coefficient in bytes
    parts = {"LayerNorm": 0, "MLP": 0, "attention": 0}
    for term in TERMS:
        parts["LayerNorm" if term.name.startswith("LayerNorm") else "MLP" if "MLP" in term.name or "GELU" in term.name
              else "attention"] += t[term.name]
    assert parts == {"LayerNorm": 4, "MLP": 19, "attention": 11 + 5}
    assert sum(layer_terms(3, 2, 8, 2, act_bytes=4, mask_bytes=2).values()) == 2 * korthikanti_layer_bytes(3, 2, 8, 2)


def _counted(block, x, selective=False) -> int:
    return saved_bytes(lambda: block(x, checkpoint if selective else None), exclude=list(block.parameters()),
                       backward=False)["saved_bytes"]


@pytest.mark.parametrize("dtype,dropout,selective,s,b", [
    (torch.float32, 0.1, False, 16, 3), (torch.float32, 0.1, False, 8, 5), (torch.float32, 0.0, False, 16, 2),
    (torch.float32, 0.1, True, 16, 3), (torch.bfloat16, 0.1, False, 8, 2)])
def test_our_block_saves_what_the_accounting_says(dtype, dropout, selective, s, b):
    h, a = 16, 2
    torch.manual_seed(0)
    block = Block(h, a, dropout).to(dtype)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    e = torch.empty((), dtype=dtype).element_size()
    model = layer_terms(s, b, h, a, act_bytes=e, mask_bytes=dropout_mask_bytes("cpu", dtype), dropout=dropout > 0,
                        output_dropout=False, selective=selective)
    small = small_terms(s, b, stat_bytes=layernorm_stat_bytes("cpu", dtype), causal_mask=not selective)
    assert _counted(block, x, selective) == sum(model.values()) + sum(small.values())


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match=">= 1"):
        layer_terms(0, 1, 1, 1)
    with pytest.raises(ValueError, match=">= 1"):
        korthikanti_layer_bytes(4, 1, 8, 2.5)
