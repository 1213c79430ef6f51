"""Day 9's checks of the block manager (Kwon et al. 2023, Sec. 4.2-4.4) and of speculative decoding's
acceptance rule (Leviathan et al. 2023, Algorithm 1), re-exported by `dlo.checks.day9`.

The block manager is a student class run in a worker through hidden sequences of operations (add,
append, fork, free, and an append that does not fit); its state after every operation (tables, lengths,
reference counts, free list, and what append returned) is compared with `dlo.inference.paged.BlockManager`
run through the same operations. The acceptance rule is run on 20,000 rounds at once and judged by the
distributions it must keep (module docstring of `dlo.checks.day9`).
"""

from __future__ import annotations

import random

import torch

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import fmt, ok
from dlo.inference.paged import BlockManager
from dlo.inference.speculative import chi_square, chi_square_quantile

BLOCKS = ("dlo.inference.paged.BlockManager", "dlo.inference.paged.BlockAllocator", "dlo.inference.paged.PagedKVCache",
          "dlo.inference.batching.Scheduler")
SPECULATIVE = ("dlo.inference.speculative.accept_draft", "dlo.inference.speculative.speculative_generate")


# ----------------------------------------------------------------------------- exercise 2: the block manager

def _operations(rng: random.Random, num_blocks: int, block_size: int) -> list[tuple]:
    """A hidden sequence of valid operations: prompts appended, forks of a partial last block (so that the
    next append copies it), frees (whose blocks are reused), one append longer than the free blocks."""
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
    return ops


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


def _blocks_mistake(op: tuple, got: dict, want: dict) -> str:
    """What the first difference says about the student's manager."""
    if op[0] == "append" and want["result"] == "RuntimeError":
        return ("an append that needs more blocks than are free must raise RuntimeError before changing anything "
                "(all or nothing)")
    if op[0] == "append" and isinstance(got["result"], list) and want["result"][1] and not got["result"][1]:
        return ("no copy-on-write: appending to a sequence whose last, partial block is shared (ref count > 1) must "
                "first copy that block to a newly allocated one (returned in copies) and write there")
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
            if i >= len(got) or isinstance(got[i], str):
                error = got[i] if i < len(got) else "nothing"
                raise AssertionError(f"{name}: {op} raised {error} ({fmt(where)}; operations before it: {ops[:i]})")
            if got[i] != w:
                diff = [k for k in w if got[i][k] != w[k]]
                slip = _blocks_mistake(op, got[i], w)
                raise AssertionError(f"{name}: after {op}, {', '.join(diff)} differ: {slip}. Got "
                                     f"{ {k: got[i][k] for k in diff} }, expected { {k: w[k] for k in diff} } "
                                     f"({fmt(where)}; operations before it: {ops[:i]})")
    ok(name, f"{trials} hidden sequences of operations, seed={seed}")


# ----------------------------------------------------------------------------- exercise 3: the acceptance rule

N_ROUNDS = 20_000
Z = 4.265  # the standard normal's 1 - 1e-5 quantile: a right rule fails a test once in 100,000 cases


def _accept_worker(fn, p, q, drafts, seed: int):
    out = fn(p, q, drafts, torch.Generator().manual_seed(seed))
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        return f"a {type(out).__name__}"
    return [x.detach() for x in out]


def _distribution(rng: random.Random, gen: torch.Generator, V: int) -> torch.Tensor:
    x = torch.rand(V, generator=gen, dtype=torch.float64) + rng.choice([0.05, 0.2])
    return x / x.sum()


