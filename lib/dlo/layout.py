"""Choosing a parallel layout: data (plain or FSDP) x tensor x pipeline x context parallelism, expert
parallelism for a mixture of experts, micro-batches and activation checkpointing, for a Llama (or a Llama
whose MLPs are experts: `Model.measure(..., n_experts, top_k)`) on n GPUs of a kind in `dlo.hardware`.

A `Layout(dp, tp, pp, fsdp, m, ac, cp, ep)` runs a global batch of B sequences of s tokens: each of the dp
replicas takes B/dp sequences in m micro-batches of b = B/(dp m), through pp stages (1F1B) of
tensor-parallel degree tp (with sequence parallelism), each sequence split over cp ranks (ring attention
on the zig-zag split: 2 cp divides s); the experts of an MoE layer are spread over ep of the dp replicas
(ep divides dp and the experts). The GPUs are numbered tp innermost, then cp, then pp, then dp, so a group
stays on NVLink while it fits in a node and uses InfiniBand otherwise. cp = ep = 1 is the 3-D model.

**Memory per GPU** (`memory_bytes`), the worst of the first and last stage:
- model states, mixed-precision AdamW, 16 bytes per parameter of the stage, / tp, and / dp under
  FSDP, which then also holds two gathered layers in bf16 (the running one and the prefetched one);
  the embedding lives on the first stage, the head on the last (a tied table on both when pp > 1);
  the cp ranks of a sequence hold the same weights: FSDP shards over dp x cp (torchtitan's mesh); an
  MoE layer's experts are divided by ep as well when replicated (under FSDP dp x cp shards them already);
- activations measured on the meta device (`Model.measure`: `dlo.experiments.day5_report.
  activation_estimate`, one block and the head at 1 x s tokens, bf16; an MoE block as the dense one of
  its active width, k x the MLP's), / (tp cp) (sequence and context parallelism split them all): per
  layer either the whole block's (no checkpointing) or its bf16 input, plus
  one block recomputed at a time (ac); 1F1B keeps min(pp, m) micro-batches alive on the first stage,
  one on the last, which also holds the head's logits of one micro-batch.

**Time per step** (`step_time`), at the GPU's dense bf16 peak (the model ranks layouts; it does not
predict MFU): a micro-batch through the slowest stage costs 6 FLOPs per active parameter and token (8
with checkpointing: the forward again), / (tp cp), plus its tensor-parallel all-reduces (4 per layer, 6
with checkpointing, 2(t-1)/t of b (s/cp) h bf16 each: nothing overlaps them), ring attention's K/V
blocks and their gradients (`dlo.distributed.context_parallel.ring_bytes_per_rank` for the stage's
layers, the forward's again with checkpointing; on the critical path like TP's: attention's FLOPs, which
the hops hide behind, are not counted either), an MoE layer's dispatch and combine all-to-alls
(`dlo.distributed.expert_parallel.ep_bytes_per_rank` of the rank's b s / (cp tp) tokens, again with
checkpointing) and the point-to-point send of its activations (b (s/cp) h / tp bf16, forward and
backward). 1F1B takes (m + pp - 1) such slots. Data parallelism's gradient all-reduce (2 (d-1)/d of the
stage's bf16 gradients, once per step, over the d = dp cp ranks that hold the same weights; an expert's
over dp cp / ep) or FSDP's traffic (all-gathers forward and backward for every micro-batch and a
reduce-scatter: (2m + 1) (d-1)/d of the stage's bf16 parameters) overlap the compute: only what exceeds
it counts.
Collective times are Day 4's ring model with alpha = 0 (`dlo.comm_compute`), at `dlo.hardware.LINKS`.

`search` is the reference of Day 10's exercise 6 (`dlo.checks.day10_layout.check_layout_search`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.comm_compute import allgather_time, pp_p2p_bytes, tp_bytes
from dlo.distributed.context_parallel import ring_bytes_per_rank
from dlo.distributed.expert_parallel import ep_bytes_per_rank
from dlo.hardware import link_bytes_per_s, peak_for_name

ADAMW_MIXED = 16  # bytes per parameter: bf16 parameter and gradient, fp32 master and two moments
BF16 = 2


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    fsdp: bool  # shard the model states over dp x cp (ZeRO-3) instead of replicating them
    m: int      # micro-batches per replica and step (pipeline slots, or gradient accumulation at pp = 1)
    ac: bool    # full activation checkpointing per block
    cp: int = 1  # context parallelism: ranks per sequence (ring attention, zig-zag split)
    ep: int = 1  # expert parallelism: data-parallel ranks an MoE layer's experts are spread over


@dataclass(frozen=True)
class Cluster:
    gpu: str              # a label of dlo.hardware.LINKS ("H100 SXM", ...)
    gpus: int
    mem_gib: float = 80.0
    per_node: int = 8


@dataclass(frozen=True)
class Model:
    """What the layout model needs of a Llama at sequence length `seq`, counted on the meta device."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    layer_params: int
    embedding: int     # vocab x hidden
    tied: bool
    seq: int
    act_layer: int     # bytes one block saves for one sequence of `seq` tokens (bf16, no checkpointing)
    act_head: int      # bytes the embedding, final norm, head and loss save for one sequence
    n_experts: int = 0  # an MoE layer's experts (0: a dense model)
    top_k: int = 0      # experts per token
    experts: int = 0    # parameters of one layer's n_experts experts (in layer_params)

    @property
    def active_params(self) -> int:
        """Parameters of one layer a token goes through: the router and k of the E experts."""
        return self.layer_params - self.experts + self.experts * self.top_k // self.n_experts if self.n_experts \
            else self.layer_params

    @classmethod
    def measure(cls, name: str, seq: int, n_experts: int = 0, top_k: int = 0) -> Model:
        """The Llama `name`; with `n_experts`, the same Llama whose MLPs are `n_experts` copies routed top
        `top_k` (Mixtral's recipe on Mistral 7B), its activations those of the dense block k MLPs wide."""
        from dataclasses import replace

        import torch

        from dlo.experiments.day5_report import activation_estimate
        from dlo.models.llama import Llama, LlamaConfig, count_parameters
        from dlo.models.moe import moe_flops_per_token

        cfg = LlamaConfig.from_name(name)
        cfg = replace(cfg, max_seq_len=max(seq, cfg.max_seq_len))  # torchtitan's CP runs go past 128k (Table 2)
        with torch.device("meta"):  # one block is every block: the other n_layers - 1 need not be built
            layer = count_parameters(Llama(replace(cfg, n_layers=1)).layers["0"])
        if not n_experts:
            act = activation_estimate(cfg, 1, seq)
            return cls(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, layer,
                       cfg.vocab_size * cfg.dim, cfg.tie_embeddings, seq, act["block"], act["head"])
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"need 1 <= top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}")
        counts = moe_flops_per_token(cfg.dim, cfg.ffn_dim, n_experts, top_k)
        mlp = 3 * cfg.dim * cfg.ffn_dim  # the dense SwiGLU the experts replace
        act = activation_estimate(replace(cfg, ffn_dim=top_k * cfg.ffn_dim), 1, seq)
        return cls(f"{name} MoE {n_experts}x top-{top_k}", cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads,
                   layer - mlp + counts["params_total"], cfg.vocab_size * cfg.dim, cfg.tie_embeddings, seq,
                   act["block"], act["head"], n_experts, top_k, counts["params_total"] - cfg.dim * n_experts)


