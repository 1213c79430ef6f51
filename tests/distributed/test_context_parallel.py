"""Context parallelism (ring attention, its all-gather version, Ulysses) against one process on the
whole sequence, in float64 at 2 and 3 gloo ranks, contiguous and zig-zag, causal and not; the bytes each
rank sends against the formulas; and the wrong variants a Day 10 check must reject, each shown to differ."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dlo.attention import naive_attention
from dlo.distributed import context_parallel as cp
from dlo.distributed import launch, ulysses
from dlo.errors import BadInput
from dlo.measure import CommCounter, gloo_wire_bytes, saved_bytes, tcp_available, tcp_sent
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
B, H, HD = 2, 6, 5  # H divisible by 2 and 3 (Ulysses); head dim odd
CASES = [(causal, zigzag) for causal in (True, False) for zigzag in (False, True)]
IMPLS = {"ring": cp.ring_attention, "allgather": cp.allgather_attention, "ulysses": ulysses.ulysses_attention}


def seq_len(n, zigzag):
    """Odd shards: T/N = 7 contiguous, zig-zag chunks of 3."""
    return 2 * n * 3 if zigzag else n * 7


def full_inputs(T):
    g = torch.Generator().manual_seed(T)
    return [torch.randn(B, H, T, HD, generator=g, dtype=D) for _ in range(4)]  # q, k, v, upstream gradient


def reference(T, causal):
    q, k, v, up = full_inputs(T)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    o = naive_attention(q, k, v, causal)
    (o * up).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def _worker():
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for causal, zigzag in CASES:
        T = seq_len(n, zigzag)
        pos = cp.rank_positions(T, n, r, zigzag)
        q, k, v, up = (x[..., pos, :] for x in full_inputs(T))
        for name, fn in IMPLS.items():
            q1, k1, v1 = (x.clone().requires_grad_(True) for x in (q, k, v))
            with CommCounter() as fwd:
                o = fn(q1, k1, v1, causal=causal, zigzag=zigzag)
            with CommCounter() as bwd:
                (o * up).sum().backward()
            out[name, causal, zigzag] = (o.detach(), q1.grad, k1.grad, v1.grad, fwd.by_kind("sent"),
                                         bwd.by_kind("sent"))
    sub = dist.new_group([0, 2]) if n == 3 else None  # every rank creates it; ranks 0 and 2 run a ring on it
    if sub is not None and r in (0, 2):
        T, mine = 2 * 7, r // 2  # global rank 2 is rank 1 of the subgroup
        pos = cp.contiguous_positions(T, 2, mine)
        q, k, v, up = (x[..., pos, :].clone().requires_grad_(True) for x in full_inputs(T))
        o = cp.ring_attention(q, k, v, causal=True, group=sub)
        (o * up.detach()).sum().backward()
        out["subgroup"] = (mine, o.detach(), q.grad, k.grad, v.grad)
    out["saved"] = {name: [_saved(fn, T) for T in (8 * n, 16 * n)] for name, fn in IMPLS.items()}
    if tcp_available():
        out["wire"] = {name: _wire(IMPLS[name]) for name in ("ring", "ulysses")}
    return out


def _saved(fn, T):
    """Bytes autograd keeps for backward on this rank beyond q, k, v (causal, contiguous)."""
    q, k, v = (torch.randn(B, H, T // dist.get_world_size(), HD, dtype=D, requires_grad=True) for _ in range(3))
    return saved_bytes(lambda: fn(q, k, v), exclude=(q, k, v), backward=False)["saved_bytes"]


def _wire(fn):
    """(bytes this rank's TCP sockets sent, what gloo sends for the collectives counted) over one forward
    and backward at T/N = 64, D = 16 (a K/V block of 98 kB)."""
    n, r = dist.get_world_size(), dist.get_rank()
    T = 64 * n
    q, k, v = (x[..., cp.contiguous_positions(T, n, r), :] for x in torch.randn(3, B, H, T, 16, dtype=D))
    counted = []

    def step():
        q1 = q.clone().requires_grad_(True)
        with CommCounter() as c:
            fn(q1, k, v.clone().requires_grad_(True)).sum().backward()
        counted.append(c.records())

    step()  # warm-up
    sent, _ = tcp_sent(step, 1)
    return sent, gloo_wire_bytes(counted[-1])


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    n = request.param
    return n, launch(_worker, n, backend="gloo")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_equal_to_one_process(results, impl):
    """Outputs and the q, k, v gradients of every rank are the full sequence's, at its positions."""
    n, res = results
    for causal, zigzag in CASES:
        T = seq_len(n, zigzag)
        want = reference(T, causal)
        for r, out in enumerate(res):
            pos = cp.rank_positions(T, n, r, zigzag)
            for got, full in zip(out[impl, causal, zigzag][:4], want):
                torch.testing.assert_close(got, full[..., pos, :], rtol=1e-12, atol=1e-12)


def test_ring_on_a_subgroup(results):
    """Ranks 0 and 2 of three as a context-parallel group of two (group ranks, not global ones)."""
    n, res = results
    if n != 3:
        pytest.skip("a subgroup of two needs three ranks")
    want = reference(14, True)
    for out in (res[0], res[2]):
        mine, *got = out["subgroup"]
        for g, full in zip(got, want):
            torch.testing.assert_close(g, full[..., cp.contiguous_positions(14, 2, mine), :], rtol=1e-12, atol=1e-12)


def test_one_rank_sends_nothing():
    assert cp.ring_bytes_per_rank(B, H, 16, HD, 1, 8, backward=True) == cp.ring_bytes_per_rank(B, H, 16, HD, 1, 8) == 0


def test_bytes_per_rank_match_the_formulas(results):
    """Counted at the dispatcher on every rank: ring sends K/V N-1 times forward (K/V again and their
    gradients N times backward), Ulysses four all-to-alls each way, the naive version two all-gathers."""
    n, res = results
    s = torch.finfo(D).bits // 8
    for causal, zigzag in CASES:
        T = seq_len(n, zigzag)
        for out in res:
            fwd, bwd = out["ring", causal, zigzag][4:]
            assert fwd == {"send": cp.ring_bytes_per_rank(B, H, T, HD, n, s), "recv": 0.0}
            assert fwd["send"] + bwd["send"] == cp.ring_bytes_per_rank(B, H, T, HD, n, s, backward=True)
            fwd, bwd = out["ulysses", causal, zigzag][4:]
            assert fwd["all_to_all"] == pytest.approx(ulysses.ulysses_bytes_per_rank(B, H, T, HD, n, s))
            assert fwd["all_to_all"] + bwd["all_to_all"] == pytest.approx(
                ulysses.ulysses_bytes_per_rank(B, H, T, HD, n, s, backward=True))
            fwd = out["allgather", causal, zigzag][4]
            assert fwd["all_gather"] == pytest.approx(cp.allgather_bytes_per_rank(B, H, T, HD, n, s))
    # Ulysses sends N/2 times fewer bytes than the ring: equal at N = 2, fewer beyond
    T = 2 * 3 * 8
    ratio = cp.ring_bytes_per_rank(B, H, T, HD, n, s) / ulysses.ulysses_bytes_per_rank(B, H, T, HD, n, s)
    assert ratio == pytest.approx(n / 2)


def test_memory_saved_per_rank(results):
    """Ring attention keeps this rank's output and log-sum-exp only (linear in T/N); the all-gather version
    keeps all T keys and values and T/N x T scores, Ulysses T x T scores for H/N heads: both grow faster."""
    n, res = results
    for out in res:
        ring, gathered, uly = out["saved"]["ring"], out["saved"]["allgather"], out["saved"]["ulysses"]
        assert ring == [cp.ring_saved_bytes(B, H, T, HD, n, 8) for T in (8 * n, 16 * n)]
        assert gathered[1] / gathered[0] > 3 and uly[1] / uly[0] > 3 and ring[1] / ring[0] == 2


def test_bytes_on_the_wire(results):
    """The kernel's TCP counters on every rank (`dlo.measure.tcp_sent`) against what gloo
    sends for the counted calls (`dlo.measure.gloo_wire_bytes`: payload and gloo's headers)."""
    n, res = results
    if "wire" not in res[0]:
        pytest.skip("no TCP counters here (Linux TCP_INFO)")
    for out in res:
        for name, (sent, (payload, headers)) in out["wire"].items():
            assert 0.99 * payload <= sent <= 1.01 * payload + headers + 400, (name, sent, payload, headers)


# ----------------------------------------------------------------------------- one process: the pieces

def test_merge_of_two_key_halves_is_attention_over_both():
    T = 9
    q, k, v, _ = full_inputs(T)
    pos = torch.arange(T)
    for causal in (True, False):
        want, want_lse = cp.block_attention(q, k, v, pos, pos, causal)
        torch.testing.assert_close(want, naive_attention(q, k, v, causal), rtol=1e-12, atol=1e-12)
        a, b = cp.block_attention(q, k[..., :4, :], v[..., :4, :], pos, pos[:4], causal), \
            cp.block_attention(q, k[..., 4:, :], v[..., 4:, :], pos, pos[4:], causal)
        o, lse = cp.merge_partials(*a, *b)
        torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        if causal:  # rows that saw no key of the second half keep the first half's result, no nan
            assert torch.isinf(b[1][..., :4]).all() and not torch.isnan(o).any()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_one_rank_without_a_process_group_is_plain_attention(impl):
    """World 1 (no process group): no message, the same outputs and gradients (what NCCL world 1 runs)."""
    for causal in (True, False):
        want = reference(7, causal)
        q, k, v, up = full_inputs(7)
        q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = IMPLS[impl](q, k, v, causal=causal)
        (o * up).sum().backward()
        for got, full in zip((o.detach(), q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)


def test_zigzag_split_and_its_inverse():
    n, T = 3, 18
    x = torch.arange(T).view(1, 1, T, 1)
    shards = [cp.zigzag_split(x, n, r) for r in range(n)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 15, 16, 17]
    for r in range(n):
        assert torch.equal(shards[r].flatten(), cp.zigzag_positions(T, n, r))
    assert torch.equal(cp.zigzag_unsplit(shards), x)
    with pytest.raises(BadInput, match="2N"):
        cp.zigzag_split(x, 4, 0)


def test_causal_work_per_rank_contiguous_against_zigzag():
    """The ring's own trimming: contiguous, rank r computes (r + 1) blocks of (T/N)^2 scores; zig-zag,
    (N + 1)/2 blocks on every rank; the same total. The useful pairs (k <= q) per rank are equal under
    zig-zag only."""
    for n in (2, 3, 4):
        T = 2 * n * 5
        t = T // n
        assert cp.ring_work(T, n, causal=True) == [(r + 1) * t * t for r in range(n)]
        assert cp.ring_work(T, n, causal=True, zigzag=True) == [(n + 1) * t * t // 2] * n
        assert cp.ring_work(T, n, causal=False) == [n * t * t] * n
        pairs = {z: [cp.causal_pairs(cp.rank_positions(T, n, r, z), torch.arange(T)) for r in range(n)]
                 for z in (False, True)}
        assert sum(pairs[False]) == sum(pairs[True]) == T * (T + 1) // 2
        assert len(set(pairs[True])) == 1 and pairs[False][-1] > pairs[False][0]


def test_uneven_shards_refused_before_any_work():
    with pytest.raises(BadInput, match="pad it to a multiple of 3"):
        cp.contiguous_positions(10, 3, 0)
    q = torch.zeros(1, 5, 4, 2)
    with pytest.raises(BadInput, match="of one shape"):
        ulysses.ulysses_attention(q, q, q.clone()[:, :4])


# ----------------------------------------------------------------------------- the wrong variants

def simulated_ring(q, k, v, n, causal, zigzag, merge=cp.merge_partials, positions=cp.rank_positions):
    """Ring attention's arithmetic in one process (rank by rank, block by block), with a merge and a
    position rule to swap for wrong ones: the reference a check compares a student's pieces with."""
    T = q.shape[-2]
    outs = []
    for r in range(n):
        pos_r = positions(T, n, r, zigzag)
        o = lse = None
        for step in range(n):
            j = (r - step) % n
            pos_j = positions(T, n, j, zigzag)
            part = cp.block_attention(q[..., pos_r, :], k[..., pos_j, :], v[..., pos_j, :], pos_r, pos_j, causal)
            o, lse = part if o is None else merge(o, lse, *part)
        outs.append(o)
    return torch.cat(outs, 2), torch.cat([positions(T, n, r, zigzag) for r in range(n)])


def merge_without_rescale(o1, lse1, o2, lse2):
    """Wrong: the partial outputs added as they are (each normalised by its own block's sum)."""
    return o1 + o2, torch.maximum(lse1, lse2)


def merge_by_max_only(o1, lse1, o2, lse2):
    """Wrong: rescaled by the maxima but not by the blocks' sums (m instead of L)."""
    lse = torch.maximum(lse1, lse2)
    return torch.exp(lse1 - lse).unsqueeze(-1) * o1 + torch.exp(lse2 - lse).unsqueeze(-1) * o2, lse


def local_positions(T, n, r, zigzag):
    """Wrong: each block masked with its own triangle (positions restart at 0 on every rank)."""
    return torch.arange(T // n)


def zigzag_off_by_one(T, n, r, zigzag):
    """Wrong: the tail chunk 2N-r instead of 2N-1-r (wraps to chunk 0 on rank 0)."""
    c = T // (2 * n)
    tail = (2 * n - r) % (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


@pytest.mark.parametrize("n", [2, 3])
def test_simulated_ring_is_attention_and_each_wrong_variant_is_not(n):
    for causal, zigzag in CASES:
        T = seq_len(n, zigzag)
        q, k, v, _ = full_inputs(T)
        want = naive_attention(q, k, v, causal)
        o, pos = simulated_ring(q, k, v, n, causal, zigzag)
        torch.testing.assert_close(o, want[..., pos, :], rtol=1e-12, atol=1e-12)
        for merge in (merge_without_rescale, merge_by_max_only):
            o, pos = simulated_ring(q, k, v, n, causal, zigzag, merge=merge)
            assert not torch.allclose(o, want[..., pos, :], atol=1e-3), merge.__name__
        if causal:
            o, _ = simulated_ring(q, k, v, n, causal, zigzag, positions=local_positions)
            assert not torch.allclose(o, want[..., pos, :], atol=1e-3)
        if zigzag:
            wrong = [zigzag_off_by_one(T, n, r, True) for r in range(n)]
            assert any(not torch.equal(w, cp.zigzag_positions(T, n, r)) for r, w in enumerate(wrong))
    x = torch.arange(12).view(1, 1, 12, 1)
    shards = [cp.zigzag_split(x, 2, r) for r in range(2)]
    assert not torch.equal(torch.cat(shards, 2), x)  # concatenating is not the inverse
