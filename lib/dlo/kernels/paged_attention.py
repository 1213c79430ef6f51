"""Paged attention at decode (Kwon et al. 2023, vLLM, Sec. 4.1), in Triton: one query token per sequence,
its keys and values gathered through the sequence's block table.

The cache is a pool of fixed-size physical blocks, k_cache and v_cache of shape (num_blocks, PAGE, Hkv, D)
(FlashAttention's paged layout: a block's tokens contiguous, each token's heads side by side); sequence b
owns the blocks `block_tables[b, 0..]` in logical order, so its token t lies in physical block
block_tables[b, t // PAGE] at slot t % PAGE. One program serves one (sequence, KV head): the GROUP =
H / Hkv query heads that share that KV head (grouped-query attention, Ainslie et al. 2023) are the rows
of one tile, so each key and value is read from HBM once for the whole group. The program streams
BLOCK_N tokens at a time (several pages: each token's page looked up in the table) with the online
softmax of Day 2's FlashAttention (Milakov & Gimelshein 2018; Dao 2023, Algorithm 1):

    S = q K_j^T / sqrt(D)       m_new = max(m, rowmax S)       P = exp(S - m_new)
    l = exp(m - m_new) l + rowsum P        acc = exp(m - m_new) acc + P V_j        O = acc / l

At decode the work per byte read is tiny (2 H D flops per key of 2 Hkv D elements): the kernel is bound
by reading the cache, and its roofline is HBM bandwidth. The group's rows are padded to 16 (tl.dot's
smallest tile); the padding costs tensor-core work the memory bound hides. Few sequences leave SMs idle
(B x Hkv programs): the launcher then splits each sequence's tokens over P partitions (flash-decoding,
Dao et al. 2023; vLLM's paged attention v2), each program writing its unnormalised acc with its m and
l, merged after: O = sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m) l_p, m = max_p m_p.

Order: kernel, launcher, `paged_attention_ref` (torch, the blocks gathered into one tensor), compile
cases, benchmark.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlo.errors import BadInput
from dlo.kernels.aot import CompileCase
from dlo.kernels.runtime import kernel_available, round_to_bf16, time_ms

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128)  # tl.arange needs a power of two; tl.dot needs >= 16
MAX_PROGRAMS_Y = 65535  # a CUDA grid's third axis: the partitions
# GPU tiles: 64 tokens (4 pages of vLLM's default 16) per step, one stage; 4 warps in 16 bits, 8 in fp32.
# Compiled (not yet timed on a GPU): 2 stages spilled 8 B per thread (fp32 on sm_80, the group of 8 on
# sm_90), 3 stages 4 B, 8 warps 4 B in bf16 on sm_100, a 128-token tile 2-13 KB in fp32; fp32 on 4 warps
# spilled 412-472 B split (sm_90/100), 32 tokens on 4 warps 8-32 B. These spill nowhere (72-128 registers,
# 12-72 KB of shared memory). The interpreter takes 16 tokens, so odd lengths cross several tiles and end
# in a padded one, and pages of 3 or 5 tokens cut tiles mid-page.
GPU_BLOCKS = {torch.bfloat16: dict(BLOCK_N=64, num_warps=4, num_stages=1),
              torch.float16: dict(BLOCK_N=64, num_warps=4, num_stages=1),
              torch.float32: dict(BLOCK_N=64, num_warps=8, num_stages=1)}
CPU_BLOCKS = dict(BLOCK_N=16)


@triton.jit
def _paged_attention_decode_kernel(q_ptr, o_ptr,  # (B, H, D) contiguous, one dtype
                                   k_ptr, v_ptr,  # (num_blocks, PAGE, H_KV, D) contiguous
                                   tables_ptr, lens_ptr,  # (B, max_blocks) int32, (B,) int32
                                   acc_ptr, ml_ptr,  # SPLIT: (B, H, P, D) and (B, H, P, 2) fp32 partials
                                   max_blocks, part_len, scale,  # tokens per partition, 1 / sqrt(D)
                                   H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                   D: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                   UPCAST: tl.constexpr,  # the interpreter on bf16, as in flash_attention
                                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    lo = part * part_len
    hi = tl.minimum(lo + part_len, seq_len)  # a partition past the sequence's end does nothing
    g = tl.arange(0, GROUP_PAD)  # the group's query heads are kv_head * GROUP + g, g < GROUP
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    rows = seq.to(tl.int64) * H_KV * GROUP + kv_head * GROUP + g  # (GROUP_PAD,) rows of q and O
    q_rows = rows * D
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=g[:, None] < GROUP, other=0.0)  # (G, D)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * max_blocks
    for start in range(lo, hi, BLOCK_N):  # partition 0's first tile holds token 0: its m_i is finite
        tokens = start + offs_n
        valid = tokens < hi
        block = tl.load(table + tokens // PAGE, mask=valid, other=0)  # each token's physical block
        slot = block.to(tl.int64) * PAGE + tokens % PAGE  # its row in the (num_blocks * PAGE) pool
        kv = (slot * H_KV + kv_head)[:, None] * D + offs_d[None, :]  # (BLOCK_N, D)
        k = tl.load(k_ptr + kv, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv, mask=valid[:, None], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (GROUP_PAD, BLOCK_N) fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = alpha * l_i + tl.sum(p, axis=1)
        if UPCAST:  # the interpreter truncates fp32 -> bf16; a GPU rounds to nearest
            p = round_to_bf16(p)
        else:
            p = p.to(v.dtype)  # P in the cache's dtype for the tensor cores (as FlashAttention-2)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SPLIT:  # unnormalised, with the rows' max and sum: the launcher merges the partitions
        part_rows = rows * tl.num_programs(2) + part
        tl.store(acc_ptr + part_rows[:, None] * D + offs_d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(ml_ptr + part_rows * 2, m_i, mask=g < GROUP)
        tl.store(ml_ptr + part_rows * 2 + 1, l_i, mask=g < GROUP)
    else:
        o = acc / l_i[:, None]
        if UPCAST:
            o = round_to_bf16(o)
        tl.store(o_ptr + q_rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=g[:, None] < GROUP)


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
           dtypes=DTYPES) -> None:
    """One-line BadInput for anything that is not one decode step over a paged cache, before any work."""
    if not all(isinstance(x, Tensor) for x in (q, k_cache, v_cache, block_tables, seq_lens)):
        raise BadInput("q, k_cache, v_cache, block_tables and seq_lens must be tensors")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1]:
        raise BadInput(f"q must be (B, H, D) and k_cache, v_cache (num_blocks, block_size, Hkv, D) of one shape, "
                       f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, H, Hkv = q.shape[0], q.shape[1], k_cache.shape[2]
    if H % Hkv:
        raise BadInput(f"H={H} query heads is not a multiple of Hkv={Hkv} KV heads")
    if block_tables.shape[:1] != (B,) or block_tables.dim() != 2 or seq_lens.shape != (B,):
        raise BadInput(f"block_tables must be (B={B}, max_blocks) and seq_lens (B,), got {tuple(block_tables.shape)}"
                       f" and {tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise BadInput(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and {seq_lens.dtype}")
    if q.dtype not in dtypes or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise BadInput(f"q and the caches must share one dtype of {', '.join(str(d) for d in dtypes)}, got "
                       f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if len({x.device for x in (q, k_cache, v_cache, block_tables, seq_lens)}) > 1:
        raise BadInput("q, the caches, block_tables and seq_lens must be on one device")


def check_block_tables(block_tables: Tensor, seq_lens: Tensor, num_blocks: int, block_size: int) -> None:
    """The values a launch trusts (reading them syncs a GPU): 1 <= seq_len <= the table's tokens, and every
    block a sequence uses is a block of the pool."""
    if seq_lens.numel() == 0:
        return
    lens = seq_lens.cpu()
    if int(lens.min()) < 1 or int(lens.max()) > block_tables.shape[1] * block_size:
        raise BadInput(f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}] (max_blocks x block_size), "
                       f"got {lens.tolist()}")
    used = torch.arange(block_tables.shape[1]) < (lens[:, None] + block_size - 1) // block_size
    blocks = block_tables.cpu()[used]
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise BadInput(f"block_tables name blocks outside the pool's {num_blocks}: {blocks.tolist()}")


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                    validate: bool = True, partitions: int | None = None) -> Tensor:
    """Triton: O (B, H, D) in q's dtype, O[b, h] = softmax(q[b, h] K_b^T / sqrt(D)) V_b over the seq_lens[b]
    tokens of sequence b, read through block_tables[b]; query head h reads KV head h // (H / Hkv).
    `validate=False` skips `check_block_tables` (the benchmark: it syncs the GPU). `partitions`: at most
    that many per sequence (default `split_partitions`)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    if partitions is not None and not (isinstance(partitions, int) and 1 <= partitions <= MAX_PROGRAMS_Y):
        raise BadInput(f"partitions must be an int in [1, {MAX_PROGRAMS_Y}], got {partitions!r}")
    if q.shape[-1] not in HEAD_DIMS:
        raise BadInput(f"head_dim D={q.shape[-1]} is not one of {HEAD_DIMS}")
    if not kernel_available(q.device):
        raise BadInput(f"the Triton kernel cannot run on {q.device} here: it needs CUDA tensors, or CPU tensors "
                       f"with TRITON_INTERPRET=1 (use paged_attention_ref otherwise)")
    (B, H, D), (num_blocks, page, Hkv, _) = q.shape, k_cache.shape
    if validate:
        check_block_tables(block_tables, seq_lens, num_blocks, page)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()  # a layer's slice: no copy
    block_tables = block_tables.contiguous()
    o = torch.empty_like(q)
    if o.numel() == 0:
        return o
    cpu = q.device.type == "cpu"
    blocks = CPU_BLOCKS if cpu else GPU_BLOCKS[q.dtype]
    tiles = triton.cdiv(block_tables.shape[1] * page, blocks["BLOCK_N"])  # of the longest a table can hold
    part_len = triton.cdiv(tiles, partitions or split_partitions(B, Hkv, tiles, q.device)) * blocks["BLOCK_N"]
    P = triton.cdiv(block_tables.shape[1] * page, part_len)
    acc, ml = (torch.empty(B, H, P, n, device=q.device) for n in (D, 2)) if P > 1 else (o, o)
    group, precision = H // Hkv, "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_decode_kernel[(B, Hkv, P)](q, o, k_cache, v_cache, block_tables, seq_lens, acc, ml,
                                                block_tables.shape[1], part_len, 1.0 / math.sqrt(D), H_KV=Hkv,
                                                GROUP=group, GROUP_PAD=group_pad(group), D=D, PAGE=page,
                                                DOT_PRECISION=precision, UPCAST=cpu and q.dtype == torch.bfloat16,
                                                SPLIT=P > 1, **blocks)
    if P == 1:
        return o
    w = torch.exp(ml[..., 0] - ml[..., 0].amax(-1, keepdim=True))  # (B, H, P); 0 for empty partitions
    return ((w[..., None] * acc).sum(2) / (w * ml[..., 1]).sum(-1, keepdim=True)).to(q.dtype)


