"""dlo.experiments.day7: the formulas, the planner against a hand count of the shards, bad degrees
refused before any process starts, and one 4-rank run of everything the notebook measures
(tensor parallelism at t = 1, 2 and FSDP 2 x TP 2) whose claims must all agree."""

import dataclasses

import pytest
import torch

import dlo.claims as claims_module
from dlo.claims import AGREES, INCONCLUSIVE, NOT_MEASURABLE
from dlo.config import get_preset
from dlo.distributed import launch
from dlo.distributed.parallelize import ParallelDims
from dlo.experiments import day7 as E
from dlo.experiments import day7_report as report
from dlo.measure import saved_bytes
from dlo.models.llama import LlamaConfig, TransformerBlock, rope_cos_sin, rope_frequencies
from dlo.registry import DAYS
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

TINY, FULL = DAYS["day7_tensor_parallel"].presets["tiny"], DAYS["day7_tensor_parallel"].presets["full"]



pytestmark = pytest.mark.usefixtures("one_thread")

def test_formulas():
    assert report.comm_bytes_per_layer(1, 4096, 3072, 8) == 8 * 4096 * 3072 * 7 / 8 * 2
    assert report.comm_bytes_per_layer(2, 8, 4, 1) == 0
    s, b, h, a = 2048, 1, 2048, 16
    assert report.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert report.activation_bytes_per_layer(s, b, h, a, 4, "tp") == s * b * h * (10 + 24 / 4 + 5 * a * s / h / 4)
    assert report.activation_bytes_per_layer(s, b, h, a, 4, "tp+sp") == pytest.approx(
        report.activation_bytes_per_layer(s, b, h, a) / 4)
    assert report.pipeline_bubble(64, 8, 32) == (64 - 8) / (8 * 32)
    plain, zigzag = report.ring_attention_schedule(4), report.ring_attention_schedule(4, zigzag=True)
    assert plain.sum(1).tolist() == [0.5, 1.5, 2.5, 3.5]  # rank r: r full blocks and its diagonal
    assert len(set(zigzag.sum(1).tolist())) == 1 and zigzag.sum() == plain.sum()  # balanced, same work
    assert report.ring_attention_schedule(3, causal=False).sum() == 9