def _stage_params(model: Model, pp: int) -> tuple[int, int]:
    """Parameters of the first and of the last stage (embedding on the first, head on the last)."""
    body = model.layers // pp * model.layer_params
    if pp == 1:
        return (body + model.embedding * (1 if model.tied else 2),) * 2
    return body + model.embedding, body + model.embedding


def _link(cluster: Cluster, span: int) -> float:
    """Bytes/s of a group whose ranks spread over `span` consecutive GPUs: NVLink inside a node."""
    return link_bytes_per_s(cluster.gpu, "nvlink" if span <= cluster.per_node else "infiniband")


def state_shards(lay: Layout) -> tuple[int, int]:
    """How many ways the dense parameters' and the experts' model states are split: tp, and dp x cp under
    FSDP (the cp ranks of a sequence hold the same weights); replicated experts also ep ways."""
    shard = lay.tp * (lay.dp * lay.cp if lay.fsdp else 1)
    return shard, shard if lay.fsdp else lay.tp * lay.ep


def memory_bytes(model: Model, lay: Layout, cluster: Cluster, batch: int) -> float:
    """Bytes per GPU of the worst stage (module docstring)."""
    b = batch / (lay.dp * lay.m)
    split = lay.tp * lay.cp  # sequence parallelism splits the activations tp ways, context parallelism cp ways
    per_layer = (BF16 * b * model.seq * model.hidden if lay.ac else b * model.act_layer) / split
    recompute = b * model.act_layer / split if lay.ac else 0.0
    shard, expert_shard = state_shards(lay)
    experts = model.layers // lay.pp * model.experts  # a stage's experts
    gathered = 0.0
    if lay.fsdp and lay.dp * lay.cp > 1:
        gathered = 2 * BF16 * (model.layer_params - model.experts + model.experts / lay.ep) / lay.tp
    worst = 0.0
    for k, params in enumerate(_stage_params(model, lay.pp)):
        alive = min(lay.pp, lay.m) if k == 0 else 1
        acts = alive * model.layers // lay.pp * per_layer + recompute + (k == 1) * b * model.act_head / split
        states = ADAMW_MIXED * (params - experts) / shard + ADAMW_MIXED * experts / expert_shard
        worst = max(worst, states + gathered + acts)
    return worst


