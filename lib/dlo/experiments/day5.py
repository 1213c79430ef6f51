"""Day 5 experiments: DDP, ZeRO-1/2/3 (dlo) and FSDP2 side by side, and FSDP2 training of a Llama.

`run_all(P, log_dir)` runs on every rank inside `dlo.distributed.launch` (rank 0's dict is read):

- `engines`: one AdamW step of each engine on the comparison Llama (fp32, batches of
  `P.compare_seq_len` tokens: DDP keeps the whole model state and every activation): the bytes of model state
  each rank holds (`dlo.measure.held_bytes`: parameters, gradients, optimizer state) and the
  payload of every collective (`dlo.measure.CommCounter`), beside the ZeRO paper's formulas;
- `timing`: step time of our ZeRO-3 and of FSDP2 on the same model and ranks, interleaved step by
  step (`dlo.measure.time_interleaved`), and their ratio;
- `same`: our ZeRO-3 and FSDP2 trained side by side from the same weights: the same losses;
- `train`: the production recipe (`recipe`: `parallelize_llama`'s activation checkpointing, compile,
  FSDP2 with the preset's MixedPrecisionPolicy) on `P.model`, meta-initialised shard by shard: losses, tokens/s,
  peak memory and MFU on GPUs.

`memory_vs_world(P)` runs in the notebook's process: the same engines at every world size of
`P.memory_world_sizes` on a fake process group and fake tensors (bytes do not depend on the data: no
arithmetic, no memory, whatever the model's size). `plan(P, gpus=,
gpu_mem_gb=)` is the full profile without a GPU (`dlo plan day5_fsdp`): Llama 3.2 3B on the meta
device, sharded by FSDP2 at `gpus` ranks inside a fake process group, beside the accountant.
The models, data and input checks are in `dlo.experiments.day5_data` (re-exported here); the claims
and the plan in `dlo.experiments.day5_report`.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from dlo import tb
from dlo.distributed.current import heartbeat, rank_device
from dlo.distributed.fsdp import apply_fsdp
from dlo.distributed.parallelize import ParallelDims, parallelize_llama
from dlo.distributed.zero import ZeRO1, ZeRO2, ZeRO3
from dlo.experiments.day5_data import build, check_weights, check_world, llama_config, lm_loss, n_params, token_batches
from dlo.measure import (
    CommCounter,
    held_bytes,
    mfu,
    peak_memory,
    sync,
    tally,
    time_interleaved,
    transformer_flops_per_token,
)

ENGINES = ("DDP (torch)", "ZeRO-1 (dlo)", "ZeRO-2 (dlo)", "ZeRO-3 (dlo)", "FSDP2 (torch)")
STAGE = {"DDP (torch)": 0, "ZeRO-1 (dlo)": 1, "ZeRO-2 (dlo)": 2, "ZeRO-3 (dlo)": 3, "FSDP2 (torch)": 3}


# ----------------------------------------------------------------------------- the engines

def recipe(P, device) -> ParallelDims:
    """The production recipe as `parallelize_llama` dims, in torchtitan's order: activation
    checkpointing, compile (GPU runs), FSDP2 over every rank with the preset's MixedPrecisionPolicy
    (the preset names its dtypes: "bfloat16" -> torch.bfloat16)."""
    return ParallelDims(dp=dist.get_world_size(), ac=P.ac_mode, compile=P.compile and device.type == "cuda",
                        param_dtype=getattr(torch, P.param_dtype), reduce_dtype=getattr(torch, P.reduce_dtype),
                        cpu_offload=P.cpu_offload, fsdp=True)


def _mesh(device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def engine(name: str, P, cfg, device, replica: bool = False, model=None, mesh=None) -> tuple:
    """(module to call, optimizer, step(), zero_grad()) of one engine on a fresh fp32 Llama, or on
    `model` (`replica`: DDP's replica without the wrapper; `mesh`: FSDP2's, else one over the world)."""
    model = build(cfg, device) if model is None else model
    kw = {"lr": P.lr}
    if name == "DDP (torch)" and replica:
        opt = torch.optim.AdamW(model.parameters(), **kw)
        return model, opt, opt.step, opt.zero_grad
    if name == "DDP (torch)":
        ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
        net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, **ids)
        opt = torch.optim.AdamW(net.parameters(), **kw)
        return net, opt, opt.step, opt.zero_grad
    if name == "FSDP2 (torch)":
        apply_fsdp(model, mesh or _mesh(device), param_dtype=None, reduce_dtype=None)  # fp32 like ours
        opt = torch.optim.AdamW(model.parameters(), **kw)
        return model, opt, opt.step, opt.zero_grad
    if name == "ZeRO-1 (dlo)":
        eng = ZeRO1(model, torch.optim.AdamW, **kw)
    elif name == "ZeRO-2 (dlo)":
        eng = ZeRO2(model, torch.optim.AdamW, bucket_cap_mb=P.bucket_cap_mb, **kw)
    elif name == "ZeRO-3 (dlo)":
        eng = ZeRO3(model, torch.optim.AdamW, units=list(model.layers.values()), **kw)
    else:
        raise ValueError(f"unknown engine {name!r}; one of {', '.join(ENGINES)}")
    return eng, eng.optimizer, eng.step, eng.zero_grad


def _grads(opt) -> list:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def measure_engine(name: str, P, cfg, device, x, y, fake: bool = False) -> dict:
    """One AdamW step: model-state bytes this rank holds after it (params, grads, optimizer) and
    the collectives' payload by kind and phase. `fake`: on a fake process group and fake tensors
    (`dlo.plan.fake_cpu`: shapes and bytes, no arithmetic, no memory), where torch DDP's reducer
    cannot run: DDP is measured as the replica it keeps (the same tensors, no collective)."""
    model, mesh, mode = None, None, contextlib.nullcontext()
    if fake:
        from dlo.models.llama import Llama
        from dlo.plan import fake_cpu

        with torch.device("meta"):
            model = Llama(cfg)
        mesh = _mesh(device) if name == "FSDP2 (torch)" else None  # made outside the fake mode: it reads ranks
        mode = fake_cpu(model)
    with mode:
        if fake:
            x, y = mode.from_tensor(x), mode.from_tensor(y)
        net, opt, step, zero = engine(name, P, cfg, device, replica=fake and name == "DDP (torch)", model=model,
                                      mesh=mesh)
        with CommCounter() as comm:
            comm.phase = "forward"
            loss = lm_loss(net, x, y)
            comm.phase = "backward"
            loss.backward()
            comm.phase = "step"
            step()
        state = held_bytes([t for s in opt.state.values() for t in s.values()])  # not the keys: they are the params
        total, grads = held_bytes(net, opt), held_bytes(_grads(opt))
        zero()
    comm_by_phase = {f"{kind} ({phase})": row["bytes"] for (kind, phase), row in tally(comm.records()).items()}
    return {"params": total - grads - state, "grads": grads, "optimizer": state, "total": total,
            "comm": comm_by_phase, "sent": comm.sent(), "payload": comm.bytes(), "world": dist.get_world_size(),
            "n_params": n_params(cfg)}


def compare_preset(P):
    """`P` with the engine comparison's sequence length (`P.compare_seq_len`): the batches of DDP, ZeRO and
    FSDP2 in fp32, without activation checkpointing, sized to fit one GPU beside DDP's whole model state."""
    return replace(P, seq_len=P.compare_seq_len)


