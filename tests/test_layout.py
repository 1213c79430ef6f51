"""dlo.layout: the memory model against a hand count, the enumeration's rules, and the search on
Llama 3.1 70B on 64 H100s with 64 sequences of 8,192 tokens (its answer, FSDP 8 x TP 8, is TP inside a node
and FSDP across; the published runs it is compared with are dlo.published_layouts', tested beside)."""

import functools
import re

import pytest

from dlo.layout import Cluster, Layout, Model, fits, layouts, memory_bytes, search, step_time


@functools.lru_cache(maxsize=None)
def model(name="llama3.1-70b", seq=8192) -> Model:
    return Model.measure(name, seq)


def test_memory_is_the_hand_count():
    m, c = model(), Cluster("H100 SXM", 64)
    lay = Layout(dp=8, tp=8, pp=1, fsdp=True, m=4, ac=True)
    b = 64 / (8 * 4)
    states = 16 * (m.layers * m.layer_params + 2 * m.embedding) / 64 + 2 * 2 * m.layer_params / 8
    acts = m.layers * 2 * b * m.seq * m.hidden / 8 + b * m.act_layer / 8 + b * m.act_head / 8
    assert memory_bytes(m, lay, c, 64) == pytest.approx(states + acts)
    assert m.layers * m.layer_params + 2 * m.embedding == 70_553_706_496 - 8192  # all but the final norm


def test_layouts_follow_the_rules_and_the_search_puts_tp_inside_a_node_for_the_70b():
    m, c = model(), Cluster("H100 SXM", 64)
    every = list(layouts(m, c, 64))
    assert all(x.dp * x.tp * x.pp == 64 and 8 % x.tp == 0 and 80 % x.pp == 0 and 64 % (x.dp * x.m) == 0
               and (x.pp == 1 or x.m >= x.pp) and (x.dp > 1 or not x.fsdp) for x in every)
    best = search(m, c, 64)
    assert (best.dp, best.tp, best.pp, best.fsdp) == (8, 8, 1, True) and fits(m, best, c, 64)
    assert all(step_time(m, x, c, 64) >= step_time(m, best, c, 64) for x in every if fits(m, x, c, 64))
    with pytest.raises(ValueError, match="no layout"):
        search(m, Cluster("H100 SXM", 8), 8)  # 70B's 1.1 TB of model state on one node: nothing fits


def test_the_layout_models_shards_are_the_ones_a_fake_process_group_holds():
    """`memory_bytes` counts model states as parameters / (tp x FSDP's dp); `dlo plan` (Day 7, 9.5) splits
    the meta Llama 3.2 3B inside a fake process group of 64 ranks and counts each rank's fp32 shard. They
    agree within 0.1% for every FSDP x TP degree and TP alone (the rest: norms every TP rank keeps whole,
    FSDP's padding); a model counting the tied embedding twice would be 12% off."""
    from dlo import presets
    from dlo.experiments.day7_report import plan

    m = model("llama3.2-3b", 4096)
    params = m.layers * m.layer_params + m.embedding * (1 if m.tied else 2)
    for row in plan(presets.DAY7["full"], gpus=64, gpu_mem_gb=80):
        dp, tp = (int(x) for x in re.fullmatch(r"(?:FSDP (\d+) x )?TP (\d+).*", row["config"]).groups(default="1"))
        assert row["params"] / 4 == pytest.approx(params / (dp * tp), rel=1e-3), row["config"]


def test_a_pipeline_stage_of_the_meta_llama_holds_what_the_layout_model_says():
    """3-D: one pipeline stage of the meta Llama 3.2 3B split FSDP x TP in a fake process group
    (`day7_report.plan_3d`) holds, per rank, the stage's blocks plus the embedding (first) or the norm
    and the tied embedding's copy (last), within 0.1% of `dlo.layout`'s count; without the copy the
    last stage at PP 4 would be 36% lighter."""
    from dlo import presets
    from dlo.experiments.day7_report import plan_3d

    m = model("llama3.2-3b", 4096)
    for pp, tp in ((2, 8), (4, 4)):
        dp = 64 // (pp * tp)
        want = (m.layers // pp * m.layer_params + m.embedding) * 4 / (dp * tp)
        for row in plan_3d(presets.DAY7["full"], gpus=64, pp=pp, tp=tp):
            assert row["parameter bytes per rank (fp32)"] == pytest.approx(want, rel=1e-3), row
    with pytest.raises(ValueError, match="must divide the 28 layers"):
        plan_3d(presets.DAY7["full"], gpus=64, pp=3, tp=8)
