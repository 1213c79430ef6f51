"""Day 4 experiments, run on every rank inside `dlo.distributed.launch` (rank 0's dict is read).

All measure side by side in one process group: the all-reduce time per message size (sizes
interleaved round by round after an untimed warm-up round, so the first call's set-up cost is not
fitted) and the bytes a rank really sends (the ring exercise's messages counted by
`dlo.measure.CommCounter`; gloo's own all-reduce on the rank's TCP socket counters);
naive vs bucketed vs torch DDP step time (interleaved step by step, paired rounds); one bucketed
step profiled and the communication its overlap hides (`day4_overlap`); the bytes torch's DDP
communication hooks send (fp16/bf16, PowerSGD of Vogels et al. 2019) and 1-bit Adam's
(`dlo.distributed.onebit_adam`, Tang et al. 2021) against fp32 Adam, with the losses over paired
seeds; local vs synchronized BatchNorm at a small per-rank batch, over paired seeds. Training curves
go to TensorBoard (rank 0, one run folder per configuration under `log_dir`). Every phase reports
`dlo.distributed.heartbeat`, so a slow run reads as progress, not as a deadlock. The preset `P` is a
`dlo.presets.Day4Preset`; `plan` sizes its full profile. Tables and claims: `day4_report`; models,
batches and the training step: `day4_data`; byte counters: `day4_comm`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo import tb
from dlo.distributed.collectives import bus_bandwidth
from dlo.distributed.current import heartbeat, rank_device
from dlo.distributed.ddp import DataParallelBucket, DataParallelNaive
from dlo.distributed.onebit_adam import OneBitAdam
from dlo.distributed.sync_bn import convert_sync_batchnorm
from dlo.experiments.day4_comm import powersgd_parts, ring_sent, wire_bytes
from dlo.experiments.day4_controls import sync_bn_gap, update_gap
from dlo.experiments.day4_data import batch, batches, ddp_step, feature_batch, mlp, model
from dlo.experiments.day4_overlap import exposed_comm, overlap
from dlo.measure import CommCounter, tcp_available, tcp_sent, time_interleaved
from dlo.models import count_parameters
from dlo.train import evaluate, train


def wrappers(P, device) -> dict:
    """The three data-parallel versions of the comparison, with the same bucket cap."""
    ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    cap = P.bucket_cap_mb
    return {"naive DDP (dlo)": lambda m: DataParallelNaive(m),
            "bucketed DDP (dlo)": lambda m: DataParallelBucket(m, bucket_cap_mb=cap),
            "torch DDP": lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap, **ddp_kw)}


def log_curve(log_dir, name: str, values, tag: str = "loss") -> None:
    w = tb.writer(log_dir, name, dist.get_rank())
    if w is not None:
        with contextlib.closing(w):
            for i, v in enumerate(values):
                w.add_scalar(tag, v, i)


# ----------------------------------------------------------------------------- data parallelism

def step_times(P, device, versions: dict, warmup: int = 2, log_dir=None) -> dict:
    """Median step time ("time_s"), every round's time ("times_s": rounds paired across versions)
    and throughput of each version, interleaved step by step on one fixed batch per rank (the data
    do not change a step's time), and each version's "update gap" against torch DDP's weights after the
    same steps (`day4_controls.update_gap`). Rank 0 logs each version's step times ("throughput/<version>")."""
    b = batch(P, 0, dist.get_rank(), device)
    fns, nets = {}, {}
    for name, wrap in versions.items():
        net = nets[name] = wrap(model(P, device))
        opt = torch.optim.SGD(net.parameters(), lr=P.lr, momentum=0.9)
        step = ddp_step(f"throughput, {name}")
        fns[name] = lambda net=net, opt=opt, step=step: step(net, opt, b)
    timings = time_interleaved(fns, device=device, warmup=warmup, reps=P.max_steps)
    world_size = dist.get_world_size()
    for name, t in timings.items():
        log_curve(log_dir, f"throughput/{FOLDERS[name]}", [1e3 * x for x in t.times_s], "step_ms")
    gaps = update_gap(nets) if "torch DDP" in nets else {}  # the same steps: torch DDP's weights are the control
    return {name: {"time_s": t.median_s, "times_s": t.times_s, "spread": t.spread,
                   "samples/s": world_size * P.batch_per_rank / t.median_s}
            | ({"update gap": gaps[name]} if name in gaps else {}) for name, t in timings.items()}


# ----------------------------------------------------------------------------- compression

FOLDERS = {"naive DDP (dlo)": "naive_dlo", "bucketed DDP (dlo)": "bucketed_dlo", "torch DDP": "torch_ddp",
           "fp32 (no compression)": "fp32", "fp16 compress": "fp16", "PowerSGD": "powersgd",
           "bf16 compress": "bf16", "local BatchNorm": "local", "SyncBatchNorm (dlo)": "sync_dlo",
           "torch SyncBatchNorm": "sync_torch", "Adam (fp32 all-reduce)": "adam_fp32", "1-bit Adam": "onebit_adam",
           "frozen variance, fp32 momentum": "frozen_v_fp32", "Adam, no BatchNorm": "adam_no_bn",
           "frozen variance, no BatchNorm": "frozen_v_no_bn"}


def compression_hooks(device) -> dict:
    """torch's DDP communication hooks of the comparison. bf16 compression needs NCCL >= 2.10 (gloo
    has no bf16 sum): on the CPU it is absent, and the notebook shows it as not measurable here."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    hooks = {"fp32 (no compression)": default_hooks.allreduce_hook, "fp16 compress": default_hooks.fp16_compress_hook,
             "PowerSGD": powersgd.powerSGD_hook}
    if device.type == "cuda":
        hooks["bf16 compress"] = default_hooks.bf16_compress_hook
    return hooks


def compression(P, device, log_dir=None) -> dict:
    """Bytes of the last step's all-reduces ("bytes/step", the payload each rank hands over;
    "sent/step", the bytes it sends under the ring model), the training losses and the final loss,
    per DDP communication hook, after P.compress_steps steps."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    # PowerSGD waits on a nested all-reduce inside a future callback; gloo runs those callbacks on
    # its few worker threads, so several buckets in flight deadlock on CPU: give gloo one bucket.
    cap = P.bucket_cap_mb if device.type == "cuda" else 1024.0
    ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    rank, out = dist.get_rank(), {}
    for name, hook in compression_hooks(device).items():
        net = nn.parallel.DistributedDataParallel(model(P, device), bucket_cap_mb=cap, **ddp_kw)
        state = (powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=P.powersgd_rank,
                                        start_powerSGD_iter=2) if name == "PowerSGD" else None)
        net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=P.lr, momentum=0.9)
        step = ddp_step(f"compression, {name}")
        losses = []
        if P.compress_steps > 1:  # PowerSGD sends full gradients for its first steps: count the last one
            hist = train(net, opt, batches(P, rank, device), steps=P.compress_steps - 1, device=device, step_fn=step,
                         progress=False, writer=tb.writer(log_dir, f"compression/{FOLDERS[name]}", dist.get_rank()))
            losses = hist["loss"]
        before = state.compression_stats()[2] if state is not None else 0
        with CommCounter() as comm:
            loss = step(net, opt, batch(P, P.compress_steps - 1, rank, device))["loss"]
        out[name] = {"bytes/step": comm.bytes("all_reduce"), "sent/step": comm.sent("all_reduce"),
                     "final loss": loss.item(), "losses": [*losses, loss.item()]}
        if state is not None:  # PowerSGD's own count of the elements it all-reduced in that step (P, Q, vectors)
            out[name]["state bytes/step"] = 4 * (state.compression_stats()[2] - before)  # fp32 gradients
        if device.type == "cpu" and tcp_available():  # PowerSGD's second all-reduce runs in a callback
            b = batch(P, P.compress_steps, rank, device)  # thread: only the sockets see all of it
            out[name]["wire sent/step"] = [tcp_sent(lambda: step(net, opt, b), 1)  # noqa: B023 - called now
                                           for _ in range(P.wire_calls)]  # (bytes, segments) per step
    parts = powersgd_parts(model(P, "meta"), P.powersgd_rank)  # what each of its three all-reduces carries
    out["PowerSGD"]["formula bytes"], out["PowerSGD"]["formula parts"] = sum(parts.values()), parts
    return out


