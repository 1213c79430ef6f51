"""A mixture-of-experts feed-forward layer (Day 10): E SwiGLU experts, a top-k softmax router with a
capacity per expert, and the load-balancing losses of Switch and GShard.

Routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2020, Sec. 2.2 and Alg. 1; Switch, Fedus et al.
2021, Sec. 2.1-2.2). For S tokens x (S, dim), p = softmax(x W_r^T) (S, E); each token goes to its k most
probable experts with gates g = those k probabilities (renormalised to sum to 1 when k > 1, as GShard's
top-2 does; Switch's k = 1 keeps p). Each expert takes at most

    C = ceil(k S capacity_factor / E)       (`expert_capacity`; capacity_factor None: no limit)

assignments; the rest are dropped. Priority is GShard's: every token's first choice before any second
choice, in token order within a choice. A dropped assignment adds nothing to the token's output, so a
token dropped by all its experts leaves the layer as 0 and the block's residual carries it through
unchanged (x + moe(x) = x). The layer returns its output without the residual.

Dispatch sorts the kept assignments by expert (stable: priority order within an expert), each expert
runs on its contiguous rows, combine scatters gate x expert output back to each token (`dispatch`,
`run_experts`, `combine`): the permutation expert parallelism sends over the ranks
(`dlo.distributed.expert_parallel`).

Auxiliary losses, from the router's probabilities and each token's first choice (before dropping):
Switch (Fedus et al. 2021, Eq. 4, without its alpha): E sum_i f_i P_i, f_i the fraction of tokens whose
top-1 is expert i, P_i the mean probability of expert i; 1 when both are uniform. GShard (Alg. 1):
(1/E) sum_e (c_e / S) m_e, the same products averaged over experts: Switch's / E^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.errors import BadInput

__all__ = ["expert_capacity", "Routing", "route", "dispatch", "run_experts", "combine", "switch_aux_loss",
           "gshard_aux_loss", "aux_loss", "MoEOutput", "MoE", "moe_ref", "moe_flops_per_token"]


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """C = ceil(k S capacity_factor / E) assignments per expert; None: every token fits (C = S)."""
    if capacity_factor is None:
        return tokens
    if capacity_factor <= 0:
        raise BadInput(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
    return math.ceil(top_k * tokens * capacity_factor / n_experts)


@dataclass
class Routing:
    """Where the kept assignments go, sorted by expert: rows of `dispatch`'s output."""
    token: Tensor    # (A,) the token of each kept assignment
    expert: Tensor   # (A,) its expert (non-decreasing)
    gate: Tensor     # (A,) its gate (differentiable: the router learns through it)
    kept: Tensor     # (E,) assignments each expert keeps: the tokens per expert
    routed: Tensor   # (E,) assignments routed to each expert before the capacity
    probs: Tensor    # (S, E) the router's softmax
    top1: Tensor     # (S,) each token's first choice
    capacity: int

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.kept.sum())


def route(x: Tensor, router_weight: Tensor, top_k: int, capacity: int, renormalize: bool | None = None) -> Routing:
    """Top-k routing of x (S, dim) with router_weight (E, dim) and at most `capacity` per expert."""
    S, E = x.shape[0], router_weight.shape[0]
    probs = torch.softmax(x @ router_weight.t(), dim=-1)  # (S, E)
    gates, experts = probs.topk(top_k, dim=-1)  # (S, k), descending: column 0 is the first choice
    if (top_k > 1) if renormalize is None else renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    # choice-major order: all first choices (token order), then all second choices (GShard's priority)
    expert = experts.t().reshape(-1)  # (k S,)
    token = torch.arange(S, device=x.device).repeat(top_k)
    gate = gates.t().reshape(-1)
    one_hot = F.one_hot(expert, E)  # (k S, E)
    slot = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # 0-based place of each assignment in its expert's queue
    keep = slot < capacity
    order = torch.argsort(expert[keep], stable=True)  # by expert, priority order within one
    return Routing(token=token[keep][order], expert=expert[keep][order], gate=gate[keep][order],
                   kept=torch.bincount(expert[keep], minlength=E), routed=one_hot.sum(0), probs=probs,
                   top1=experts[:, 0], capacity=capacity)


def dispatch(x: Tensor, routing: Routing) -> Tensor:
    """(A, dim): each kept assignment's token, grouped by expert (`routing.kept` rows each)."""
    return x[routing.token]


