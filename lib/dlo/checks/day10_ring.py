"""Day 10's exercise 3: ring attention's forward on ranks, re-exported by `dlo.checks.day10`.

The case is drawn here (a secret seed under `dlo grade`); each rank is given only its contiguous shard of
q, k, v (float64, odd sizes) and runs the student's function in a trusted worker that counts what it
sends, and to whom, and copies what each message carries (`dlo.checks.day7_comms.CommTap`; its total checked
against the rank's sockets, read outside it: `dlo.grading.api.verify_wire`): hop s carries the K/V block of rank
r - s, not zeros of the right size beside blocks passed through a file. The comparison with one process on the
whole sequence (`dlo.distributed.context_parallel.block_attention` over all T keys) is made here, outside the ranks; a
mismatch is named by simulating the usual slips on the same shards here (a causal mask on each block's
local positions, a hop short, the blocks' owners counted the wrong way round the ring, no rescale).
A rank that passes the right blocks but keeps them all and attends once at the end satisfies all of that (at
N = 3 it holds no more than a double-buffered ring does): where the launcher reads the ranks' memory, a large
case on 6 ranks is counted outside them too (`dlo.checks.day10_count`), its shape drawn from the seed and its
result checked like the small cases' (a digest of each rank's output against one process, the bytes its sockets
sent against the ring's).
"""

from __future__ import annotations

import random

import torch

from dlo.checks import day10_count
from dlo.checks.day4 import COLLECTIVES, one_neighbour
from dlo.checks.day7_comms import CommTap
from dlo.checks.rank_count import every_rank
from dlo.checks.torch_source import torch_defined
from dlo.distributed import context_parallel as cp
from dlo.grading.api import case_seed, check, on_ranks, verify_wire, wire_sent
from dlo.grading.compare import assert_close, fmt, ok

_EXPERIMENTAL = "torch.distributed.tensor.experimental"
_CP_NAMES = (  # torch's context parallelism doing exercises 1-3's work: its merger, its ring, its load balancers
    "_SDPAMerger", "_templated_ring_attention", "_templated_ring_attention_backward", "_RingRotater",
    "_AllToAllRotater", "_AllGatherRotater", "_create_rotater", "_sdpa_handler", "_context_parallel_buffers",
    "_context_parallel_shard", "_ContextParallel", "_scaled_dot_product_ring_flash_attention",
    "_scaled_dot_product_ring_efficient_attention", "_scaled_dot_product_ring_cudnn_attention",
    "_LoadBalancer", "_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer",
    "_RoundRobinLoadBalancer", "_SequentialSharder", "_create_default_load_balancer")


def _defined(module: str, names=_CP_NAMES, star: bool = True) -> tuple[str, ...]:
    """torch's context-parallel helpers of `module` this torch defines (`dlo.checks.torch_source`): they moved
    between releases (2.6: experimental._attention; 2.13: experimental._context_parallel._attention and
    _load_balancer), and a forbidden name that does not resolve stops the check."""
    return torch_defined(module, names, star)


TORCH_CP = (_defined(f"{_EXPERIMENTAL}._attention") + _defined(f"{_EXPERIMENTAL}._context_parallel")
            + _defined(f"{_EXPERIMENTAL}._context_parallel._attention", star=False)
            + _defined(f"{_EXPERIMENTAL}._context_parallel._load_balancer", star=False))
RING = ("dlo.distributed.context_parallel.*", "dlo.distributed.ulysses.*", "dlo.distributed.tp_comms.*",
        "dlo.distributed.expert_parallel.*") + COLLECTIVES + TORCH_CP
RING_HINT = ("pass the K/V blocks with dist.isend/dist.irecv (point-to-point) and merge the partial results "
             "with your merge_partials")


MASKS = (True, False)  # each case is run causal, then not: a slip in either branch shows


def _ring_case(seed: int, n: int) -> dict:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, H, t, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([3, 5, 7]), rng.choice([3, 4, 5])
    q, k, v = (torch.randn(B, H, n * t, D, generator=gen, dtype=torch.float64) for _ in range(3))
    return {"q": q, "k": k, "v": v, "where": dict(B=B, H=H, T=n * t, D=D, N=n)}


