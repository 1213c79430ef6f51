"""Context parallelism: the sequence split over N ranks inside attention (Day 10).

Each rank holds T/N positions of q, k, v (B, H, T/N, D). Attention needs every key for every query,
so the keys and values have to travel. Two ways:

- **Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers", Sec. 3 and Alg. 1):
  each rank keeps its queries and passes its K/V block to the next rank N-1 times (isend/irecv around
  the ring, overlapped with the block's compute); the partial results of each block are merged with
  the online softmax of Day 2's FlashAttention (Milakov & Gimelshein 2018; Dao 2023): a partial result
  is (O, L), the block's normalised output and the log-sum-exp of its score rows, and two merge as

      L = log(exp(L1) + exp(L2)),   O = exp(L1 - L) O1 + exp(L2 - L) O2.

  Backward (FlashAttention-2's Algorithm 2 per block) recomputes P = exp(S - L) with the final L, passes
  K/V around the ring again and the K/V gradients with them, home after N hops.
  `allgather_attention` is the naive version beside it: all-gather K and V (reduce-scatter their
  gradients), attend locally; T x T/N scores and all T keys held at once.
- **DeepSpeed-Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence shards into head shards, each
  rank attends over the whole sequence for H/N heads, a second all-to-all turns it back
  (`dlo.distributed.ulysses`).

Causal masks make the contiguous split unequal: rank r's queries see the keys of ranks 0..r only, so
rank N-1 computes N blocks and rank 0 one. The **zig-zag** (head-tail) split gives rank r the chunks r
and 2N-1-r of 2N equal chunks (Brandon et al. 2023 "Striped attention" discuss the imbalance; the
head-tail order is torchtitan's `_HeadTailLoadBalancer` and ring-flash-attention's zigzag): every rank
then computes the diagonal block and half a block per other step, (N+1)/2 blocks each.
`ring_work` counts the scores each rank computes with the ring's own block trimming.

torch's own API (`torch.distributed.tensor.experimental.context_parallel`, torch 2.13) does not run on
a CPU: it shards SDPA's fused kernels only (flash, efficient, cuDNN); on CPU tensors SDPA dispatches to
`aten._scaled_dot_product_flash_attention_for_cpu`, and context_parallel fails on gloo (fp32 and fp64) with
"NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered." A GPU check can compare against it.

Every rank must hold the same number of positions (T divisible by N; by 2N for zig-zag): a `BadInput`
says so. `group` is the context-parallel process group (None: the default group).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from dlo.attention import attention_scores
from dlo.distributed.tp_comms import gather_from_sp, tp_rank, tp_size
from dlo.errors import BadInput

__all__ = ["merge_partials", "block_attention", "zigzag_positions", "contiguous_positions", "rank_positions",
           "zigzag_split", "zigzag_unsplit", "causal_pairs", "ring_work", "ring_forward", "ring_backward",
           "RingAttention", "ring_attention",
           "allgather_attention", "ring_bytes_per_rank", "ring_saved_bytes", "allgather_bytes_per_rank"]


# ----------------------------------------------------------------------------- the online-softmax pieces

def merge_partials(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attention results over disjoint key sets merged into the result over both:
    o (B, H, T, D), lse (B, H, T). A row that saw no key has lse = -inf and o = 0; it gets weight 0."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)  # both empty: exp(-inf - 0) = 0, not exp(nan)
    w1, w2 = torch.exp(lse1 - safe).unsqueeze(-1), torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * o1 + w2 * o2, lse


def _scores(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, causal: bool) -> Tensor:
    """S = q k^T / sqrt(D) (B, H, Tq, Tk), -inf where a key comes after the query (global positions)."""
    s = attention_scores(q, k, causal=False)
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s


def block_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
                    causal: bool) -> tuple[Tensor, Tensor]:
    """Attention of queries at positions q_pos (Tq,) over keys at k_pos (Tk,): (O (B, H, Tq, D), L (B, H, Tq)),
    in q's dtype. Rows that see no key: O = 0, L = -inf (what `merge_partials` expects)."""
    s = _scores(q, k, q_pos, k_pos, causal)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # all-masked rows: exp(-inf) = 0
    return p @ v, lse


# ----------------------------------------------------------------------------- the splits

def _shard_len(T: int, n: int, zigzag: bool) -> int:
    parts = 2 * n if zigzag else n
    if T % parts:
        raise BadInput(f"a sequence of {T} positions cannot be split into {parts} equal "
                       f"{'zig-zag chunks (2N)' if zigzag else 'shards (N)'}; pad it to a multiple of {parts}")
    return T // n


def contiguous_positions(T: int, n: int, rank: int) -> Tensor:
    """Rank r's positions in the plain split: r T/N .. (r+1) T/N - 1."""
    t = _shard_len(T, n, False)
    return torch.arange(rank * t, (rank + 1) * t)


