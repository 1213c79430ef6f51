"""Day 7 experiments: what tensor parallelism communicates, what it saves, what it costs.

`run_all(P)` runs inside `dlo.distributed.launch` on `P.world_size` ranks (the largest degree)
and measures every degree t of `P.degrees` on the first t ranks (subgroups), so the whole sweep is
one launch; rank 0's dict is what the notebook reads:

- `layers`: a stack of GPT blocks (Korthikanti et al. 2022's model: LayerNorm, 4h GELU MLP, dropout,
  attention written out) split by hand (`dlo.distributed.tp_gpt.TensorParallelGPTBlock`) without, with and with
  Megatron's sequence parallelism: bytes each rank sends per layer (`CommCounter`, ring model) beside
  the seminar's 8 b s h (t-1)/t, and bytes saved for backward per layer (`SavedTensorMeter`, in
  bfloat16 as the paper counts) beside s b h (34 + 5 a s / h) and its tensor/sequence-parallel forms;
- `steps`: the Llama split with DTensor (`apply_tp`), training steps per degree: time, tokens/s,
  MFU on GPUs, memory, and the loss, which must not depend on t;
- `fsdp_tp`: the 2D composition (`parallelize_llama`, FSDP x TP) against one process.
The formulas, the claims beside the measurements and the full profile's plan are in
`dlo.experiments.day7_report`.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.distributed.current import heartbeat
from dlo.distributed.tp_comms import tp_size
from dlo.distributed.tp_gpt import MODES, TensorParallelGPTBlock
from dlo.measure import CommCounter, SavedTensorMeter
from dlo.models import count_parameters
from dlo.models.transformer import Block


def gpt_stack(P, group=None, mode: str = "none") -> nn.Sequential:
    """P.gpt_layers GPT layers in bfloat16 (the paper's 16-bit count), the same weights on every call;
    mode "none" wants a group of one rank."""
    torch.manual_seed(0)
    blocks = [TensorParallelGPTBlock(Block(P.gpt_dim, P.gpt_heads, P.dropout), group, mode)
              for _ in range(P.gpt_layers)]
    return nn.Sequential(*blocks).to(torch.bfloat16).train()


def measure_layers(P, group, mode: str, device) -> dict:
    """Per layer, on this rank: bytes sent (forward, backward; ring model), the collectives' payload
    (what the layer hands them, forward + backward: no model) and bytes saved for backward, for one
    forward + backward of the GPT stack on (b, s, h) inputs."""
    t = tp_size(group)
    if (mode == "none") != (t == 1):
        raise ValueError(f"mode {mode!r} on a group of {t} rank(s): 'none' is the one-rank layer")
    stack = gpt_stack(P, group, mode).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(P.gpt_batch, P.gpt_seq, P.gpt_dim, generator=g).to(device, torch.bfloat16)
    if mode.startswith("tp+sp"):
        x = x.chunk(t, 1)[dist.get_rank(group)].contiguous()  # the stack lives in the sequence-parallel region
    x.requires_grad_(True)
    with CommCounter() as fwd, SavedTensorMeter(exclude=list(stack.parameters())) as meter:
        y = stack(x)
        saved = meter.bytes
    with CommCounter() as bwd:
        y.float().square().mean().backward()
    L = P.gpt_layers
    return {"mode": mode, "t": t, "saved/layer": saved / L, "sent fwd/layer": fwd.sent() / L,
            "sent bwd/layer": bwd.sent() / L, "payload/layer": (fwd.bytes() + bwd.bytes()) / L,
            "calls": {"forward": fwd.by_kind("calls"), "backward": bwd.by_kind("calls")}}


# ----------------------------------------------------------------------------- the Llama, split with DTensor

def llama_config(P):
    """The preset's Llama: a named config (`P.model`) with `P.model_overrides` ((field, value) pairs)."""
    from dlo.models.llama import LlamaConfig

    return LlamaConfig.from_name(P.model, **dict(P.model_overrides))


def build_llama(P, dims, mesh, device):
    """The Llama built on the meta device, split by `dims` on `mesh`, then materialised and initialised
    on `device` (the torchtitan flow: no rank ever holds the whole model)."""
    from dlo.distributed.parallelize import parallelize_llama
    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(llama_config(P))
    parallelize_llama(model, dims, mesh)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def batch(P, step: int, vocab: int, device):
    """Synthetic next-token data, the same on every rank (a TP group shares its batch)."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, vocab, (P.batch, P.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T) inputs and targets


def _loss(logits, targets, sharded: bool) -> Tensor:
    if not sharded:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _backward(loss, sharded: bool) -> None:
    if not sharded:
        return loss.backward()
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


def local_bytes(tensors) -> int:
    """Bytes this rank holds of (possibly DTensor) tensors."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def train_steps(P, model, dims, device, steps: int, label: str) -> dict:
    """`steps` SGD-with-momentum steps (bf16 autocast on GPUs): loss and seconds per step, then peak
    memory and bytes of parameters on this rank. The TP group's ranks all hold the same batch; with
    FSDP each "dp" rank takes its share of it. SGD, not AdamW: Adam's first steps divide gradients
    by their own magnitude, which turns float rounding in tiny gradients into visible differences,
    while the point here is that the loss does not depend on how the model is split."""
    from dlo.measure import peak_memory, sync

    sharded = dims.tp > 1 and dims.loss_parallel
    opt = torch.optim.SGD(model.parameters(), lr=P.lr, momentum=0.9)
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    vocab = model.config.vocab_size

    def step(i: int) -> float:
        x, y = batch(P, i, vocab, device)
        if dims.dp > 1:  # FSDP is data parallel: this "dp" rank's share of the batch (mean of equal shares)
            x, y = (z.chunk(dims.dp)[dist.get_rank() // dims.tp] for z in (x, y))
        with amp:
            loss = _loss(model(x), y, sharded)
        _backward(loss, sharded)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        if dims.dp > 1:  # the mean over the "dp" shares (every TP rank of a share holds the same value)
            dist.all_reduce(loss)
            loss /= dims.world_size
        return float(loss)

    losses, times = [], []
    for i in range(steps + 1):  # step 0 warms up (allocations, DTensor's caches)
        heartbeat(f"{label}: step {i} of {steps}")
        sync(device)
        t0 = time.perf_counter()
        losses.append(step(i))
        sync(device)
        times.append(time.perf_counter() - t0)
    with peak_memory(device, exclude=list(model.parameters())) as peak:
        step(steps + 1)
    return {"loss": losses[1:], "step_s": times[1:], "peak_bytes": peak.bytes, "peak_kind": peak.kind,
            "param_bytes": local_bytes(model.parameters())}


def step_metrics(P, cfg, t: int, res: dict, device) -> dict:
    """Tokens/s of one TP group and MFU per GPU (6N + 12 l h s FLOPs per token; the tied table
    counted once, as the output matmul) from a run's median step time; "step_s" keeps every timed
    step (the report gives MFU the interval of that median)."""
    from dlo.measure import mfu, transformer_flops_per_token
    from dlo.models.llama import Llama

    with torch.device("meta"):
        n_params = count_parameters(Llama(cfg))
    med = statistics.median(res["step_s"])
    tokens_s = P.batch * P.seq_len / med
    flops = transformer_flops_per_token(n_params, cfg.n_layers, cfg.dim, P.seq_len) * tokens_s
    return {"t": t, "step ms": 1e3 * med, "tokens/s": tokens_s, "mfu": mfu(flops / t, 1.0, device),
            "params/rank": res["param_bytes"], "peak/rank": res["peak_bytes"], "peak kind": res["peak_kind"],
            "final loss": res["loss"][-1], "step_s": res["step_s"]}  # the timings: MFU's interval


# ----------------------------------------------------------------------------- everything, in one launch

def _tp_mesh(t: int, device):
    """A ("dp", "tp") = (1, t) mesh over ranks 0..t-1; every rank must build it (it makes groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device.type, torch.arange(t).view(1, t), mesh_dim_names=("dp", "tp"))


def run_all(P) -> dict:
    """Every measurement of the day on this launch's ranks; degree t runs on ranks 0..t-1 while the
    others wait at a barrier. Each rank returns what it measured: read rank 0's (it is in every group)."""
    from dlo.distributed.current import rank_device
    from dlo.distributed.parallelize import ParallelDims

    rank, world_size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    degrees = [t for t in P.degrees if t <= world_size]
    cfg = llama_config(P)
    out = {"world": world_size, "device": str(device), "degrees": degrees, "layers": [], "steps": [], "history": {},
           "fsdp_tp": None}
    for t in sorted(set(degrees) | {1}):  # the unsplit GPT layer is the activation table's baseline
        group = dist.new_group(list(range(t)))  # collective: every rank creates every group
        mesh = _tp_mesh(t, device)
        if rank < t:
            for mode in (("none",) if t == 1 else MODES[1:]):
                heartbeat(f"t={t}: GPT layers, {mode}")
                out["layers"].append(measure_layers(P, group, mode, device))
        if rank < t and t in degrees:
            dims = ParallelDims(tp=t)
            model = build_llama(P, dims, mesh, device)
            res = train_steps(P, model, dims, device, P.max_steps, f"t={t}: Llama")
            out["steps"].append(step_metrics(P, cfg, t, res, device))
            out["history"][t] = {"loss": res["loss"], "step_s": res["step_s"]}
            del model
        if rank >= t:
            heartbeat(f"waiting while ranks 0..{t - 1} run t={t}")
        dist.barrier()
    dp, tp = P.fsdp_tp
    if dp * tp == world_size:
        dims = ParallelDims(dp=dp, tp=tp)
        model = build_llama(P, dims, dims.build_mesh(device.type), device)
        res = train_steps(P, model, dims, device, P.max_steps, f"FSDP {dp} x TP {tp}")
        out["fsdp_tp"] = {"dp": dp, "tp": tp, **step_metrics(P, cfg, dims.world_size, res, device),
                          "loss": res["loss"], "step_s": res["step_s"]}
    dist.barrier()
    return out


__all__ = ["batch", "build_llama", "gpt_stack", "llama_config",
           "local_bytes", "measure_layers", "run_all", "step_metrics", "train_steps"]
