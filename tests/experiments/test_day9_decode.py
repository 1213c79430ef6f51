"""Day 9's quantized decoding (dlo.experiments.day9_decode): bytes and programs counted by hand, the kernel check,
and the claims' verdicts from timings (a GPU's, stood in for by numbers: no timing happens here)."""

import torch

from dlo import claims as C
from dlo.experiments import day9_decode as d


def test_weight_bytes_by_hand():
    # one (8192, 3072) weight at G = 128: bf16 2 B each; W4A16 half a byte each and 4 B per 128
    b = d.weight_bytes(3072, 8192, 128)
    assert b == {"bf16": 2 * 8192 * 3072, "W4A16": 8192 * 3072 / 2 + 4 * 8192 * 24}
    rows = d.weight_bytes_rows("3B", 128)
    total = rows[-1]
    # Llama 3.2 3B's 28 layers: q,o 3072^2 twice, k,v 3072 x 1024 twice, gate,up and down 3072 x 8192 three times
    params = 28 * (2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192)
    assert round(total["bf16 MB"] * 1e6) == 2 * params
    assert abs(total["ratio"] - 2 / (0.5 + 4 / 128)) < 1e-9  # 3.76x, whatever the shapes
    assert [r["layer"] for r in rows] == ["q,o", "k,v", "gate,up", "down", "all 28 layers"]


def test_programs_against_the_sms():
    rows = {r["layer"]: r for r in d.programs_rows("3B", 132)}
    assert rows["k,v"]["programs, split 1"] == 1024 // 64 and rows["gate,up"]["programs, split 1"] == 8192 // 64
    assert all(r["programs, split-K"] == r["programs, split 1"] * r["split"] for r in rows.values())
    assert all(r["programs, split-K"] >= 132 for r in rows.values())  # every projection fills the SMs


def test_kernel_check_against_the_reference():
    got = d.kernel_check(torch.device("cpu"))  # the interpreter (tests/conftest.py) on a CPU
    assert got["ran"] and got["max_diff"] <= 2 * 2 ** -7 * got["y_ref_max"]


def _times(split_k_ms: float, day8_ms: float) -> dict:
    jitter = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01]
    return {("gate,up", 1): {"torch bf16": [0.03 * j for j in jitter],
                             "W4A16 Day 8 (GEMM tiles)": [day8_ms * j for j in reversed(jitter)],
                             "W4A16 split-K": [split_k_ms * j for j in jitter]}}


LOOP = {"agree": [0.97, 1.0, 0.98, 0.95]}  # decode_loop's on a CPU: no step times


def test_claims_without_a_gpu_are_not_measurable():
    rows = d.decode_claims(None, LOOP, "cpu")
    assert [r.verdict for r in rows] == [C.BY_CONSTRUCTION, C.AGREES] + [C.NOT_MEASURABLE] * 3
    assert d.decode_claims(None, {"agree": [0.5, 0.6, 0.55]}, "cpu")[1].verdict == C.DISAGREES


def test_the_decode_loop_on_a_cpu():
    """A small Llama (fp32, converted to bf16 in a copy) against its W4A16 copy: agreement per sequence, the bytes,
    no step timed on a CPU."""
    from dlo.experiments.day9 import make_model

    model = make_model("tiny", 0, "cpu", "float32")
    seqs = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    got = d.decode_loop(model, seqs, length=8, rounds=3, reps=3, impl="reference")  # the kernels: test_w4a16.py
    assert got["impl"] == "reference" and len(got["agree"]) == 3 and all(0 <= a <= 1 for a in got["agree"])
    assert 3.4 < got["bf16 bytes"] / got["W4A16 bytes"] < 4 and "step_s" not in got
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched


def test_claims_from_gpu_timings_agreeing_or_not():
    loop = {**LOOP, "step_s": {"bf16": [10.0, 10.2, 9.9], "W4A16": [9.0, 9.1, 9.2]}, "length": 512}
    agree, step, faster, as_bytes = d.decode_claims(_times(0.012, 0.07), loop, "cuda")[1:]
    assert agree.verdict == step.verdict == C.AGREES and "GPU claim" in step.row()["evidence"]
    assert faster.verdict == C.AGREES  # 2.5x, and Day 8's layout (the control: same bytes) 0.43x
    assert as_bytes.verdict == C.DISAGREES  # 2.5x is not 3.76x +- 25%
    assert "GPU claim" in faster.row()["evidence"]
    faster, as_bytes = d.decode_claims(_times(0.0081, 0.02), LOOP, "cuda")[3:]
    assert faster.verdict == C.CONTROL_TOO and as_bytes.verdict == C.AGREES  # Day 8's tiles beat bf16 too
    assert d.decode_claims(_times(0.04, 0.07), LOOP, "cuda")[3].verdict == C.DISAGREES
    assert d.decode_claims(_times(0.012, 0.07), LOOP, "cpu")[3].verdict == C.NOT_MEASURABLE  # a GPU claim on a CPU


def test_timing_rows_list_every_implementation():
    rows = d.timing_rows(_times(0.012, 0.07))
    assert [r["impl"] for r in rows] == ["torch bf16", "W4A16 Day 8 (GEMM tiles)", "W4A16 split-K"]
    assert rows[0]["bf16 / it [95%]"].startswith("1")
