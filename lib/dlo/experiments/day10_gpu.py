"""What a lent GPU measures for Day 10 (`bench/gpu_steps.py day10_cp`; the CPU dry run does the same at the
tiny sizes on gloo): ring attention on NCCL at world = the GPUs against one process (torch's SDPA on the whole
sequence) and against torch's own context-parallel API, which runs on GPUs only; and the MoE layer's
training step against a dense SwiGLU with the same active parameters.

Every number is recorded, agreeing or not: the session's JSON is the evidence (`dlo.gpu_results`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.distributed import context_parallel as cp
from dlo.distributed.current import rank_device
from dlo.experiments.day10_moe import DenseSwiGLU
from dlo.measure import time_fn
from dlo.models.moe import MoE

PROBE_T = 8192  # one (T/N)^2 fp32 score block of 24 heads: 6.4 GB at N = 1


def _torch_cp(q, k, v, n: int, r: int) -> dict:
    """torch's `context_parallel` on a 1-D mesh of the ranks (it shards q, k, v in place and SDPA attends to the
    shards); its output against this rank's zig-zag and contiguous shards of one process's output."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mesh = init_device_mesh(q.device.type, (n,))
        q1, k1, v1 = q.clone(), k.clone(), v.clone()
        with context_parallel(mesh, buffers=[q1, k1, v1], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True)
        errs = {}
        for name, zz in (("zig-zag", True), ("contiguous", False)):
            pos = cp.rank_positions(q.shape[2], n, r, zz).to(q.device)
            if out.shape == want[..., pos, :].shape:
                errs[name] = float((out.float() - want[..., pos, :].float()).abs().max())
        return {"torch_cp_max_err": errs}
    except Exception as exc:  # noqa: BLE001 - recorded: the API's state on this node is the finding
        return {"torch_cp_error": f"{type(exc).__name__}: {exc}"[:400]}


def ring_probe(P, T: int = PROBE_T) -> dict:
    """On a launched rank: ring attention (causal, zig-zag, fp32) forward + backward against SDPA on the whole
    sequence (max |error| of output and gradients), its median step, and torch's context-parallel API."""
    n, r, device = dist.get_world_size(), dist.get_rank(), rank_device()
    T = min(T, max(P.seq_lens))
    g = torch.Generator().manual_seed(0)
    q, k, v, up = (torch.randn(P.batch, P.heads, T, P.head_dim, generator=g).to(device) for _ in range(4))
    full = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    (want * up).sum().backward()
    pos = cp.rank_positions(T, n, r, True).to(device)
    mine = [x[..., pos, :].contiguous().requires_grad_(True) for x in (q, k, v)]
    out = cp.ring_attention(*mine, causal=True, zigzag=True)
    (out * up[..., pos, :]).sum().backward()
    errs = [(out - want[..., pos, :]).abs().max()] + [(m.grad - f.grad[..., pos, :]).abs().max()
                                                      for m, f in zip(mine, full)]

    def step():
        a = [x.detach().requires_grad_(True) for x in mine]
        (cp.ring_attention(*a, causal=True, zigzag=True) * up[..., pos, :]).sum().backward()

    timing = time_fn(step, device=device, warmup=1, reps=5, before=dist.barrier)
    res = {"world": n, "device": str(device), "backend": dist.get_backend(), "T": T, "heads": P.heads,
           "head_dim": P.head_dim, "ring_max_err": float(max(errs)), "ring_step_ms": 1e3 * timing.median_s,
           "ring_times_ms": [1e3 * t for t in timing.times_s]}
    if device.type == "cuda":
        res.update(_torch_cp(q, k, v, n, r))
    else:
        res["torch_cp_error"] = "not run on a CPU: no sharding rule for SDPA's CPU kernel"
    return res


def moe_vs_dense(P, device, reps: int = 10) -> dict:
    """Median training step (forward + backward, bf16 autocast on a GPU) of the MoE layer (no capacity limit)
    and of a dense SwiGLU of width k x hidden, on P.moe_tokens tokens."""
    torch.manual_seed(0)
    layers = {"moe": MoE(P.moe_dim, P.moe_hidden, P.n_experts, top_k=P.top_k, capacity_factor=None).to(device),
              "dense, same active": DenseSwiGLU(P.moe_dim, P.top_k * P.moe_hidden).to(device)}
    x = torch.randn(P.moe_tokens, P.moe_dim, device=device)
    on_gpu = device.type == "cuda"
    out = {}
    for name, layer in layers.items():
        def step(layer=layer):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                y = layer(x)
                y = y.y if hasattr(y, "y") else y
            y.float().sum().backward()

        t = time_fn(step, device=device, warmup=2, reps=reps)
        out[name] = {"median_ms": 1e3 * t.median_s, "times_ms": [1e3 * s for s in t.times_s]}
    out["ratio"] = out["moe"]["median_ms"] / out["dense, same active"]["median_ms"]
    return out
