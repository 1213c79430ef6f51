"""Attention two ways, and a pointwise chain compiled: what fused kernels save.

`naive_attention` is softmax(Q K^T / sqrt(d)) V written out: it materialises the (T, T) scores and
autograd keeps them for backward, O(T^2) memory per head. `sdpa_attention` calls torch's fused
`scaled_dot_product_attention`, which on GPUs runs FlashAttention (Dao et al. 2022): the scores
are computed block by block in on-chip memory, never written out, and recomputed in backward; only
the output and the softmax's log-sum-exp per row are kept, O(T). The CPU has a fused kernel of the
same algorithm, so the memory effect is measurable here; the speed claims (HBM traffic) are not.
The bytes one forward allocates, naive against the course's own tiled kernel, are counted beside that
kernel (`dlo.kernels.flash_attention.attention_memory`), which builds on this module.

`compile_speedup` times a chain of pointwise ops eager and under torch.compile, which fuses the
chain into one loop (one kernel on a GPU): one read and one write of memory instead of one per op.
It also counts the kernels each launches per call (`kernel_launches`), the part of the claim a CPU
can measure: the time saved is a GPU's (launch overhead, HBM traffic).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from dlo.measure import saved_bytes, time_interleaved


def attention_scores(q: Tensor, k: Tensor, causal: bool = True) -> Tensor:
    """S = q k^T / sqrt(d) on (B, H, T, d) tensors, -inf where a query would see a later key (causal):
    the (B, H, T, T) matrix naive attention writes out."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        t = q.shape[-2]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v on (B, H, T, d) tensors, the (T, T) scores written out."""
    return torch.softmax(attention_scores(q, k, causal), dim=-1) @ v  # (B, H, T, d)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """The same attention through torch's fused kernel (FlashAttention's algorithm where available)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


IMPLS = {"naive": naive_attention, "sdpa": sdpa_attention}


def qkv(batch: int, heads: int, seq: int, head_dim: int, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """Random (B, H, T, d) queries, keys and values that require grad (the previous layer's outputs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=gen, device=device, dtype=dtype).requires_grad_()
            for _ in range(3)]


def attention_costs(lengths, *, batch: int = 1, heads: int = 4, head_dim: int = 16, device="cpu",
                    dtype=torch.float32, reps: int = 5) -> list[dict]:
    """Per sequence length and implementation: bytes autograd saves for backward (beyond q, k, v
    themselves, which exist anyway) and forward + backward time (interleaved; a Timing)."""
    def fwd_bwd(impl, inputs):
        for x in inputs:
            x.grad = None
        impl(*inputs).sum().backward()

    rows = []
    for t in lengths:
        inputs = qkv(batch, heads, t, head_dim, device=device, dtype=dtype)
        saved = {name: saved_bytes(lambda impl=impl, i=inputs: impl(*i), exclude=inputs, backward=False)["saved_bytes"]
                 for name, impl in IMPLS.items()}
        fns = {name: (lambda impl=impl, i=inputs: fwd_bwd(impl, i)) for name, impl in IMPLS.items()}
        timing = time_interleaved(fns, device=device, warmup=2, reps=reps)
        for name in IMPLS:
            rows.append({"T": t, "impl": name, "saved_bytes": saved[name], "timing": timing[name]})
    return rows


def loglog_slope(xs, ys) -> float:
    """Slope of log y against log x between the last two points: the exponent of y ~ x^p at the largest x."""
    (x0, x1), (y0, y1) = xs[-2:], ys[-2:]
    return math.log(y1 / y0) / math.log(x1 / x0)


def gelu_residual(x: Tensor, bias: Tensor) -> Tensor:
    """A chain of pointwise ops (bias, GELU, sigmoid gate, residual): eager runs one pass over memory
    per op, a fusing compiler one pass for all."""
    y = F.gelu(x + bias)
    return x + y * torch.sigmoid(y)


def compile_speedup(fn=gelu_residual, args=None, *, device="cpu", reps: int = 20, n: int = 1024) -> dict:
    """Compile `fn` with torch.compile, report the first call's time (tracing + code generation +
    C++/Triton compilation) and interleaved timings eager vs compiled, with the largest difference of
    the outputs. Default arguments: an (n, n) tensor and an (n,) bias. Each call compiles from scratch
    (dynamo's caches reset), so a second size is not a recompilation with dynamic shapes. If
    compilation fails (no C compiler, unsupported platform) returns {"error": why}."""
    if args is None:
        gen = torch.Generator().manual_seed(0)
        args = (torch.randn(n, n, generator=gen).to(device), torch.randn(n, generator=gen).to(device))
    from torch._inductor import metrics

    torch._dynamo.reset()
    compiled = torch.compile(fn)
    try:
        metrics.reset()
        start = time.perf_counter()
        out = compiled(*args)
        compile_s = time.perf_counter() - start
        generated = metrics.generated_kernel_count  # the fused loops inductor wrote for this graph
    except Exception as exc:  # noqa: BLE001 - any backend failure means "not measurable here", with its reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"error": f"{type(exc).__name__}: {first[:200]}"}
    timing = time_interleaved({"eager": lambda: fn(*args), "compiled": lambda: compiled(*args)}, device=device,
                              warmup=2, reps=reps)
    return {"compile_s": compile_s, "eager": timing["eager"], "compiled": timing["compiled"], "shape": args[0].shape,
            "max_abs_diff": float((out - fn(*args)).abs().max()),
            "eager_kernels": kernel_launches(fn, *args),
            "compiled_kernels": generated + kernel_launches(compiled, *args)}


def kernel_launches(fn, *args) -> int:
    """ATen operators one call of fn(*args) dispatches at the top level (each one kernel launch on a
    GPU), counted by the profiler; a compiled call's own generated kernels are not ATen operators
    (`compile_speedup` adds inductor's count of them)."""
    from torch.profiler import ProfilerActivity, profile

    from dlo.profiling import quiet_profiler

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")) for e in aten)
