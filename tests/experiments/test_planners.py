"""The planners of days 1, 2, 3 and 8 against hand counts on small configurations: parameters,
gradients and optimizer state from the layer shapes, activations against the same model run for
real on the CPU (the meta device and the fake CPU tensors must count exactly what a real run saves)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dlo.experiments import day1, day2, day3, day8
from dlo.measure import saved_bytes
from dlo.models.small import MLP, SmallCNN
from dlo.plan import GIB
from dlo.presets import Day1Preset, Day2Preset, Day3Preset, Day8Preset


def smallcnn_params(w: int) -> int:
    convs = 3 * 9 * w + w * 9 * 2 * w + 2 * w * 9 * 4 * w + 4 * w * 9 * 8 * w  # 3x3, no bias
    return convs + 2 * (w + 2 * w + 4 * w + 8 * w) + 8 * w * 10 + 10  # BatchNorm weight + bias, head


def real_saved(model, forward, autocast=None):
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        return saved_bytes(forward, exclude=[*model.parameters(), *model.buffers()])["peak_saved_bytes"]


def test_day1_rows():
    P = dataclasses.replace(Day1Preset(), width=2, image_size=8, small_batch=3, large_batch=5, bench_numel=1000)
    rows = {r["config"]: r for r in day1.plan(P, gpus=4, gpu_mem_gb=0.5)}
    n = smallcnn_params(2)
    assert all(rows[f"{o} b{b}"]["params"] == rows[f"{o} b{b}"]["grads"] == 4 * n
               for o in ("sgd", "adamw", "lamb") for b in (3, 5))
    assert rows["sgd b3"]["optimizer"] == 4 * n
    assert rows["adamw b5"]["optimizer"] == rows["lamb b3"]["optimizer"] == 8 * n
    model = SmallCNN(width=2)
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 10, (5,))
    assert rows["sgd b5"]["activations"] == real_saved(model, lambda: F.cross_entropy(model(x), y))
    assert rows["adamw b5"]["main"] and not rows["adamw b3"].get("main")
    bench = rows["AdamW step benchmark"]
    assert (bench["params"], bench["grads"], bench["optimizer"], bench["activations"]) == (4000, 4000, 8000, 0)
    assert bench["gpu"] == GIB // 2 and bench["world"] == 1  # a single-process day ignores gpus


def test_day2_rows_count_autocast_like_a_real_cpu_run():
    P = dataclasses.replace(Day2Preset(), lm_vocab=50, lm_d_model=16, lm_layers=2, lm_heads=2, lm_seq=8, lm_batch=3,
                            width=2, image_size=8, batch_size=4)
    rows = {r["config"]: r for r in day2.plan(P, gpus=1, gpu_mem_gb=80)}
    lm = day2.make_lm(P)
    n = sum(p.numel() for p in lm.parameters())
    d, f = 16, 64
    layer = 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d + 4 * d  # attention, MLP, two LayerNorms
    assert n == 50 * d + 8 * d + 2 * layer + 2 * d + d * 50  # embeddings, layers, final norm, head
    row = rows["TinyLM bf16 autocast"]
    assert (row["params"], row["grads"], row["optimizer"]) == (4 * n, 4 * n, 8 * n)
    idx = torch.randint(0, 50, (3, 8))
    y = torch.randint(0, 50, (24,))
    for label, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        assert rows[f"TinyLM {label}"]["activations"] == real_saved(lm, lambda: F.cross_entropy(lm(idx), y), dtype)
    cnn = day2.make_cnn(P)
    x, yc = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    # the CPU's BatchNorm keeps its per-channel batch statistics of a bf16 input in fp32, its fake
    # (meta) implementation in bf16: 2 x 2 bytes per channel apart, nothing else
    channels = 2 + 4 + 8 + 16
    real = real_saved(cnn, lambda: F.cross_entropy(cnn(x), yc), torch.bfloat16)
    assert real - rows["SmallCNN bf16 autocast"]["activations"] == 2 * 2 * channels
    assert rows["TinyLM bf16 autocast"]["activations"] < rows["TinyLM fp32"]["activations"]


def test_day3_rows_per_policy():
    P = dataclasses.replace(Day3Preset(), vocab=40, d_model=16, n_heads=2, n_layers=4, seq_len=8, batch_size=2)
    rows = {r["config"]: r for r in day3.plan(P, gpus=1, gpu_mem_gb=80)}
    torch.manual_seed(0)
    model = day3.build_model(P)
    n = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, 40, (2, 9))
    for name, policy in day3.policies(4).items():
        row = rows[f"policy: {name}"]
        assert (row["params"], row["grads"], row["optimizer"]) == (4 * n, 4 * n, 0)
        if name != day3.OFFLOAD:
            torch.manual_seed(1)  # dropout masks differ, their sizes do not
            want = real_saved(model, lambda policy=policy: day3.lm_loss(model, idx[:, :-1], idx[:, 1:], **policy))
            assert row["activations"] == want, name
    assert rows["policy: every 1"]["activations"] < rows["policy: none"]["activations"]
    assert rows["policy: offload to CPU"]["activations"] == 0 and rows["policy: none"]["main"]
    assert rows["resume run (AdamW, GradScaler)"]["optimizer"] == 8 * n


def test_day8_rows():
    P = dataclasses.replace(Day8Preset(), image_size=4, hidden=128, student_hidden=32, batch_size=6, calib_batches=3,
                            llama_d_model=8, llama_hidden=256, llama_tokens=5)
    rows = {r["config"]: r for r in day8.plan(P, gpus=1, gpu_mem_gb=80)}
    d_in = 48
    n_base = d_in * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    n_student = d_in * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    base = rows["base MLP training"]
    assert (base["params"], base["grads"], base["optimizer"]) == (4 * n_base, 4 * n_base, 8 * n_base)
    distill = rows["distillation"]
    assert (distill["params"], distill["grads"], distill["optimizer"]) == (4 * (n_student + n_base), 4 * n_student,
                                                                          8 * n_student)
    mlp = MLP(d_in, 128, 10, depth=3)
    x, y = torch.randn(6, d_in), torch.randint(0, 10, (6,))
    assert base["activations"] == real_saved(mlp, lambda: F.cross_entropy(mlp(x), y))
    assert rows["PTQ calibration (percentile)"]["activations"] == 3 * 6 * (d_in + 128 + 128) * 4
    w = 3 * 8 * 256
    assert rows["MLP block bf16 dense"]["params"] == 2 * w
    assert rows["MLP block W8A16 group 128"]["params"] == w + 4 * w // 128
    assert rows["MLP block W4A16 group 128"]["params"] == w // 2 + 4 * w // 128
    assert rows["MLP block bf16 dense"]["activations"] == 5 * (8 + 3 * 256) * 2


@pytest.mark.parametrize("planner", [day1.plan, day2.plan, day3.plan, day8.plan])
def test_rows_have_every_column(planner):
    from dlo.registry import DAYS

    preset = next(d.presets["tiny"] for d in DAYS.values() if d.planner == f"{planner.__module__}:plan")
    for r in planner(preset, gpus=1, gpu_mem_gb=80):
        assert r["total"] == r["params"] + r["grads"] + r["optimizer"] + r["activations"] and r["fits"]