def memory_vs_world(P, world_sizes=None) -> list[dict]:
    """`measure_engine` for every engine at every world size, as rank 0 of a fake process group in
    this process, on fake tensors: collectives return at once, nothing is computed or stored, the bytes
    are exact (they do not depend on the data), so the full profile's comparison model costs the CPU
    no more than the tiny one."""
    from dlo.plan import fake_world
    from dlo.progress import tqdm

    cfg = llama_config(P, "compare_model")
    x = y = torch.zeros(P.batch_per_rank, P.compare_seq_len, dtype=torch.long)
    rows = []
    for world_size in tqdm(list(world_sizes or P.memory_world_sizes), desc="world sizes (fake process group)"):
        with fake_world(world_size):
            for name in ENGINES:
                # no gc.collect() after each engine (0.3 s a call in a notebook's heap, 20 calls): fake
                # tensors hold no storage, so the engines' reference cycles can wait for the collector
                rows.append({"engine": name, **measure_engine(name, P, cfg, torch.device("cpu"), x, y, fake=True)})
    return rows


# ----------------------------------------------------------------------------- time and training

def step_fn(net, opt_step, zero):
    def step(model, optimizer, b) -> dict:
        loss = lm_loss(net, *b)
        loss.backward()
        opt_step()
        zero()
        return {"loss": loss}
    return step


def timing(P, cfg, device, batch) -> dict:
    """Median step time of our ZeRO-3 and FSDP2 on the same fp32 model, interleaved step by step."""
    fns = {}
    for name in ("ZeRO-3 (dlo)", "FSDP2 (torch)"):
        net, opt, step, zero = engine(name, P, cfg, device)
        one_step = step_fn(net, step, zero)
        fns[name] = lambda s=one_step, o=opt: s(None, o, batch)
    heartbeat("timing ZeRO-3 (dlo) vs FSDP2")
    timings = time_interleaved(fns, device=device, warmup=2, reps=P.timing_steps)
    fns.clear()
    gc.collect()
    return {name: t.times_s for name, t in timings.items()}


