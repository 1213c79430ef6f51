"""dlo.experiments.day5_hsdp: FSDP vs HSDP collectives counted on a fake process group of 8 ranks."""

import pytest

from dlo.claims import AGREES, DISAGREES
from dlo.experiments import day5_hsdp as H
from dlo.presets import DAY5


def test_hsdp_sends_only_a_shard_all_reduce_across_nodes_and_keeps_g_times_more():
    fsdp, hsdp = rows = H.hsdp_bytes(DAY5["tiny"], nodes=2, gpus_per_node=4)
    assert fsdp["sent in one node's group"] == 0 and set(fsdp["collectives"]) == {"all_gather (8 ranks)",
                                                                                    "reduce_scatter (8 ranks)"}
    assert "all_reduce (2 ranks)" in hsdp["collectives"]  # the replicas' gradient all-reduce
    assert hsdp["sent in groups spanning nodes"] == pytest.approx(hsdp["psi"] / 4)  # 2(r-1)/r Psi/g, r = 2
    assert [c.verdict for c in H.claims(rows)] == [AGREES] * 3
    broken = [dict(fsdp), dict(hsdp, **{"sent in groups spanning nodes": fsdp["sent in groups spanning nodes"]})]
    assert H.claims(broken)[0].verdict == DISAGREES  # the count can fail the formula


def test_hsdp_refuses_a_single_node():
    with pytest.raises(ValueError, match="2 nodes"):
        H.hsdp_bytes(DAY5["tiny"], nodes=1, gpus_per_node=8)