def zigzag_positions(T: int, n: int, rank: int) -> Tensor:
    """Rank r's positions in the zig-zag split: chunks r and 2N-1-r of 2N (head and tail), in order."""
    c = _shard_len(T, n, True) // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def rank_positions(T: int, n: int, rank: int, zigzag: bool) -> Tensor:
    return zigzag_positions(T, n, rank) if zigzag else contiguous_positions(T, n, rank)


def zigzag_split(x: Tensor, n: int, rank: int, dim: int = 2) -> Tensor:
    """Rank r's zig-zag shard of a full sequence x along `dim`: chunks r and 2N-1-r of 2N, concatenated."""
    _shard_len(x.shape[dim], n, True)
    chunks = x.chunk(2 * n, dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim)


def zigzag_unsplit(shards: list[Tensor], dim: int = 2) -> Tensor:
    """The full sequence from the ranks' zig-zag shards (the inverse of `zigzag_split`)."""
    heads, tails = zip(*(s.chunk(2, dim) for s in shards))
    return torch.cat([*heads, *reversed(tails)], dim)


# ----------------------------------------------------------------------------- the work of the causal mask

def _useful(q_pos: Tensor, k_pos: Tensor, causal: bool) -> tuple[int, int]:
    """(first query row, number of key columns) of a block worth computing. Positions rise within a rank,
    so under a causal mask the queries that see any of these keys are a suffix (q >= min k) and the keys
    any query sees a prefix (k <= max q): the ring computes only that rectangle (zero: skip the block)."""
    if not causal:
        return 0, len(k_pos)
    row0 = int(torch.searchsorted(q_pos, k_pos[0]))  # first query at or after the first key
    cols = int(torch.searchsorted(k_pos, q_pos[-1], right=True))  # keys up to the last query
    return row0, cols


def causal_pairs(q_pos: Tensor, k_pos: Tensor) -> int:
    """Query-key pairs a causal mask leaves (k <= q): the useful work, whatever a kernel computes."""
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


def ring_work(T: int, n: int, causal: bool = True, zigzag: bool = False) -> list[int]:
    """Scores each rank computes in the ring (per batch and head), with the ring's own trimming: contiguous
    causal, rank r computes (r + 1) (T/N)^2; zig-zag, every rank (N + 1)/2 (T/N)^2; non-causal N (T/N)^2."""
    pos = [rank_positions(T, n, r, zigzag) for r in range(n)]
    work = []
    for r in range(n):
        total = 0
        for j in range(n):
            row0, cols = _useful(pos[r], pos[j], causal)
            total += (len(pos[r]) - row0) * cols
        work.append(total)
    return work


# ----------------------------------------------------------------------------- ring attention

def _ring_pass(send: Tensor, group, tag: int = 0) -> tuple[Tensor, list]:
    """Start sending `send` to the next rank and receiving the previous rank's into a new buffer: both
    at once (isend/irecv), or every rank would block in send with nobody receiving. `tag` keeps the K/V
    and gradient messages of one step apart (at N = 2 both go to the same neighbour)."""
    n, r = tp_size(group), tp_rank(group)
    if n == 1:
        return send, []
    recv = torch.empty_like(send)
    ops = [dist.isend(send, group=group, group_dst=(r + 1) % n, tag=tag),
           dist.irecv(recv, group=group, group_src=(r - 1) % n, tag=tag)]
    return recv, ops


def _wait(ops: list) -> None:
    for op in ops:
        op.wait()


def ring_forward(q, k, v, causal, zigzag, group=None) -> tuple[Tensor, Tensor]:
    """Ring attention's forward without autograd: this rank's (O, L) after N blocks (Liu et al. 2023, Alg. 1)."""
    n, r = tp_size(group), tp_rank(group)
    T = q.shape[-2] * n
    pos = [rank_positions(T, n, j, zigzag).to(q.device) for j in range(n)]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])  # (2, B, H, T/N, D): one message per hop
    for step in range(n):
        ops = []
        if step < n - 1:  # start the next block's transfer before computing on this one
            nxt, ops = _ring_pass(kv, group)
        j = (r - step) % n  # the rank this K/V block belongs to
        row0, cols = _useful(pos[r], pos[j], causal)
        if row0 < len(pos[r]) and cols > 0:
            o_j, lse_j = block_attention(q[..., row0:, :], kv[0][..., :cols, :], kv[1][..., :cols, :],
                                         pos[r][row0:], pos[j][:cols], causal)
            o[..., row0:, :], lse[..., row0:] = merge_partials(o[..., row0:, :], lse[..., row0:], o_j, lse_j)
        _wait(ops)
        if step < n - 1:
            kv = nxt
    return o, lse


