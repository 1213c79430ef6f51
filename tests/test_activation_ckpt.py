"""dlo.activation_ckpt: same gradients as no checkpointing (dropout included), less saved memory, offload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlo import activation_ckpt as ac
from dlo.experiments import day3
from dlo.measure import SavedTensorMeter
from dlo.models.transformer import TransformerStack


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small gain nothing from a second intra-op thread; on a shared 2-core machine it
    only spin-waits and makes every test several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    return TransformerStack(vocab_size=37, d_model=24, n_heads=3, n_layers=5, max_len=13, dropout=0.2)


def _grads(model, idx, tgt, **policy):
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(idx, **policy).flatten(0, 1), tgt.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()], torch.rand(3)  # rand: the RNG stream after backward


POLICIES = [dict(checkpoint_blocks=ac.every_kth(5, 1)), dict(checkpoint_blocks=ac.every_kth(5, 2)),
            dict(checkpoint_attention=True), dict(checkpoint_segments=2)]


@pytest.mark.parametrize("policy", POLICIES, ids=["k1", "k2", "selective", "segments2"])
def test_gradients_identical_to_no_checkpointing(policy):
    model = _model()
    gen = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 37, (3, 13), generator=gen), torch.randint(0, 37, (3, 13), generator=gen)
    want, rng_want = _grads(model, idx, tgt)
    got, rng_got = _grads(model, idx, tgt, **policy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # same ops, same dropout masks: bit-identical
    assert torch.equal(rng_got, rng_want)  # fork_rng: the caller's RNG stream is untouched


def test_without_rng_preservation_dropout_differs():
    model = _model()
    idx = torch.randint(0, 37, (3, 13))
    want, _ = _grads(model, idx, idx)
    no_rng = lambda fn, *a: ac.checkpoint(fn, *a, preserve_rng_state=False)  # noqa: E731
    got, _ = _grads(model, idx, idx, checkpoint_blocks=[0, 1], checkpoint_fn=no_rng)
    assert not all(torch.equal(a, b) for a, b in zip(got, want))


def test_saved_bytes_fall_with_more_checkpointing():
    model = _model()
    idx = torch.randint(0, 37, (3, 13))
    policies = {k: dict(checkpoint_blocks=ac.every_kth(5, k)) for k in (0, 1, 2)} | {"offload": dict(offload=True)}
    rows = {r["policy"]: r for r in day3.policy_rows(model, idx, idx, policies, reps=1, device="cpu")}
    saved = {k: rows[k]["saved_bytes"] for k in (0, 1, 2)}
    assert saved[1] < saved[2] < saved[0]
    assert saved[1] < 0.2 * saved[0]  # full checkpointing keeps only block inputs
    # the peak also counts what recomputation saves again in backward
    assert rows[1]["peak_saved_bytes"] > rows[1]["saved_bytes"] and rows[0]["peak_saved_bytes"] == saved[0]
    assert rows["offload"]["saved_bytes"] == saved[0] and rows[0]["saved_vs_none"] == 1.0
    assert all(r["time_s"] > 0 and r["peak_kind"] == "saved-tensor peak" for r in rows.values())


def test_meter_counts_exact_bytes_and_frees_after_backward():
    w = nn.Parameter(torch.randn(5, 7, dtype=torch.float64))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        h = x @ w  # saves x (w excluded)
        y = h.exp()  # saves exp's output (3, 7)
        assert meter.bytes == (3 * 5 + 3 * 7) * 8
        y.sum().backward()
    del h, y
    assert meter.bytes == 0 and meter.peak == (3 * 5 + 3 * 7) * 8


def test_meter_counts_meta_tensors_from_their_shapes():
    # the meta device has no memory (every data pointer is 0): storages are told apart by identity
    with torch.device("meta"):
        w = nn.Parameter(torch.randn(5, 7))
        x = torch.randn(3, 5, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        y = (x @ w).exp()
        assert meter.bytes == (3 * 5 + 3 * 7) * 4 and len(meter.sizes) == 2
    del y


def test_cpu_offload_same_gradients_and_copies():
    model = _model()
    idx = torch.randint(0, 37, (3, 13))
    want, _ = _grads(model, idx, idx)
    with ac.cpu_offload():
        got, _ = _grads(model, idx, idx)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    t = torch.randn(4, 3)
    device, host = ac.offload_pack(t)
    assert host.data_ptr() != t.data_ptr() and torch.equal(ac.offload_unpack((device, host)), t)


def test_bad_input():
    with pytest.raises(ValueError, match="no input requires grad"):
        ac.checkpoint(nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="k must be >= 0"):
        ac.every_kth(4, -1)
    assert ac.every_kth(7, 3) == [0, 3, 6] and ac.every_kth(7, 0) == []


def test_tuple_outputs_and_non_tensor_args():
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True)
    fn = lambda x, y, scale: (x * y * scale, (x + y).sin())  # noqa: E731
    u, v = ac.checkpoint(fn, a, b, 2.5)
    (u.sum() + v.pow(2).sum()).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    u, v = fn(a, b, 2.5)
    (u.sum() + v.pow(2).sum()).backward()
    assert torch.allclose(ga, a.grad, rtol=0, atol=0) and torch.allclose(gb, b.grad, rtol=0, atol=0)
