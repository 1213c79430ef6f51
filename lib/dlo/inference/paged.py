"""Paged KV cache: vLLM's PagedAttention memory manager (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP).

A contiguous cache reserves max_len slots per sequence before knowing how long it will be: the unused
tail is reserved, and the gaps between reservations fragment memory; the paper measures 60-80% of the
cache wasted this way (Sec. 3, Fig. 2). vLLM instead cuts the cache into fixed-size blocks of
`block_size` tokens, allocated one at a time as a sequence grows, "as an OS does with pages" (Sec. 4.2):

    BlockAllocator   a pool of physical blocks: a free list, a reference count per block
    BlockManager     per sequence a block table: logical block i -> physical block; token t is in
                     table[t // block_size] at slot t % block_size. Waste: the last block's empty slots,
                     < block_size per sequence (under 4% in the paper's Fig. 2).
    fork             a child sequence shares its parent's blocks (parallel sampling, beam search: the
                     prompt is stored once, Sec. 4.4); each shared block's count goes up.
    copy-on-write    writing a block whose count is > 1 first copies it to a fresh block (Sec. 4.4):
                     full shared blocks are never written again, so only the last, partial one is copied.

`PagedKVCache` adds the tensors, (layers, num_blocks, block_size, Hkv, D) for K and V, and the
`append_slots` / `update_and_attend` pair `dlo.inference.kv_cache.forward_cached` calls, so the same Llama
decodes from either cache. Decode attention reads the blocks through the tables
(`dlo.kernels.paged_attention`: the torch reference, or the Triton kernel with `kernel=True`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dlo.errors import BadInput
from dlo.inference.kv_cache import cached_attention, forward_cached, sample
from dlo.kernels.paged_attention import gather_blocks, paged_attention, paged_attention_ref
from dlo.models.llama import LlamaConfig


class OutOfBlocks(RuntimeError):
    """No free block left: the scheduler preempts a sequence (dlo.inference.batching)."""


class BlockAllocator:
    """Physical blocks 0..num_blocks-1: a free list and a reference count per block."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise BadInput(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free_list = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        if not self.free_list:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more table points at `block` (fork)."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free: it cannot be shared")
        self.ref_counts[block] += 1
        return block

    def free(self, block: int) -> None:
        """One table fewer points at `block`; the last one returns it to the free list."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is already free (a double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)


class BlockManager:
    """Block tables of sequences over one allocator (vLLM's block space manager), no tensors: what the
    scheduler plans with, and what a `PagedKVCache` applies to its K and V."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise BadInput(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}

    def add(self, seq) -> None:
        if seq in self.tables:
            raise BadInput(f"sequence {seq!r} already has a block table")
        self.tables[seq], self.lengths[seq] = [], 0

    def blocks_needed(self, seq, T: int) -> int:
        """Free blocks that appending T tokens to `seq` takes: new blocks, plus a copy of its last block
        when that block is partial and shared (copy-on-write)."""
        table, length = self.tables[seq], self.lengths[seq]
        new = math.ceil((length + T) / self.block_size) - len(table)
        cow = length % self.block_size != 0 and T > 0 and self.allocator.ref_counts[table[-1]] > 1
        return new + int(cow)

    def can_append(self, seqs, T: int) -> bool:
        return sum(self.blocks_needed(s, T) for s in seqs) <= self.allocator.num_free

    def append_slots(self, seq, T: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Room for T more tokens of `seq`: (their slots, block * block_size + offset; the copies
        (source block, new block) copy-on-write made, for the cache to apply to its tensors). All or
        nothing: OutOfBlocks before any change when the free blocks do not suffice."""
        if self.blocks_needed(seq, T) > self.allocator.num_free:
            raise OutOfBlocks(f"{seq!r} needs {self.blocks_needed(seq, T)} blocks, {self.allocator.num_free} are free")
        table, length, copies = self.tables[seq], self.lengths[seq], []
        if length % self.block_size and T and self.allocator.ref_counts[table[-1]] > 1:
            shared = table[-1]
            table[-1] = self.allocator.allocate()  # the partial block is written: this sequence's own copy
            self.allocator.free(shared)
            copies.append((shared, table[-1]))
        while len(table) * self.block_size < length + T:
            table.append(self.allocator.allocate())
        self.lengths[seq] = length + T
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(length, length + T)], copies

    def fork(self, parent, child) -> None:
        """`child` starts as `parent`'s copy, sharing all its blocks (nothing is copied until written)."""
        if child in self.tables:
            raise BadInput(f"sequence {child!r} already has a block table")
        self.tables[child] = [self.allocator.share(b) for b in self.tables[parent]]
        self.lengths[child] = self.lengths[parent]

    def free(self, seq) -> None:
        for block in self.tables.pop(seq):
            self.allocator.free(block)
        del self.lengths[seq]

    def usage(self) -> dict:
        """Blocks in use, token slots they reserve, tokens the sequences hold (a shared token counts once per
        sequence), and the blocks sharing saves against every table owning its blocks."""
        used = self.allocator.num_blocks - self.allocator.num_free
        logical = sum(len(t) for t in self.tables.values())
        return dict(blocks_used=used, slots_reserved=used * self.block_size, tokens=sum(self.lengths.values()),
                    blocks_shared_saved=logical - used)


class PagedKVCache:
    """K and V for every layer in blocks, (layers, num_blocks, block_size, Hkv, D), addressed through a
    `BlockManager`'s tables; sequences are named by any hashable key (`add` one before its prefill)."""

    def __init__(self, cfg: LlamaConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kernel: bool = False):
        self.manager = BlockManager(num_blocks, block_size)
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.kernel = kernel  # decode through the Triton kernel (a GPU, or the interpreter) or its reference
        self._slots: Tensor | None = None  # this step's slots and tables, set by append_slots
        self._tables: tuple[Tensor, Tensor] | None = None

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, kernel: bool = False) -> PagedKVCache:
        w = model.output.weight
        return cls(model.config, num_blocks, block_size, dtype=w.dtype, device=w.device, kernel=kernel)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def add(self, seq) -> None:
        self.manager.add(seq)

    def fork(self, parent, child) -> None:
        self.manager.fork(parent, child)

    def free(self, seq) -> None:
        self.manager.free(seq)

    def append_slots(self, rows: list, T: int) -> Tensor:
        """`forward_cached`'s first call: blocks for T more tokens of each sequence in `rows` (copy-on-write
        applied to every layer), their positions (B, T)."""
        if not self.manager.can_append(rows, T):
            raise OutOfBlocks(f"{T} more tokens of {len(rows)} sequences need more than the "
                              f"{self.manager.allocator.num_free} free blocks")
        start = [self.manager.lengths[s] for s in rows]
        slots = []
        for seq in rows:
            seq_slots, copies = self.manager.append_slots(seq, T)
            for src, dst in copies:
                self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]
            slots.append(seq_slots)
        device = self.k.device
        self._slots = torch.tensor(slots, device=device)  # (B, T)
        self._tables = self.block_tables(rows)  # fixed until the next step: built once, not once per layer
        return torch.tensor(start, device=device)[:, None] + torch.arange(T, device=device)

    def copy_blocks_out(self, blocks: list[int]) -> tuple[Tensor, Tensor]:
        """The blocks' K and V, every layer, copied to host memory (a swap-out)."""
        index = torch.tensor(blocks, device=self.k.device)
        return self.k[:, index].cpu(), self.v[:, index].cpu()

    def copy_blocks_in(self, blocks: list[int], saved: tuple[Tensor, Tensor]) -> None:
        """`copy_blocks_out`'s copy written into (other) blocks (a swap-in)."""
        index = torch.tensor(blocks, device=self.k.device)
        self.k[:, index], self.v[:, index] = saved[0].to(self.k.device), saved[1].to(self.v.device)

    def block_tables(self, rows: list) -> tuple[Tensor, Tensor]:
        """(B, max_blocks) int32 tables (padded with 0, never read past a length) and (B,) int32 lengths."""
        tables = [self.manager.tables[s] for s in rows]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = torch.tensor([self.manager.lengths[s] for s in rows], dtype=torch.int32)
        return padded.to(self.k.device), lens.to(self.k.device)

    def update_and_attend(self, layer: int, rows: list, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """Write k, v (B, Hkv, T, D) into their slots, then attend: one new token per sequence through the
        block tables (the decode kernel or its reference); several (a prefill) over the gathered blocks."""
        B, Hkv, T, D = k.shape
        slots = self._slots.flatten()
        self.k[layer].view(-1, Hkv, D)[slots] = k.transpose(1, 2).reshape(-1, Hkv, D)  # (B T, Hkv, D)
        self.v[layer].view(-1, Hkv, D)[slots] = v.transpose(1, 2).reshape(-1, Hkv, D)
        tables, lens = self._tables
        if T == 1:
            attend = paged_attention if self.kernel else paged_attention_ref
            o = attend(q[:, :, 0], self.k[layer], self.v[layer], tables, lens, validate=False)  # (B, H, D)
            return o[:, :, None].to(q.dtype)
        keys, values = (gather_blocks(cache[layer], tables) for cache in (self.k, self.v))
        return cached_attention(q, keys, values, positions)


@torch.no_grad()
def parallel_sampling(model, prompt: Tensor, n: int, max_new_tokens: int, *, block_size: int = 16,
                      temperature: float = 1.0, generator: torch.Generator | None = None) -> tuple[Tensor, dict]:
    """n samples of one prompt (1, T0) with the prompt's blocks shared (Kwon et al. Sec. 4.4): one prefill,
    then `fork`s; each sample's first write to the shared partial block copies it. The draws are
    `generate`'s for the prompt repeated n times (one `sample` call over the n rows per step).
    Returns (tokens (n, T0 + max_new_tokens), usage): blocks used at the end against the blocks of n
    unshared copies."""
    if prompt.dim() != 2 or prompt.shape[0] != 1 or not (isinstance(n, int) and n >= 1):
        raise BadInput(f"prompt must be (1, T0) and n an int >= 1, got {tuple(prompt.shape)} and {n!r}")
    length = prompt.shape[1] + max_new_tokens
    cache = PagedKVCache.for_model(model, n * math.ceil(length / block_size), block_size)
    cache.add(0)
    logits = forward_cached(model, prompt, cache, rows=[0])[:, -1].expand(n, -1)  # (n, vocab)
    for i in range(1, n):
        cache.fork(0, i)
    tokens = prompt.expand(n, -1)
    for step in range(max_new_tokens):
        nxt = sample(logits, temperature, generator)[:, None]  # (n, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        if step < max_new_tokens - 1:
            logits = forward_cached(model, nxt, cache, rows=list(range(n)))[:, -1]
    usage = cache.manager.usage()
    return tokens, dict(blocks_used=usage["blocks_used"], blocks_unshared=n * math.ceil((length - 1) / block_size),
                        blocks_saved=usage["blocks_shared_saved"])


# ---------------------------------------------------------------- reserved vs used (Kwon et al. 2023, Sec. 3)

def reservation(lengths: list[int], block_size: int, max_len: int) -> dict:
    """Token slots `lengths` sequences reserve each way: contiguous at max_len each, or paged in whole
    blocks; waste = 1 - tokens / reserved; the paged waste per sequence is < block_size by construction."""
    if any(n < 0 or n > max_len for n in lengths):
        raise BadInput(f"lengths must lie in [0, max_len={max_len}], got {sorted(lengths)[-1]}")
    tokens = sum(lengths)
    contiguous = len(lengths) * max_len
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    return dict(tokens=tokens, contiguous_slots=contiguous, paged_slots=paged,
                contiguous_waste=1 - tokens / contiguous if contiguous else 0.0,
                paged_waste=1 - tokens / paged if paged else 0.0,
                max_internal_waste=max((math.ceil(n / block_size) * block_size - n for n in lengths), default=0))


def batch_that_fits(lengths: list[int], budget_slots: int, block_size: int, max_len: int) -> dict:
    """How many of `lengths` (taken in order) fit `budget_slots` token slots: contiguous (max_len each) vs
    paged (whole blocks of what each holds)."""
    paged, used = 0, 0
    for n in lengths:
        need = math.ceil(n / block_size) * block_size
        if used + need > budget_slots:
            break
        paged, used = paged + 1, used + need
    return dict(contiguous=min(len(lengths), budget_slots // max_len), paged=paged)


__all__ = ["BlockAllocator", "BlockManager", "OutOfBlocks", "PagedKVCache", "batch_that_fits", "parallel_sampling",
           "reservation"]