def _wrong_first(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first emitted token's distribution under the usual wrong rules (p (k+1, V), q (k, V))."""
    p1, q1 = p[0], q[0]
    alpha = torch.minimum(p[:-1], q).sum(-1)  # (k,) each position's acceptance rate
    residual = (p1 - q1).clamp(min=0) / (p1 - q1).clamp(min=0).sum()
    kept_by_q_over_p = q1 * torch.minimum(torch.ones_like(q1), q1 / p1)
    kept = torch.minimum(p1, q1) / q1  # a draft x at the first position is accepted with this probability
    later = 1 - torch.prod(1 - alpha[1:])  # some later draft accepted: n > 0 when n counts every acceptance
    return {"accepted every draft: accept x with probability min(1, p(x) / q(x)), not always": q1,
            "on a rejection you sampled from p: sample from the residual norm(max(0, p - q))":
            torch.minimum(p1, q1) + (1 - alpha[0]) * p1,
            "the ratio is upside down: accept with probability min(1, p(x) / q(x)), p the target's":
            kept_by_q_over_p + (1 - kept_by_q_over_p.sum()) * residual,
            "n counted every accepted draft: n is the accepted prefix, it stops at the first rejection":
            q1 * (kept + (1 - kept) * later) + (1 - alpha[0]) * (1 - later) * residual}


def _fit(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    return chi_square(counts, probs) < chi_square_quantile(len(probs) - 1, Z)


@check(forbid=SPECULATIVE)
def check_accept_draft(fn, seed: int = 0, trials: int = 2) -> None:
    """`fn(p, q, drafts, generator) -> (n, token)` on 20,000 rounds at once: p (B, k+1, V), q (B, k, V),
    drafts (B, k) drawn from q. The first token emitted must follow p_1 and the second p_2 (chi-square);
    with q = p every draft is accepted and the bonus token follows p_{k+1}."""
    name, rng = "accept_draft", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for _ in range(trials):
        k, V = rng.choice([2, 3]), rng.choice([5, 6, 7])
        p = torch.stack([_distribution(rng, gen, V) for _ in range(k + 1)])  # (k+1, V)
        for same in (False, True):
            q = p[:k].clone() if same else torch.stack([_distribution(rng, gen, V) for _ in range(k)])
            drafts = torch.multinomial(q, N_ROUNDS, replacement=True, generator=gen).t().contiguous()  # (B, k)
            P, Q = p.expand(N_ROUNDS, k + 1, V).contiguous(), q.expand(N_ROUNDS, k, V).contiguous()
            got = run_student(_accept_worker, fn, P, Q, drafts, rng.randrange(1 << 30))
            where = dict(k=k, V=V, rounds=N_ROUNDS, q_equals_p=same)
            if isinstance(got, str):
                raise AssertionError(f"{name}: return a tuple (n, token) of two tensors, got {got} ({fmt(where)})")
            n, token = (x.long().flatten() for x in got)
            if n.shape != (N_ROUNDS,) or token.shape != (N_ROUNDS,) or n.min() < 0 or n.max() > k or \
                    token.min() < 0 or token.max() >= V:
                raise AssertionError(f"{name}: n and token must be (B,) = ({N_ROUNDS},), n in [0, k={k}] and tokens in "
                                     f"[0, V={V}); got shapes "
                                     f"{tuple(got[0].shape)}, {tuple(got[1].shape)} ({fmt(where)})")
            if same:
                _check_all_accepted(name, n, token, p, k, where)
                continue
            first = torch.where(n > 0, drafts[:, 0], token)
            counts = torch.bincount(first, minlength=V)
            if not _fit(counts, p[0]):
                fits = {slip: chi_square(counts, probs) for slip, probs in _wrong_first(p, q).items()
                        if _fit(counts, probs)}
                if fits:  # the wrong rule whose distribution the counts fit best
                    raise AssertionError(f"{name}: {min(fits, key=fits.get)} ({fmt(where)})")
                raise AssertionError(f"{name}: the first token emitted does not follow the target's p_1 (chi-square "
                                     f"{chi_square(counts, p[0]):.1f} > {chi_square_quantile(V - 1, Z):.1f} at {V - 1} "
                                     f"degrees of freedom): the rule must keep the target's distribution "
                                     f"({fmt(where)})")
            second = torch.where(n > 1, drafts[:, 1], token)[n > 0]
            if not _fit(torch.bincount(second, minlength=V), p[1]):
                raise AssertionError(f"{name}: after an accepted first draft, the second token does not follow p_2: n "
                                     f"is the accepted prefix, stop at the first rejection (the drafts after it are "
                                     f"dropped, however they would fare) ({fmt(where)})")
    ok(name, f"{trials} trials of {N_ROUNDS:,} rounds, seed={seed}")


def _check_all_accepted(name: str, n, token, p, k: int, where: dict) -> None:
    if not bool((n == k).all()):
        raise AssertionError(f"{name}: with q = p every draft must be accepted (min(1, p/q) = 1), but n < k in "
                             f"{int((n < k).sum())} rounds ({fmt(where)})")
    counts = torch.bincount(token, minlength=p.shape[1])
    if not _fit(counts, p[k]):
        said = "drawn from p_k, the last draft's position" if _fit(counts, p[k - 1]) else "not drawn from p_{k+1}"
        raise AssertionError(f"{name}: no +1 bonus token: when all k drafts are accepted the token emitted after them "
                             f"is drawn from p_{{k+1}}, the target's distribution after the last draft; yours is "
                             f"{said} ({fmt(where)})")
