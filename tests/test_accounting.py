"""dlo.accounting: the N of 6N on modules whose count is known by hand, and bytes per parameter."""

import pytest
import torch
from torch import nn

from dlo.accounting import (
    OPTIMIZER_STATES,
    PRECISIONS,
    matmul_params,
    model_state_bytes,
    optimizer_bytes,
    precision_of,
    training_bytes_per_param,
)


class _LM(nn.Module):
    def __init__(self, vocab=11, d=4, tied=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(7, d)
        self.proj, self.norm = nn.Linear(d, 3 * d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight


def test_matmul_params_counts_weights_and_a_tied_head_once():
    d, vocab = 4, 11
    untied, tied = _LM(vocab, d), _LM(vocab, d, tied=True)
    assert matmul_params(untied) == 3 * d * d + vocab * d  # proj + head; looked-up tables and vectors left out
    assert matmul_params(tied) == 3 * d * d + vocab * d  # the tied table counts once, as the head


BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("dtypes, optimizer, want", [((F32, None), "adamw", 16), ((BF16, F32), "adamw", 16),
                                                     ((BF16, None), "adamw", 8), ((F32, None), "sgd", 8),
                                                     ((BF16, F32), "sgd_momentum", 12), ((BF16, F32), "lamb", 16),
                                                     ((torch.float64, None), "adamw", 32),
                                                     ((torch.float16, F32), "adamw", 16)])
def test_training_bytes_per_param_from_the_dtypes(dtypes, optimizer, want):
    assert training_bytes_per_param(dtypes[0], optimizer, master_dtype=dtypes[1]) == want


def test_the_precisions_table_is_three_pairs_of_dtypes():
    from dlo.accounting import copy_widths

    assert PRECISIONS == {"fp32": copy_widths(F32), "mixed": copy_widths(BF16, F32), "bf16": copy_widths(BF16)}


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="param_dtype must be a floating torch.dtype"):
        training_bytes_per_param("fp8", "adamw")
    with pytest.raises(ValueError, match="master_dtype"):
        training_bytes_per_param(BF16, "adamw", master_dtype=torch.int8)
    with pytest.raises(ValueError, match="optimizer"):
        training_bytes_per_param(F32, "lion")
    with pytest.raises(ValueError, match="optimizer 'adam'; choose from sgd, sgd_momentum, adamw, lamb"):
        optimizer_bytes("adam", 4)  # one vocabulary: AdamW's name for Adam's two moments
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(10, "adamw", stage=4)


def test_one_accountant_for_plans_zero_and_the_exercise():
    """`optimizer_bytes` (dlo plan's rows) and `training_bytes_per_param` are `model_state_bytes` at one
    rank; ZeRO's stages partition it, a shard being ceil(n / world) elements."""
    for opt in OPTIMIZER_STATES:
        whole = model_state_bytes(10, opt)  # fp32
        assert whole["optimizer"] == optimizer_bytes(opt, whole["params"])
        assert whole["total"] == 10 * training_bytes_per_param(F32, opt)
    zero3 = model_state_bytes(10, "adamw", precision_of(torch.bfloat16), world_size=4, stage=3)
    assert zero3 == {"params": 2 * 3, "grads": 2 * 3, "optimizer": 12 * 3, "total": 16 * 3}
    assert precision_of(torch.float64) == (8, 8, 0, 8) and precision_of(torch.float16) == PRECISIONS["mixed"]
