"""dlo.experiments.day2: the verdict logic of the claims on synthetic per-seed results, not the numbers
of a run. The case once printed as "yes": "equivalent accuracy" passed with a 7-point spread between
seeds against a 5-point tolerance. Also: GPU claims stay as "not measurable here" rows on a CPU."""

import pytest

from dlo.claims import AGREES, BY_CONSTRUCTION, DISAGREES, INCONCLUSIVE, NOT_MEASURABLE, exact
from dlo.experiments import day2 as E
from dlo.measure import Timing

ACT = {"TinyLM": 0.52, "SmallCNN": 0.50}


def _verdicts(bf16_minus_fp32, demo=None, speed=None, n_test=2048) -> dict[str, str]:
    fp32 = [0.60, 0.62, 0.58, 0.61]
    accs = {"fp32": fp32, "bf16": [a + d for a, d in zip(fp32, bf16_minus_fp32)]}
    return {c.claim: c.verdict for c in E.precision_claims(ACT, accs, n_test, demo=demo, speed=speed)}


def _find(v: dict, text: str) -> str:
    (hit,) = [x for k, x in v.items() if text in k]
    return hit


def test_a_7_point_spread_does_not_pass_a_5_point_tolerance():
    v = _verdicts([-0.04, 0.03, 0.00, -0.01])  # gaps spread over 7 points; mean -0.5 point
    assert _find(v, "equivalent accuracy") == INCONCLUSIVE
    assert _find(v, "equivalent accuracy") != AGREES


def test_tight_gaps_agree_and_a_clear_loss_disagrees():
    assert _find(_verdicts([0.004, -0.003, 0.001, 0.0]), "equivalent accuracy") == AGREES
    assert _find(_verdicts([-0.12, -0.10, -0.11, -0.13]), "equivalent accuracy") == DISAGREES


def test_activation_ratios_are_exact_counts():
    v = _verdicts([0.0] * 4)
    assert _find(v, "in bf16 (TinyLM)") == AGREES and _find(v, "in bf16 (SmallCNN)") == AGREES
    v = {c.claim: c.verdict for c in E.precision_claims({"TinyLM": 0.70, "SmallCNN": 0.5},
                                                         {"fp32": [0.6, 0.6], "bf16": [0.6, 0.6]}, 2048)}
    assert _find(v, "in bf16 (TinyLM)") == DISAGREES


def test_gpu_rows_are_kept_as_not_measurable_on_a_cpu():
    v = _verdicts([0.0] * 4)
    assert _find(v, "30% memory") == NOT_MEASURABLE and _find(v, "2x speed-up") == NOT_MEASURABLE


def test_underflow_demo_claims():
    fp32 = [0.50, 0.52, 0.49, 0.51]
    demo = {"fp32": fp32, "bf16": [a + 0.002 for a in fp32], "fp16": [0.10, 0.11, 0.10, 0.12],
            "fp16 + scaler": [a - 0.002 for a in fp32], "skipped": [21, 21, 22, 21]}
    v = _verdicts([0.0] * 4, demo=demo)
    assert _find(v, "fp16 without loss scaling trains worse") == AGREES
    assert _find(v, "loss scaling recovers") == AGREES
    assert _find(v, "bf16 needs no loss scaling") == AGREES
    # a 2^40 starting scale forces the skips: shown, labelled, not evidence
    assert _find(v, "skips overflowing steps") == BY_CONSTRUCTION


def _Timing(s: float) -> Timing:
    """Five timed calls around s, within +-2%."""
    return Timing([s * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)])


def test_gpu_rows_get_verdicts_with_a_measurement():
    speed = {"fp32": {"timing": _Timing(2.1), "peak_bytes": 20.6e9},
             "bf16": {"timing": _Timing(1.1), "peak_bytes": 14.6e9}}
    v = _verdicts([0.0] * 4, speed=speed)
    assert _find(v, "30% memory") == AGREES and _find(v, "2x speed-up") == AGREES


def _attn(naive_exp: float, sdpa_exp: float, speedup: float = 3.0) -> list[dict]:
    rows = []
    for t in (128, 256):
        rows += [{"T": t, "impl": "naive", "saved_bytes": 1000 * t ** naive_exp, "timing": _Timing(1e-3 * t)},
                 {"T": t, "impl": "sdpa", "saved_bytes": 1000 * t ** sdpa_exp, "timing": _Timing(1e-3 * t / speedup)}]
    return rows


def test_kernel_claims():
    compiled = {"eager": _Timing(2e-3), "compiled": _Timing(1e-3), "eager_kernels": 5, "compiled_kernels": 1}
    v = {c.claim: c.verdict for c in E.kernel_claims(_attn(2.0, 1.0), compiled, on_gpu=False)}
    assert _find(v, "linear in T") == AGREES and _find(v, "T x T scores") == AGREES
    # a GPU claim timed on a CPU is no evidence; its CPU proxy, the launches per call, is counted
    assert _find(v, "~3x faster") == NOT_MEASURABLE and _find(v, "ops: faster") == NOT_MEASURABLE
    assert _find(v, "fewer kernel launches") == AGREES  # 1 of 5
    unfused = {**compiled, "compiled_kernels": 4}
    assert _find({c.claim: c.verdict for c in E.kernel_claims(_attn(2.0, 1.0), unfused, on_gpu=False)},
                 "fewer kernel launches") == DISAGREES
    assert _find({c.claim: c.verdict for c in E.kernel_claims(_attn(2.0, 1.0), compiled, on_gpu=True)},
                 "ops: faster") == AGREES
    v = {c.claim: c.verdict for c in E.kernel_claims(_attn(2.0, 2.0), {"error": "no compiler"}, on_gpu=True)}
    assert _find(v, "linear in T") == DISAGREES and _find(v, "ops: faster") == NOT_MEASURABLE
    assert _find(v, "~3x faster") == AGREES
    v = {c.claim: c.verdict for c in E.kernel_claims(_attn(2.0, 1.0, speedup=1.0), {"error": "-"}, on_gpu=True)}
    assert _find(v, "~3x faster") == DISAGREES


def test_flops_claims():
    v = {c.claim: c.verdict for c in E.flops_claims(1.0e6, 1.0e6, 16.0)}
    assert _find(v, "6N + 12 l h s") == AGREES and _find(v, "16 bytes") == AGREES
    assert _find(v, "MFU") == NOT_MEASURABLE
    v = {c.claim: c.verdict for c in E.flops_claims(1.3e6, 1.0e6, 8.0, mfu=exact(0.1))}
    assert _find(v, "6N + 12 l h s") == DISAGREES and _find(v, "16 bytes") == DISAGREES
    assert _find(v, "MFU") == DISAGREES


def test_accuracy_gap_pairs_by_seed():
    with pytest.raises(ValueError, match="pair"):
        E.accuracy_gap([0.5, 0.6], [0.5], 2048)
    one = E.accuracy_gap([0.6], [0.6], 2048)
    assert one.value == 0 and one.reason == "one seed"  # not two Wilson intervals of the same 2048 images


def test_mixed_precision_bytes_are_counted_on_bf16_weights_with_an_fp32_master(one_thread):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50))
    x, y = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (32,))
    per_param = E.mixed_precision_bytes(torch.nn.Sequential(model, torch.nn.Flatten(0, 1)), x, y, 1e-3)
    # 2 (bf16 weight) + 2 (bf16 grad) + 4 (fp32 master) + 8 (moments) = 16, plus Adam's step counters
    assert 16.0 <= per_param < 16.01
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
