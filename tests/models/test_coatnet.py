"""CoAtNet: the paper's sizes, the block list a pipeline cuts, and the per-block costs."""

import pytest
import torch
import torch.nn.functional as F

from dlo.distributed.pipeline import make_stage_modules
from dlo.measure import count_flops, saved_bytes
from dlo.models.coatnet import (
    CoAtNet,
    CoAtNetConfig,
    RelativeAttention,
    block_costs,
    coatnet,
    count_parameters,
    stage_table,
)

# Dai et al. 2021, Table 3 / the IDRIS slides: parameters at 224 x 224. A re-implementation is held to
# 10%: the paper leaves open on which width MBConv's 4x expansion and squeeze-excitation are counted,
# where a downsampling block's stride sits, the projection shortcuts and the head (ours: -1% to -3%).

PAPER = {"coatnet-0": 25e6, "coatnet-1": 42e6, "coatnet-2": 75e6, "coatnet-3": 168e6}


@pytest.fixture(autouse=True)
def one_thread():
    """Small CPU models: one thread is as fast, and does not spin when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(PAPER))
def test_parameter_counts_match_the_paper_within_10_percent(name):
    with torch.device("meta"):
        n = count_parameters(coatnet(name))
    assert abs(n / PAPER[name] - 1) < 0.10, (name, n)


def test_blocks_are_a_chain_a_pipeline_can_cut_anywhere():
    torch.manual_seed(0)
    model = coatnet("tiny", image_size=32).double().eval()
    cfg = model.cfg
    assert len(model.blocks) == sum(cfg.depths) + 1  # every stem conv, MBConv, transformer block, and the head
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    y = model(x)
    assert y.shape == (3, cfg.num_classes)
    for bounds in ([0, 1, len(model.blocks)], [0, 7, 9, 14, len(model.blocks)]):
        h = x
        for stage in make_stage_modules(list(model.blocks), bounds):
            h = stage(h)
        torch.testing.assert_close(h, y, rtol=0, atol=0)


def test_stages_halve_the_resolution():
    rows = block_costs(coatnet("coatnet-0"))
    last = {r["stage"]: r["shape"] for r in rows}
    assert [last[s][-1] for s in ("S0", "S1", "S2", "S3", "S4")] == [112, 56, 28, 14, 7]
    assert last["head"] == (1, 1000)


def test_block_costs_add_up_to_the_model():
    torch.manual_seed(0)
    model = coatnet("tiny", image_size=32)
    rows = block_costs(model, batch_size=2)
    assert sum(r["params"] for r in rows) == count_parameters(model)
    x = torch.randn(2, 3, 32, 32)
    assert sum(r["flops"] for r in rows) == count_flops(lambda: model(x))
    # a storage two blocks save is counted once, by the first: the column sums to the whole model's
    held = [*model.parameters(), *model.buffers()]
    whole = saved_bytes(lambda: model(x), exclude=held, backward=False)["saved_bytes"]
    assert sum(r["saved_bytes"] for r in rows) == whole
    table = stage_table(rows)
    assert [s["stage"] for s in table] == ["S0", "S1", "S2", "S3", "S4", "head"]
    # the point of the day: activations early, parameters late
    by = {s["stage"]: s for s in table}
    assert by["S1"]["saved_bytes"] > by["S4"]["saved_bytes"] and by["S4"]["params"] > by["S1"]["params"]


def test_relative_position_bias_depends_on_the_offset_only():
    attn = RelativeAttention(8, 8, 4, grid=3)
    idx = attn.bias_index
    coords = [(i // 3, i % 3) for i in range(9)]
    for a in range(9):
        for b in range(9):
            for c in range(9):
                for d in range(9):
                    same = (coords[a][0] - coords[b][0], coords[a][1] - coords[b][1]) == \
                           (coords[c][0] - coords[d][0], coords[c][1] - coords[d][1])
                    assert (idx[a, b] == idx[c, d]).item() == same
    x = torch.randn(2, 9, 8)
    y = attn(x)
    with torch.no_grad():
        attn.bias_table.add_(torch.randn_like(attn.bias_table))
    assert not torch.allclose(attn(x), y)  # the bias is used
    y.sum().backward()
    assert attn.bias_table.grad is not None


def test_training_step_on_the_tiny_model_learns_one_batch():
    torch.manual_seed(0)
    model = coatnet("tiny", image_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown CoAtNet"):
        CoAtNetConfig.from_name("coatnet-9")
    with pytest.raises(ValueError, match="multiple of 32"):
        CoAtNetConfig.from_name("tiny", image_size=48)
    with pytest.raises(ValueError, match="head_dim"):
        CoAtNet(CoAtNetConfig(widths=(16, 16, 32, 60, 64), head_dim=16))
