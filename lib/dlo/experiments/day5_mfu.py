"""Day 5's production recipe on one device, measured beside its plan: does `P.model` (Llama 3.2 3B at
the full profile) train with FSDP2, `P.param_dtype` compute, activation checkpointing and torch.compile,
at what MFU, and in the memory `dlo plan` said it would need?

`recipe_vs_plan(P, steps=)` runs `day5.train_fsdp` (random weights of the model's real config: nothing
is downloaded; synthetic tokens) on one rank launched by `dlo.distributed.launch` (NCCL on a GPU, gloo on
a CPU), then `day5_report.plan` for the very same run at one GPU of this device's memory, and returns
the two side by side. The GPU session (`bench/gpu_steps.py day5_3b`) calls it at the full profile; on a
CPU it runs at the tiny profile's sizes (no MFU: no peak to divide by).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dlo.distributed.current import rank_device
from dlo.distributed.launch import launch
from dlo.experiments.day5 import train_fsdp
from dlo.experiments.day5_report import mfu_estimate, plan

PLANNED = ("params", "grads", "optimizer", "activations", "total", "gpu", "fits")


def _train(P) -> dict:
    """On the rank: the run, and on a GPU the peak since `train_fsdp`'s last reset, i.e. the last step's
    forward, backward and optimizer step (train_fsdp's own peak leaves the optimizer's step out)."""
    device = rank_device()
    out = train_fsdp(P, device, log_dir=None)
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out["peak_step_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out["reserved_bytes"] = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return out


def recipe_vs_plan(P, *, steps: int = 6, timeout: float = 1800.0) -> dict:
    """`P`'s FSDP2 recipe on one rank for `steps` steps (the first, which compiles, is left out of the
    timing) and its plan at one GPU: MFU (with the interval of the median step), tokens/s, and the
    measured peak (CUDA's max_memory_allocated over the last step's forward and backward, model state
    included; on a CPU the saved-tensor peak) over the plan's total for the same configuration."""
    from dlo.plan import device_memory_gb

    P = replace(P, world_size=1, max_steps=steps)
    P.validate()
    got = launch(_train, 1, P, timeout=timeout)[0]
    rows = plan(P, gpus=1, gpu_mem_gb=device_memory_gb())
    main = next((r for r in rows if r.get("main")), rows[0])
    est = mfu_estimate(got)
    cuda = got["peak_kind"].startswith("cuda")
    return {"model": P.model, "device": got["device"], "world": 1, "steps": steps, "seq_len": P.seq_len,
            "batch_per_rank": P.batch_per_rank, "param_dtype": P.param_dtype, "reduce_dtype": P.reduce_dtype,
            "ac_mode": P.ac_mode, "compile": bool(P.compile and cuda), "n_params": got["n_params"],
            "flops/token": got["flops/token"], "step_s": got["step_s"], "times_s": got["times_s"],
            "tokens/s": got["tokens/s per rank"], "mfu": got["mfu"],
            "mfu_interval": None if est is None else [est.lo, est.hi], "losses": got["losses"],
            "peak_bytes": got["peak_bytes"], "peak_kind": got["peak_kind"], "peak_step_bytes": got["peak_step_bytes"],
            "reserved_bytes": got["reserved_bytes"], "model_state_bytes": got["model_state_bytes"],
            "plan_config": main["config"], "planned": {k: main[k] for k in PLANNED},
            "peak_over_plan": got["peak_bytes"] / main["total"] if cuda else None}


__all__ = ["recipe_vs_plan"]