def _ring_worker(mine: dict, fn, masks: tuple) -> list:
    """One call of `fn` per mask (`MASKS`), each counted on its own: what it returned, what it sent, to whom."""
    out = []
    for causal in masks:
        with CommTap() as counter:  # a copy of what each message carries, taken as it is sent
            got = fn(mine["q"], mine["k"], mine["v"], causal)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return out + [{"error": f"returned {type(got).__name__}, expected a pair (o, lse)"}]
        out.append({"o": got[0], "lse": got[1], "sent": counter.by_kind("sent"), "to": counter.sent_by_peer(),
                    "records": counter.records(),
                    "payloads": [x for call, x in zip(counter.calls, counter.inputs) if call.kind == "send"]})
    return out


def _simulated(c: dict, n: int, r: int, blocks, positions, merge=cp.merge_partials):
    """Rank r's (o, lse) from the blocks `blocks` ((owner, labelled-as) ranks), each attended with the
    positions `positions(rank)` and merged by `merge`: the usual slips, replayed on the same shards."""
    T, t = c["q"].shape[2], c["q"].shape[2] // n
    shard = [slice(j * t, (j + 1) * t) for j in range(n)]
    q = c["q"][:, :, shard[r]]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for owner, label in blocks:
        o_j, l_j = cp.block_attention(q, c["k"][:, :, shard[owner]], c["v"][:, :, shard[owner]], positions(r, T, n),
                                      positions(label, T, n), c["causal"])
        o, lse = merge(o, lse, o_j, l_j)
    return o, lse


