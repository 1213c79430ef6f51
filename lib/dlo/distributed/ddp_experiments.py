"""Day 4 experiments, run on every rank inside `dlo.distributed.launch` (rank 0's dict is read).

All measure side by side in one process group: naive vs bucketed vs torch DDP step time (versions
interleaved step by step, so a noisy neighbour slows all of them alike), how many all-reduces start
while backward is still running (the overlap of Li et al. 2020, Fig. 2), the bytes torch's DDP
communication hooks send (fp16/bf16 compression, PowerSGD of Vogels et al. 2019), and local vs
synchronized BatchNorm at a small per-rank batch. The preset `P` is a `dlo.presets.Day4Preset`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.distributed.collectives import _sync, bus_bandwidth, count_calls
from dlo.distributed.ddp import DataParallelBucket, DataParallelNaive
from dlo.distributed.launch import rank_device
from dlo.distributed.sync_bn import convert_sync_batchnorm
from dlo.models.resnet import resnet18
from dlo.models.small import MLP
from dlo.train import evaluate


def mlp(P, device, norm: bool = False) -> nn.Module:
    """d_in -> (hidden [BatchNorm] ReLU) x layers -> 10, the same weights on every call (seeded)."""
    torch.manual_seed(0)
    return MLP(P.d_in, P.hidden, 10, depth=P.layers + 1, norm=norm).to(device)


def feature_batch(P, step: int, rank: int, device, n: int | None = None):
    """A learnable synthetic batch, different on every rank and step: 10 Gaussian clusters around
    fixed centres, each feature with its own offset and scale (so that normalization matters)."""
    centres = torch.randn(10, P.d_in, generator=torch.Generator().manual_seed(12345))  # (10, d_in)
    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, 10, (n or P.batch_per_rank,), generator=g)  # (B,)
    x = 0.3 * centres[y] + torch.randn(len(y), P.d_in, generator=g)  # (B, d_in)
    shift = torch.linspace(-3, 3, P.d_in)
    scale = torch.linspace(0.5, 4, P.d_in).roll(P.d_in // 3)
    return (x * scale + shift).to(device), y.to(device)


def image_batch(P, step: int, rank: int, device):
    """Synthetic images (B, 3, S, S) for the ResNet: 10 classes, each with its own mean pattern."""
    centres = torch.randn(10, 3, P.image_size, P.image_size, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, 10, (P.batch_per_rank,), generator=g)  # (B,)
    x = 0.5 * centres[y] + torch.randn(len(y), 3, P.image_size, P.image_size, generator=g)  # (B, 3, S, S)
    return x.to(device), y.to(device)


def model(P, device) -> nn.Module:
    """The model of the DDP comparisons: P.model is "mlp" (tiny) or "resnet18" (full, He et al. 2016)."""
    if P.model == "resnet18":
        torch.manual_seed(0)
        return resnet18(num_classes=10, width=P.width).to(device)
    if P.model == "mlp":
        return mlp(P, device)
    raise ValueError(f"Day4Preset.model must be 'mlp' or 'resnet18', got {P.model!r}")


def batch(P, step: int, rank: int, device):
    """A batch for `model(P, device)`."""
    return (image_batch if P.model == "resnet18" else feature_batch)(P, step, rank, device)


def _step(net, opt, x, y):
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    if hasattr(net, "finish_gradient_synchronization"):  # ours; torch DDP syncs inside backward
        net.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad()
    return loss


def wrappers(P, device) -> dict:
    """The three data-parallel versions of the comparison, with the same bucket cap."""
    ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    cap = P.bucket_cap_mb
    return {"naive (ours)": lambda m: DataParallelNaive(m),
            "bucketed (ours)": lambda m: DataParallelBucket(m, bucket_cap_mb=cap),
            "torch DDP": lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap, **ddp_kw)}


def step_times(P, device, versions: dict, warmup: int = 2) -> dict:
    """Median step time and throughput of each version, the versions interleaved step by step."""
    r, runs = dist.get_rank(), {}
    for name, wrap in versions.items():
        net = wrap(model(P, device))
        runs[name] = (net, torch.optim.SGD(net.parameters(), lr=P.lr, momentum=0.9), [])
    for s in range(warmup + P.max_steps):
        x, y = batch(P, s, r, device)
        for net, opt, times in runs.values():
            _sync(device)
            t0 = time.perf_counter()
            _step(net, opt, x, y)
            _sync(device)
            if s >= warmup:
                times.append(time.perf_counter() - t0)
    out = {}
    for name, (_, _, times) in runs.items():
        ms = 1e3 * sorted(times)[len(times) // 2]
        out[name] = {"step ms": ms, "samples/s": dist.get_world_size() * P.batch_per_rank / (ms / 1e3)}
    return out


def overlap(P, device, log_dir) -> dict:
    """Profile one bucketed step; count the all-reduces that start before backward's last op ends."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    net = DataParallelBucket(model(P, device), bucket_cap_mb=P.bucket_cap_mb)
    opt = torch.optim.SGD(net.parameters(), lr=P.lr)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    handler = tensorboard_trace_handler(str(log_dir / "profile"), worker_name=f"rank{dist.get_rank()}")
    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=handler) as prof:
        for s in range(2):
            _step(net, opt, *batch(P, s, dist.get_rank(), device))
            prof.step()
    events = prof.events()
    backward_end = max(e.time_range.end for e in events if e.name.startswith("autograd::engine::evaluate_function"))
    # c10d::allreduce_ is the launch from the hook (one per bucket); the backend's own event
    # (gloo:all_reduce, nccl:all_reduce) is the transfer it queues, so counting both would double
    starts = [e.time_range.start for e in events if e.name == "c10d::allreduce_"]
    return {"all-reduces": len(starts), "during backward": sum(t < backward_end for t in starts),
            "buckets": len(net.buckets)}