def test_plan_counts_each_ranks_shards():
    cfg = E.llama_config(FULL)
    n = 3_212_749_824  # Llama 3.2 3B, the tied table once
    norms = cfg.dim * (2 * cfg.n_layers + 1)  # replicated by tensor parallelism, sharded by FSDP
    P = dataclasses.replace(FULL, degrees=(2, 8), plan_tp=(1, 8))  # fewer configurations: faster
    rows = {r["config"]: r for r in report.plan(P, gpus=16, gpu_mem_gb=80)}
    for t in P.degrees:  # TP alone: everything but the norms split t ways
        assert rows[f"TP {t} (one node)"]["params"] == 4 * ((n - norms) // t + norms)
        assert rows[f"TP {t} (one node)"]["main"]
    for t in P.plan_tp:  # 2D: then FSDP splits every TP shard over the 16 / t other ranks
        r = rows[f"FSDP {16 // t} x TP {t}"]
        assert r["params"] == r["grads"] == 4 * (n - norms) // 16 + 4 * norms // (16 // t)
        assert r["optimizer"] == 2 * r["params"] and not r.get("main")  # AdamW: two fp32 moments
    assert rows["FSDP 2 x TP 4 (one node)"]["params"] == 4 * ((n - norms) // 8 + norms // 2)  # norms: FSDP halves
    acts = [rows[f"FSDP {16 // t} x TP {t}"]["activations"] for t in P.plan_tp]
    assert acts[0] / acts[1] > 5  # tensor + sequence parallelism divide them (by 8, less the gathered inputs)


def test_block_activations_match_a_real_cpu_run():
    P = dataclasses.replace(TINY, model_overrides=(("dim", 32), ("n_heads", 4), ("n_kv_heads", 2)))
    cfg = E.llama_config(P)
    block = TransformerBlock(cfg)
    x = torch.randn(2, 12, cfg.dim, requires_grad=True)
    cos, sin = rope_cos_sin(rope_frequencies(cfg), 12)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(x, cos, sin)
    real = saved_bytes(forward, exclude=list(block.parameters()))["peak_saved_bytes"]
    assert report.block_activation_bytes(P, 2, 12) == real


def test_placements_of_the_2d_plan():
    rows = {r["parameter"]: r for r in report.placements(FULL, gpus=16, tp=4)}
    wq, w2 = rows["layers.0.attention.wq.weight"], rows["layers.0.feed_forward.w2.weight"]
    assert wq["placements (dp, tp)"] == "_S(0, 4), S(0)" and wq["shape on a rank"] == (3072 // 16, 3072)
    assert w2["placements (dp, tp)"] == "S(0), S(1)" and w2["shape on a rank"] == (3072 // 4, 8192 // 4)
    assert rows["layers.0.ffn_norm.weight"]["shape on a rank"] == (3072 // 4,)


def test_bad_degrees_are_refused_before_any_process():
    with pytest.raises(ValueError, match="does not divide n_kv_heads=4"):
        get_preset("day7_tensor_parallel", "tiny", degrees=(1, 3), world_size=4)
    with pytest.raises(ValueError, match="does not divide seq_len=30"):
        get_preset("day7_tensor_parallel", "tiny", seq_len=30)
    with pytest.raises(ValueError, match="dp x tp must equal world_size=4"):
        get_preset("day7_tensor_parallel", "tiny", fsdp_tp=(2, 4))
    cfg = LlamaConfig.from_name("llama3.2-3b")
    with pytest.raises(ValueError, match="does not divide n_kv_heads=8"):
        ParallelDims(dp=4, tp=16).validate(cfg)
    with pytest.raises(ValueError, match="but the world has 32"):
        ParallelDims(dp=2, tp=8).validate(cfg, world_size=32)
    with pytest.raises(ValueError, match="unsynchronised replicas"):
        ParallelDims(dp=2, fsdp=False).validate(cfg)
    with pytest.raises(ValueError, match="does not divide ffn_dim=8192"):
        ParallelDims(tp=3).validate(dataclasses.replace(cfg, n_heads=24, n_kv_heads=3, vocab_size=128257, dim=3072))


def test_megatron_mfu_carries_the_interval_of_the_step_time(monkeypatch):
    # t = 1: MFU 0.40 at a median of 1 s over [0.99, 1.01] s -> [0.396, 0.404], inside 0.41 +- 0.05
    steps = [{"t": 1, "mfu": 0.40, "step_s": [1.0, 1.01, 0.99]}, {"t": 2, "mfu": 0.45, "step_s": [1.0]}]
    by_t = {c.claim.split("t=")[-1]: c for c in report.megatron_claims(steps, "cuda")}
    assert by_t["1"].verdict == AGREES and (by_t["1"].measured.lo, by_t["1"].measured.hi) == pytest.approx(
        (0.40 / 1.01, 0.40 / 0.99))
    assert by_t["2"].verdict == NOT_MEASURABLE and by_t["2"].row()["how"].startswith("one timed step")
    assert by_t["4"].verdict == by_t["8"].verdict == NOT_MEASURABLE  # no such run on this node
    noisy = [{"t": 1, "mfu": 0.40, "step_s": [0.5, 1.0, 2.0]}]  # [0.2, 0.8]: the noise decides nothing
    assert report.megatron_claims(noisy, "cuda")[0].verdict == INCONCLUSIVE
    # 8 ranks and the kernel on a 2-core host: the same timings are no evidence
    monkeypatch.setattr(claims_module, "cpu_cores", lambda: 2)
    crowded = report.megatron_claims(steps, "cuda", world_size=8)[0]
    assert crowded.verdict == NOT_MEASURABLE and "kernel > 2 cores" in crowded.reason


def test_run_all_measures_what_the_claims_say():
    """One launch, like the notebook's: every claim agrees, and the loss does not depend on how the
    Llama is split (t = 1, t = 2, FSDP 2 x TP 2)."""
    P = dataclasses.replace(TINY, degrees=(1, 2), max_steps=1, gpt_layers=1, seq_len=16, gpt_seq=16)
    R = launch(E.run_all, 4, P, backend="gloo", timeout=300)[0]
    claims = report.comm_claims(P, R["layers"]) + report.activation_claims(P, R["layers"])
    assert len(claims) == 3 + 4 and all(c.verdict == AGREES for c in claims), [c.row() for c in claims]
    h = R["history"]
    assert h[1]["loss"] == pytest.approx(h[2]["loss"], abs=1e-5)
    assert R["fsdp_tp"]["loss"] == pytest.approx(h[2]["loss"], abs=1e-5)
    steps = {r["t"]: r for r in R["steps"]}
    assert len(steps[1]["step_s"]) == P.max_steps  # every timed step kept: MFU's interval on a GPU
    assert steps[2]["params/rank"] < 0.55 * steps[1]["params/rank"]  # halved, but the norms stay whole
    assert R["fsdp_tp"]["params/rank"] < 0.3 * steps[1]["params/rank"]
    assert all(c.verdict == "not measurable here" for c in report.megatron_claims(R["steps"], "cpu"))
