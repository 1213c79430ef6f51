"""Ring all-reduce, bus bandwidth and the alpha-beta fit.

One launch (3 ranks, so the ring has a real middle rank) does every multi-process comparison; the
model fits run in-process on synthetic timings.
"""

import math

import pytest
import torch
import torch.distributed as dist

from dlo.distributed import launch
from dlo.distributed.collectives import allreduce_time, bus_bandwidth, bus_factor, fit_alpha_beta, ring_all_reduce


def _ring_vs_torch():
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + r)  # different data on every rank
    errors = []
    # sizes below, at and above the world size, odd and non-contiguous shapes
    for shape, dtype in [((1,), torch.float64), ((2,), torch.float32), ((7,), torch.float64),
                         ((5, 13), torch.float32), ((1001,), torch.float64), ((3, 4, 5), torch.float64)]:
        x = torch.randn(shape, generator=gen, dtype=dtype)
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        out = ring_all_reduce(got)
        assert out is got
        errors.append((str(dtype), tuple(shape), (got - want).abs().max().item()))
    ints = torch.arange(11, dtype=torch.int64) * (r + 1)
    ring_all_reduce(ints)
    errors.append(("int64", (11,), (ints - torch.arange(11) * 6).abs().max().item()))
    t = torch.randn(6, 4, generator=gen, dtype=torch.float64).t()  # non-contiguous view
    want = t.clone()
    dist.all_reduce(want)
    ring_all_reduce(t)
    errors.append(("transposed", tuple(t.shape), (t - want).abs().max().item()))
    rows = bus_bandwidth([64, 4096], reps=2, warmup=1)
    return errors, rows


def test_ring_all_reduce_matches_torch_on_three_ranks():
    results = launch(_ring_vs_torch, 3, timeout=120)
    for errors, rows in results:
        for dtype, shape, err in errors:
            # float32 sums in a different order than gloo: a few ulps of the sum of 3 values
            tol = 1e-5 if "float32" in dtype else 1e-12
            assert err <= tol, f"{dtype} {shape}: max error {err}"
        assert [row["bytes"] for row in rows] == [64, 4096]
        for row in rows:
            assert row["s"] > 0
            assert math.isclose(row["busbw GB/s"], row["algbw GB/s"] * 4 / 3)


def test_fit_alpha_beta_recovers_the_model():
    alpha, beta, world_size = 20e-6, 1 / 5e9, 4
    sizes = [2 ** k for k in range(8, 28, 2)]
    times = [allreduce_time(n, world_size, alpha, beta) for n in sizes]
    fit = fit_alpha_beta(sizes, times, world_size)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert fit["GB/s"] == pytest.approx(5.0, rel=1e-6)


def test_fit_alpha_beta_stays_positive_on_noisy_times():
    # the notebook's CPU run once measured a 1 MB all-reduce faster than a 256 KB one
    sizes, times = [1024, 16384, 262144, 1048576], [1.25e-3, 3.36e-3, 3.61e-3, 0.66e-3]
    fit = fit_alpha_beta(sizes, times, 2)
    assert fit["alpha"] > 0 and fit["beta"] > 0
    assert fit["alpha"] == pytest.approx(1.25e-3 / 2)
    assert 0.1 < fit["GB/s"] < 100  # physical, not the 1e21 GB/s of an unconstrained fit


def test_cost_model_shapes():
    assert bus_factor(2) == 1.0 and bus_factor(8) == pytest.approx(1.75)
    # a tree pays fewer latencies on tiny messages, the ring less bandwidth on large ones (N = 16)
    assert allreduce_time(8, 16, 1e-5, 1e-10, "tree") < allreduce_time(8, 16, 1e-5, 1e-10, "ring")
    assert allreduce_time(2 ** 30, 16, 1e-5, 1e-10, "ring") < allreduce_time(2 ** 30, 16, 1e-5, 1e-10, "tree")
    assert allreduce_time(123, 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="world_size >= 2"):
        fit_alpha_beta([1, 2], [1.0, 2.0], 1)
    with pytest.raises(ValueError, match="algo"):
        allreduce_time(1, 2, 1.0, 1.0, "butterfly")


def _peers_of_messages():
    from dlo.measure import CommCounter

    t, r = torch.zeros(3), dist.get_rank()
    with CommCounter() as counter:
        if r == 0:
            dist.send(t + 1, 1)
            dist.send(t + 2, 1)
        else:
            dist.recv(t, 0)
            dist.recv(t)  # from any source: the op carries a tag, no peer
    return [(c.kind, c.peer) for c in counter.calls]


def test_comm_counter_records_the_peer_of_each_message_and_none_for_any_source():
    assert launch(_peers_of_messages, 2, timeout=120) == [[("send", 1), ("send", 1)], [("recv", 0), ("recv", None)]]
