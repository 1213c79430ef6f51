"""Paged-attention decode kernel against its torch reference, in the interpreter on CPU, and the reference
against plain attention over the same keys stored contiguously.

Lengths 1, 17 and 50 against the interpreter's 16-token tiles (one token; a tile and a padded one; several
tiles), pages of 1, 3, 5 and 16 tokens (a tile cut mid-page, a page per token), blocks scattered over the
pool in random order, GQA groups of 1, 3 and 4. Small on purpose: the interpreter runs numpy per block op.
"""

import math

import pytest
import torch

from dlo.errors import BadInput
from dlo.kernels.paged_attention import check_block_tables, paged_attention, paged_attention_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def paged_case(lens, page, H=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", seed=0, spare=3):
    """q (B, H, D), a pool of blocks holding each sequence's keys in scattered blocks, and the same keys
    contiguous (B, Hkv, max_len, D) for the independent check."""
    gen = torch.Generator().manual_seed(seed)
    n = [math.ceil(x / page) for x in lens]
    num_blocks = sum(n) + spare  # free blocks in the pool too: the kernel must not read them
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(n), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks, page, Hkv, D, generator=gen)
    used = 0
    for b, nb in enumerate(n):
        tables[b, :nb] = order[used:used + nb].int()
        tables[b, nb:] = -7  # past a sequence's blocks: never read
        used += nb
    q = torch.randn(len(lens), H, D, generator=gen)
    cast = dict(device=device, dtype=dtype)
    return (q.to(**cast), k_cache.to(**cast), v_cache.to(**cast), tables.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def output_tolerance(dtype, v):
    """|O - O_ref| bound, as for FlashAttention (tests/kernels/test_flash_attention.py): P rounded to the
    input dtype before P V and O rounded once, each within eps / 2 relative, so eps max |v|; 1e-5 for
    fp32 sums over <= 50 keys in another order."""
    return torch.finfo(dtype).eps * v.float().abs().max().item() + 1e-5 if dtype != torch.float32 else 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 3, 16])
def test_matches_reference(page, dtype, device):
    q, k_cache, v_cache, tables, lens = paged_case([1, 17, 50], page, dtype=dtype, device=device, seed=page)
    o = paged_attention(q, k_cache, v_cache, tables, lens)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens)
    assert o.dtype == dtype and o.shape == q.shape and ref.dtype == torch.float32
    assert (o.float() - ref).abs().max().item() <= output_tolerance(dtype, v_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partitions", [2, 4])
def test_split_partitions_merge_to_the_reference(partitions, dtype, device):
    """Flash-decoding's split: lengths 1 (every partition but the first empty), 17 and 50 over 16-token
    tiles in 2 or 4 partitions; the merge is fp32 (partials unrounded), O rounded once: the same bound."""
    q, k_cache, v_cache, tables, lens = paged_case([1, 17, 50], 5, dtype=dtype, device=device, seed=7)
    o = paged_attention(q, k_cache, v_cache, tables, lens, partitions=partitions)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens)
    assert o.dtype == dtype and (o.float() - ref).abs().max().item() <= output_tolerance(dtype, v_cache)


@pytest.mark.parametrize("H,Hkv,D", [(3, 3, 32), (6, 2, 64), (8, 2, 128), (20, 1, 16)])  # 20 on 1: 32 rows
def test_gqa_groups_and_head_dims(H, Hkv, D, device):
    q, k_cache, v_cache, tables, lens = paged_case([5, 33], 5, H=H, Hkv=Hkv, D=D, dtype=torch.float16, device=device)
    o = paged_attention(q, k_cache, v_cache, tables, lens)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens)
    assert (o.float() - ref).abs().max().item() <= output_tolerance(torch.float16, v_cache)