ONEBIT_RUNS = {  # name: (compressed after the warm-up?, BatchNorm MLP?, warm-up steps or None for P.onebit_warmup)
    "Adam (fp32 all-reduce)": (False, True, "never"),
    "1-bit Adam": (True, True, None),
    "frozen variance, fp32 momentum": (False, True, None),  # the control: the freeze without the compression
    "Adam, no BatchNorm": (False, False, "never"),  # the control's own baseline: the same MLP, Adam throughout
    "frozen variance, no BatchNorm": (False, False, None),  # the freeze where its premise fails (no normalisation)
}


def onebit_adam(P, device, log_dir=None) -> dict:
    """Data-parallel Adam against 1-bit Adam on the MLP with BatchNorm (the same engine,
    `dlo.distributed.onebit_adam`, without and with its compression stage), and controls: the
    variance frozen after the warm-up but the momentum averaged in fp32 (what the freeze alone
    costs), and the same freeze on the MLP without BatchNorm against Adam on that MLP (where the
    variance is not yet stable at the freeze). `P.onebit_seeds` seeds (initial weights and data),
    the same for every run (paired by seed). Per run: the bytes this rank sends per step
    (CommCounter, ring model) and the training losses."""
    r = dist.get_rank()
    out = {name: {"sent": [], "losses": []} for name in ONEBIT_RUNS}
    for seed in range(P.onebit_seeds):
        for name, (compress, norm, warm) in ONEBIT_RUNS.items():
            heartbeat(f"1-bit Adam: {name}, seed {seed}")
            net = mlp(P, device, norm=norm, seed=seed)
            warmup = P.onebit_steps + 1 if warm == "never" else P.onebit_warmup
            opt = OneBitAdam(net.parameters(), lr=P.onebit_lr, warmup_steps=warmup, chunk=P.onebit_chunk,
                             compression=compress)
            sent, losses = [], []
            for step in range(P.onebit_steps):
                x, y = feature_batch(P, 10_000 * (seed + 1) + step, r, device)
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                with CommCounter() as comm:
                    opt.step()
                sent.append(comm.sent())
                losses.append(loss.item())
            log_curve(log_dir, f"onebit/{FOLDERS[name]}/seed{seed}", losses)
            out[name]["sent"].append(sent)
            out[name]["losses"].append(losses)
    out["warmup"], out["steps"], out["chunk"] = P.onebit_warmup, P.onebit_steps, P.onebit_chunk
    return out


