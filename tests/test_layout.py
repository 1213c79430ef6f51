"""dlo.layout: the memory model against a hand count, the enumeration's rules, and the search on
Llama 3.1 70B on 64 H100s with 64 sequences of 8,192 tokens (its answer, FSDP 8 x TP 8, is TP inside a node
and FSDP across; the published runs it is compared with are dlo.published_layouts', tested beside). Then the
fourth and fifth axes (issue 36): the 3-D layouts keep their numbers to the last bit at cp = ep = 1; context
parallelism divides the activations by cp and adds ring attention's bytes (`ring_bytes_per_rank`); expert
parallelism divides replicated experts by ep and adds the all-to-alls (`ep_bytes_per_rank`)."""

import dataclasses
import functools
import re

import pytest

from dlo.distributed.context_parallel import ring_bytes_per_rank
from dlo.distributed.expert_parallel import ep_bytes_per_rank
from dlo.hardware import link_bytes_per_s
from dlo.layout import Cluster, Layout, Model, cp_bytes, ep_bytes, fits, layouts, memory_bytes, search, step_time
from dlo.models.moe import moe_flops_per_token


@functools.lru_cache(maxsize=None)
def model(name="llama3.1-70b", seq=8192, n_experts=0, top_k=0) -> Model:
    return Model.measure(name, seq, n_experts, top_k)


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
    assert all(x.dp * x.tp * x.pp * x.cp == 64 and 8 % x.tp == 0 and 80 % x.pp == 0 and 64 % (x.dp * x.m) == 0
               and (x.pp == 1 or x.m >= x.pp) and (x.dp * x.cp > 1 or not x.fsdp) and x.ep == 1 for x in every)
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


# (model, seq, GPU, GPUs, GiB, batch, (dp, tp, pp, fsdp, m, ac), memory_bytes, step_time) of the 3-D model before
# the context and expert degrees (main at f191237): the same floats, bit for bit
THREE_D = [
    ("llama3.1-8b", 8192, "H100 SXM", 8, 80.0, 8, (8, 1, 1, False, 1, True), 136756494340.0, 0.49731291695524366),
    ("llama3.1-8b", 8192, "H100 SXM", 8, 80.0, 8, (1, 1, 8, False, 8, True), 28757884932.0, 1.393835046198962),
    ("llama3.1-8b", 8192, "H100 SXM", 8, 80.0, 8, (4, 1, 2, True, 2, False), 69850398720.0, 0.5995346223686578),
    ("llama3.1-8b", 8192, "H100 SXM", 8, 80.0, 8, (4, 2, 1, False, 2, False), 92936388610.0, 0.41116217479198836),
    ("llama3.1-70b", 8192, "H100 SXM", 64, 80.0, 64, (16, 2, 2, True, 4, True), 26351108096.0, 6.203448692358197),
    ("llama3.1-70b", 8192, "H100 SXM", 64, 80.0, 64, (4, 1, 16, True, 16, False), 285964894208.0, 8.376518633320833),
    ("llama3.1-70b", 8192, "H100 SXM", 64, 80.0, 64, (8, 8, 1, False, 8, False), 174353166336.5, 4.7904210388184625),
    ("llama3.2-3b", 4096, "A100 80GB SXM", 16, 80.0, 32, (8, 2, 1, True, 1, True), 10310471688.0, 0.7312130199236923),
    ("llama3.2-3b", 4096, "A100 80GB SXM", 16, 80.0, 32, (8, 1, 2, True, 4, False), 19171180544.0,
     1.1361259929599998),
]


@pytest.mark.parametrize("name, seq, gpu, gpus, mem, batch, degrees, mem_bytes, seconds", THREE_D)
def test_three_d_layouts_keep_their_numbers(name, seq, gpu, gpus, mem, batch, degrees, mem_bytes, seconds):
    m, c, lay = model(name, seq), Cluster(gpu, gpus, mem), Layout(*degrees)
    assert (lay.cp, lay.ep) == (1, 1)
    assert memory_bytes(m, lay, c, batch) == mem_bytes and step_time(m, lay, c, batch) == seconds