def run_experts(rows: Tensor, counts: list[int], w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """Expert e's SwiGLU, w2[e]^T (silu(w1[e]^T x) * w3[e]^T x), on its `counts[e]` consecutive rows.
    w1, w3: (E, dim, hidden), w2: (E, hidden, dim)."""
    outs = [(F.silu(part @ w1[e]) * (part @ w3[e])) @ w2[e] for e, part in enumerate(rows.split(counts))]
    return torch.cat(outs) if outs else rows.new_zeros((0, w2.shape[-1]))


def combine(y: Tensor, routing: Routing, tokens: int) -> Tensor:
    """(S, dim): each token's sum of gate x expert output over its kept assignments (0 if none)."""
    out = y.new_zeros((tokens, y.shape[-1]))
    return out.index_add(0, routing.token, routing.gate.unsqueeze(-1).to(y.dtype) * y)


def switch_aux_loss(probs: Tensor, top1: Tensor) -> Tensor:
    """Fedus et al. 2021, Eq. 4 (without alpha): E sum_i f_i P_i; 1 for a uniform router."""
    E = probs.shape[-1]
    f = torch.bincount(top1, minlength=E).to(probs.dtype) / top1.numel()  # fraction dispatched (no gradient)
    return E * (f * probs.mean(0)).sum()


def gshard_aux_loss(probs: Tensor, top1: Tensor) -> Tensor:
    """Lepikhin et al. 2020, Alg. 1: (1/E) sum_e (c_e / S) m_e, c_e the tokens whose first choice is e."""
    E = probs.shape[-1]
    c = torch.bincount(top1, minlength=E).to(probs.dtype)
    return (c / top1.numel() * probs.mean(0)).mean()


def aux_loss(routing: Routing, kind: str) -> Tensor:
    """The auxiliary loss named `kind` ("switch" or "gshard") of a routing."""
    return (switch_aux_loss if kind == "switch" else gshard_aux_loss)(routing.probs, routing.top1)


@dataclass
class MoEOutput:
    y: Tensor                  # the layer's output, x's shape (no residual)
    aux_loss: Tensor           # the selected auxiliary loss (Switch's or GShard's)
    tokens_per_expert: Tensor  # (E,) kept assignments per expert
    routed: Tensor             # (E,) assignments before the capacity
    dropped: int               # assignments over capacity
    capacity: int


class MoE(nn.Module):
    """E SwiGLU experts of width `hidden` behind a top-k router. Tokens are routed as one group per call
    (GShard's groups: the capacity counts the tokens of this call, e.g. one rank's)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                 aux: str = "switch", renormalize: bool | None = None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise BadInput(f"top_k must be between 1 and n_experts={n_experts}, got {top_k}")
        if aux not in ("switch", "gshard"):
            raise BadInput(f"aux must be 'switch' or 'gshard', got {aux!r}")
        expert_capacity(1, n_experts, top_k, capacity_factor)  # refuses a bad factor now
        self.n_experts, self.top_k, self.capacity_factor, self.aux, self.renormalize = \
            n_experts, top_k, capacity_factor, aux, renormalize
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / math.sqrt(dim))
        self.w3 = nn.Parameter(torch.randn(n_experts, dim, hidden) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / math.sqrt(hidden))

    def route(self, x: Tensor) -> Routing:
        """The routing of x (S, dim) with this layer's capacity for S tokens."""
        cap = expert_capacity(x.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        return route(x, self.router.weight, self.top_k, cap, self.renormalize)

    def forward(self, x: Tensor) -> MoEOutput:
        flat = x.reshape(-1, x.shape[-1])  # (S, dim)
        r = self.route(flat)
        y = run_experts(dispatch(flat, r), r.kept.tolist(), self.w1, self.w3, self.w2)
        out = combine(y, r, flat.shape[0]).view_as(x)
        return MoEOutput(out, aux_loss(r, self.aux), r.kept, r.routed, r.dropped, r.capacity)


def moe_ref(layer: MoE, x: Tensor) -> Tensor:
    """The layer's output token by token, assignment by assignment, with Python counters for the capacity:
    the slow reference `MoE.forward` is checked against (differentiable)."""
    flat = x.reshape(-1, x.shape[-1])
    S, E, k = flat.shape[0], layer.n_experts, layer.top_k
    cap = expert_capacity(S, E, k, layer.capacity_factor)
    probs = torch.softmax(flat @ layer.router.weight.t(), dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if (k > 1) if layer.renormalize is None else layer.renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    used, rows = [0] * E, [flat.new_zeros(flat.shape[-1]) for _ in range(S)]
    for choice in range(k):
        for s in range(S):
            e = int(experts[s, choice])
            if used[e] < cap:
                used[e] += 1
                h = F.silu(flat[s] @ layer.w1[e]) * (flat[s] @ layer.w3[e])
                rows[s] = rows[s] + gates[s, choice] * (h @ layer.w2[e])
    return torch.stack(rows).view_as(x)


def moe_flops_per_token(dim: int, hidden: int, n_experts: int, top_k: int) -> dict:
    """Forward FLOPs per token (2 per multiply-add): the router (2 dim E) and k SwiGLU experts (3 matmuls of
    dim x hidden each), against a dense SwiGLU of the same active parameters (width k hidden)."""
    expert = 2 * 3 * dim * hidden
    return {"moe": 2 * dim * n_experts + top_k * expert, "dense_same_active": top_k * expert,
            "params_total": n_experts * 3 * dim * hidden + dim * n_experts,
            "params_active": top_k * 3 * dim * hidden + dim * n_experts}