def batchnorm(P, device, log_dir=None) -> dict:
    """Local vs synchronized BatchNorm at P.bn_batch samples per rank, over P.bn_seeds seeds (the
    initial weights and the training data; both variants get the same ones: paired by seed), all
    evaluated on one held-out set of 512 samples. Per variant, one entry per seed: "test loss", "test
    acc", "correct" (per example, 0/1: McNemar's paired test within a seed) and the training "losses"
    (TensorBoard: seed 0)."""
    r = dist.get_rank()
    variants = {"local BatchNorm": lambda m: m, "SyncBatchNorm (dlo)": convert_sync_batchnorm}
    if device.type == "cuda":  # torch's SyncBatchNorm supports CUDA (NCCL) only
        variants["torch SyncBatchNorm"] = nn.SyncBatchNorm.convert_sync_batchnorm
    x_test, y_test = feature_batch(P, 10 ** 6, 0, device, n=512)
    out = {name: {"test loss": [], "test acc": [], "correct": [], "losses": [], "n": len(y_test)} for name in variants}
    for seed in range(P.bn_seeds):
        for name, convert in variants.items():
            net = DataParallelBucket(convert(mlp(P, device, norm=True, seed=seed)), bucket_cap_mb=P.bucket_cap_mb)
            opt = torch.optim.SGD(net.parameters(), lr=P.bn_lr, momentum=0.9)
            data = batches(P, r, device, n=P.bn_batch, features=True, first=100_000 * seed)
            hist = train(net, opt, data, steps=P.bn_steps, device=device, progress=False,
                         step_fn=ddp_step(f"batchnorm, {name}, seed {seed}"),
                         writer=tb.writer(log_dir, f"batchnorm/{FOLDERS[name]}", r) if seed == 0 else None)
            # eval mode: running statistics, rank 0's own for local BN, the global ones when synced
            loss, acc = evaluate(net, (x_test, y_test), device)
            net.eval()
            with torch.no_grad():
                correct = (net(x_test).argmax(dim=1) == y_test).int().tolist()
            for key, value in (("test loss", loss), ("test acc", acc), ("correct", correct), ("losses", hist["loss"])):
                out[name][key].append(value)
    return out