def test_context_parallelism_divides_the_activations_and_sends_the_ring_attentions_blocks():
    m, c, batch = model("llama3.1-8b", 131072), Cluster("H100 SXM", 16), 16
    lay = Layout(dp=4, tp=2, pp=1, fsdp=True, m=2, ac=False, cp=2)
    b = batch / (lay.dp * lay.m)
    states = 16 * (m.layers * m.layer_params + 2 * m.embedding) / (2 * 4 * 2) + 2 * 2 * m.layer_params / 2
    acts = (m.layers * b * m.act_layer + b * m.act_head) / (2 * 2)  # / (tp cp)
    assert memory_bytes(m, lay, c, batch) == pytest.approx(states + acts)
    ring = ring_bytes_per_rank(b, m.kv_heads // 2, m.seq, m.hidden // m.heads, 2, 2, backward=True)
    assert cp_bytes(m, lay, batch) == pytest.approx(m.layers * ring)
    again = ring_bytes_per_rank(b, m.kv_heads // 2, m.seq, m.hidden // m.heads, 2, 2)  # checkpointing's forward
    assert cp_bytes(m, dataclasses.replace(lay, ac=True), batch) == pytest.approx(m.layers * (ring + again))
    # on the critical path, over NVLink (tp cp = 4 GPUs of a node), in each of the m slots
    silent = dataclasses.replace(m, kv_heads=0)
    extra = step_time(m, lay, c, batch) - step_time(silent, lay, c, batch)
    assert extra == pytest.approx(lay.m * m.layers * ring / link_bytes_per_s("H100 SXM", "nvlink"))
    assert cp_bytes(m, dataclasses.replace(lay, cp=1, dp=8), batch) == 0


def test_expert_parallelism_divides_replicated_experts_and_adds_the_all_to_alls():
    dense, m = model("llama3.2-3b", 4096), model("llama3.2-3b", 4096, 8, 2)
    mlp = 3 * dense.hidden * 8192  # Llama 3.2 3B's SwiGLU
    counts = moe_flops_per_token(dense.hidden, 8192, 8, 2)
    assert m.layer_params == dense.layer_params - mlp + counts["params_total"]
    assert m.active_params == dense.layer_params - mlp + counts["params_active"] and m.experts == 8 * mlp
    c, batch = Cluster("H100 SXM", 16), 16
    lay = Layout(dp=8, tp=2, pp=1, fsdp=False, m=1, ac=False, ep=4)
    whole = memory_bytes(m, dataclasses.replace(lay, ep=1), c, batch)
    assert whole - memory_bytes(m, lay, c, batch) == pytest.approx(16 * m.layers * m.experts * (1 - 1 / 4) / 2)
    tokens = batch / (lay.dp * lay.m) * m.seq / lay.tp  # sequence parallelism: a TP rank's share
    assert ep_bytes(m, lay, batch) == pytest.approx(
        m.layers * ep_bytes_per_rank(tokens, m.hidden, 2, 4, 2, backward=True))
    assert ep_bytes(dense, lay, batch) == 0
    # FSDP over dp x cp shards the experts already: ep then changes the traffic, not the states
    sharded = dataclasses.replace(lay, fsdp=True)
    gathered = 2 * 2 * m.experts * (1 - 1 / 4) / 2  # the two gathered layers' experts, / ep
    assert memory_bytes(m, dataclasses.replace(sharded, ep=1), c, batch) - memory_bytes(m, sharded, c, batch) \
        == pytest.approx(gathered)


def test_the_five_d_enumeration_follows_the_rules():
    for m, c, batch in ((model("llama3.1-8b", 131072), Cluster("H100 SXM", 16), 16),
                        (model("llama3.2-3b", 4096, 8, 2), Cluster("H100 SXM", 16), 16)):
        every = list(layouts(m, c, batch))
        assert all(x.dp * x.tp * x.pp * x.cp == 16 and (x.cp == 1 or m.seq % (2 * x.cp) == 0)
                   and x.dp % x.ep == 0 and (m.n_experts % x.ep == 0 if m.n_experts else x.ep == 1)
                   and (x.dp * x.cp > 1 or not x.fsdp) and batch % (x.dp * x.m) == 0 for x in every)
        assert {x.cp for x in every} == {1, 2, 4, 8, 16} and len(every) == len(set(every))
        assert {x.ep for x in every} == ({1, 2, 4, 8} if m.n_experts else {1})
        assert any(x.fsdp and x.dp == 1 for x in every)  # FSDP over the cp ranks alone
    with pytest.raises(ValueError, match="top_k"):
        Model.measure("llama3.2-3b", 4096, 8, 9)
