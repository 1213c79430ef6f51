"""Fused AdamW kernel against its torch reference, and the reference against torch.optim.AdamW.

Runs in the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1 without a GPU), so the
tensors are small, with odd sizes that leave partial blocks, and one above BLOCK_SIZE.
"""

import pytest
import torch

import dlo.kernels.fused_adamw as fa
from dlo.kernels.fused_adamw import bench_optimizer_step, fused_adamw_, fused_adamw_ref
from dlo.kernels.runtime import launch_tables

SHAPES = [(1,), (7,), (129,), (13, 77), (2049,)]  # 2049 > BLOCK_SIZE: three programs on one tensor
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 (8 significant bits)


def make_quads(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    exp_avgs = [0.1 * torch.randn(s, generator=gen).to(device) for s in shapes]
    exp_avg_sqs = [0.01 * torch.rand(s, generator=gen).to(device) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def clone(quads):
    return [[t.clone() for t in lst] for lst in quads]


def assert_matches(ours, ref, dtype):
    params, _, exp_avgs, exp_avg_sqs = ours
    ref_params, _, ref_exp_avgs, ref_exp_avg_sqs = ref
    # fp32 state: the same fp32 formulas, only operation order and FMA contraction differ (~1 ulp
    # per op); 1e-6 relative leaves room for a few ulps, far below any real bug. m = m + 0.1 (g - m)
    # cancels where m is near 0, so its absolute error follows |g| ~ 1: 1e-7 absolute.
    torch.testing.assert_close(exp_avgs, ref_exp_avgs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sqs, ref_exp_avg_sqs, rtol=1e-6, atol=1e-10)
    if dtype == torch.float32:
        torch.testing.assert_close(params, ref_params, rtol=1e-6, atol=1e-7)
    else:
        # Both round an fp32 result once; an fp32 difference of an ulp can flip the rounding of a
        # value that sits at a tie, so allow one ulp of the low-precision type (bf16: 2^-7, fp16: 2^-10).
        ulp = BF16_ULP if dtype == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close([p.float() for p in params], [p.float() for p in ref_params], rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_kernel_matches_reference(dtype, weight_decay, device):
    ours = make_quads(SHAPES, dtype, device)
    ref = clone(ours)
    for step in (1, 2, 3):  # bias corrections change every step
        fused_adamw_(*ours, step=step, weight_decay=weight_decay, **HYPER)
        fused_adamw_ref(*ref, step=step, weight_decay=weight_decay, **HYPER)
    assert not torch.equal(ours[0][-1], make_quads(SHAPES, dtype, device)[0][-1])  # it did update
    assert_matches(ours, ref, dtype)


def test_mixed_dtypes_chunked_launches(device, monkeypatch):
    """fp32 and bf16 params in one call split by dtype; a long table splits into chunks."""
    launches = []
    kernel = fa._fused_adamw_kernel

    class CountingKernel:  # `kernel[grid](...)` is a launch: count the grid lookups
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]
    monkeypatch.setattr(fa, "_fused_adamw_kernel", CountingKernel())
    monkeypatch.setattr(fa, "MAX_TENSORS_PER_LAUNCH", 2)
    f32 = make_quads([(5,), (0,), (300,), (31,)], torch.float32, device, seed=1)  # the empty one is skipped
    b16 = make_quads([(17,), (3, 3)], torch.bfloat16, device, seed=2)
    b16[0][0] = torch.randn(40, dtype=torch.bfloat16, device=device)[1:18]  # 2 bytes off: unaligned launch
    ours = [a + b for a, b in zip(f32, b16)]
    ref = clone(ours)
    fused_adamw_(*ours, step=4, weight_decay=0.05, **HYPER)
    fused_adamw_ref(*ref, step=4, weight_decay=0.05, **HYPER)
    assert len(launches) == 3  # fp32: 3 non-empty tensors -> 2 chunks; bf16: 1 chunk
    f32_ours, f32_ref = [lst[:4] for lst in ours], [lst[:4] for lst in ref]
    b16_ours, b16_ref = [lst[4:] for lst in ours], [lst[4:] for lst in ref]
    assert_matches(f32_ours, f32_ref, torch.float32)
    assert_matches(b16_ours, b16_ref, torch.bfloat16)


def test_launch_tables():
    quads = [[torch.zeros(n) for n in (1, 2 * fa.BLOCK_SIZE + 1)] for _ in range(4)]
    addrs, numels, block_tensor, block_start, aligned = launch_tables(quads, torch.device("cpu"), fa.BLOCK_SIZE)
    assert addrs[2].tolist() == [t.data_ptr() for t in quads[2]] and numels.tolist() == [1, 2 * fa.BLOCK_SIZE + 1]
    assert block_tensor.tolist() == [0, 1, 1, 1]
    assert block_start.tolist() == [0, 0, fa.BLOCK_SIZE, 2 * fa.BLOCK_SIZE]
    assert aligned
    quads[1][0] = torch.zeros(2)[1:]  # a view 4 bytes into its storage
    assert not launch_tables(quads, torch.device("cpu"), fa.BLOCK_SIZE)[-1]


def test_reference_matches_torch_adamw():
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(7,), (5, 11), (129,)]]
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(torch_params, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.2, foreach=False)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, 11):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        fused_adamw_ref([p.data for p in params], grads, exp_avgs, exp_avg_sqs, step=step, lr=3e-3, beta1=0.8,
                        beta2=0.99, eps=1e-6, weight_decay=0.2)
    # Same ops in the same order as torch's single-tensor AdamW: agreement to float rounding.
    torch.testing.assert_close([p.data for p in params], [p.data for p in torch_params], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sqs, [opt.state[p]["exp_avg_sq"] for p in torch_params],
                               rtol=1e-6, atol=1e-10)


