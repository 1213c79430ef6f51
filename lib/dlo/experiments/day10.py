"""Day 10's experiments on ranks: one launch (`run_all`) measures context parallelism (ring attention, its
all-gather version, DeepSpeed-Ulysses) and expert parallelism on `world_size` ranks.

What each rank measures (`dlo.distributed.context_parallel`, `ulysses`, `expert_parallel` are the code under
test; every measurement comes from outside it):

- equality: each implementation against one process on the full sequence (torch's `scaled_dot_product_attention`),
  outputs and q/k/v gradients, float64, odd shards (T/N = 7 contiguous, zig-zag chunks of 3), causal and not;
  the control: a ring told the contiguous positions while it holds zig-zag shards (the causal mask on the
  wrong positions), which must differ;
- the causal work: the FLOPs torch's dispatcher counts (`dlo.measure.count_flops`) in this rank's forward and
  backward, contiguous and zig-zag, and the step's wall time (`time_fn`, the ranks started by a barrier);
- memory: the bytes autograd saves for backward beyond q, k, v (`dlo.measure.saved_bytes`) per T;
- bytes: what this rank's TCP sockets send per forward and backward (`dlo.measure.tcp_sent`, gloo only);
- expert parallelism: `ExpertParallelMoE` against the single-process `MoE` on this rank's tokens (outputs
  and gradients, float64; the control: a combine in arrival order), and its all-to-all bytes on the wire
  against the rows this rank's routing sends to the other ranks, counted here from the router's top-k.

`plan(P, gpus, gpu_mem_gb)` is `dlo plan day10_context_experts` (`dlo.experiments.day10_report`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.distributed import context_parallel as cp
from dlo.distributed import expert_parallel as ep
from dlo.distributed import ulysses
from dlo.distributed.current import rank_device
from dlo.experiments.day10_report import plan  # noqa: F401 (the registry's planner: dlo.experiments.day10:plan)
from dlo.measure import count_flops, saved_bytes, tcp_available, tcp_sent, time_fn
from dlo.models.moe import MoE

IMPLS = {"ring": cp.ring_attention, "all-gather": cp.allgather_attention, "ulysses": ulysses.ulysses_attention}
EQ_B, EQ_H, EQ_D = 2, 6, 5  # the equality case: H divisible by 2 and 3 (Ulysses), odd head dim


def _full(T: int, B: int, H: int, D: int, dtype, device, seed: int) -> list[torch.Tensor]:
    """q, k, v and an upstream gradient of the whole sequence, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype).to(device) for _ in range(4)]


def _fwd_bwd(fn, q, k, v, up, **kw) -> tuple[torch.Tensor, ...]:
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v, **kw)
    (o * up).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def equality(n: int, r: int, device) -> dict:
    """{(impl, causal, zigzag): max |error| over output and gradients} against one process, and the
    control's error (the ring's causal mask on contiguous positions while it holds zig-zag shards)."""
    errors = {}
    for causal in (True, False):
        for zigzag in (False, True):
            T = 2 * n * 3 if zigzag else n * 7
            q, k, v, up = _full(T, EQ_B, EQ_H, EQ_D, torch.float64, device, seed=T)
            want = _fwd_bwd(F.scaled_dot_product_attention, q, k, v, up, is_causal=causal)  # torch's own
            pos = cp.rank_positions(T, n, r, zigzag).to(device)
            mine = [x[..., pos, :] for x in (q, k, v, up)]
            for name, fn in IMPLS.items():
                got = _fwd_bwd(fn, *mine, causal=causal, zigzag=zigzag)
                errors[name, causal, zigzag] = max(float((g - w[..., pos, :]).abs().max()) for g, w in zip(got, want))
            if causal and zigzag:  # the control
                got = _fwd_bwd(cp.ring_attention, *mine, causal=True, zigzag=False)
                errors["control"] = max(float((g - w[..., pos, :]).abs().max()) for g, w in zip(got, want))
    return errors


def causal_work(P, n: int, r: int, device) -> dict:
    """This rank's counted FLOPs and timed step (forward + backward of ring attention, causal) per split."""
    T, out = P.work_seq, {}
    q, k, v, up = _full(T, P.batch, P.heads, P.head_dim, torch.float32, device, seed=1)
    for split in ("contiguous", "zig-zag"):
        pos = cp.rank_positions(T, n, r, split == "zig-zag").to(device)
        mine = [x[..., pos, :] for x in (q, k, v, up)]

        def step(mine=mine, z=split == "zig-zag"):
            return _fwd_bwd(cp.ring_attention, *mine, causal=True, zigzag=z)

        out[split] = {"flops": count_flops(step),
                      "times": time_fn(step, device=device, warmup=1, reps=P.timing_reps, before=dist.barrier).times_s}
    return out


def memory(P, n: int, device) -> dict:
    """{impl: [bytes saved for backward beyond q, k, v, per T of P.seq_lens]} (causal, contiguous)."""
    out = {}
    for name, fn in IMPLS.items():
        row = []
        for T in P.seq_lens:
            q, k, v = (torch.randn(P.batch, P.heads, T // n, P.head_dim, device=device, requires_grad=True)
                       for _ in range(3))
            row.append(saved_bytes(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), exclude=(q, k, v),
                                   backward=False)["saved_bytes"])
        out[name] = row
    return out


