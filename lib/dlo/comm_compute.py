"""Compute against communication: when a parallelism's collectives hide behind the matmuls they
overlap, from Day 4's alpha-beta model (a message of n bytes costs alpha + n beta; beta = 1 / the
link's bytes per second in one direction) and a GPU's peak FLOP/s (`dlo.hardware`).

- **FSDP / ZeRO-3** (Day 5). Layer i+1's parameters are all-gathered while layer i computes (prefetch).
  A ring all-gather of P parameters of b bytes over N ranks takes (N-1) alpha + (N-1)/N P b beta
  (each rank receives the N-1 shards it lacks); the layer's forward matmuls take 2 P FLOPs per token
  (one multiply-add per weight) at F FLOP/s. The gather hides once the rank's tokens T satisfy
      2 P T / F >= (N-1) alpha + (N-1)/N P b beta,
  i.e. T >= F ((N-1) alpha + (N-1)/N P b beta) / (2 P). With alpha = 0 the layer's size cancels:
  T >= (N-1)/N (b/2) F/B, the GPU's FLOP/s over its link's bytes/s, whatever the model.
- **Tensor parallelism** (Day 7). A layer's forward ends its attention and its MLP with an all-reduce
  of the activations, T h elements of b bytes, over the t ranks: 2 (2 (t-1) alpha + 2 (t-1)/t T h b
  beta); the layer's matmuls, split t ways, take 2 P T / (t F). Their ratio, with alpha = 0,
  2 (t-1) h b F / (P B), does not depend on T: more tokens cannot hide it. With P ~ 12 h^2 it is
  (t-1) b F / (6 h B): it grows as t / h, hence tensor parallelism on the fast links of one node.

Both count matmul FLOPs only (attention scores add 4 s h per token and layer, so more compute: the
bounds are conservative) and assume the overlap is perfect (FSDP) or absent (TP: the next matmul
needs the sum). Day 7's exercise 7 asks for these two functions; `dlo.checks.day7_scale` grades it.

Volumes (Day 7's exercise 7b asks for the pipeline's and the bucket, graded by `dlo.checks.day7_volumes`;
TP's is section 4's equation 5), per micro-batch of b sequences of
s tokens, hidden size h, in bytes:

- **Pipeline** (Day 6). A stage boundary carries the activation forward and its gradient backward,
  b s h elements each way (Narayanan et al. 2021, Sec. 3.2); with tensor parallelism of degree t in
  the stages each of the t ranks sends its 1/t (Sec. 4.1, the scatter/gather optimisation).
- **Tensor parallelism**: 4 all-reduces of b s h per layer (2 forward, 2 backward), 2 (t-1)/t of it
  sent per rank each under the ring: 8 b s h (t-1)/t per layer (Sec. 3.2), times the stage's layers.
  Their ratio, 4 L (t-1)/t for L layers a stage (t = 1 at the boundary), is why the pipeline takes
  the slow links between nodes and TP the fast ones inside.
- **DDP's bucket** (Day 4). A ring all-reduce of n bytes costs 2 (N-1) alpha + 2 (N-1)/N n beta: the
  latency term is at most a share f of it from n >= N alpha (1 - f) / (f beta) on, the smallest
  bucket worth sending (it grows with N: at f = 1/2, N alpha / beta).
"""

from __future__ import annotations

import math

# A bound that is a whole number (the A100's NVLink at N = 8: exactly 910 tokens) comes out of float
# arithmetic as 909.9999999999999 or 910.0000000000001 depending on the order of the operations. The
# "fewest whole" tokens or bytes are therefore the smallest whole number >= x (1 - WHOLE_RTOL), x the real
# bound: an exact bound stays itself, and 1e-12 is far below one unit at any size used here (x < 1e10).
WHOLE_RTOL = 1e-12


def fewest_whole(x: float) -> int:
    """The smallest whole number >= x (1 - WHOLE_RTOL) (0 for x <= 0)."""
    return max(0, math.ceil(x * (1 - WHOLE_RTOL)))