def _block_grads(q, k, v, o, lse, do, q_pos, k_pos, causal):
    """FlashAttention-2's backward of one block (Dao 2023, Alg. 2) with the final L: dq, dk, dv."""
    p = torch.exp(_scores(q, k, q_pos, k_pos, causal) - lse.unsqueeze(-1))  # (B, H, Tq, Tk), masked: 0
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))  # D_i = rowsum(dO o O)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def ring_backward(q, k, v, o, lse, do, causal, zigzag, group=None) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention's backward: this rank's dq, dk, dv (K/V and their gradients around the ring)."""
    n, r = tp_size(group), tp_rank(group)
    T = q.shape[-2] * n
    pos = [rank_positions(T, n, j, zigzag).to(q.device) for j in range(n)]
    dq = torch.zeros_like(q)
    kv, dkv = torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=k.dtype, device=k.device)
    for step in range(n):
        ops = []
        if step < n - 1:
            nxt, ops = _ring_pass(kv, group)
        j = (r - step) % n
        row0, cols = _useful(pos[r], pos[j], causal)
        if row0 < len(pos[r]) and cols > 0:
            rows = slice(row0, None)
            gq, gk, gv = _block_grads(q[..., rows, :], kv[0][..., :cols, :], kv[1][..., :cols, :], o[..., rows, :],
                                      lse[..., rows], do[..., rows, :], pos[r][rows], pos[j][:cols], causal)
            dq[..., rows, :] += gq
            dkv[0][..., :cols, :] += gk
            dkv[1][..., :cols, :] += gv
        # block j's gradient travels on with it; after the last step the next rank is j itself: home
        dkv, grad_ops = _ring_pass(dkv.contiguous(), group, tag=1)
        _wait(ops + grad_ops)
        if step < n - 1:
            kv = nxt
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention over the context-parallel group: this rank's q, k, v (B, H, T/N, D) in, this rank's
    attention output out, K/V (and in backward their gradients) passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, causal, zigzag, group):
        o, lse = ring_forward(q, k, v, causal, zigzag, group)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.zigzag, ctx.group = causal, zigzag, group
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.zigzag, ctx.group)
        return dq, dk, dv, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, zigzag: bool, group) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise BadInput(f"q, k, v must be (B, H, T/N, D) of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                       f"{tuple(v.shape)}")
    if zigzag and q.shape[-2] % 2:
        raise BadInput(f"a zig-zag shard holds two equal chunks: {q.shape[-2]} positions per rank is odd")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, zigzag: bool = False, group=None) -> Tensor:
    """This rank's attention output (B, H, T/N, D) for its positions (contiguous, or zig-zag with `zigzag`)."""
    _check(q, k, v, zigzag, group)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), causal, zigzag, group)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, zigzag: bool = False,
                        group=None) -> Tensor:
    """The naive context parallelism: all-gather K and V along the sequence (their gradients
    reduce-scattered back), attend locally. Autograd through plain torch ops."""
    _check(q, k, v, zigzag, group)
    n, r = tp_size(group), tp_rank(group)
    T = q.shape[-2] * n
    k_all, v_all = gather_from_sp(k, 2, group), gather_from_sp(v, 2, group)  # (B, H, T, D), rank-block order
    k_pos = torch.cat([rank_positions(T, n, j, zigzag) for j in range(n)]).to(q.device)
    return block_attention(q, k_all, v_all, rank_positions(T, n, r, zigzag).to(q.device), k_pos, causal)[0]


# ----------------------------------------------------------------------------- bytes per rank

def ring_bytes_per_rank(B: int, H_kv: int, T: int, D: int, n: int, itemsize: int, backward: bool = False) -> int:
    """Bytes one rank sends in ring attention: forward, its K/V block (2 B H_kv T/N D) to the next rank
    N-1 times; backward, K/V again N-1 times and their gradients N times (back to their owner); one rank
    (n = 1) sends nothing."""
    if n == 1:
        return 0
    block = 2 * B * H_kv * (T // n) * D * itemsize
    return (n - 1) * block + ((n - 1) * block + n * block if backward else 0)


def ring_saved_bytes(B: int, H: int, T: int, D: int, n: int, itemsize: int) -> int:
    """Bytes ring attention saves for backward beyond its inputs q, k, v: this rank's output and
    log-sum-exp, B H T/N (D + 1): linear in T/N, where the all-gather version also keeps all T keys and
    values and the T/N x T scores."""
    return B * H * (T // n) * (D + 1) * itemsize


def allgather_bytes_per_rank(B: int, H_kv: int, T: int, D: int, n: int, itemsize: int) -> float:
    """Bytes one rank sends in the naive version's forward: all-gathers of K and V, (N-1)/N of T each."""
    return (n - 1) / n * 2 * B * H_kv * T * D * itemsize