def split_partitions(B: int, Hkv: int, tiles: int, device: torch.device) -> int:
    """Partitions per sequence: enough for about two programs per SM on a GPU (one per tile at most);
    1 on a CPU (the interpreter runs programs one after another)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, triton.cdiv(2 * sms, B * Hkv)))


def group_pad(group: int) -> int:
    """The tile's rows for GROUP query heads: a power of two, at least 16 (tl.dot's smallest M)."""
    return max(16, triton.next_power_of_2(group))


def paged_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                        validate: bool = True) -> Tensor:
    """The torch reference of `paged_attention`, in fp32 at least (fp64 stays fp64), returned in that dtype:
    each sequence's blocks gathered into one (Hkv, max_blocks x block_size, D) tensor, the tokens past its
    length masked, then softmax(q K^T / sqrt(D)) V per group of query heads."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, dtypes=(*DTYPES, torch.float64))
    (B, H, D), (num_blocks, page, Hkv, _) = q.shape, k_cache.shape
    if validate:
        check_block_tables(block_tables, seq_lens, num_blocks, page)
    dtype = torch.promote_types(q.dtype, torch.float32)
    k, v = gather_blocks(k_cache, block_tables).to(dtype), gather_blocks(v_cache, block_tables).to(dtype)
    qg = q.to(dtype).view(B, Hkv, H // Hkv, D)  # query head h = kv_head * group + g
    s = qg @ k.transpose(-2, -1) / math.sqrt(D)  # (B, Hkv, group, L)
    past = torch.arange(k.shape[2], device=q.device) >= seq_lens.long()[:, None]  # (B, L)
    s = s.masked_fill(past[:, None, None, :], float("-inf"))
    v = v.masked_fill(past[:, None, :, None], 0.0)  # 0 x nan is nan: what lies past a length never counts
    return (torch.softmax(s, dim=-1) @ v).reshape(B, H, D)


def gather_blocks(cache: Tensor, block_tables: Tensor) -> Tensor:
    """A layer's blocks (num_blocks, block_size, Hkv, D) in each table's order, one tensor per sequence:
    (B, Hkv, max_blocks x block_size, D). Entries past a sequence's blocks may hold anything (clamped into
    the pool); the tokens past its length are for the caller to mask."""
    tables = block_tables.long().clamp(0, max(cache.shape[0] - 1, 0))
    return cache[tables].flatten(1, 2).transpose(1, 2)


def moved_bytes(B: int, H: int, Hkv: int, L: int, D: int, itemsize: int, page: int = 16) -> int:
    """HBM bytes of one decode step at least: read every cached key and value once (2 B L Hkv D elements),
    q, the block tables and lengths (int32), write O."""
    return 2 * B * L * Hkv * D * itemsize + 2 * B * H * D * itemsize + 4 * B * (triton.cdiv(L, page) + 1)


def attention_flops(B: int, H: int, L: int, D: int) -> int:
    """q K^T and P V: 2 H L D multiply-adds per sequence, x 2."""
    return 4 * B * H * L * D


def compile_cases(B: int = 32, L: int = 4096, page: int = 16) -> list[CompileCase]:
    """What a GPU launch compiles (see dlo.kernels.aot), at vLLM's default block of 16 tokens: Llama 3.2 3B
    (24 heads on 8 KV heads of D = 128: a group of 3, padded to 16 rows) in bf16, fp16 and fp32; Llama 3.2
    1B (32 on 8, D = 64); Llama 3.1 70B (64 on 8: a group of 8); split into partitions of 1024 tokens, 3B in
    bf16 and fp32 (one sequence of 32k tokens, 32 partitions). Work: B sequences of L cached tokens (the
    split's partials written too), against SDPA over a contiguous cache reading the same bytes."""
    cases = []
    for dtype, H, D, split in ((torch.bfloat16, 24, 128, False), (torch.float16, 24, 128, False),
                               (torch.float32, 24, 128, False), (torch.bfloat16, 32, 64, False),
                               (torch.bfloat16, 64, 128, False), (torch.bfloat16, 24, 128, True),
                               (torch.float32, 24, 128, True)):
        Hkv, (b, n, part_len) = 8, (1, 32768, 1024) if split else (B, L, L)
        partial = torch.float32 if split else dtype  # unsplit, the launcher passes O in their place
        config = GPU_BLOCKS[dtype]
        blocks = {name: value for name, value in config.items() if name.startswith("BLOCK")}
        args = dict(q_ptr=dtype, o_ptr=dtype, k_ptr=dtype, v_ptr=dtype, tables_ptr=torch.int32, lens_ptr=torch.int32,
                    acc_ptr=partial, ml_ptr=partial, max_blocks=triton.cdiv(n, page), part_len=part_len,
                    scale=1.0 / math.sqrt(D), H_KV=Hkv, GROUP=H // Hkv, GROUP_PAD=group_pad(H // Hkv), D=D, PAGE=page,
                    DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", UPCAST=False, SPLIT=split, **blocks)
        moved = moved_bytes(b, H, Hkv, n, D, dtype.itemsize, page)
        written = b * H * (n // part_len) * (D + 2) * 4 if split else 0
        peak = "fp32_tflops" if dtype == torch.float32 else "bf16_tflops"
        cases.append(CompileCase(_paged_attention_decode_kernel, args,
                                 f"{str(dtype).removeprefix('torch.')} H={H} Hkv={Hkv} D={D} page={page}"
                                 + (f" split{n // part_len}" if split else ""),
                                 num_warps=config["num_warps"], num_stages=config["num_stages"],
                                 shape=f"B={b} L={n}", bytes=moved + written, flops=attention_flops(b, H, n, D),
                                 peak=peak, torch=(moved, attention_flops(b, H, n, D), peak)))
    return cases


# ----------------------------------------------------------------------------- benchmark

def bench(shapes: tuple[tuple[int, int], ...] = ((32, 1024), (32, 8192), (1, 32768)), H: int = 24, Hkv: int = 8,
          D: int = 128, page: int = 16) -> list[dict]:
    """GPU: one decode step of Llama 3.2 3B's attention (bf16) over B sequences of L cached tokens, per (B, L):
    the torch reference (blocks gathered, then attention), SDPA over the same K, V stored contiguously (what
    a contiguous cache runs), this kernel unsplit and as launched (split when B x Hkv leaves SMs idle);
    GB/s of the cache read, beside the HBM roofline."""
    if not torch.cuda.is_available() or not kernel_available("cuda"):
        raise RuntimeError("the paged_attention benchmark needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from dlo.hardware import add_roofline, peak
    figures = peak("cuda") or {}
    rows = []
    for B, L in shapes:
        n = triton.cdiv(L, page)
        gen = torch.Generator(device="cuda").manual_seed(L)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_cache, v_cache = (torch.randn(B * n, page, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                            for _ in range(2))
        tables = torch.randperm(B * n, device="cuda", generator=gen).view(B, n).int()  # scattered blocks
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        k, v = (gather_blocks(c, tables).contiguous() for c in (k_cache, v_cache))
        moved = moved_bytes(B, H, Hkv, L, D, 2, page)
        impls = {"torch ref (gather)": lambda: paged_attention_ref(q, k_cache, v_cache, tables, lens, validate=False),
                 "torch sdpa contiguous": lambda: torch.nn.functional.scaled_dot_product_attention(
                     q[:, :, None], k, v, enable_gqa=True),
                 "dlo triton unsplit": lambda: paged_attention(q, k_cache, v_cache, tables, lens, validate=False,
                                                               partitions=1),
                 "dlo triton": lambda: paged_attention(q, k_cache, v_cache, tables, lens, validate=False)}
        for impl, fn in impls.items():
            ms = time_ms(fn)
            gbs = moved / (ms * 1e-3) / 1e9
            pk = figures.get("hbm_gbs")
            rows.append({"op": "paged_attention", "size": f"B={B} H={H} Hkv={Hkv} L={L} D={D} page={page}",
                         "dtype": "bfloat16", "impl": impl, "ms": ms, "GB/s": gbs,
                         "% peak": 100 * gbs / pk if pk else None,
                         "work": (moved, attention_flops(B, H, L, D), "bf16_tflops")})
        q = k_cache = v_cache = k = v = None
        torch.cuda.empty_cache()
    return add_roofline(rows, figures.get("name"))
