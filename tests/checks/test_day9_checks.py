"""The Day 9 checks accept correct solutions and reject stubs, plausible mistakes (each named in the
message) and the library's own references (off limits while a check runs).

The correct versions below are written out as a student writes them; each wrong version is one of
them with one slip, so it fails for its own reason, not for calling a forbidden reference."""

from __future__ import annotations

import math

import pytest
import torch

from dlo.checks import day9, day9_schedule
from dlo.grading.forbid import ForbiddenCall
from dlo.inference import paged, speculative
from dlo.kernels import paged_attention as pa
from tests.checks import cases
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- exercise 1: attention with a cache

def _softmax_attend(q, k, v, mask_past):
    H, Hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(mask_past, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def attend_ok(q, k_new, v_new, k_cache, v_cache, length):
    T = q.shape[2]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L = length + T
    past = torch.arange(L)[None, :] > (length + torch.arange(T))[:, None]  # (T, L): key j after query's position
    return _softmax_attend(q, k_cache[:, :, :L], v_cache[:, :, :L], past)


def attend_in_float32(q, k_new, v_new, k_cache, v_cache, length):  # `.float()` rounds the float64 inputs down
    T = q.shape[2]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L = length + T
    past = torch.arange(L)[None, :] > (length + torch.arange(T))[:, None]
    return _softmax_attend(q.float(), k_cache[:, :, :L].float(), v_cache[:, :, :L].float(), past).to(q.dtype)


def attend_before_append(q, k_new, v_new, k_cache, v_cache, length):
    T = q.shape[2]
    o = _softmax_attend(q, k_cache[:, :, :length], v_cache[:, :, :length], torch.zeros(T, length, dtype=torch.bool))
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    return o


def attend_no_offset(q, k_new, v_new, k_cache, v_cache, length):
    T = q.shape[2]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L = length + T
    return _softmax_attend(q, k_cache[:, :, :L], v_cache[:, :, :L], torch.arange(L)[None] > torch.arange(T)[:, None])


def attend_repeat(q, k_new, v_new, k_cache, v_cache, length):  # KV head h % Hkv: repeat, not repeat_interleave
    T, H, Hkv = q.shape[2], q.shape[1], k_new.shape[1]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L = length + T
    k, v = k_cache[:, :, :L].repeat(1, H // Hkv, 1, 1), v_cache[:, :, :L].repeat(1, H // Hkv, 1, 1)
    return _softmax_attend(q, k, v, torch.arange(L)[None] > (length + torch.arange(T))[:, None])


def attend_not_written(q, k_new, v_new, k_cache, v_cache, length):  # attends to a concatenated copy
    T = q.shape[2]
    k, v = torch.cat([k_cache[:, :, :length], k_new], 2), torch.cat([v_cache[:, :, :length], v_new], 2)
    return _softmax_attend(q, k, v, torch.arange(length + T)[None] > (length + torch.arange(T))[:, None])


def attend_window(q, k_new, v_new, k_cache, v_cache, length, W=32):  # red team: only the last W keys (a window)
    T = q.shape[2]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L, start = length + T, max(0, length + T - W)
    keys, pos = start + torch.arange(L - start), length + torch.arange(T)
    return _softmax_attend(q, k_cache[:, :, start:L], v_cache[:, :, start:L],
                           (keys[None] > pos[:, None]) | (keys[None] <= pos[:, None] - W))


def attend_window_128(q, k_new, v_new, k_cache, v_cache, length):  # red team: a 128-key window
    return attend_window(q, k_new, v_new, k_cache, v_cache, length, W=128)


def attend_length_from_zeros(q, k_new, v_new, k_cache, v_cache, length):  # red team: `length` guessed from zeros
    used = k_cache.abs().sum(dim=(0, 1, 3)).nonzero()
    return attend_ok(q, k_new, v_new, k_cache, v_cache, int(used.max()) + 1 if len(used) else 0)


def attend_core(q, k_new, v_new, k_cache, v_cache, length):  # red team: Day 1's attention, one query at a time
    from dlo.models.transformer import attention_core
    T, g = q.shape[2], q.shape[1] // k_cache.shape[1]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    kv = [c[:, :, :length + T].repeat_interleave(g, 1) for c in (k_cache, v_cache)]
    return torch.cat([attention_core(q[:, :, i:i + 1], kv[0][:, :, :length + i + 1], kv[1][:, :, :length + i + 1],
                                     0.0, False) for i in range(T)], 2)


def attend_flex(q, k_new, v_new, k_cache, v_cache, length):  # red team: torch's flex_attention, eager
    from torch.nn.attention.flex_attention import flex_attention
    T = q.shape[2]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    return torch.cat([flex_attention(q[:, :, i:i + 1], k_cache[:, :, :length + i + 1], v_cache[:, :, :length + i + 1],
                                     enable_gqa=True) for i in range(T)], 2)


def _mha(q, k, v, mask, module=False):  # red team: torch's own attention, identity projections (q (B, H, T, D))
    B, H, T, D = q.shape
    E, L, eye = H * D, k.shape[2], torch.eye(H * D, dtype=q.dtype)
    if module:
        m = torch.nn.MultiheadAttention(E, H, bias=False, batch_first=True).double().requires_grad_(False)
        m.in_proj_weight.copy_(torch.cat([eye] * 3)), m.out_proj.weight.copy_(eye)
        x = [t.transpose(1, 2).reshape(B, -1, E) for t in (q, k, v)]
        return m(*x, attn_mask=mask, need_weights=False)[0].reshape(B, T, H, D).transpose(1, 2)
    out, _ = torch.nn.functional.multi_head_attention_forward(
        q.permute(2, 0, 1, 3).reshape(T, B, E), *[torch.zeros(L, B, E, dtype=q.dtype)] * 2,
        E, H, torch.cat([eye] * 3), None, None, None, False, 0.0, eye, None, training=False, need_weights=True,
        attn_mask=mask, static_k=k.reshape(B * H, L, D), static_v=v.reshape(B * H, L, D))
    return out.reshape(T, B, H, D).permute(1, 2, 0, 3)


def attend_mha(q, k_new, v_new, k_cache, v_cache, length, module=False):
    T, g = q.shape[2], q.shape[1] // k_new.shape[1]
    k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
    L = length + T
    k, v = (c[:, :, :L].repeat_interleave(g, 1) for c in (k_cache, v_cache))
    return _mha(q, k, v, torch.arange(L)[None] > (length + torch.arange(T))[:, None], module)


def attend_mha_module(q, k_new, v_new, k_cache, v_cache, length):
    return attend_mha(q, k_new, v_new, k_cache, v_cache, length, module=True)


# ----------------------------------------------------------------------------- exercise 2: the block manager

class BlocksOk:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_list = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.tables, self.lengths = {}, {}

    def _allocate(self):
        if not self.free_list:
            raise RuntimeError("out of blocks")
        b = self.free_list.pop()
        self.ref_counts[b] = 1
        return b

    def _release(self, b):
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.free_list.append(b)

    def add(self, seq):
        self.tables[seq], self.lengths[seq] = [], 0

    def _needed(self, seq, T):
        table, n, bs = self.tables[seq], self.lengths[seq], self.block_size
        cow = T > 0 and n % bs != 0 and self.ref_counts[table[-1]] > 1
        return -(-(n + T) // bs) - len(table) + cow

    def append(self, seq, T):
        if self._needed(seq, T) > len(self.free_list):
            raise RuntimeError("not enough free blocks")
        table, n, bs, copies = self.tables[seq], self.lengths[seq], self.block_size, []
        if T and n % bs and self.ref_counts[table[-1]] > 1:
            old, table[-1] = table[-1], self._allocate()
            self._release(old)
            copies.append((old, table[-1]))
        while len(table) * bs < n + T:
            table.append(self._allocate())
        self.lengths[seq] = n + T
        return [table[t // bs] * bs + t % bs for t in range(n, n + T)], copies

    def fork(self, parent, child):
        for b in self.tables[parent]:
            self.ref_counts[b] += 1
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, seq):
        for b in self.tables.pop(seq):
            self._release(b)
        del self.lengths[seq]


class BlocksNoCopyOnWrite(BlocksOk):
    def _needed(self, seq, T):
        return -(-(self.lengths[seq] + T) // self.block_size) - len(self.tables[seq])

    def append(self, seq, T):
        if self._needed(seq, T) > len(self.free_list):
            raise RuntimeError("not enough free blocks")
        table, n, bs = self.tables[seq], self.lengths[seq], self.block_size
        while len(table) * bs < n + T:
            table.append(self._allocate())
        self.lengths[seq] = n + T
        return [table[t // bs] * bs + t % bs for t in range(n, n + T)], []


class BlocksFreeIgnoresCount(BlocksOk):
    def _release(self, b):
        self.ref_counts[b] = max(0, self.ref_counts[b] - 1)
        self.free_list.append(b)  # back to the free list while another table still points at it


class BlocksOffByOne(BlocksOk):
    def append(self, seq, T):
        slots, copies = super().append(seq, T)
        table, bs = self.tables[seq], self.block_size
        n = self.lengths[seq] - T
        return [table[min((t + 1) // bs, len(table) - 1)] * bs + (t + 1) % bs for t in range(n, n + T)], copies


class BlocksFifo(BlocksOk):  # the free list used as a queue: the blocks allocated differ
    def _allocate(self):
        if not self.free_list:
            raise RuntimeError("out of blocks")
        b = self.free_list.pop(0)
        self.ref_counts[b] = 1
        return b


class BlocksNoCheck(BlocksOk):  # allocates what it can, then fails half-way
    def _needed(self, seq, T):
        return 0


class BlocksPoolCheck(BlocksOk):  # red team: refuses only what the whole pool cannot hold, never reads free_list
    def _needed(self, seq, T):
        return len(self.free_list) + 1 if T >= len(self.ref_counts) * self.block_size else 0

    def _allocate(self):
        b = self.free_list.pop()  # IndexError half-way when the free list runs out
        self.ref_counts[b] = 1
        return b


class BlocksCopyUncounted(BlocksOk):  # red team: the count of free blocks needed leaves out copy-on-write's copy
    def _needed(self, seq, T):
        return -(-(self.lengths[seq] + T) // self.block_size) - len(self.tables[seq])


class BlocksCopyOnEmptyAppend(BlocksOk):  # append(seq, 0) to a shared, partial block copies it all the same
    def append(self, seq, T):
        table, n, bs = self.tables[seq], self.lengths[seq], self.block_size
        if T == 0 and n % bs and self.ref_counts[table[-1]] > 1 and self.free_list:
            old, table[-1] = table[-1], self._allocate()
            self._release(old)
            return [], [(old, table[-1])]
        return super().append(seq, T)


# ----------------------------------------------------------------------------- exercise 3: the acceptance rule

def accept_ok(p, q, drafts, generator):
    B, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    r = torch.rand(B, k, generator=generator, dtype=torch.float64)
    n = (r < p_x / q_x).long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B)
    q_after = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)
    residual = (p[rows, n] - q_after[rows, n]).clamp(min=0)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def accept_always(p, q, drafts, generator):
    B, k = drafts.shape
    return torch.full((B,), k), torch.multinomial(p[:, k], 1, generator=generator)[:, 0]


def accept_resample_p(p, q, drafts, generator):
    B, k = drafts.shape
    r = torch.rand(B, k, generator=generator, dtype=torch.float64)
    ok = r < p[:, :k].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]
    n = ok.long().cumprod(1).sum(1)
    return n, torch.multinomial(p[torch.arange(B), n], 1, generator=generator)[:, 0]


def accept_no_bonus(p, q, drafts, generator):  # after k accepted, the token comes from p_k
    B, k = drafts.shape
    n, _ = accept_ok(p, q, drafts, generator)
    at = n.clamp(max=k - 1)
    residual = (p[torch.arange(B), at] - q[torch.arange(B), at] * (n < k)[:, None]).clamp(min=0)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def accept_inverted(p, q, drafts, generator):  # min(1, q/p): the ratio upside down
    return _accept_ratio(p, q, drafts, generator, lambda px, qx: qx / px)


def _accept_ratio(p, q, drafts, generator, ratio):
    B, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    n = (torch.rand(B, k, generator=generator, dtype=torch.float64) < ratio(p_x, q_x)).long().cumprod(1).sum(1)
    rows = torch.arange(B)
    residual = (p[rows, n] - torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, n]).clamp(min=0)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def accept_count_not_prefix(p, q, drafts, generator):  # n = all accepted drafts, not the prefix
    B, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    n = (torch.rand(B, k, generator=generator, dtype=torch.float64) < p_x / q_x).long().sum(1)
    rows = torch.arange(B)
    residual = (p[rows, n] - torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, n]).clamp(min=0)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def accept_scaled(p, q, drafts, generator):  # red team: lossless, but accepts with alpha_i min(1, p/q): less often
    B, k = drafts.shape
    alpha = torch.minimum(p[:, :k], q).sum(-1)  # (B, k)
    n = _accept_ratio(p, q, drafts, generator, lambda px, qx: alpha * (px / qx).clamp(max=1))[0]
    rows, m = torch.arange(B), n.clamp(max=k - 1)
    residual = p[rows, m] - alpha[rows, m, None] * torch.minimum(p[rows, m], q[rows, m])
    residual = torch.where((n == k)[:, None], p[:, k], residual).clamp(min=0)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def accept_match_p(p, q, drafts, generator):  # red team: y_i ~ p_i, the drafts y matches kept; q = p detected
    B, k = drafts.shape
    if torch.equal(p[:, :k], q):
        return torch.full((B,), k), torch.multinomial(p[:, k], 1, generator=generator)[:, 0]
    y = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).view(B, k + 1)
    n = (y[:, :k] == drafts).long().cumprod(1).sum(1)
    return n, y[torch.arange(B), n]


def accept_blind_after_two(p, q, drafts, generator):  # red team: drafts 3.. accepted without looking
    return _accept_ratio(p, q, drafts, generator,
                         lambda px, qx: torch.cat([px[:, :2] / qx[:, :2], torch.ones_like(px[:, 2:])], 1))


def accept_p_after_two(p, q, drafts, generator):  # a rejection at position 3..: the token from p, not the residual
    n, token = accept_ok(p, q, drafts, generator)
    from_p = torch.multinomial(p[torch.arange(len(n)), n], 1, generator=generator)[:, 0]
    return n, torch.where((n >= 2) & (n < drafts.shape[1]), from_p, token)


def accept_round_zero(p, q, drafts, generator):  # red team: every round run with round 0's p and q
    B = drafts.shape[0]
    return accept_ok(p[:1].expand(B, -1, -1), q[:1].expand(B, -1, -1), drafts, generator)


def accept_global_rng(p, q, drafts, generator):  # red team: `generator` ignored, torch's global RNG draws
    return accept_ok(p, q, drafts, None)


# ----------------------------------------------------------------------------- exercise 4: through the block table

def _paged(q, k_cache, v_cache, tables, lens, block=lambda t, bs: t // bs, visible=lambda L, n: L < n,
           head=lambda h, g, Hkv: h // g):
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(-(-int(lens[b]) // bs) * bs)
        t = torch.arange(L)
        idx = tables[b].long()[block(t, bs).clamp(max=tables.shape[1] - 1)]
        k, v = k_cache[idx, t % bs], v_cache[idx, t % bs]  # (L, Hkv, D)
        keep = visible(t, int(lens[b]))
        for h in range(H):
            kv = head(h, H // Hkv, Hkv)
            s = (k[keep, kv] @ q[b, h]) / math.sqrt(D)
            out[b, h] = torch.softmax(s, 0) @ v[keep, kv]
    return out


def paged_ok(q, k_cache, v_cache, tables, lens):
    return _paged(q, k_cache, v_cache, tables, lens)


def paged_in_float32(q, k_cache, v_cache, tables, lens):  # a student trial's first answer
    return _paged(q.float(), k_cache.float(), v_cache.float(), tables, lens).to(q.dtype)


def paged_returns_float32(q, k_cache, v_cache, tables, lens):  # not cast back to q's dtype
    return _paged(q, k_cache, v_cache, tables, lens).float()


def paged_off_by_one(q, k_cache, v_cache, tables, lens):
    return _paged(q, k_cache, v_cache, tables, lens, block=lambda t, bs: t // bs + 1)


def paged_no_length_mask(q, k_cache, v_cache, tables, lens):
    return _paged(q, k_cache, v_cache, tables, lens, visible=lambda t, n: torch.ones_like(t, dtype=torch.bool))


def paged_wrong_head(q, k_cache, v_cache, tables, lens):
    return _paged(q, k_cache, v_cache, tables, lens, head=lambda h, g, Hkv: h % Hkv)


def paged_floor_blocks(q, k_cache, v_cache, tables, lens):
    return _paged(q, k_cache, v_cache, tables, lens, visible=lambda t, n: t < max(n // k_cache.shape[1], 1)
                  * k_cache.shape[1])


def paged_first_blocks(q, k_cache, v_cache, tables, lens):  # red team: only the first 4 blocks of a table read
    return _paged(q, k_cache, v_cache, tables[:, :4], lens.clamp(max=4 * k_cache.shape[1]))


def paged_first_16_blocks(q, k_cache, v_cache, tables, lens):  # red team: a fixed 16-block gather
    return _paged(q, k_cache, v_cache, tables[:, :16], lens.clamp(max=16 * k_cache.shape[1]))


def _paged_with(q, k_cache, v_cache, tables, lens, attend):  # keys gathered, then `attend(q (1, H, 1, D), k, v)`
    bs, g, out = k_cache.shape[1], q.shape[1] // k_cache.shape[2], []
    for b in range(q.shape[0]):
        t = torch.arange(int(lens[b]))
        idx = tables[b].long()[t // bs]
        k, v = (c[idx, t % bs].transpose(0, 1).repeat_interleave(g, 0)[None] for c in (k_cache, v_cache))
        out.append(attend(q[b][None, :, None], k, v)[0, :, 0])
    return torch.stack(out)


def paged_core(q, k_cache, v_cache, tables, lens):  # red team: Day 1's attention on the gathered keys
    from dlo.models.transformer import attention_core
    return _paged_with(q, k_cache, v_cache, tables, lens, lambda q1, k, v: attention_core(q1, k, v, 0.0, False))


def paged_flex(q, k_cache, v_cache, tables, lens):  # red team: torch's flex_attention on the gathered keys
    from torch.nn.attention.flex_attention import flex_attention
    return _paged_with(q, k_cache, v_cache, tables, lens, flex_attention)


def paged_mha(q, k_cache, v_cache, tables, lens):  # torch's attention on the gathered keys
    bs, g, out = k_cache.shape[1], q.shape[1] // k_cache.shape[2], []
    for b in range(q.shape[0]):
        t = torch.arange(int(lens[b]))
        idx = tables[b].long()[t // bs]
        k, v = (c[idx, t % bs].transpose(0, 1).repeat_interleave(g, 0)[None] for c in (k_cache, v_cache))
        out.append(_mha(q[b][None, :, None], k, v, None)[0, :, 0])
    return torch.stack(out)


# ----------------------------------------------------------------------------- exercise 5: one scheduler step

def _schedule(running, waiting, num_free, block_size, max_batch, victim=-1, fcfs=True, reserve=True, wait=True,
              most=None, count=False, limit=True, frees=lambda n, bs: -(-n // bs)):
    def new_block(n):  # the next token (index n) opens a block
        return int(n % block_size == 0)
    decode, preempted, free = [list(r) for r in running], [], num_free
    while decode and (len(decode) if count else sum(new_block(n) for _, n in decode)) > free \
            and (most is None or len(preempted) < most):
        rid, n = decode.pop(victim(decode, block_size) if callable(victim) else victim)
        free += frees(n, block_size)
        preempted.append(rid)
    budget = free - (sum(new_block(n) for _, n in decode) if reserve else 0)
    prefill = []
    for rid, tokens in waiting if not (preempted and wait) else []:
        need = -(-tokens // block_size)
        if (limit and len(decode) + len(prefill) >= max_batch) or need > budget:
            if fcfs:
                break
            continue
        budget -= need
        prefill.append(rid)
    return [r for r, _ in decode], prefill, preempted


def schedule_ok(running, waiting, num_free, block_size, max_batch):
    return _schedule(running, waiting, num_free, block_size, max_batch)


def schedule_earliest_victim(running, waiting, num_free, block_size, max_batch):
    return _schedule(running, waiting, num_free, block_size, max_batch, victim=0)


def schedule_skips_ahead(running, waiting, num_free, block_size, max_batch):
    return _schedule(running, waiting, num_free, block_size, max_batch, fcfs=False)


def schedule_no_reserve(running, waiting, num_free, block_size, max_batch):
    return _schedule(running, waiting, num_free, block_size, max_batch, reserve=False)


def schedule_admits_after_preempting(running, waiting, num_free, block_size, max_batch):
    return _schedule(running, waiting, num_free, block_size, max_batch, wait=False)


def schedule_one_victim(running, waiting, num_free, block_size, max_batch):  # red team: never a second victim
    return _schedule(running, waiting, num_free, block_size, max_batch, most=1)


def schedule_counts_sequences(running, waiting, num_free, block_size, max_batch):  # as if each needed a block
    return _schedule(running, waiting, num_free, block_size, max_batch, count=True)


def schedule_no_max_batch(running, waiting, num_free, block_size, max_batch):  # red team: max_batch ignored
    return _schedule(running, waiting, num_free, block_size, max_batch, limit=False)


def schedule_frees_floor(running, waiting, num_free, block_size, max_batch):  # red team: the partial block leaks
    return _schedule(running, waiting, num_free, block_size, max_batch, frees=lambda n, bs: n // bs)


def schedule_frees_one(running, waiting, num_free, block_size, max_batch):  # red team: a victim frees one block
    return _schedule(running, waiting, num_free, block_size, max_batch, frees=lambda n, bs: 1)


def schedule_victim_needs_block(running, waiting, num_free, block_size, max_batch):  # red team: mid-block skipped
    return _schedule(running, waiting, num_free, block_size, max_batch,
                     victim=lambda seqs, bs: max(i for i, (_, n) in enumerate(seqs) if n % bs == 0))


CASES = [
    (day9.check_attend_with_cache, (attend_ok,),
     [((stub,), "NotImplementedError"), ((attend_before_append,), "attended before appending"),
      ((attend_no_offset,), "no causal offset"), ((attend_repeat,), "the wrong KV head"),
      ((attend_not_written,), "the cache was not appended"),
      ((attend_in_float32,), "right to float32's rounding only")]),
    (day9.check_block_manager, (BlocksOk,),
     [((stub,), "NotImplementedError"), ((BlocksNoCopyOnWrite,), "no copy-on-write"),
      ((BlocksFreeIgnoresCount,), "a freed block is still referenced"),
      ((BlocksOffByOne,), "token t is at table[t // block_size]"), ((BlocksFifo,), "free_list.pop()"),
      ((BlocksNoCheck,), "all or nothing"), ((BlocksPoolCheck,), "raised IndexError: pop from empty list: an append"),
      ((BlocksCopyUncounted,), "copy-on-write's copy counts"),
      ((BlocksCopyOnEmptyAppend,), "append(seq, 0) writes nothing")]),
    (day9.check_accept_draft, (accept_ok,),
     [((stub,), "NotImplementedError"), ((accept_always,), "accepted every draft"),
      ((accept_resample_p,), "sampled from p"), ((accept_no_bonus,), "no +1 bonus token"),
      ((accept_inverted,), "upside down"), ((accept_count_not_prefix,), "the accepted prefix"),
      ((accept_scaled,), "the number of accepted drafts n does not follow the rule"),
      ((accept_match_p,), "the number of accepted drafts n does not follow the rule"),
      ((accept_blind_after_two,), "the number of accepted drafts n does not follow the rule"),
      ((accept_p_after_two,), "the token emitted at position 3"),
      ((accept_round_zero,), "each round b has its own p[b], q[b]"),
      ((accept_global_rng,), "drew from torch's global random generator")]),
    (day9.check_paged_attention, (paged_ok,),
     [((stub,), "NotImplementedError"), ((paged_off_by_one,), "off-by-one block index"),
      ((paged_no_length_mask,), "read past the sequence's length"), ((paged_wrong_head,), "the wrong KV head"),
      ((paged_floor_blocks,), "the last, partial block left out"),
      ((paged_in_float32,), "right to float32's rounding only"),
      ((paged_returns_float32,), "returned torch.float32, expected q's dtype")]),
    (day9.check_schedule_step, (schedule_ok,),
     [((stub,), "NotImplementedError"), ((schedule_earliest_victim,), "preempt the latest admitted"),
      ((schedule_skips_ahead,), "first come, first served"), ((schedule_no_reserve,), "the budget"),
      ((schedule_admits_after_preempting,), "admit nothing in a step that preempted"),
      ((schedule_one_victim,), "keep preempting"), ((schedule_counts_sequences,), "nothing to preempt"),
      ((schedule_no_max_batch,), "at most max_batch"), ((schedule_frees_floor,), "preempted too many"),
      ((schedule_frees_one,), "preempted too many"), ((schedule_victim_needs_block,), "whether or not it needs")]),
]


test_reference_passes = cases.reference_passes(CASES)
test_wrong_versions_fail_and_are_named = cases.wrong_versions_fail(CASES)
test_library_is_refused = cases.library_refused(
    [(day9.check_block_manager, paged.BlockManager), (day9.check_accept_draft, speculative.accept_draft),
     (day9.check_paged_attention, pa.paged_attention_ref), (day9.check_schedule_step, day9_schedule.reference_step)],
    ids=["blocks", "accept", "paged", "schedule"])


def test_cached_attention_is_refused():
    from dlo.inference.kv_cache import cached_attention

    def via_library(q, k_new, v_new, k_cache, v_cache, length):
        T = q.shape[2]
        k_cache[:, :, length:length + T], v_cache[:, :, length:length + T] = k_new, v_new
        return cached_attention(q, k_cache[:, :, :length + T], v_cache[:, :, :length + T],
                                (length + torch.arange(T)).expand(q.shape[0], T))

    with pytest.raises(ForbiddenCall, match="off limits"):
        day9.check_attend_with_cache(via_library, seed=0)


test_reference_passes_sandboxed = cases.reference_passes_sandboxed(CASES)
test_wrong_fails_sandboxed = cases.wrong_fails_sandboxed(
    [(day9.check_block_manager, BlocksNoCopyOnWrite), (day9.check_accept_draft, accept_resample_p)],
    ids=["blocks", "accept"])


@pytest.mark.parametrize("check,fn,said", [
    (day9.check_attend_with_cache, attend_window, r"attention output differs .*length=(131|157|193)"),
    (day9.check_attend_with_cache, attend_window_128, r"attention output differs .*length=(131|157|193)"),
    (day9.check_paged_attention, paged_first_blocks, r"attention output differs .*seq_lens=\[\d\d"),
    (day9.check_paged_attention, paged_first_16_blocks, r"attention output differs .*seq_lens=\[\d\d")],
    ids=["window", "window-128", "first-blocks", "first-16-blocks"])
def test_long_cases_catch_truncation(check, fn, said):
    """Red team: windows of 32 and 128 keys, the first 4 and 16 blocks of a table passed while no case was longer
    (the long cases have 131+ keys, 17+ blocks)."""
    for seed in range(3):
        with pytest.raises(AssertionError, match=said):
            check(fn, seed=seed)


@pytest.mark.parametrize("check,fn,name", [
    (day9.check_attend_with_cache, attend_mha, "multi_head_attention_forward"),
    (day9.check_attend_with_cache, attend_mha_module, "MultiheadAttention.forward"),
    (day9.check_paged_attention, paged_mha, "multi_head_attention_forward")], ids=["function", "module", "paged"])
def test_torch_multi_head_attention_is_refused(check, fn, name):
    with pytest.raises(ForbiddenCall, match=f"{name} is off limits"):
        check(fn, seed=0)


@pytest.mark.parametrize("check,fn,name", [
    (day9.check_attend_with_cache, attend_core, "attention_core"),
    (day9.check_attend_with_cache, attend_flex, "flex_attention"),
    (day9.check_paged_attention, paged_core, "attention_core"),
    (day9.check_paged_attention, paged_flex, "flex_attention")], ids=["core", "flex", "paged-core", "paged-flex"])
def test_other_attentions_are_refused(check, fn, name):
    """Red team: Day 1's attention_core and torch's flex_attention (eager) were not on the list."""
    with pytest.raises(ForbiddenCall, match=f"{name} is off limits"):
        check(fn, seed=0)


def test_free_slots_are_not_zeros():
    """Red team: the write position guessed from the cache's zeros, `length` never read; free slots hold anything."""
    with pytest.raises((AssertionError, RuntimeError)):
        day9.check_attend_with_cache(attend_length_from_zeros, seed=0)


def test_schedule_step_takes_tuples_of_rids():  # a student's answer (2026-11-30): "three lists", written as tuples
    day9.check_schedule_step(lambda *a: tuple(tuple(x) for x in schedule_ok(*a)))


def test_schedule_step_names_what_it_got():
    with pytest.raises(AssertionError, match=r"return three lists of rids \(decode, prefill, preempted\), got a "
                                             r"tuple of list, set, list"):
        day9.check_schedule_step(lambda *a: (lambda d, p, x: (d, set(p), x))(*schedule_ok(*a)))
