"""Day 3 experiments: what each activation-checkpointing policy saves and costs, optimizer-state
offload, and the day's plan; the table, the memory/time frontier and the claims are in
`dlo.experiments.day3_report`.

`policies(n_layers)` names the policies of the table (keyword arguments of
`dlo.models.transformer.TransformerStack.forward`, plus "offload" for saved tensors in host memory);
`policy_rows` measures each with `dlo.measure`: bytes saved at the end of forward and at the peak of
forward + backward (recomputation saves again), exact on any device, and the step time, the
policies interleaved round by round so that each round's ratio to no checkpointing is a paired
sample (a noisy neighbour slows the whole round).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo import estimates as E
from dlo.accounting import held_after_step, optimizer_bytes
from dlo.activation_ckpt import cpu_offload, every_kth
from dlo.measure import count_flops, optimizer_state_bytes, peak_memory, saved_bytes, tensor_bytes, time_interleaved
from dlo.models import count_parameters
from dlo.models.transformer import TransformerStack
from dlo.optim.offload import CPUOffloadOptimizer
from dlo.plan import GIB, first_step, param_bytes, row, step_memory
from dlo.progress import tqdm

OFFLOAD = "offload to CPU"


def build_model(P) -> TransformerStack:
    return TransformerStack(vocab_size=P.vocab, d_model=P.d_model, n_heads=P.n_heads, n_layers=P.n_layers,
                            max_len=P.seq_len, dropout=P.dropout)


def segments(n_layers: int) -> int:
    """sqrt(n) segments (Chen et al. 2016), at least one."""
    return max(1, round(math.sqrt(n_layers)))


def policies(n_layers: int) -> dict[str, dict]:
    """The table's policies, in order: none, every 4th / 2nd / every block, selective (attention
    only), sqrt(n) segments, and offloading every saved tensor to host memory."""
    out: dict[str, dict] = {"none": {}}
    for k in (4, 2, 1):
        out[f"every {k}"] = dict(checkpoint_blocks=every_kth(n_layers, k))
    out["selective (attention)"] = dict(checkpoint_attention=True)
    out[f"sqrt(n): {segments(n_layers)} segments"] = dict(checkpoint_segments=segments(n_layers))
    out[OFFLOAD] = dict(offload=True)
    return out


def slug(name: str) -> str:
    """A policy name as a folder name: "sqrt(n): 3 segments" -> "sqrt_n_3_segments"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def lm_loss(model: nn.Module, inputs: Tensor, targets: Tensor, **policy) -> Tensor:
    """Next-token cross-entropy of `model(inputs, **policy)`; inputs, targets (B, T)."""
    logits = model(inputs, **policy)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def policy_rows(model: nn.Module, inputs: Tensor, targets: Tensor, policies: dict[str, dict], *, reps: int,
                device, log=None) -> list[dict]:
    """One row per policy (the first is the baseline): "saved_bytes" (end of forward),
    "peak_saved_bytes" (forward + backward), "peak_bytes"/"peak_kind" (`dlo.measure.peak_memory`:
    CUDA's whole-step peak, else the saved-tensor peak), "flops" (forward + backward with its
    recomputation, counted: exact, and what a GPU's matmul-bound time follows), "times_s" (one forward + backward per
    round, `reps` rounds interleaved after one warm-up round), "ratios" (each round's time over the
    baseline's in the same round) and "time_vs_none" (their median with its 95% interval). The
    offload row saves the same bytes as the baseline, in host memory. `log`: `Run.writer`, one run
    per policy ("policy/<name>": its step times and saved bytes)."""
    params = list(model.parameters())
    steps, rows = {}, []
    for name, policy in tqdm(policies.items(), desc="policies: memory"):
        policy = dict(policy)
        offload = policy.pop("offload", False)

        def step(policy=policy, offload=offload):
            model.zero_grad(set_to_none=True)
            with cpu_offload() if offload else contextlib.nullcontext():
                loss = lm_loss(model, inputs, targets, **policy)
            loss.backward()

        saved = saved_bytes(lambda policy=policy: lm_loss(model, inputs, targets, **policy), exclude=params)
        with peak_memory(device, exclude=params) as peak:
            step()
        steps[name] = step
        rows.append({"policy": name, "saved_bytes": saved["saved_bytes"], "peak_saved_bytes": saved["peak_saved_bytes"],
                     "peak_bytes": peak.bytes, "peak_kind": peak.kind, "flops": count_flops(step)})
    timings = time_interleaved(steps, device=device, warmup=1, reps=reps)
    add_times(rows, {name: t.times_s for name, t in timings.items()})
    if log is not None:
        for r in rows:
            with contextlib.closing(log(f"policy/{slug(r['policy'])}")) as w:
                for i, t in enumerate(r["times_s"]):
                    w.add_scalar("step_ms", 1e3 * t, i)
                    w.add_scalar("peak_saved_MiB", r["peak_saved_bytes"] / 2**20, i)
    return rows