def fits(model: Model, lay: Layout, cluster: Cluster, batch: int) -> bool:
    return memory_bytes(model, lay, cluster, batch) <= cluster.mem_gib * 2 ** 30


def cp_bytes(model: Model, lay: Layout, batch: int) -> float:
    """Bytes a rank sends per micro-batch for ring attention in its stage's layers: K/V blocks of its tp
    share of the KV heads forward, again and their gradients backward, the forward again with checkpointing
    (0 at cp = 1: no ring)."""
    b, layers = batch / (lay.dp * lay.m), model.layers // lay.pp
    kv, d = model.kv_heads // lay.tp, model.hidden // model.heads
    once = ring_bytes_per_rank(b, kv, model.seq, d, lay.cp, BF16, backward=True)
    again = ring_bytes_per_rank(b, kv, model.seq, d, lay.cp, BF16) if lay.ac else 0
    return layers * (once + again)


def ep_bytes(model: Model, lay: Layout, batch: int) -> float:
    """Bytes a rank sends per micro-batch for its stage's MoE layers' dispatch and combine all-to-alls: its
    b s / (cp tp) tokens (sequence parallelism), k rows each, the forward's again with checkpointing."""
    if not model.n_experts:
        return 0.0
    tokens = batch / (lay.dp * lay.m) * model.seq / (lay.cp * lay.tp)
    once = ep_bytes_per_rank(tokens, model.hidden, model.top_k, lay.ep, BF16, backward=True)
    again = ep_bytes_per_rank(tokens, model.hidden, model.top_k, lay.ep, BF16) if lay.ac else 0.0
    return model.layers // lay.pp * (once + again)


