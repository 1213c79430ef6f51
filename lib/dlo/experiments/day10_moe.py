"""Day 10's mixture-of-experts experiments in one process (`dlo.models.moe` is the code under test).

- `train`: the MoE layer (E SwiGLU experts, top-k, no capacity limit while training) fitted to a fixed
  random SwiGLU teacher on tokens with a shared mean direction (as a transformer's activations have: a router starts
  biased), with and without Switch's auxiliary loss (Fedus et al. 2021, Eq. 4: alpha E sum_i f_i P_i),
  paired by seed (same data, same initial layer). Logged to TensorBoard (loss, aux, imbalance).
- `loads`: the assignments per expert of held-out tokens, counted here from the router's softmax and
  top-k (not from the layer's own routing bookkeeping), and the share of assignments a capacity factor
  f drops: sum_e max(0, load_e - C) / (k S), C = ceil(k S f / E).
- `flops`: FLOPs per token counted by torch's dispatcher (`dlo.measure.count_flops`) of the MoE layer
  (no capacity limit), of a dense SwiGLU with the same active parameters (width k x hidden) and of a dense
  one with all of the experts' parameters (width E x hidden).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dlo.measure import count_flops
from dlo.models.moe import MoE
from dlo.progress import tqdm


def data(P, seed: int, device):
    """`batch(n) -> (x (n, dim), teacher(x))`: tokens drawn on `device` from a generator seeded by `seed`, one
    batch at a time (the full profile's 500 steps of 8192 x 3072 tokens would be 50 GB at once). Both arms of
    a seed draw the same sequence of batches."""
    g = torch.Generator(device=device).manual_seed(1000 + seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    mean = randn(P.moe_dim)  # the shared direction: one expert is favoured at first
    w1, w3 = (randn(P.moe_dim, P.moe_hidden) / math.sqrt(P.moe_dim) for _ in range(2))  # the teacher's SwiGLU
    w2 = randn(P.moe_hidden, P.moe_dim) / math.sqrt(P.moe_hidden)

    def batch(n: int):
        x = randn(n, P.moe_dim) + mean
        with torch.no_grad():
            return x, (F.silu(x @ w1) * (x @ w3)) @ w2

    return batch


def loads(layer: MoE, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """(E,) assignments per expert of x, from the router's softmax and top-k (before any capacity)."""
    with torch.no_grad():
        experts = torch.softmax(x @ layer.router.weight.t(), -1).topk(top_k, -1)[1]
    return torch.bincount(experts.flatten().cpu(), minlength=layer.n_experts)


def imbalance(load: torch.Tensor) -> float:
    """The busiest expert's load over the mean load: 1 when balanced, E/k when every token goes to the same k."""
    return float(load.max() / load.float().mean())


def dropped_share(load: torch.Tensor, top_k: int, factor: float) -> float:
    """Share of the k S assignments over capacity C = ceil(k S f / E) (GShard, Switch Sec. 2.2)."""
    S_k, E = int(load.sum()), load.numel()
    cap = math.ceil(S_k * factor / E)
    return float((load - cap).clamp(min=0).sum() / S_k)


def train(P, seed: int, aux: bool, device, writer=None) -> dict:
    """One arm of the pair: the layer after P.max_steps Adam steps on the teacher's targets (MSE, plus
    P.aux_weight x Switch's loss when `aux`); its losses, and the loads of held-out tokens."""
    batch = data(P, seed, device)
    torch.manual_seed(seed)
    layer = MoE(P.moe_dim, P.moe_hidden, P.n_experts, top_k=P.top_k, capacity_factor=None).to(device)
    opt = torch.optim.Adam(layer.parameters(), lr=P.lr)
    x_held = batch(4 * P.moe_tokens)[0]  # held out: drawn first, never trained on
    start = loads(layer, x_held, P.top_k)
    losses = []
    for i in range(P.max_steps):
        x, y = batch(P.moe_tokens)
        out = layer(x)
        mse = F.mse_loss(out.y, y)
        loss = mse + P.aux_weight * out.aux_loss if aux else mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(mse.detach()))
        if writer is not None:
            writer.add_scalar("mse", float(mse.detach()), i)
            writer.add_scalar("switch_aux", float(out.aux_loss.detach()), i)
            writer.add_scalar("imbalance", imbalance(loads(layer, x, P.top_k)), i)
    end = loads(layer, x_held, P.top_k)
    return {"seed": seed, "aux": aux, "losses": losses, "load_start": start.tolist(), "load": end.tolist(),
            "imbalance": imbalance(end), "imbalance_start": imbalance(start),
            "dropped": {f: dropped_share(end, P.top_k, f) for f in P.capacity_factors}}


def pairs(P, seed: int, device, writer_for=None) -> list[dict]:
    """Both arms for seeds seed .. seed + P.seeds - 1 (paired: the same data and initial layer per seed)."""
    out = []
    for s in tqdm(range(seed, seed + P.seeds), desc="MoE trainings (seeds, both arms)"):
        row = {}
        for aux in (False, True):
            w = writer_for(f"moe_{'aux' if aux else 'noaux'}/seed{s}") if writer_for and s == seed else None
            row[aux] = train(P, s, aux, device, w)
            if w is not None:
                w.close()
        out.append(row)
    return out


class DenseSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def flops(P, device="cpu", tokens: int = 64) -> dict:
    """Forward FLOPs per token counted by torch: the MoE layer (no capacity: no token dropped), a dense SwiGLU
    of the same active parameters (k x hidden) and one holding all the experts' parameters (E x hidden);
    and the parameters of each."""
    torch.manual_seed(0)
    x = torch.randn(tokens, P.moe_dim, device=device)
    layers = {"moe": MoE(P.moe_dim, P.moe_hidden, P.n_experts, top_k=P.top_k, capacity_factor=None),
              "dense, same active": DenseSwiGLU(P.moe_dim, P.top_k * P.moe_hidden),
              "dense, all parameters": DenseSwiGLU(P.moe_dim, P.n_experts * P.moe_hidden)}
    layers = {k: layer.to(device) for k, layer in layers.items()}
    out = {}
    with torch.no_grad():
        for name, layer in layers.items():
            out[name] = {"flops/token": count_flops(lambda layer=layer: layer(x)) / tokens,
                         "params": sum(p.numel() for p in layer.parameters())}
    return out