def add_times(rows: list[dict], times: dict[str, list[float]]) -> None:
    """Put each policy's interleaved step times into its row with what the table and the claims read:
    "times_s", "time_s" (median), "ratios" (per round, over the first row's), "time_vs_none" (their
    median with its 95% interval) and "saved_vs_none" (peak saved bytes over the first row's)."""
    base = rows[0]
    for r in rows:
        t = list(times[r["policy"]])
        ratios = [a / b for a, b in zip(t, times[base["policy"]])]
        r.update(times_s=t, time_s=E.median_interval(t).value, ratios=ratios,
                 time_vs_none=E.median_interval(ratios, f"paired ratio, median of {len(t)} rounds"),
                 saved_vs_none=r["peak_saved_bytes"] / base["peak_saved_bytes"])


def block_sizes(model: TransformerStack, inputs: Tensor) -> dict:
    """Chen et al.'s a and b for this model: the bytes one block saves for backward ("inside", its
    input included) and the bytes of a block's input ("boundary"), exact; and the segment count
    s* = sqrt(n a / b) that minimises s b + (n / s) a, capped at n."""
    with torch.no_grad():
        h = model.drop(model.tok(inputs) + model.pos(torch.arange(inputs.shape[1], device=inputs.device)))
    h = h.detach().requires_grad_(True)  # (B, T, C): the boundary a checkpoint keeps
    block = model.blocks[0]
    a = saved_bytes(lambda: block(h).sum(), exclude=list(block.parameters()), backward=False)["saved_bytes"]
    b = tensor_bytes([h])
    n = len(model.blocks)
    return {"inside": a, "boundary": b, "n": n, "s_opt": min(n, math.sqrt(n * a / b))}


# ----------------------------------------------------------------------------- optimizer-state offload