def run_all(P, log_dir) -> dict:
    """Every Day 4 measurement at this world size (call it through dlo.distributed.launch)."""
    device = rank_device()
    heartbeat("bus bandwidth sweep")
    out = {"world": dist.get_world_size(), "device": str(device), "backend": dist.get_backend(),
           "model": P.model, "params": count_parameters(model(P, device)), "bn_batch": P.bn_batch,
           "bandwidth": bus_bandwidth(P.msg_sizes, reps=P.bw_reps, trials=P.bw_trials, device=device),
           "ring sent": ring_sent(dist.get_world_size() * 4096)}
    if dist.get_backend() == "gloo" and tcp_available():
        heartbeat("bytes on this rank's sockets")
        out["wire"] = wire_bytes(P.wire_bytes, P.wire_calls, P.wire_trials)
    out["throughput"] = step_times(P, device, wrappers(P, device), log_dir=log_dir)
    out["overlap"] = overlap(P, device, log_dir)
    out["exposed"] = exposed_comm(P, device)
    out["compression"] = compression(P, device, log_dir)
    out["onebit"] = onebit_adam(P, device, log_dir)
    out["batchnorm"] = batchnorm(P, device, log_dir)
    out["sync_bn_gap"] = sync_bn_gap(P.hidden, P.bn_batch, device)  # torch's BatchNorm on the global batch
    return out


def wire_only(P) -> dict:
    """`wire_bytes` (in all and per connection) at another world size (a ring at N = 2 cannot be told
    from sending everything or from a tree, at N = 3 it can)."""
    return wire_bytes(P.wire_bytes, P.wire_calls, P.wire_trials)


def scaling(P) -> dict:
    """Step times of bucketed DDP (dlo) and torch DDP at this world size (weak scaling: fixed per-rank batch)."""
    device = rank_device()
    versions = {k: v for k, v in wrappers(P, device).items() if k != "naive DDP (dlo)"}
    return step_times(P, device, versions)


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Bytes per rank of each experiment at `gpus` ranks. Models on the meta device; our bucketed DDP
    built inside `fake_world(gpus)` (its flat buckets are real objects there), torch DDP's buckets
    counted as one gradient-sized copy (gradient_as_bucket_view=False, its default). SGD momentum:
    one buffer per parameter. The throughput table keeps its three versions alive together."""
    from dlo.accounting import optimizer_bytes
    from dlo.plan import activation_bytes, fake_world, param_bytes, row

    with torch.device("meta"):
        net = model(P, "meta")
        x, y = batch(P, 0, 0, "meta")
        bn = mlp(P, "meta", norm=True)
        xb, yb = feature_batch(P, 0, 0, "meta", n=P.bn_batch)
    n, n_bn = param_bytes(net), param_bytes(bn)  # fp32: SGD's momentum buffer is as large again
    momentum = optimizer_bytes("sgd_momentum", n)
    acts = activation_bytes(lambda: F.cross_entropy(net(x), y), exclude=[*net.parameters(), *net.buffers()])
    acts_bn = activation_bytes(lambda: F.cross_entropy(bn(xb), yb), exclude=[*bn.parameters(), *bn.buffers()])
    with fake_world(gpus):
        bucket = sum(b.buffer.numel() * b.buffer.element_size()
                     for b in DataParallelBucket(net, bucket_cap_mb=P.bucket_cap_mb).buckets)
    what = f"{P.model}, {P.batch_per_rank} samples per rank"
    rows = [row("throughput: naive + bucketed + torch DDP", gpus, params=3 * n, grads=3 * n,
                optimizer=3 * momentum + bucket + n, activations=acts, gpu_mem_gb=gpu_mem_gb, main=True,
                note=f"{what}; three replicas alive together, dlo's buckets and torch DDP's in optimizer"),
            row("exposed communication: 3 x bucketed", gpus, params=3 * n, grads=3 * n,
                optimizer=3 * (momentum + bucket), activations=acts, gpu_mem_gb=gpu_mem_gb,
                note=f"{what}; overlapped, after backward, no all-reduce, alive together"),
            row("scaling: bucketed + torch DDP", gpus, params=2 * n, grads=2 * n,
                optimizer=2 * momentum + bucket + n, activations=acts, gpu_mem_gb=gpu_mem_gb, note=what),
            row("compression: torch DDP + hook", gpus, params=n, grads=n, optimizer=momentum + n,
                activations=acts, gpu_mem_gb=gpu_mem_gb, note=f"{what}; PowerSGD's low-rank factors not counted"),
            row(f"bus bandwidth: {max(P.msg_sizes) / 2**20:.0f} MiB all-reduce", gpus, params=0, grads=0,
                optimizer=0, activations=max(P.msg_sizes), gpu_mem_gb=gpu_mem_gb, note="the message itself"),
            row("SyncBatchNorm: MLP", gpus, params=n_bn, grads=n_bn,
                optimizer=optimizer_bytes("sgd_momentum", n_bn) + n_bn, activations=acts_bn, gpu_mem_gb=gpu_mem_gb,
                note=f"{P.layers} x {P.hidden} wide, {P.bn_batch} samples per rank")]
    return rows
