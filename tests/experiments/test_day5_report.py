"""Day 5's report counts the bytes FSDP2 sends from the wrapping policy itself (`fsdp.fsdp_units`), not a copy."""

import pytest

from dlo.distributed import fsdp
from dlo.experiments import day5_report as report
from dlo.models.llama import LlamaConfig

CFG = LlamaConfig.from_name("tiny", tie_embeddings=False)  # an untied head: every kind of unit


def test_the_report_changes_with_the_policy(monkeypatch):
    policy = fsdp.fsdp_units
    k = report.fsdp2_sent_factor(CFG)
    monkeypatch.setattr(fsdp, "fsdp_units", lambda model: [(unit, True) for unit, _ in policy(model)])
    assert report.fsdp2_sent_factor(CFG) == pytest.approx(3.0)  # every unit gathered again: ZeRO-3
    monkeypatch.setattr(fsdp, "fsdp_units", lambda model: policy(model, reshard_after_forward=False))
    assert report.fsdp2_sent_factor(CFG) == pytest.approx(2.0)  # every unit kept: ZeRO-2's bytes
    monkeypatch.setattr(fsdp, "fsdp_units", lambda model: [(u, r or u is list(model.layers.values())[-1])
                                                           for u, r in policy(model)])
    assert k < report.fsdp2_sent_factor(CFG) < 3.0  # the last block resharded too: more sent, not all


def test_the_policy_keeps_the_last_block_and_an_untied_head():
    import torch

    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(CFG)
    units = fsdp.fsdp_units(model)
    blocks = list(model.layers.values())
    assert units[0] == (model.tok_embeddings, True) and units[-1] == (model, True)
    assert [r for u, r in units if any(u is b for b in blocks)] == [True] * (len(blocks) - 1) + [False]
    assert ([model.norm, model.output], False) in units
    assert not any(r for _, r in fsdp.fsdp_units(model, reshard_after_forward=False))