def offload_comparison(P, inputs: Tensor, targets: Tensor, device, *, steps: int, log=None) -> dict:
    """The same model trained `steps` steps with AdamW and with `CPUOffloadOptimizer(AdamW)`
    (interleaved step by step): losses, whether the parameters are equal afterwards (and their largest
    difference), the optimizer bytes by side (the offload optimizer's own accounting), the model-state
    bytes per parameter a step leaves held on the device, read from the allocator (`held_after_step`:
    CUDA's memory_allocated on a GPU), and each step's time ratio offload / plain."""
    torch.manual_seed(0)
    models = {"adamw": build_model(P).to(device)}
    models["adamw_offload"] = build_model(P).to(device)
    models["adamw_offload"].load_state_dict(models["adamw"].state_dict())
    kw = dict(lr=P.lr, weight_decay=0.1)
    opts = {"adamw": torch.optim.AdamW(models["adamw"].parameters(), **kw),
            "adamw_offload": CPUOffloadOptimizer(models["adamw_offload"].parameters(), torch.optim.AdamW, **kw)}
    losses: dict[str, list[float]] = {k: [] for k in models}

    def step(name):
        def run():
            m, opt = models[name], opts[name]
            m.eval()  # no dropout: the two runs must see the same function
            loss = lm_loss(m, inputs, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
        return run

    timings = time_interleaved({k: step(k) for k in models}, device=device, warmup=0, reps=steps)
    if log is not None:
        for name, ls in losses.items():
            with contextlib.closing(log(f"optimizer/{name}")) as w:
                for i, v in enumerate(ls):
                    w.add_scalar("loss", v, i)
    pairs = [(a.detach(), b.detach())
             for a, b in zip(models["adamw"].parameters(), models["adamw_offload"].parameters())]
    equal = all(torch.equal(a, b) for a, b in pairs)
    # on a GPU not bit-equal: torch's CUDA AdamW (foreach) and the host's loop round in another order
    max_abs_diff = max(float((a - b).abs().max()) for a, b in pairs)
    t_plain, t_off = timings["adamw"].times_s, timings["adamw_offload"].times_s
    # the allocator's side (not the optimizer's report of itself): bytes per parameter a step leaves held
    held = {name: held_after_step(models[name], opts[name], lambda name=name: _plain_step(models[name], opts[name],
                                                                                          inputs, targets), device)
            for name in models}
    return {"losses": losses, "equal": equal, "max_abs_diff": max_abs_diff, "held_per_param": held,
            "n_params": count_parameters(models["adamw"]),
            "plain_state_bytes": optimizer_state_bytes(opts["adamw"]),
            "offload_bytes": opts["adamw_offload"].bytes_by_side(), "ratios": [b / a for a, b in zip(t_plain, t_off)],
            "ms": {k: 1e3 * t.median_s for k, t in timings.items()}}


def _plain_step(model: nn.Module, opt, inputs: Tensor, targets: Tensor) -> None:
    model.eval()
    opt.zero_grad()
    lm_loss(model, inputs, targets).backward()
    opt.step()


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Per policy: the fp32 model and its gradients (the table runs forward + backward, no optimizer),
    the peak saved bytes at the preset's batch, and the step's peak (`dlo.plan.step_memory`, op by op
    on the meta device with a GPU's dropout masks: its `transient` is mostly the logits and the loss's
    buffers); then the resume run (an AdamW step, no checkpointing; GradScaler's few scalars left
    out), the same with the optimizer state offloaded to host memory. Single process: `gpus` does not
    change the rows."""
    with torch.device("meta"):
        model = build_model(P)
        idx = torch.randint(0, P.vocab, (P.batch_size, P.seq_len + 1))
    params = list(model.parameters())
    n_bytes = param_bytes(model)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    before = n_bytes + tensor_bytes(model.buffers()) + tensor_bytes([idx])

    def counted(policy, opt=None):
        def step():
            model.zero_grad(set_to_none=True)
            lm_loss(model, inputs, targets, **policy).backward()
            if opt is not None:
                opt.step()
        out = step_memory(step, exclude=params)
        model.zero_grad(set_to_none=True)
        return out

    rows, none = [], None
    for name, policy in policies(P.n_layers).items():
        policy = dict(policy)
        if policy.pop("offload", False):  # the saved tensors in host memory; the loss's buffers stay on the GPU
            rows.append(row(f"policy: {name}", 1, params=n_bytes, grads=n_bytes, optimizer=0, activations=0,
                            peak=none["total"] - none["activations"], gpu_mem_gb=gpu_mem_gb,
                            note="saved tensors in host memory: ~0 on the GPU"))
            continue
        c = counted(policy)
        rows.append(row(f"policy: {name}", 1, params=n_bytes, grads=n_bytes, optimizer=0, activations=c["saved"],
                        peak=before + c["allocated"], gpu_mem_gb=gpu_mem_gb, main=name == "none"))
        none = none or rows[-1]
    opt = torch.optim.AdamW(params, lr=P.lr, foreach=True)
    first_step(opt)
    state = optimizer_state_bytes(opt)
    c = counted({}, opt)
    rows.append(row("resume run (AdamW, GradScaler)", 1, params=n_bytes, grads=n_bytes,
                    optimizer=optimizer_bytes("adamw", n_bytes), activations=c["saved"],
                    peak=before + state + c["allocated"], gpu_mem_gb=gpu_mem_gb,
                    note=f"{P.batch_size} x {P.seq_len} tokens, no checkpointing"))
    rows.append(row("AdamW state offloaded (ZeRO-Offload)", 1, params=n_bytes, grads=n_bytes, optimizer=0,
                    activations=none["activations"], peak=none["total"], gpu_mem_gb=gpu_mem_gb,
                    note=f"{optimizer_bytes('adamw', n_bytes) / GIB:.2g} GiB of state + "
                         f"{n_bytes / GIB:.2g} GiB master copy in host memory"))
    rows.append(row("SIGKILL demo (host memory, disk)", 1, params=0, grads=0, optimizer=0, activations=0,
                    gpu_mem_gb=gpu_mem_gb, note=f"{P.big_numel * 4 / GIB:.2g} GiB per checkpoint, on disk"))
    return rows
