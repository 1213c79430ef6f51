"""FlashAttention-2 forward kernel against its fp32 torch reference, in the interpreter on CPU.

Sequence lengths 1, 17 and 67 against the interpreter's 32-query, 16-key blocks: one lone query, a
padded block, several blocks with the causal diagonal cutting through them. Small on purpose: the
interpreter runs every block op in numpy (the whole file takes a few CPU seconds). Also the block-wise
torch reference (`flash_attention_blocked_ref`) against the written-out one.
"""

import pytest
import torch

from dlo.errors import BadInput
from dlo.kernels.flash_attention import flash_attention, flash_attention_blocked_ref, flash_attention_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_qkv(T, dtype, device, D=16, B=1, H=2, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + T)
    return [torch.randn(B, H, T, D, generator=gen).to(device, dtype) for _ in range(3)]


def output_tolerance(dtype, v):
    """|O - O_ref| bound. The kernel rounds P to the input dtype before P V (as FlashAttention-2
    does) and rounds O once at the end: each a relative error of at most eps / 2 (bf16: eps = 2^-7,
    fp16: 2^-10), so |O - O_ref| <= eps / 2 (max |v| + |O|) <= eps max |v|. The fp32 arithmetic
    (exp, sums over <= 67 keys in another order than torch's) adds ~1e-6; 1e-5 covers it."""
    return torch.finfo(dtype).eps * v.float().abs().max().item() + 1e-5 if dtype != torch.float32 else 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 17, 67])
def test_matches_reference(T, dtype, causal, device):
    q, k, v = make_qkv(T, dtype, device)
    o, lse = flash_attention(q, k, v, causal)
    o_ref, lse_ref = flash_attention_ref(q, k, v, causal)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert (o.float() - o_ref).abs().max().item() <= output_tolerance(dtype, v)
    # L comes from the fp32 scores (products of the same 16-bit values, summed in fp32) in every dtype:
    # only fp32 rounding separates it from the reference.
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_other_head_dims(D, device):
    q, k, v = make_qkv(17, torch.float16, device, D=D, B=2, H=1, seed=1)
    o, lse = flash_attention(q, k, v, causal=True)
    o_ref, lse_ref = flash_attention_ref(q, k, v, causal=True)
    assert (o.float() - o_ref).abs().max().item() <= output_tolerance(torch.float16, v)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-5)


def test_causal_rows_never_see_later_keys(device):
    """Changing the last key and value moves only the last output row under the causal mask."""
    q, k, v = make_qkv(17, torch.float32, device, seed=2)
    o, lse = flash_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., -1, :] += 3.0
    v2[..., -1, :] -= 5.0
    o2, lse2 = flash_attention(q, k2, v2, causal=True)
    assert torch.equal(o[..., :-1, :], o2[..., :-1, :]) and torch.equal(lse[..., :-1], lse2[..., :-1])
    assert not torch.equal(o[..., -1, :], o2[..., -1, :])


def test_large_scores_do_not_overflow(device):
    """Scores of ~1e4 would overflow exp() without the running maximum; the online softmax subtracts it."""
    q, k, v = make_qkv(40, torch.float32, device, seed=3)
    o, lse = flash_attention(100 * q, 100 * k, v)
    o_ref, lse_ref = flash_attention_ref(100 * q, 100 * k, v)
    assert torch.isfinite(o).all() and lse.abs().max() > 1e3
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=0)


def test_non_contiguous_and_empty_inputs(device):
    q, k, v = (x.transpose(1, 2) for x in make_qkv(17, torch.float32, device, B=1, H=3))  # (B, T, H, D) -> views
    q, k, v = (x.transpose(1, 2) for x in (q.contiguous(), k.contiguous(), v.contiguous()))  # (B, H, T, D) strided
    assert not q.is_contiguous()
    torch.testing.assert_close(flash_attention(q, k, v)[0], flash_attention_ref(q, k, v)[0], rtol=0, atol=1e-5)
    empty = torch.zeros(1, 2, 0, 16, device=device)
    o, lse = flash_attention(empty, empty, empty)
    assert o.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("fn", [flash_attention, flash_attention_ref])
def test_bad_input(fn, device):
    q = torch.zeros(1, 2, 5, 16, device=device)
    for args, message in [((q[0], q[0], q[0]), "must be \\(B, H, T, D\\) of one shape"),
                          ((q, q[:, :, :4], q), "of one shape"),
                          ((torch.zeros(1, 2, 5, 24, device=device),) * 3, "head_dim D=24 is not one of"),
                          ((q.double(), q.double(), q.double()), "share one dtype"),
                          ((q, q.half(), q), "share one dtype"),
                          ((q, q.to("meta"), q), "on one device"),
                          ((q, q, None), "must be tensors")]:
        with pytest.raises(BadInput, match=message) as info:
            fn(*args)
        assert "\n" not in str(info.value)


def test_kernel_refuses_a_device_it_cannot_run_on():
    q = torch.zeros(1, 1, 4, 16, device="meta")
    with pytest.raises(BadInput, match="cannot run on meta"):
        flash_attention(q, q, q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,block_k", [(1, 16), (17, 16), (67, 5), (67, 100)])
def test_blocked_reference_matches_the_written_out_one(T, block_k, causal):
    """The kernel's loop in torch (block by block, running max and sum) gives the scores-written-out
    reference's O and L: fp32 sums over <= 67 keys in two orders, ~1e-6 apart."""
    q, k, v = make_qkv(T, torch.bfloat16, "cpu", seed=3)
    for got, want in zip(flash_attention_blocked_ref(q, k, v, causal, block_k), flash_attention_ref(q, k, v, causal)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_blocked_reference_refuses_a_bad_block():
    q, k, v = make_qkv(3, torch.float32, "cpu")
    with pytest.raises(BadInput, match="block_k must be a positive int, got 0"):
        flash_attention_blocked_ref(q, k, v, block_k=0)