def compression(P, device) -> dict:
    """Bytes per step each rank hands to all_reduce, and the final loss, per DDP communication hook."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    hooks = {"fp32 (no compression)": default_hooks.allreduce_hook, "fp16 compress": default_hooks.fp16_compress_hook,
             "PowerSGD": powersgd.powerSGD_hook}
    if device.type == "cuda":  # NCCL (rank_device): torch's bf16 hook needs NCCL >= 2.10; gloo has no bf16 sum
        hooks["bf16 compress"] = default_hooks.bf16_compress_hook
    # PowerSGD waits on a nested all-reduce inside a future callback; gloo runs those callbacks on
    # its few worker threads, so several buckets in flight deadlock on CPU: give gloo one bucket.
    cap = P.bucket_cap_mb if device.type == "cuda" else 1024.0
    ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    out = {}
    with count_calls("all_reduce") as sent:  # the hooks call dist.all_reduce from Python: count what they send
        for name, hook in hooks.items():
            net = nn.parallel.DistributedDataParallel(model(P, device), bucket_cap_mb=cap, **ddp_kw)
            state = (powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=P.powersgd_rank,
                                            start_powerSGD_iter=2) if name == "PowerSGD" else None)
            net.register_comm_hook(state, hook)
            opt = torch.optim.SGD(net.parameters(), lr=P.lr, momentum=0.9)
            for s in range(P.compress_steps):
                sent.calls.clear()  # keep the last step's bytes: PowerSGD sends full gradients for its first steps
                loss = _step(net, opt, *batch(P, s, dist.get_rank(), device))
            out[name] = {"bytes/step": sent.nbytes, "final loss": loss.item()}
    return out


def batchnorm(P, device) -> dict:
    """Local vs synchronized BatchNorm at P.bn_batch samples per rank: held-out loss and accuracy."""
    r = dist.get_rank()
    variants = {"local BatchNorm": lambda m: m, "SyncBatchNorm (ours)": convert_sync_batchnorm}
    if device.type == "cuda":
        variants["torch SyncBatchNorm"] = nn.SyncBatchNorm.convert_sync_batchnorm
    x_test, y_test = feature_batch(P, 10 ** 6, 0, device, n=512)
    out = {}
    for name, convert in variants.items():
        net = DataParallelBucket(convert(mlp(P, device, norm=True)), bucket_cap_mb=P.bucket_cap_mb)
        opt = torch.optim.SGD(net.parameters(), lr=P.bn_lr, momentum=0.9)
        for s in range(P.bn_steps):
            _step(net, opt, *feature_batch(P, s, r, device, n=P.bn_batch))
        # eval mode: running statistics, rank 0's own for local BN, the global ones when synced
        loss, acc = evaluate(net, (x_test, y_test), device)
        out[name] = {"test loss": loss, "test acc": acc}
    return out


def run_all(P, log_dir) -> dict:
    """Every Day 4 measurement at this world size (call it through dlo.distributed.launch)."""
    device = rank_device()
    out = {"world": dist.get_world_size(), "device": str(device),
           "model": P.model, "params": sum(p.numel() for p in model(P, device).parameters()),
           "bandwidth": bus_bandwidth(P.msg_sizes, reps=P.bw_reps, device=device)}
    out["throughput"] = step_times(P, device, wrappers(P, device))
    out["overlap"] = overlap(P, device, log_dir)
    out["compression"] = compression(P, device)
    out["batchnorm"] = batchnorm(P, device)
    return out


def scaling(P) -> dict:
    """Step times of bucketed (ours) and torch DDP at this world size (weak scaling: fixed per-rank batch)."""
    device = rank_device()
    versions = {k: v for k, v in wrappers(P, device).items() if k != "naive (ours)"}
    return step_times(P, device, versions)
