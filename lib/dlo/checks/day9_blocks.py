"""Day 9's check of the block manager (Kwon et al. 2023, Sec. 4.2-4.4), re-exported by `dlo.checks.day9`.

The block manager is a student class run in a worker through hidden sequences of operations (add, append,
fork, free; then, from the reference's state, appends that do not fit: one block short of the free list, short
only by copy-on-write's copy, longer than the pool; one that takes every free block; an append of 0 tokens to a
shared partial block); its state after every operation (tables, lengths, reference counts, free list, and what
append returned) is compared with `dlo.inference.paged.BlockManager` run through the same operations.
"""

from __future__ import annotations

import random

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import fmt, ok
from dlo.inference.paged import BlockManager

BLOCKS = ("dlo.inference.paged.BlockManager", "dlo.inference.paged.BlockAllocator", "dlo.inference.paged.PagedKVCache",
          "dlo.inference.batching.Scheduler")


# ----------------------------------------------------------------------------- exercise 2: the block manager

def _operations(rng: random.Random, num_blocks: int, block_size: int) -> list[tuple]:
    """A hidden sequence of valid operations: prompts appended, forks of a partial last block (so that the
    next append copies it), frees (whose blocks are reused), one append longer than the pool; then the limits
    of the free list (`_limits`)."""
    ops, live, nxt = [], [], 0
    for _ in range(2):
        ops += [("add", nxt), ("append", nxt, rng.randint(1, 2 * block_size) + (block_size if not nxt else 0))]
        live.append(nxt)
        nxt += 1
    for _ in range(rng.randint(6, 9)):
        kind = rng.choice(["append", "append", "fork", "fork", "free"] if len(live) > 1 else ["append", "fork"])
        if kind == "append":
            ops.append(("append", rng.choice(live), rng.randint(1, block_size + 1)))
        elif kind == "fork":
            ops.append(("fork", rng.choice(live), nxt))
            live.append(nxt)
            nxt += 1
        else:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
    ops.append(("append", live[0], num_blocks * block_size))  # never fits: refused, nothing changed
    ops.append(("append", live[-1], 1))
    return ops + _limits(rng, ops, live, nxt, num_blocks, block_size)


def _limits(rng: random.Random, ops: list, live: list, nxt: int, num_blocks: int, bs: int) -> list[tuple]:
    """From the reference's state after `ops`: a sequence with a shared, partial last block (add, append,
    fork), an append of 0 tokens to it (no copy), an append one block short of the free list (refused), one
    short only by copy-on-write's copy (refused), then one to the shared block that takes every free block."""
    ref, more = BlockManager(num_blocks, bs), []

    def do(op):
        more.append(op)
        _apply(ref, op)

    for op in ops:
        _apply(ref, op)
    while ref.allocator.num_free < 3 and live:
        do(("free", live.pop(0)))
    do(("add", nxt))
    do(("append", nxt, rng.randint(1, bs - 1)))
    do(("fork", nxt, nxt + 1))
    shared = [nxt, nxt + 1]
    rng.shuffle(shared)
    do(("append", shared[0], 0))
    plain = [seq for seq in live if not _cow(ref, seq)] or live or [nxt + 2]
    if not live:
        do(("add", nxt + 2))
    free = ref.allocator.num_free
    do(("append", (seq := rng.choice(plain)), _taking(rng, ref, seq, free + 1)))
    do(("append", shared[1], _taking(rng, ref, shared[1], free + 1)))
    do(("append", shared[0], _taking(rng, ref, shared[0], free)))
    return more


def _cow(ref: BlockManager, seq) -> bool:
    """Appending to `seq` copies its last block first: partial and shared."""
    table, n = ref.tables[seq], ref.lengths[seq]
    return bool(n % ref.block_size and ref.allocator.ref_counts[table[-1]] > 1)


def _taking(rng: random.Random, ref: BlockManager, seq, need: int) -> int:
    """T such that appending T tokens to `seq` takes exactly `need` free blocks (copy-on-write's copy counted)."""
    n, m, bs = ref.lengths[seq], len(ref.tables[seq]), ref.block_size
    new = need - _cow(ref, seq)  # blocks past the table's: length + T in ((m + new - 1) bs, (m + new) bs]
    return rng.randint(max(n, (m + new - 1) * bs) + 1, (m + new) * bs) - n


def _apply(manager, op: tuple):
    kind, seq, *more = op
    if kind == "append":
        try:
            slots, copies = manager.append_slots(seq, more[0]) if isinstance(manager, BlockManager) else \
                manager.append(seq, more[0])
        except RuntimeError:
            return "RuntimeError"
        return [list(map(int, slots)), [list(map(int, c)) for c in copies]]
    if kind == "fork":
        return manager.fork(seq, more[0])
    return getattr(manager, kind)(seq)


def _state(tables, lengths, ref_counts, free_list, result) -> dict:
    return dict(tables={int(s): [int(b) for b in t] for s, t in tables.items()},
                lengths={int(s): int(n) for s, n in lengths.items()}, ref_counts=[int(c) for c in ref_counts],
                free_list=[int(b) for b in free_list], result=result)


