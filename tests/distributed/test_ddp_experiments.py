"""dlo.distributed.ddp_experiments: model and batch choices, and one 2-rank run of the ResNet path
(the tiny notebook covers the MLP path end to end)."""

import dataclasses

import pytest
import torch

from dlo.distributed import ddp_experiments as E
from dlo.distributed import launch
from dlo.models.resnet import resnet18
from dlo.presets import Day4Preset

RESNET = Day4Preset(model="resnet18", image_size=16, width=4, batch_per_rank=3, max_steps=2, bucket_cap_mb=0.01)


def test_resnet18_has_the_papers_size():
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512  # ResNet-18, 1000 classes
    assert resnet18(10, 4)(torch.randn(2, 3, 17, 17)).shape == (2, 10)  # odd sizes pool to 1x1


def test_models_and_batches():
    cpu = torch.device("cpu")
    x, y = E.batch(RESNET, 0, 1, cpu)
    assert x.shape == (3, 3, 16, 16) and y.shape == (3,) and E.model(RESNET, cpu)(x).shape == (3, 10)
    tiny = Day4Preset()
    x, y = E.batch(tiny, 0, 0, cpu)
    assert x.shape == (tiny.batch_per_rank, tiny.d_in) and E.model(tiny, cpu)(x).shape == (tiny.batch_per_rank, 10)
    assert torch.equal(E.batch(tiny, 3, 1, cpu)[0], E.batch(tiny, 3, 1, cpu)[0])  # seeded
    assert not torch.equal(E.batch(tiny, 3, 0, cpu)[0], E.batch(tiny, 3, 1, cpu)[0])  # ranks differ
    with pytest.raises(ValueError, match="resnet18"):
        E.model(dataclasses.replace(tiny, model="vit"), cpu)


def _resnet_worker(P, log_dir):
    return E.step_times(P, E.rank_device(), E.wrappers(P, E.rank_device())), E.overlap(P, E.rank_device(), log_dir)


def test_resnet_comparison_and_overlap_on_two_ranks(tmp_path):
    times, ov = launch(_resnet_worker, 2, RESNET, tmp_path, timeout=120)[0]
    assert set(times) == {"naive (ours)", "bucketed (ours)", "torch DDP"}
    assert all(v["step ms"] > 0 and v["samples/s"] > 0 for v in times.values())
    # 0.01 MB buckets: several, one launch each, all issued during backward
    assert ov["buckets"] > 2 and ov["all-reduces"] == ov["buckets"] and ov["during backward"] >= 1
    assert list((tmp_path / "profile").glob("rank0*.json"))