def _slips(c: dict, n: int, r: int) -> dict:
    def global_pos(j, T, n):
        return cp.contiguous_positions(T, n, j)

    def local_pos(j, T, n):
        return torch.arange(T // n)

    def no_rescale(o1, l1, o2, l2):
        return o1 + o2, torch.logaddexp(l1, l2)

    ring = [((r - s) % n, (r - s) % n) for s in range(n)]
    return {"the causal mask is applied to each block with local positions: mask with global positions (a key "
            "of an earlier rank is always visible, of a later rank never)": _simulated(c, n, r, ring, local_pos),
            "a block is missing: after N-1 hops every rank has seen all N blocks, its own included":
                _simulated(c, n, r, ring[:-1], global_pos),
            "the blocks' owners are counted the wrong way round the ring: receiving from rank r-1, after step s "
            "this rank holds the block of rank r-s": _simulated(c, n, r, [(o, (r + s) % n) for s, (o, _) in
                                                                           enumerate(ring)], global_pos),
            "the partial outputs are added without rescaling: merge with weights exp(L_i - L)":
                _simulated(c, n, r, ring, global_pos, no_rescale)}


@check(forbid=RING, hint=RING_HINT)
def check_ring_forward(fn, seed: int = 0, world_size: int = 2) -> None:
    """`fn(q, k, v, causal) -> (o, lse)` on every rank: this rank's contiguous shard (B, H, T/N, D) in, its
    queries' attention over the whole sequence out, K/V passed around the ring with point-to-point messages."""
    name, n = "ring_forward", world_size
    c = _ring_case(case_seed(seed), n)
    t = c["q"].shape[2] // n
    parts = [{x: c[x][:, :, r * t:(r + 1) * t].clone() for x in ("q", "k", "v")} for r in range(n)]
    got = every_rank(name, on_ranks(_ring_worker, n, fn, MASKS, per_rank=parts), n, fmt(c["where"]), of=list)
    for r, res in enumerate(got):  # a call per mask, or the calls up to the one that went wrong (its "error")
        if len(res) != len(MASKS) and not (res and isinstance(res[-1], dict) and "error" in res[-1]):
            raise AssertionError(f"{name}: rank {r} returned {len(res)} of {len(MASKS)} calls' results (causal, then "
                                 f"not): the grader got no result to check for the rest ({fmt(c['where'])})")
    for i, causal in enumerate(MASKS):
        _verify(name, {**c, "causal": causal}, n, [res[min(i, len(res) - 1)] for res in got])
    verify_wire(name, [[rec for call in res for rec in call["records"]] for res in got], n, fmt(c["where"]))
    counted = ""
    if wire_sent() is not None:  # ranks the launcher reads (not the tests' reused ones): the kernel's count too
        large = day10_count.count_case(case_seed(seed))
        res = on_ranks(day10_count.count_worker, day10_count.RANKS, fn, per_rank=day10_count.count_parts(large))
        counted = f"; {day10_count.verify_count(name, f'seed={seed}', res, large)}"
    ok(name, f"{n} ranks, T={c['where']['T']}, causal and not{counted}, seed={seed}")


def _verify(name: str, c: dict, n: int, got: list) -> None:
    """Every rank's (o, lse) for one mask (`c["causal"]`) against one process on the whole sequence, the usual
    slips named; what it sent (the ring's bytes), to whom (one neighbour) and what each hop carried."""
    t, T = c["q"].shape[2] // n, c["q"].shape[2]
    everything = torch.arange(T)
    o_all, lse_all = cp.block_attention(c["q"], c["k"], c["v"], everything, everything, c["causal"])
    B, H, _, D = c["q"].shape
    for r, res in enumerate(got):
        here = {**c["where"], "causal": c["causal"], "rank": r}
        if "error" in res:
            raise AssertionError(f"{name}: rank {r} {res['error']} ({fmt(here)})")
        want_o, want_lse = o_all[:, :, r * t:(r + 1) * t], lse_all[:, :, r * t:(r + 1) * t]
        for slip, (o_s, _) in _slips(c, n, r).items():
            if torch.allclose(o_s, want_o, atol=1e-9):  # the slip changes nothing on this rank
                continue
            g = torch.as_tensor(res["o"]).to(torch.float64)
            if g.shape == o_s.shape and torch.allclose(g, o_s, atol=1e-9):
                raise AssertionError(f"{name}: {slip} ({fmt(here)})")
        assert_close(name, f"rank {r}'s output o", res["o"], want_o, here)
        assert_close(name, f"rank {r}'s log-sum-exp", res["lse"], want_lse, here)
        sent, ring = sum(res["sent"].values()), cp.ring_bytes_per_rank(B, H, T, D, n, 8)
        if sent != ring:
            raise AssertionError(f"{name}: rank {r} sent {sent:,.0f} bytes; passing its K and V blocks N-1 = {n - 1} "
                                 f"times around the ring sends {ring:,} (2 B H T/N D x 8 bytes per hop) ({fmt(here)})")
        if not one_neighbour(res["to"], r, n):
            raise AssertionError(f"{name}: rank {r} sent to ranks {sorted(res['to'])}: in a ring each rank passes "
                                 f"the K/V block it holds to one neighbour, (rank + 1) % N; sending its own block to "
                                 f"every rank moves the same bytes but keeps all N blocks at once ({fmt(here)})")
        _hops_carry_blocks(name, c, n, r, res, here)


def _sent_values(payloads: list) -> torch.Tensor:
    """What a rank sent, in order, as float64 values: the bytes as they went, whatever dtype they went as."""
    raw = [torch.as_tensor(p).contiguous().reshape(-1).view(torch.uint8) for p in payloads]
    return torch.cat(raw).view(torch.float64) if raw else torch.zeros(0, dtype=torch.float64)


def _hops_carry_blocks(name: str, c: dict, n: int, r: int, res: dict, here: dict) -> None:
    """What rank r's messages carry, hop by hop: at hop s (from 0) the K and V blocks of rank (r - s) mod N, its
    own at hop 0 (of rank (r + s) mod N for a ring run the other way), as values in any layout (K and V as two
    messages or one stacked, concatenated, transposed). Counts and peers do not see contents: zeros of the right
    size pass them while the blocks travel beside the process group (a file in /tmp), as a red team's did."""
    t = c["q"].shape[2] // n
    block = {j: torch.cat([c[x][:, :, j * t:(j + 1) * t].reshape(-1) for x in ("k", "v")]).sort().values
             for j in range(n)}
    size, way = block[0].numel(), 1 if set(res["to"]) == {(r + 1) % n} else -1
    sent, peer = _sent_values(res["payloads"]), (r + way) % n
    for s in range(n - 1):
        hop, want = sent[s * size:(s + 1) * size].sort().values, (r - way * s) % n
        if hop.shape == block[want].shape and torch.equal(hop, block[want]):
            continue
        seen = next((f"the K and V blocks of rank {j}" for j in block if hop.shape == block[j].shape
                     and torch.equal(hop, block[j])), "zeros" if not hop.any() else "values of no rank's K and V")
        held = "its own" if s == 0 else f"received at hop {s}"
        raise AssertionError(f"{name}: rank {r}'s hop {s + 1} of {n - 1} to rank {peer} carried {seen}, expected the "
                             f"K and V blocks of rank {want} ({held}): each hop passes on the block the rank holds, "
                             f"the values themselves, not stand-ins of the right size ({fmt(here)})")
