"""2:4 mask-and-compress kernel vs its torch reference (interpreter), ties and bad input."""

import pytest
import torch

from dlo.kernels.sparse24 import decompress24, sparse24, sparse24_ref

SHAPES = [(1, 4), (7, 12), (13, 36), (33, 20)]  # the last two span several 64-group programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, device):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).to(device, dtype)
    values, idx, mask = sparse24(w)
    v_ref, i_ref, m_ref = sparse24_ref(w)
    # Pure selection, no arithmetic: everything is exact in every dtype.
    assert torch.equal(mask, m_ref) and torch.equal(idx, i_ref) and torch.equal(values, v_ref)
    assert (mask.reshape(-1, 4).sum(1) == 2).all()
    assert torch.equal(decompress24(values, idx), w * mask)
    # The kept magnitudes dominate the dropped ones in every group.
    g = w.float().abs().reshape(-1, 4)
    m = mask.reshape(-1, 4)
    assert (g.masked_fill(~m, float("inf")).amin(1) >= g.masked_fill(m, -1.0).amax(1)).all()


def test_ties_keep_lower_index(device):
    w = torch.tensor([[1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 3.0, -3.0, 1.0]], device=device)
    values, idx, mask = sparse24(w)
    assert idx.tolist() == [[0, 1, 0, 1, 1, 2]]
    assert values.tolist() == [[1.0, -1.0, 0.0, 0.0, 3.0, -3.0]]


@pytest.mark.parametrize("fn", [sparse24, sparse24_ref])
def test_bad_input(fn, device):
    with pytest.raises(ValueError, match="multiple of 4"):
        fn(torch.randn(3, 10, device=device))
    with pytest.raises(ValueError, match="nan"):
        fn(torch.tensor([[1.0, float("nan"), 0.0, 2.0]], device=device))