def _dp_time(model: Model, lay: Layout, cluster: Cluster) -> float:
    """Data parallelism's (or FSDP's) traffic per step: the dense gradients over the dp x cp ranks that hold
    them, the experts' over the dp cp / ep that hold the same experts."""
    dp_bw, grads = _link(cluster, cluster.gpus), BF16 * max(_stage_params(model, lay.pp)) / lay.tp
    rounds = 2 * lay.m + 1 if lay.fsdp else 2  # FSDP: gathers forward and backward per micro-batch, a
    # reduce-scatter; DDP: an all-reduce, twice an all-gather
    if not model.n_experts:
        return rounds * allgather_time(grads, lay.dp * lay.cp, 0.0, 1 / dp_bw)
    experts = BF16 * (model.layers // lay.pp) * model.experts / lay.tp
    return rounds * (allgather_time(grads - experts, lay.dp * lay.cp, 0.0, 1 / dp_bw)
                     + allgather_time(experts / lay.ep, lay.dp * lay.cp // lay.ep, 0.0, 1 / dp_bw))


def step_time(model: Model, lay: Layout, cluster: Cluster, batch: int) -> float:
    """Seconds per step (module docstring)."""
    peak = peak_for_name(cluster.gpu)["bf16_tflops"] * 1e12
    b = batch / (lay.dp * lay.m)
    tokens = b * model.seq
    seq = model.seq // lay.cp  # a rank's positions of each sequence
    # the last stage is the slowest: its blocks and the head's matmul (the embedding lookup costs no FLOP)
    flops = ((8 if lay.ac else 6) * (model.layers // lay.pp * model.active_params + model.embedding) * tokens
             / (lay.tp * lay.cp))
    tp_bw, pp_bw = _link(cluster, lay.tp), _link(cluster, lay.tp * lay.cp * lay.pp)
    # a stage's 4 all-reduces per layer, 6 when checkpointing recomputes the forward (its 2 again)
    tp_comm = tp_bytes(b, seq, model.hidden, lay.tp, model.layers // lay.pp, BF16) / tp_bw
    slot = flops / peak + (1.5 if lay.ac else 1) * tp_comm
    if lay.cp > 1:
        slot += cp_bytes(model, lay, batch) / _link(cluster, lay.tp * lay.cp)
    if lay.ep > 1:  # the ep ranks are data-parallel ones: the widest span
        slot += ep_bytes(model, lay, batch) / _link(cluster, lay.tp * lay.cp * lay.pp * lay.ep)
    if lay.pp > 1:
        slot += pp_p2p_bytes(b, seq, model.hidden, lay.tp, BF16) / pp_bw
    pipeline = (lay.m + lay.pp - 1) * slot
    dp_comm = _dp_time(model, lay, cluster)
    return pipeline + max(0.0, dp_comm - pipeline)


def _divisors(n: int):
    return (d for d in range(1, n + 1) if n % d == 0)


def layouts(model: Model, cluster: Cluster, batch: int):
    """Every valid layout: dp tp pp cp = gpus; tp divides the KV heads; 2 cp divides the sequence (the
    zig-zag split) when cp > 1; pp divides the layers; ep divides dp and the experts (1 for a dense model);
    m micro-batches of a whole number of sequences, m >= pp when pp > 1 (1F1B); fsdp only with dp cp > 1."""
    n = cluster.gpus
    for tp in (d for d in _divisors(n) if model.kv_heads % d == 0):
        for cp in (d for d in _divisors(n // tp) if d == 1 or model.seq % (2 * d) == 0):
            for pp in (d for d in _divisors(n // (tp * cp)) if model.layers % d == 0):
                dp = n // (tp * cp * pp)
                if batch % dp:
                    continue
                for ep in (e for e in _divisors(dp) if (model.n_experts % e == 0 if model.n_experts else e == 1)):
                    for m in (k for k in range(pp, batch // dp + 1) if (batch // dp) % k == 0):
                        for fsdp in (False, True) if dp * cp > 1 else (False,):
                            for ac in (False, True):
                                yield Layout(dp, tp, pp, fsdp, m, ac, cp, ep)


def search(model: Model, cluster: Cluster, batch: int) -> Layout:
    """The fastest layout that fits (ties: the first in `layouts`' order); ValueError if none fits."""
    best = None
    for lay in layouts(model, cluster, batch):
        if fits(model, lay, cluster, batch):
            t = step_time(model, lay, cluster, batch)
            if best is None or t < best[0]:
                best = (t, lay)
    if best is None:
        raise ValueError(f"no layout of {model.name} fits {cluster.gpus} x {cluster.gpu} ({cluster.mem_gib} GiB) "
                         f"at a batch of {batch} x {model.seq}")
    return best[1]


__all__ = ["Cluster", "Layout", "Model", "cp_bytes", "ep_bytes", "fits", "layouts", "memory_bytes", "search",
           "state_shards", "step_time"]