def test_rejects_bad_inputs(device):
    p, g, m, v = make_quads([(4, 6)], torch.float32, device)
    kw = dict(step=1, weight_decay=0.0, **HYPER)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(4, 5\)"):
        fused_adamw_(p, [g[0][:, :5]], m, v, **kw)
    with pytest.raises(ValueError, match="must be contiguous"):
        fused_adamw_([p[0].t()], [g[0].t()], [m[0].t()], [v[0].t()], **kw)
    with pytest.raises(TypeError, match="must be fp32 optimizer state"):
        fused_adamw_(p, g, [m[0].double()], v, **kw)
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.bfloat16"):
        fused_adamw_(p, [g[0].bfloat16()], m, v, **kw)
    with pytest.raises(ValueError, match="lengths 1, 0, 1, 1"):
        fused_adamw_(p, [], m, v, **kw)
    with pytest.raises(ValueError, match="1-based"):
        fused_adamw_(p, g, m, v, **{**kw, "step": 0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path without the interpreter")
def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_adamw_(*make_quads([(3,)], torch.float32, "cpu"), step=1, weight_decay=0.0, **HYPER)


def test_bench_optimizer_step_rows():
    rows = bench_optimizer_step([100, 37], device="cpu", impls=("torch for-loop", "torch fused"), reps=4)
    assert [r["impl"] for r in rows] == ["torch for-loop", "torch fused"]
    for r in rows:
        assert r["ms"] > 0 and r["% peak"] is None  # no peak bandwidth for a CPU
        # Interleaved rounds: one timing per round for every path, the median inside its interval.
        est = r["ms (95%)"]
        assert est.n == 4 and est.value == r["ms"] and est.lo <= est.value <= est.hi and not est.reason
        # 137 fp32 params: p, g read and p written (12 B) plus m, v read and written (16 B) each.
        assert r["GB/s"] == pytest.approx(137 * 28 / (r["ms"] * 1e-3) / 1e9)
    with pytest.raises(ValueError, match="unknown impls"):
        bench_optimizer_step([3], device="cpu", impls=("apex",))
    with pytest.raises(ValueError, match="reps >= 3"):
        bench_optimizer_step([3], device="cpu", reps=2)