def same_losses(P, cfg, device, batches, log_dir) -> dict:
    """Our ZeRO-3 and FSDP2 (fp32) trained step by step from the same weights: the loss curves."""
    from dlo.train import train

    out = {}
    for name, run in (("ZeRO-3 (dlo)", "zero3_dlo"), ("FSDP2 (torch)", "fsdp2_fp32")):
        heartbeat(f"training {name}")
        net, opt, step, zero = engine(name, P, cfg, device)
        writer = tb.writer(log_dir, run, dist.get_rank())
        hist = train(net, opt, batches, steps=P.max_steps, device=device, step_fn=step_fn(net, step, zero),
                     writer=writer, tag=name, progress=False)
        if writer is not None:
            writer.close()
        out[name] = hist["loss"]
        del net, opt, step, zero
        gc.collect()
    return out


def train_fsdp(P, device, log_dir, data_dir=None, weights_dir: str = "") -> dict:
    """The production run on `P.model`: built on the meta device, sharded, then materialised shard
    by shard: initialised, or each rank's slices of `weights_dir` read straight into its shards (never
    a full copy per rank); tokens/s per rank, MFU, peak memory."""
    from dlo.models.llama import Llama, count_parameters
    from dlo.models.llama_hf import load_hf_sharded, parameter_slots
    from dlo.progress import tqdm

    cfg = llama_config(P)
    with torch.device("meta"):
        model = Llama(cfg)
    slots = parameter_slots(model)  # before the wrappers rename the parameters' paths
    dims = recipe(P, device)
    parallelize_llama(model, dims, dims.build_mesh(device.type))
    model.to_empty(device=device)
    if weights_dir:
        heartbeat(f"loading this rank's shards of {weights_dir}")
        load_hf_sharded(model, slots, weights_dir)
    else:
        model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
    batches = token_batches(P, cfg, dist.get_rank(), device, data_dir)
    writer = tb.writer(log_dir, f"fsdp2_{P.param_dtype}_ac-{P.ac_mode}", dist.get_rank())
    losses, times = [], []
    bar = tqdm(range(P.max_steps), desc=f"FSDP2 {P.model}", disable=dist.get_rank() != 0)
    for s in bar:
        heartbeat(f"FSDP2 training step {s}")
        sync(device)
        t0 = time.perf_counter()
        with peak_memory(device) as peak:
            loss = lm_loss(model, *batches[s % len(batches)])
            loss.backward()
        opt.step()
        opt.zero_grad()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if writer is not None:
            writer.add_scalar("loss", losses[-1], s)
            writer.add_scalar("step_s", times[-1], s)
    if writer is not None:
        writer.close()
    step_s = statistics.median(times[1:] or times)  # the first (warm-up) left out
    tokens = P.batch_per_rank * P.seq_len
    n_flops = count_parameters(model)  # the tied embedding once: as the head's matmul (a lookup costs nothing)
    per_token = transformer_flops_per_token(n_flops, cfg.n_layers, cfg.dim, P.seq_len)
    return {"losses": losses, "step_s": step_s, "times_s": times, "tokens/s per rank": tokens / step_s,
            "flops/token": per_token, "n_params": n_flops,
            "mfu": mfu(per_token * tokens, step_s, device, dtype="bf16" if P.param_dtype == "bfloat16" else "fp32"),
            "peak_bytes": peak.bytes, "peak_kind": peak.kind, "model_state_bytes": held_bytes(model, opt)}


def run_all(P, log_dir=None, data_dir=None, weights_dir: str = "") -> dict:
    """Every Day 5 measurement at this world size (call it through dlo.distributed.launch)."""
    device = rank_device()
    r = dist.get_rank()
    cfg = llama_config(P, "compare_model")
    batches = token_batches(compare_preset(P), cfg, r, device, data_dir)
    out = {"world": dist.get_world_size(), "device": str(device), "engines": {}}
    for name in ENGINES:
        heartbeat(f"one step of {name}")
        out["engines"][name] = measure_engine(name, P, cfg, device, *batches[0])
        gc.collect()  # one engine's model state at a time
    out["timing"] = timing(P, cfg, device, batches[0])
    out["same"] = same_losses(P, cfg, device, batches, log_dir)
    out["train"] = train_fsdp(P, device, log_dir, data_dir, weights_dir)
    dist.barrier()  # no rank tears down while another still talks (gloo aborts otherwise)
    return out


__all__ = ["ENGINES", "STAGE", "build", "check_weights", "check_world", "compare_preset", "engine", "llama_config",
           "lm_loss", "measure_engine", "memory_vs_world", "n_params", "recipe", "run_all", "same_losses",
           "step_fn", "timing", "token_batches", "train_fsdp"]