def allgather_time(n_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring all-gather of a tensor of n_bytes in all over `world_size` ranks: (N-1) alpha + (N-1)/N n beta."""
    if world_size < 1 or n_bytes < 0 or alpha < 0 or beta <= 0:
        raise ValueError(f"allgather_time: need world_size >= 1, n_bytes >= 0, alpha >= 0, beta > 0; got "
                         f"{world_size}, {n_bytes}, {alpha}, {beta}")
    return (world_size - 1) * alpha + (world_size - 1) / world_size * n_bytes * beta


def fsdp_min_tokens(layer_params: int, world_size: int, peak_flops: float, link_bytes_per_s: float,
                    alpha: float = 0.0, param_bytes: int = 2) -> int:
    """The fewest tokens per GPU for which one layer's forward all-gather (ring, `world_size` ranks,
    `param_bytes` per parameter) takes no longer than the layer's forward matmuls (2 FLOPs per
    parameter and token at `peak_flops`). 0 on one rank (nothing to gather)."""
    if layer_params < 1 or peak_flops <= 0:
        raise ValueError(f"fsdp_min_tokens: need layer_params >= 1 and peak_flops > 0, got {layer_params}, "
                         f"{peak_flops}")
    gather = allgather_time(layer_params * param_bytes, world_size, alpha, 1.0 / link_bytes_per_s)
    return fewest_whole(gather * peak_flops / (2 * layer_params))


def tp_comm_ratio(layer_params: int, hidden: int, t: int, tokens: int, peak_flops: float,
                  link_bytes_per_s: float, alpha: float = 0.0, act_bytes: int = 2) -> float:
    """Time of a layer's two forward all-reduces of the (tokens x hidden) activations over t ranks
    (ring: 2 (t-1) alpha + 2 (t-1)/t n beta each) over the time of its matmuls split t ways
    (2 layer_params tokens / t FLOPs at `peak_flops`). 0 at t = 1."""
    if min(layer_params, hidden, t, tokens) < 1 or peak_flops <= 0 or link_bytes_per_s <= 0 or alpha < 0:
        raise ValueError(f"tp_comm_ratio: need positive sizes, t, tokens, peak and bandwidth, alpha >= 0; got "
                         f"{layer_params}, {hidden}, {t}, {tokens}, {peak_flops}, {link_bytes_per_s}, {alpha}")
    n = tokens * hidden * act_bytes
    comm = 2 * (2 * (t - 1) * alpha + 2 * (t - 1) / t * n / link_bytes_per_s)
    return comm / (2 * layer_params * tokens / t / peak_flops)


def pp_p2p_bytes(batch: int, seq: int, hidden: int, t: int = 1, act_bytes: int = 2) -> float:
    """Bytes one stage boundary carries per micro-batch, the activation forward and its gradient
    backward (b s h each, Narayanan et al. 2021, Sec. 3.2), sent by each of the stage's t tensor-parallel
    ranks: its 1/t (Sec. 4.1)."""
    if min(batch, seq, hidden, t, act_bytes) < 1:
        raise ValueError(f"pp_p2p_bytes: need positive sizes, t and act_bytes; got {batch}, {seq}, {hidden}, "
                         f"{t}, {act_bytes}")
    return 2 * batch * seq * hidden * act_bytes / t


def tp_bytes(batch: int, seq: int, hidden: int, t: int, layers: int = 1, act_bytes: int = 2) -> float:
    """Bytes one rank sends per micro-batch for `layers` tensor-parallel layers: 4 ring all-reduces of
    b s h per layer (2 forward, 2 backward), 2 (t-1)/t of it each: 8 b s h (t-1)/t (Narayanan et al.
    2021, Sec. 3.2). 0 at t = 1."""
    if min(batch, seq, hidden, t, act_bytes) < 1 or layers < 0:
        raise ValueError(f"tp_bytes: need positive sizes, t and act_bytes, layers >= 0; got {batch}, {seq}, "
                         f"{hidden}, {t}, {layers}, {act_bytes}")
    return 8 * batch * seq * hidden * (t - 1) / t * layers * act_bytes


def ddp_bucket_bytes(world_size: int, alpha: float, link_bytes_per_s: float, latency_share: float = 0.1) -> int:
    """The smallest bucket, in whole bytes, whose ring all-reduce over `world_size` ranks spends at most
    `latency_share` of its time on latency: 2 (N-1) alpha <= f (2 (N-1) alpha + 2 (N-1)/N n beta),
    n >= N alpha (1 - f) / (f beta). 0 on one rank or without latency."""
    if world_size < 1 or alpha < 0 or link_bytes_per_s <= 0 or not 0 < latency_share <= 1:
        raise ValueError(f"ddp_bucket_bytes: need world_size >= 1, alpha >= 0, link_bytes_per_s > 0, "
                         f"0 < latency_share <= 1; got {world_size}, {alpha}, {link_bytes_per_s}, {latency_share}")
    if world_size == 1:
        return 0
    return fewest_whole(world_size * alpha * link_bytes_per_s * (1 - latency_share) / latency_share)


__all__ = ["WHOLE_RTOL", "allgather_time", "ddp_bucket_bytes", "fewest_whole", "fsdp_min_tokens", "pp_p2p_bytes",
           "tp_bytes", "tp_comm_ratio"]
