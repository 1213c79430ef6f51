"""The split-K W4A16 decode kernel against Day 8's dequantize-then-matmul reference: in the interpreter on a CPU
(8 x 16 tiles, so N and K cross tile edges), compiled on a GPU (the `device` fixture); and its split heuristic."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from dlo.kernels import weight_only_decode as wod
from dlo.kernels.quantize import pack_int4, quantize_ref
from dlo.kernels.weight_only_decode import blocks_for, split_k, w4a16_decode, w4a16_decode_ref

# The reference rounds each dequantized weight to x's dtype and y once; the kernel keeps the weights in fp32
# and rounds y once (the interpreter truncates that cast: up to 1 ulp), both accumulate in fp32 in other orders
# (split-K adds slices of K, then the slices). 2 ulps of |y|max: bf16 keeps 8 significant bits, fp16 11.
ULPS = {torch.bfloat16: 2 * 2 ** -7, torch.float16: 2 * 2 ** -10}
# (M, K, N, G): N not a multiple of the CPU's 8 (or the GPU's 16-64) outputs a program, K not always a multiple
# of the 16-input step; groups of 8 and 56 gather a scale per code (no step divides them), groups of 32 and
# per channel (G = K: 48, 96) take one scale per row and step. M from one token to the largest decode (16).
SHAPES = [(1, 200, 23, 8), (2, 192, 17, 32), (5, 96, 9, 96), (1, 48, 5, 48), (16, 64, 7, 16), (3, 112, 33, 56)]


def _case(M, K, N, G, dtype, device):
    gen = torch.Generator().manual_seed(M + K + N + G)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    q, s = quantize_ref(torch.randn(N, K, generator=gen), 4, G)  # Day 8's format: symmetric int4, fp32 scales
    return x, pack_int4(q).to(device), s.to(device)


def _steps(M, K, G, device) -> int:
    return triton.cdiv(K, blocks_for(M, G, device.type)[2])


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("dtype", list(ULPS))
@pytest.mark.parametrize("M,K,N,G", SHAPES)
def test_matches_reference(M, K, N, G, dtype, split, device):
    x, w, s = _case(M, K, N, G, dtype, device)
    y = w4a16_decode(x, w, s, min(split, _steps(M, K, G, device)))
    y_ref = w4a16_decode_ref(x, w, s)
    assert y.dtype == dtype and y.shape == (M, N)
    atol = ULPS[dtype] * y_ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=0.0)


def test_default_split_and_determinism(device):
    """The heuristic's split (several slices here: 4 SMs on a CPU), and the same y bit for bit on every run:
    the slices are added in a fixed order by a second launch, not by atomics."""
    x, w, s = _case(1, 192, 9, 32, torch.bfloat16, device)
    block_m, block_n, block_k = blocks_for(1, 32, device.type)
    assert split_k(9, 192, wod.sm_count(device), block_n, block_k) > 1
    first = w4a16_decode(x, w, s)
    assert all(torch.equal(first, w4a16_decode(x, w, s)) for _ in range(3))
    atol = ULPS[torch.bfloat16] * first.float().abs().max().item()
    torch.testing.assert_close(first.float(), w4a16_decode_ref(x, w, s).float(), atol=atol, rtol=0.0)


def test_bad_input(device):
    x, w, s = _case(2, 48, 5, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="M <= 16 tokens; got M=17: use dlo.kernels.weight_only_matmul"):
        w4a16_decode(x.repeat(9, 1)[:17], w, s)
    with pytest.raises(ValueError, match=r"split=0 must lie in \[1, "):
        w4a16_decode(x, w, s, 0)
    with pytest.raises(ValueError, match="split=99 must lie in"):
        w4a16_decode(x, w, s, 99)
    with pytest.raises(TypeError, match="packed with pack_int4"):
        w4a16_decode(x, w.to(torch.int8), s)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        w4a16_decode(x.float(), w, s)


@pytest.mark.parametrize("M,G,block_k", [(1, 128, 64), (16, 128, 32), (4, 3072, 64), (1, 48, 16), (2, 8, 64),
                                         (8, 56, 32)])
def test_blocks_follow_m_and_divide_the_group_when_they_can(M, G, block_k):
    block_m, block_n, k = blocks_for(M, G)
    assert block_m == triton.next_power_of_2(M) and k == block_k
    assert (block_n, block_k) == wod.BLOCKS[block_m] or G % k == 0  # halved only to divide G


# H200 (132 SMs), one token, 64 x 64 tiles: Llama 3.2 3B's k/v (N=1024, K=3072) has 16 column tiles, so it
# splits K as far as MIN_STEPS allows (24 slices of 2 steps: 384 programs); gate/up (N=8192) has 128 tiles
# and wants 9 slices, 8 once each slice is whole steps (6 of 48): 1024 programs; an A100 (108 SMs) 7.
@pytest.mark.parametrize("N,K,sms,split", [(1024, 3072, 132, 24), (8192, 3072, 132, 8), (8192, 3072, 108, 7),
                                           (3072, 8192, 132, 22), (2048, 2048, 132, 16), (200_000, 3072, 132, 1),
                                           (8192, 64, 132, 1), (8192, 256, 132, 2)])
def test_split_k_by_hand(N, K, sms, split):
    assert split_k(N, K, sms, 64, 64) == split


@pytest.mark.parametrize("N", [512, 1000, 3072, 8192, 50_000])
@pytest.mark.parametrize("K", [64, 192, 2048, 8192])
@pytest.mark.parametrize("sms", [4, 108, 132, 148])
def test_split_k_fills_the_sms_without_empty_slices(N, K, sms):
    block_n, block_k = 64, 64
    split, steps, tiles = split_k(N, K, sms, block_n, block_k), triton.cdiv(K, block_k), triton.cdiv(N, block_n)
    assert 1 <= split <= max(1, steps // wod.MIN_STEPS)
    assert triton.cdiv(steps, triton.cdiv(steps, split)) == split  # whole steps per slice, none empty
    # enough programs for WAVES per SM, unless K has too few steps to split that far (or one slice is enough)
    room = max(1, steps // wod.MIN_STEPS)
    assert tiles * split >= min(wod.WAVES * sms, tiles * room) // 2 or split == room
    assert split_k(N, K, 2 * sms, block_n, block_k) >= split  # more SMs, never fewer programs


# ----------------------------------------------------------------------------- the GPU session's step

ROOT = Path(__file__).resolve().parents[2]


def test_session_step_dry_run_checks_the_kernel_and_times_nothing(tmp_path):
    """bench/gpu_steps.py day9_decode --cpu, as the session's dry run starts it: the kernel against its reference
    in the interpreter, its numbers in $DLO_STEP_RESULT, no timing from a CPU."""
    out = tmp_path / "step.json"
    env = {**os.environ, "DLO_STEP_RESULT": str(out), "DLO_STEP_WORK": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_steps.py"), "day9_decode", "--cpu"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["day"] == "day9_inference" and got["check"]["ran"] and got["rows"] == []
    assert got["check"]["max_diff"] <= 2 ** -6 * got["check"]["y_ref_max"]
    assert "day9_decode" in [s.name for s in _session_steps()]


def _session_steps():
    spec = importlib.util.spec_from_file_location("gpu_session_for_decode", ROOT / "bench" / "gpu_session.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module.STEPS


def test_session_step_rows_are_in_day9s_gpu_table(tmp_path):
    """A GPU session's day9_decode step: every timing it kept, in Day 9's "measured on a GPU" table (and none in
    Day 8's), a failed step as a row too."""
    from dlo.gpu_results import gpu_rows

    rows = [{"op": "weight_only_decode", "impl": impl, "size": "1x3072x8192", "M": 1, "K": 3072, "N": 8192, "ms": ms,
             "speed-up": 0.0305 / ms, "layer": "Llama 3.2 3B gate,up"}
            for impl, ms in (("torch bf16", 0.0305), ("dlo W4A16 (Day 8)", 0.0712), ("dlo W4A16 split-K 8", 0.0191))]
    session = {"session": {"device": "NVIDIA H200", "commit": "0123456789abcdef"}, "steps": [
        {"name": "day9_decode", "status": "ok", "numbers": {"day": "day9_inference", "rows": {"rows": rows}}},
        {"name": "day9_decode", "status": "failed", "reason": "the split-K kernel against its reference: ...",
         "numbers": {"day": "day9_inference"}}]}
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "2026-12-02T1100_nvidia-h200_gpu-session.json").write_text(json.dumps(session))
    day9 = gpu_rows("day9_inference", folder)
    assert [r.value.split(" ms")[0] for r in day9 if r.verdict == "benchmark"] == ["0.0305", "0.0712", "0.0191"]
    assert any(r.verdict == "failed" and "against its reference" in r.value for r in day9)
    assert not gpu_rows("day8_quantization_pruning", folder)


def test_session_times_the_decode_kernel_once(monkeypatch, tmp_path):
    """The session's bench step runs `dlo bench` on every op but the one day9_decode times (not twice in one
    session's minutes)."""
    from dlo.bench import registry

    spec = importlib.util.spec_from_file_location("gpu_steps_for_decode", ROOT / "bench" / "gpu_steps.py")
    steps = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    calls = []
    monkeypatch.setattr(steps, "dlo_cmd", lambda *args, **kw: (calls.append(args), (0, ""))[1])
    monkeypatch.setattr(steps, "WORK", tmp_path)
    assert steps.step_bench(None) == 0
    ops = calls[0][1:calls[0].index("--out")]
    assert calls[0][0] == "bench" and "weight_only_decode" not in ops
    assert set(ops) == set(registry()) - {"weight_only_decode"} and "weight_only_matmul" in ops
    assert steps.STEPS["day9_decode"] is steps.step_day9_decode
