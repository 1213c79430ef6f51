"""dlo.accounting: the N of 6N on modules whose count is known by hand, and bytes per parameter."""

import pytest
from torch import nn

from dlo.accounting import matmul_params, training_bytes_per_param


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


@pytest.mark.parametrize("precision, optimizer, want", [("fp32", "adam", 16), ("mixed", "adam", 16),
                                                        ("bf16", "adam", 8), ("fp32", "sgd", 8),
                                                        ("mixed", "momentum", 12)])
def test_training_bytes_per_param(precision, optimizer, want):
    assert training_bytes_per_param(precision, optimizer) == want


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="precision"):
        training_bytes_per_param("fp8", "adam")
    with pytest.raises(ValueError, match="optimizer"):
        training_bytes_per_param("fp32", "lion")
