"""dlo.comm_compute against its closed forms, and dlo.hardware's link table."""

import pytest

from dlo.comm_compute import allgather_time, ddp_bucket_bytes, fsdp_min_tokens, pp_p2p_bytes, tp_bytes, tp_comm_ratio
from dlo.distributed.collectives import allreduce_time
from dlo.hardware import LINKS, PEAKS, link_bytes_per_s


def test_fsdp_bound_is_flops_over_bytes_without_latency():
    # alpha = 0: T = (N-1)/N * b/2 * F/B, whatever the layer's size
    for P in (10**6, 100_669_440, 10**9):
        assert fsdp_min_tokens(P, 8, 989e12, 450e9) == 1924  # ceil(7/8 * 989/450 * 1000) = ceil(1923.06)
    assert fsdp_min_tokens(10**6, 1, 989e12, 450e9) == 0  # one rank gathers nothing
    # latency raises it, and more for a smaller layer (alpha does not scale with P)
    assert fsdp_min_tokens(10**6, 64, 989e12, 450e9, alpha=5e-6) > fsdp_min_tokens(10**9, 64, 989e12, 450e9,
                                                                                     alpha=5e-6)
    # the returned count hides the gather, one token less does not
    P, N, F, B, a = 123_457, 3, 312e12, 25e9, 2e-6
    T, gather = fsdp_min_tokens(P, N, F, B, a), allgather_time(2 * P, N, a, 1 / B)
    assert 2 * P * T / F >= gather > 2 * P * (T - 1) / F


def test_tp_ratio_does_not_fall_with_tokens_and_grows_with_t():
    h, P = 3072, 12 * 3072**2
    r = [tp_comm_ratio(P, h, 8, T, 989e12, 450e9) for T in (512, 4096, 32768)]
    assert r == pytest.approx([r[0]] * 3)
    assert r[0] == pytest.approx(2 * 7 * h * 2 * 989e12 / (P * 450e9))  # 2 (t-1) h b F / (P B)
    assert tp_comm_ratio(P, h, 1, 4096, 989e12, 450e9) == 0
    assert tp_comm_ratio(P, h, 2, 4096, 989e12, 450e9) < r[0] < tp_comm_ratio(P, h, 8, 4096, 989e12, 50e9)
    with pytest.raises(ValueError, match="tp_comm_ratio"):
        tp_comm_ratio(P, h, 0, 4096, 989e12, 450e9)


def test_link_table_covers_its_gpus_and_names_what_it_lacks():
    labels = {label for _, label, _ in PEAKS}
    assert set(LINKS) <= labels  # every row has its peak FLOP/s
    assert link_bytes_per_s("NVIDIA H100 80GB HBM3", "nvlink") == 450e9  # a device name, as torch reports it
    assert link_bytes_per_s("H200 SXM", "infiniband") == 50e9
    with pytest.raises(ValueError, match="no link figures"):
        link_bytes_per_s("V100", "nvlink")
    with pytest.raises(ValueError, match="no link 'pcie'"):
        link_bytes_per_s("A100 80GB SXM", "pcie")


def test_tp_sends_4_l_t_minus_1_over_t_times_the_pipeline():
    # Narayanan et al. 2021, Sec. 3.2: bsh each way per boundary, 8 bsh (t-1)/t per layer
    b, s, h = 1, 4096, 3072
    assert pp_p2p_bytes(b, s, h) == 2 * b * s * h * 2
    assert pp_p2p_bytes(b, s, h, t=8) == pp_p2p_bytes(b, s, h) / 8  # each rank of the stage its 1/t
    assert tp_bytes(b, s, h, 8, layers=7) / pp_p2p_bytes(b, s, h) == pytest.approx(4 * 7 * 7 / 8)
    assert tp_bytes(b, s, h, 1, layers=7) == 0
    with pytest.raises(ValueError, match="tp_bytes"):
        tp_bytes(b, s, h, 0)


def test_ddp_bucket_is_where_latency_falls_to_its_share():
    N, alpha, B = 8, 5e-6, 450e9
    n = ddp_bucket_bytes(N, alpha, B, latency_share=0.5)
    assert n == 18_000_000  # N alpha B at f = 1/2: the latency equals the bandwidth term
    for f in (0.05, 0.1, 0.5):
        n = ddp_bucket_bytes(N, alpha, B, f)
        share = [2 * (N - 1) * alpha / allreduce_time(k, N, alpha, 1 / B) for k in (n, n - 1)]
        assert share[0] <= f < share[1]
    assert ddp_bucket_bytes(64, alpha, B) > ddp_bucket_bytes(8, alpha, B)  # the ring's latency grows with N
    assert ddp_bucket_bytes(1, alpha, B) == 0 == ddp_bucket_bytes(8, 0.0, B)
    with pytest.raises(ValueError, match="latency_share"):
        ddp_bucket_bytes(8, alpha, B, latency_share=0)