def test_reference_equals_attention_over_contiguous_keys():
    """The reference against SDPA on the same keys laid out contiguously, sequence by sequence (fp64)."""
    lens, page = [7, 1, 12], 4
    q, k_cache, v_cache, tables, seq_lens = paged_case(lens, page, H=6, Hkv=2, dtype=torch.float64)
    o = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens)
    for b, n in enumerate(lens):
        k = k_cache[tables[b, :math.ceil(n / page)].long()].flatten(0, 1)[:n].transpose(0, 1)  # (Hkv, n, D)
        v = v_cache[tables[b, :math.ceil(n / page)].long()].flatten(0, 1)[:n].transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[b, :, None], k, v, enable_gqa=True)[:, 0]
        torch.testing.assert_close(o[b], want, rtol=0, atol=1e-12)


def test_free_blocks_and_stale_table_entries_are_never_read(device):
    q, k_cache, v_cache, tables, lens = paged_case([9, 4], 4, device=device)
    o = paged_attention(q, k_cache, v_cache, tables, lens)
    used = {int(b) for row, n in zip(tables, lens) for b in row[:math.ceil(int(n) / 4)]}
    k2, v2 = k_cache.clone(), v_cache.clone()
    for b in set(range(k_cache.shape[0])) - used:
        k2[b], v2[b] = float("nan"), float("nan")
    k2[int(tables[0, 2]), 1:], v2[int(tables[0, 2]), 1:] = float("nan"), float("nan")  # past token 8 of seq 0
    assert torch.equal(paged_attention(q, k2, v2, tables, lens), o)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens)  # the reference gathers them, then masks
    assert torch.equal(paged_attention_ref(q, k2, v2, tables, lens), ref)


def test_large_scores_do_not_overflow(device):
    q, k_cache, v_cache, tables, lens = paged_case([40], 16, device=device, seed=3)
    o = paged_attention(100 * q, 100 * k_cache, v_cache, tables, lens)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, paged_attention_ref(100 * q, 100 * k_cache, v_cache, tables, lens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref])
def test_bad_input(fn, device):
    q, k_cache, v_cache, tables, lens = paged_case([5, 3], 4, device=device)
    for args, message in [((q[0], k_cache, v_cache, tables, lens), r"q must be \(B, H, D\)"),
                          ((q, k_cache, v_cache[:2], tables, lens), "of one shape"),
                          ((q[:, :3], k_cache, v_cache, tables, lens), "H=3 query heads is not a multiple of Hkv=2"),
                          ((q, k_cache, v_cache, tables[:1], lens), r"block_tables must be \(B=2, max_blocks\)"),
                          ((q, k_cache, v_cache, tables.long(), lens), "must be int32"),
                          ((q.half(), k_cache, v_cache, tables, lens), "share one dtype"),
                          ((q, k_cache, v_cache, tables, lens - 3), r"seq_lens must lie in \[1, 8\]"),
                          ((q, k_cache, v_cache, tables + 100, lens), "outside the pool's"),
                          ((q, k_cache, v_cache, tables, None), "must be tensors")]:
        with pytest.raises(BadInput, match=message) as info:
            fn(*args)
        assert "\n" not in str(info.value)


def test_kernel_refuses_what_it_cannot_run():
    q, k_cache, v_cache, tables, lens = paged_case([5], 4, D=24)
    with pytest.raises(BadInput, match="head_dim D=24 is not one of"):
        paged_attention(q, k_cache, v_cache, tables, lens)
    q, k_cache, v_cache, tables, lens = paged_case([5], 4)
    with pytest.raises(BadInput, match="cannot run on meta"):
        paged_attention(*(x.to("meta") for x in (q, k_cache, v_cache, tables, lens)), validate=False)
    with pytest.raises(BadInput, match="float64"):
        paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens)
    with pytest.raises(BadInput, match=r"partitions must be an int in \[1, 65535\], got 0"):
        paged_attention(q, k_cache, v_cache, tables, lens, partitions=0)


def test_check_block_tables_ignores_entries_past_each_sequence():
    tables = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32)
    check_block_tables(tables, torch.tensor([3, 5], dtype=torch.int32), num_blocks=3, block_size=4)
