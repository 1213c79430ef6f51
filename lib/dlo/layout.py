"""Choosing a parallel layout: data (plain or FSDP) x tensor x pipeline parallelism, micro-batches
and activation checkpointing, for a Llama on n GPUs of a kind in `dlo.hardware`.

A `Layout(dp, tp, pp, fsdp, m, ac)` runs a global batch of B sequences of s tokens: each of the dp
replicas takes B/dp sequences in m micro-batches of b = B/(dp m), through pp stages (1F1B) of
tensor-parallel degree tp (with sequence parallelism). The GPUs are numbered tp innermost, then
pp, then dp, so a group stays on NVLink while it fits in a node and uses InfiniBand otherwise.

**Memory per GPU** (`memory_bytes`), the worst of the first and last stage:
- model states, mixed-precision AdamW, 16 bytes per parameter of the stage, / tp, and / dp under
  FSDP, which then also holds two gathered layers in bf16 (the running one and the prefetched one);
  the embedding lives on the first stage, the head on the last (a tied table on both when pp > 1);
- activations measured on the meta device (`Model.measure`: `dlo.experiments.day5_report.
  activation_estimate`, one block and the head at 1 x s tokens, bf16), / tp (sequence parallelism
  splits them all): per layer either the whole block's (no checkpointing) or its bf16 input, plus
  one block recomputed at a time (ac); 1F1B keeps min(pp, m) micro-batches alive on the first stage,
  one on the last, which also holds the head's logits of one micro-batch.

**Time per step** (`step_time`), at the GPU's dense bf16 peak (the model ranks layouts; it does not
predict MFU): a micro-batch through the slowest stage costs 6 FLOPs per parameter and token (8 with
checkpointing: the forward again), / tp, plus its tensor-parallel all-reduces (4 per layer, 6 with
checkpointing, 2(t-1)/t of b s h bf16 each: nothing overlaps them) and the point-to-point send of
its activations (b s h / tp bf16, forward and backward). 1F1B takes (m + pp - 1) such slots. Data
parallelism's gradient all-reduce (2 (d-1)/d of the stage's bf16 gradients, once per step) or
FSDP's traffic (all-gathers forward and backward for every micro-batch and a reduce-scatter:
(2m + 1) (d-1)/d of the stage's bf16 parameters) overlap the compute: only what exceeds it counts.
Collective times are Day 4's ring model with alpha = 0 (`dlo.comm_compute`), at `dlo.hardware.LINKS`.

`search` is the reference of Day 7's exercise 8 (`dlo.checks.day7_scale.check_layout_search`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.comm_compute import allgather_time, pp_p2p_bytes, tp_bytes
from dlo.hardware import link_bytes_per_s, peak_for_name

ADAMW_MIXED = 16  # bytes per parameter: bf16 parameter and gradient, fp32 master and two moments
BF16 = 2


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    fsdp: bool  # shard the model states over dp (ZeRO-3) instead of replicating them
    m: int      # micro-batches per replica and step (pipeline slots, or gradient accumulation at pp = 1)
    ac: bool    # full activation checkpointing per block


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

    @classmethod
    def measure(cls, name: str, seq: int) -> Model:
        import torch

        from dlo.experiments.day5_report import activation_estimate
        from dlo.models.llama import Llama, LlamaConfig, count_parameters

        cfg = LlamaConfig.from_name(name)
        with torch.device("meta"):
            layer = count_parameters(Llama(cfg).layers["0"])
        act = activation_estimate(cfg, 1, seq)
        return cls(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, layer, cfg.vocab_size * cfg.dim,
                   cfg.tie_embeddings, seq, act["block"], act["head"])


def _stage_params(model: Model, pp: int) -> tuple[int, int]:
    """Parameters of the first and of the last stage (embedding on the first, head on the last)."""
    body = model.layers // pp * model.layer_params
    if pp == 1:
        return (body + model.embedding * (1 if model.tied else 2),) * 2
    return body + model.embedding, body + model.embedding


def _link(cluster: Cluster, span: int) -> float:
    """Bytes/s of a group whose ranks spread over `span` consecutive GPUs: NVLink inside a node."""
    return link_bytes_per_s(cluster.gpu, "nvlink" if span <= cluster.per_node else "infiniband")


def memory_bytes(model: Model, lay: Layout, cluster: Cluster, batch: int) -> float:
    """Bytes per GPU of the worst stage (module docstring)."""
    b = batch / (lay.dp * lay.m)
    per_layer = (BF16 * b * model.seq * model.hidden if lay.ac else b * model.act_layer) / lay.tp
    recompute = b * model.act_layer / lay.tp if lay.ac else 0.0
    shard = lay.tp * (lay.dp if lay.fsdp else 1)
    gathered = 2 * BF16 * model.layer_params / lay.tp if lay.fsdp and lay.dp > 1 else 0.0
    worst = 0.0
    for k, params in enumerate(_stage_params(model, lay.pp)):
        alive = min(lay.pp, lay.m) if k == 0 else 1
        acts = alive * model.layers // lay.pp * per_layer + recompute + (k == 1) * b * model.act_head / lay.tp
        worst = max(worst, ADAMW_MIXED * params / shard + gathered + acts)
    return worst


def fits(model: Model, lay: Layout, cluster: Cluster, batch: int) -> bool:
    return memory_bytes(model, lay, cluster, batch) <= cluster.mem_gib * 2 ** 30


def step_time(model: Model, lay: Layout, cluster: Cluster, batch: int) -> float:
    """Seconds per step (module docstring)."""
    peak = peak_for_name(cluster.gpu)["bf16_tflops"] * 1e12
    b = batch / (lay.dp * lay.m)
    tokens = b * model.seq
    # the last stage is the slowest: its blocks and the head's matmul (the embedding lookup costs no FLOP)
    flops = (8 if lay.ac else 6) * (model.layers // lay.pp * model.layer_params + model.embedding) * tokens / lay.tp
    tp_bw, pp_bw = _link(cluster, lay.tp), _link(cluster, lay.tp * lay.pp)
    # a stage's 4 all-reduces per layer, 6 when checkpointing recomputes the forward (its 2 again)
    tp_comm = tp_bytes(b, model.seq, model.hidden, lay.tp, model.layers // lay.pp, BF16) / tp_bw
    slot = flops / peak + (1.5 if lay.ac else 1) * tp_comm
    if lay.pp > 1:
        slot += pp_p2p_bytes(b, model.seq, model.hidden, lay.tp, BF16) / pp_bw
    pipeline = (lay.m + lay.pp - 1) * slot
    dp_bw, grads = _link(cluster, cluster.gpus), BF16 * max(_stage_params(model, lay.pp)) / lay.tp
    if lay.fsdp:
        dp_comm = (2 * lay.m + 1) * allgather_time(grads, lay.dp, 0.0, 1 / dp_bw)
    else:
        dp_comm = 2 * allgather_time(grads, lay.dp, 0.0, 1 / dp_bw)  # an all-reduce: twice an all-gather
    return pipeline + max(0.0, dp_comm - pipeline)


def layouts(model: Model, cluster: Cluster, batch: int):
    """Every valid layout: dp tp pp = gpus; tp divides the KV heads; pp divides the layers; m
    micro-batches of a whole number of sequences, m >= pp when pp > 1 (1F1B); fsdp only with dp > 1."""
    n = cluster.gpus
    for tp in (d for d in range(1, n + 1) if n % d == 0 and model.kv_heads % d == 0):
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0 and model.layers % d == 0):
            dp = n // (tp * pp)
            if batch % dp:
                continue
            for m in (k for k in range(pp, batch // dp + 1) if (batch // dp) % k == 0):
                for fsdp in (False, True) if dp > 1 else (False,):
                    for ac in (False, True):
                        yield Layout(dp, tp, pp, fsdp, m, ac)


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


__all__ = ["Cluster", "Layout", "Model", "fits", "layouts", "memory_bytes", "search", "step_time"]
