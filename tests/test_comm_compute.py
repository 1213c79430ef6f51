"""dlo.comm_compute against its closed forms, and dlo.hardware's link table."""

import pytest

from dlo.comm_compute import allgather_time, fsdp_min_tokens, tp_comm_ratio
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