def _blocks_worker(cls, num_blocks: int, block_size: int, ops: list) -> list:
    """The student's manager through `ops`: its state after each one (an exception ends the list)."""
    manager, states = cls(num_blocks, block_size), []
    for op in ops:
        try:
            result = _apply(manager, op)
        except Exception as exc:  # noqa: BLE001 (reported as the student's error, by op)
            return states + [f"{type(exc).__name__}: {exc}"]
        states.append(_state(manager.tables, manager.lengths, manager.ref_counts, manager.free_list,
                             result if op[0] == "append" else None))
    return states


def _reference(num_blocks: int, block_size: int, ops: list) -> list:
    manager, states = BlockManager(num_blocks, block_size), []
    for op in ops:
        result = _apply(manager, op)
        a = manager.allocator
        states.append(_state(manager.tables, manager.lengths, a.ref_counts, a.free_list,
                             result if op[0] == "append" else None))
    return states


_NO_COW = ("no copy-on-write: appending to a sequence whose last, partial block is shared (ref count > 1) must first "
           "copy that block to a newly allocated one (returned in copies) and write there")


def _refusal(op: tuple, before: dict | None, block_size: int, got=None) -> str:
    """Why the reference refused `op`, an append, from its state `before` (`got`: what the student's returned)."""
    seq, T = op[1], op[2]
    table, n = before["tables"][seq], before["lengths"][seq]
    new = -(-(n + T) // block_size) - len(table)
    if n % block_size and before["ref_counts"][table[-1]] > 1 and new == len(before["free_list"]):
        if isinstance(got, list) and not got[1]:
            return _NO_COW
        return ("copy-on-write's copy counts: the free blocks must cover the new blocks plus one for the copy of a "
                f"shared, partial last block ({new} + 1 > {new} free), else raise RuntimeError before changing "
                "anything (all or nothing)")
    return (f"an append that needs more blocks than are free ({new} > {len(before['free_list'])}) must raise "
            "RuntimeError before changing anything (all or nothing)")


def _blocks_mistake(op: tuple, got: dict, want: dict, before: dict | None, block_size: int) -> str:
    """What the first difference says about the student's manager (`before`: the reference's state before `op`)."""
    if op[0] == "append" and want["result"] == "RuntimeError":
        return _refusal(op, before, block_size, got["result"])
    if op[0] == "append" and op[2] == 0:
        return "append(seq, 0) writes nothing: no copy-on-write and no new block when T == 0, slots and copies empty"
    if op[0] == "append" and isinstance(got["result"], list) and want["result"][1] and not got["result"][1]:
        return _NO_COW
    if op[0] == "free" and any(got["ref_counts"][b] > 0 for b in got["free_list"]):
        return ("a freed block is still referenced: free decrements each block's count and returns a block to the "
                "free list only when its count reaches 0")
    if got["tables"] == want["tables"] and got["result"] != want["result"] and op[0] == "append":
        return "the slots: token t is at table[t // block_size] * block_size + t % block_size"
    if op[0] == "fork" and got["ref_counts"] != want["ref_counts"]:
        return "fork shares every block of the parent: each shared block's reference count goes up by one"
    if got["free_list"] != want["free_list"] and got["tables"] != want["tables"]:
        return ("the blocks allocated: take free_list.pop() (block 0 first), and push a block back with "
                "free_list.append when it is freed, so the last freed block is the next allocated")
    return "the state differs from vLLM's block manager's"


@check(forbid=BLOCKS)
def check_block_manager(cls, seed: int = 0, trials: int = 3) -> None:
    """`cls(num_blocks, block_size)` with add / append / fork / free and the attributes tables, lengths,
    ref_counts, free_list; against `dlo.inference.paged.BlockManager` after every operation."""
    name, rng = "block_manager", random.Random(case_seed(seed))
    for _ in range(trials):
        block_size, num_blocks = rng.choice([2, 3, 4, 5]), rng.choice([24, 31])
        ops = _operations(rng, num_blocks, block_size)
        got = run_student(_blocks_worker, cls, num_blocks, block_size, ops)
        want = _reference(num_blocks, block_size, ops)
        for i, (op, w) in enumerate(zip(ops, want)):
            where = dict(num_blocks=num_blocks, block_size=block_size, operation=i, op=op)
            before = want[i - 1] if i else None
            if i >= len(got) or isinstance(got[i], str):
                error = got[i] if i < len(got) else "nothing"
                why = f": {_refusal(op, before, block_size)}" if w["result"] == "RuntimeError" else ""
                raise AssertionError(f"{name}: {op} raised {error}{why} ({fmt(where)}; operations before it: "
                                     f"{ops[:i]})")
            if got[i] != w:
                diff = [k for k in w if got[i][k] != w[k]]
                slip = _blocks_mistake(op, got[i], w, before, block_size)
                raise AssertionError(f"{name}: after {op}, {', '.join(diff)} differ: {slip}. Got "
                                     f"{ {k: got[i][k] for k in diff} }, expected { {k: w[k] for k in diff} } "
                                     f"({fmt(where)}; operations before it: {ops[:i]})")
    ok(name, f"{trials} hidden sequences of operations, seed={seed}")