def wire(P, n: int, r: int) -> dict:
    """{impl: bytes this rank's sockets send per forward + backward} at T = P.work_seq (gloo only)."""
    T = P.work_seq
    q, k, v, up = _full(T, P.batch, P.heads, P.head_dim, torch.float32, "cpu", seed=2)
    mine = [x[..., cp.contiguous_positions(T, n, r), :] for x in (q, k, v, up)]
    out = {}
    for name in ("ring", "ulysses"):
        def step(name=name):
            _fwd_bwd(IMPLS[name], *mine, causal=True)

        step()  # warm-up: gloo's first messages set up its pairs
        out[name] = tcp_sent(step, 3)[0]
    return out


# ----------------------------------------------------------------------------- expert parallelism

class CombineInArrivalOrder(ep.ExpertParallelMoE):
    """The control: the expert-major outputs sent home without undoing the regrouping."""

    def restore_order(self, y, perm):
        return y


def moe_layer(P, n: int, dtype=torch.float64, capacity_factor: float | None = 1.25) -> MoE:
    torch.manual_seed(7)
    return MoE(P.moe_dim, P.moe_hidden, P.n_experts, top_k=P.top_k, capacity_factor=capacity_factor).to(dtype)


def rank_tokens(P, r: int, dtype=torch.float64) -> torch.Tensor:
    """Rank r's tokens: moe_tokens + r of them (unequal), a shared mean direction as real activations have."""
    g = torch.Generator().manual_seed(100 + r)
    return (torch.randn(P.moe_tokens + r, P.moe_dim, generator=g) + 0.5).to(dtype)


def rows_by_destination(P, layer: MoE, x: torch.Tensor, n: int) -> list[int]:
    """Kept assignments of these tokens per destination rank, counted from the router's softmax and top-k
    here (choice-major priority, capacity ceil(k S f / E): GShard's rule), not from the layer's routing."""
    S, E, k = x.shape[0], P.n_experts, P.top_k
    cap = math.ceil(k * S * layer.capacity_factor / E) if layer.capacity_factor else S
    experts = torch.softmax(x @ layer.router.weight.t(), -1).topk(k, -1)[1]  # (S, k)
    used, dest = [0] * E, [0] * n
    for j in range(k):
        for s in range(S):
            e = int(experts[s, j])
            if used[e] < cap:
                used[e] += 1
                dest[e // (E // n)] += 1
    return dest


def expert_parallel(P, n: int, r: int, device) -> dict:
    """EP against the single-process layer (float64): max |error| of this rank's output, input gradient and
    its experts' weight gradients (the reference's summed over every rank's tokens, each rank one group);
    the control's output error; on gloo, the bytes this rank's sockets send per forward + backward and the
    rows its routing sends to each rank (counted here)."""
    full, model = moe_layer(P, n).to(device), ep.ExpertParallelMoE(moe_layer(P, n).to(device))
    mine = slice(r * P.n_experts // n, (r + 1) * P.n_experts // n)
    for j in range(n):  # every rank's tokens through the one-process layer: the experts' summed gradients
        xj = rank_tokens(P, j).to(device).requires_grad_(True)
        yj = full(xj).y
        yj.sum().backward()
        if j == r:
            y_ref, gx_ref = yj.detach(), xj.grad
    xe = rank_tokens(P, r).to(device).requires_grad_(True)
    y = model(xe).y
    y.sum().backward()
    errs = [(y - y_ref).abs().max(), (xe.grad - gx_ref).abs().max()]
    errs += [(getattr(model, w).grad - getattr(full, w).grad[mine]).abs().max() for w in ("w1", "w2", "w3")]
    with torch.no_grad():
        wrong = CombineInArrivalOrder(moe_layer(P, n).to(device))(rank_tokens(P, r).to(device)).y
    res = {"error": float(max(errs)), "control": float((wrong - y_ref).abs().max())}
    if device.type == "cpu" and tcp_available():
        model32, x32 = ep.ExpertParallelMoE(moe_layer(P, n, torch.float32)), rank_tokens(P, r, torch.float32)

        def step():
            model32(x32.clone().requires_grad_(True)).y.sum().backward()

        step()
        res["wire"] = tcp_sent(step, 3)[0]
        res["rows_by_destination"] = rows_by_destination(P, moe_layer(P, n, torch.float32), x32, n)
    return res


def run_all(P) -> dict:
    """Everything above on this rank; the launch returns one dict per rank."""
    n, r, device = dist.get_world_size(), dist.get_rank(), rank_device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the cores: one thread each
    res = {"world": n, "rank": r, "device": str(device), "backend": dist.get_backend()}
    res["equality"] = equality(n, r, device)
    res["work"] = causal_work(P, n, r, device)
    res["memory"] = memory(P, n, device)
    if device.type == "cpu" and tcp_available():
        res["wire"] = wire(P, n, r)
    res["ep"] = expert_parallel(P, n, r, device)
    return res
