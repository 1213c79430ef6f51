"""Day 3 experiments: what each activation-checkpointing policy saves and costs, which policies are
worth having (the memory/time frontier), optimizer-state offload, the claims, and the day's plan.

`policies(n_layers)` names the policies of the table (keyword arguments of
`dlo.models.transformer.TransformerStack.forward`, plus "offload" for saved tensors in host memory);
`policy_rows` measures each with `dlo.measure`: bytes saved at the end of forward and at the peak of
forward + backward (recomputation saves again), exact on any device, and the step time, the
policies interleaved round by round so that each round's ratio to no checkpointing is a paired
sample (a noisy neighbour slows the whole round). `claims` turns rows into `dlo.claims` verdicts.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo import claims as C
from dlo.accounting import optimizer_bytes
from dlo.activation_ckpt import cpu_offload, every_kth
from dlo.measure import count_flops, optimizer_state_bytes, peak_memory, saved_bytes, tensor_bytes, time_interleaved
from dlo.models import count_parameters
from dlo.models.transformer import TransformerStack
from dlo.optim.offload import CPUOffloadOptimizer
from dlo.plan import GIB, activation_bytes, param_bytes, row
from dlo.progress import tqdm

OFFLOAD = "offload to CPU"
LIPPE = "Lippe 2024 case study (seed 004)"
ZERO_OFFLOAD = "Ren et al. 2021 (ZeRO-Offload)"


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
        r.update(times_s=t, time_s=C.median_interval(t).value, ratios=ratios,
                 time_vs_none=C.median_interval(ratios, f"paired ratio, median of {len(t)} rounds"),
                 saved_vs_none=r["peak_saved_bytes"] / base["peak_saved_bytes"])


def table(rows: list[dict], cuda: bool) -> list[dict]:
    """The rows in table units (MiB, counted FLOPs and ms as ratios to none, the time's with its interval)."""
    out = []
    for r in rows:
        t = {"policy": r["policy"], "saved MiB": r["saved_bytes"] / 2**20,
             "peak saved MiB": r["peak_saved_bytes"] / 2**20, "saved_vs_none": r["saved_vs_none"],
             "FLOPs_vs_none": r["flops"] / rows[0]["flops"], "ms": 1e3 * r["time_s"],
             "time_vs_none [95%]": str(r["time_vs_none"])}
        if cuda:
            t["cuda peak MiB"] = r["peak_bytes"] / 2**20
        out.append(t)
    return out


def compare_times(p: dict, q: dict) -> C.Estimate:
    """q's step time over p's, paired round by round (both rows from the same `policy_rows` call)."""
    return C.median_interval([tq / tp for tp, tq in zip(p["times_s"], q["times_s"])],
                             f"paired ratio, median of {len(p['times_s'])} rounds")


def compare_flops(p: dict, q: dict) -> C.Estimate:
    """q's counted FLOPs over p's: exact."""
    return C.exact(q["flops"] / p["flops"], "counted FLOPs")


TIME_TIE = 0.05  # a measured time ratio within 5% counts as "as fast" (an equivalence margin, stated)


def frontier(rows: list[dict], axis: str = "time") -> tuple[list[str], dict, dict]:
    """The memory/time frontier of the recomputing policies (offload moves memory elsewhere and is
    left out). The cost axis is the measured step time ("time": paired ratios with their interval)
    or the counted FLOPs ("flops": exact). q dominates p when it keeps no more bytes at its peak, costs
    no more (its cost ratio to p lies entirely at or below 1 + TIME_TIE for times, 1 for FLOPs: a
    `dlo.claims` verdict "agrees"), and is strictly better on one axis; a q measurably costlier than
    p (the ratio's interval above 1) leaves p its place. Between the two (an interval from below 1 to
    above the bound) the noise cannot tell: p is *undecided*, neither kept nor dropped.
    Returns (policies on the frontier, {dominated: (a dominating policy, ratio)},
    {undecided: (the policy it might be dominated by, ratio)})."""
    if axis not in ("time", "flops"):
        raise ValueError(f"frontier: axis must be 'time' or 'flops', got {axis!r}")
    cost, bound = (compare_times, 1 + TIME_TIE) if axis == "time" else (compare_flops, 1.0)
    cands = [r for r in rows if r["policy"] != OFFLOAD]
    dominated, undecided = {}, {}
    for p in cands:
        for q in cands:
            if q is p or q["peak_saved_bytes"] > p["peak_saved_bytes"]:
                continue
            t = cost(p, q)
            if q["peak_saved_bytes"] == p["peak_saved_bytes"] and t.hi >= 1.0:
                continue  # equal memory: only a measurably cheaper q dominates
            if C.verdict(t, C.at_most(bound)) == C.AGREES:
                dominated[p["policy"]] = (q["policy"], t)
                break
            if t.lo <= 1.0:  # not measurably costlier, not surely as cheap: the noise cannot tell
                undecided.setdefault(p["policy"], (q["policy"], t))
    undecided = {k: v for k, v in undecided.items() if k not in dominated}
    on = [r["policy"] for r in cands if r["policy"] not in dominated and r["policy"] not in undecided]
    return on, dominated, undecided


def plot_frontier(ax, rows: list[dict], axis: str) -> None:
    """Peak saved bytes against the cost ratio to no checkpointing (counted FLOPs, or the measured
    time with its 95% interval), each policy labelled, the `frontier` drawn dashed."""
    on = frontier(rows, axis)[0]

    def cost(r):
        return r["flops"] / rows[0]["flops"] if axis == "flops" else r["time_vs_none"].value

    for r in rows:
        mib, t = r["peak_saved_bytes"] / 2**20, r["time_vs_none"]
        if axis == "time":
            ax.errorbar(t.value, mib, xerr=[[t.value - t.lo], [t.hi - t.value]], fmt="o", capsize=3)
        elif r["policy"] == OFFLOAD:
            continue  # the same FLOPs and bytes as none: its bytes are in host memory
        else:
            ax.plot(cost(r), mib, "o")
        below = r["policy"] == OFFLOAD  # beside none: label it underneath
        ax.annotate(r["policy"], (cost(r), mib), fontsize=8, xytext=(4, -11 if below else 4),
                    textcoords="offset points")
    front = sorted((r for r in rows if r["policy"] in on), key=cost)
    ax.plot([cost(r) for r in front], [r["peak_saved_bytes"] / 2**20 for r in front], "k--", lw=1, label="frontier")
    what = "counted FLOPs (exact)" if axis == "flops" else "step time (median, 95% interval)"
    ax.set(xlabel=f"{what} relative to no checkpointing", ylabel="peak saved activations (MiB)")
    ax.legend(fontsize=8)


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
    (interleaved step by step): losses, whether the parameters are equal afterwards, the optimizer
    bytes by side (exact accounting), and each step's time ratio offload / plain."""
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
    equal = all(torch.equal(a, b) for a, b in zip(models["adamw"].parameters(), models["adamw_offload"].parameters()))
    t_plain, t_off = timings["adamw"].times_s, timings["adamw_offload"].times_s
    return {"losses": losses, "equal": equal, "n_params": count_parameters(models["adamw"]),
            "plain_state_bytes": optimizer_state_bytes(opts["adamw"]),
            "offload_bytes": opts["adamw_offload"].bytes_by_side(), "ratios": [b / a for a, b in zip(t_plain, t_off)],
            "ms": {k: 1e3 * t.median_s for k, t in timings.items()}}


# ----------------------------------------------------------------------------- claims

def claims(rows: list[dict], n_layers: int, plan_rows: list[dict], offload: dict, cuda: bool) -> list[C.Claim]:
    """Day 3's claims table. `rows`: `policy_rows`; `plan_rows`: this day's `plan` (full profile,
    counted on the meta device); `offload`: `offload_comparison`; `cuda`: whether the rows were
    measured on a GPU (the whole-step memory and the transfer costs need one)."""
    R = {r["policy"]: r for r in rows}
    none, full = rows[0], R["every 1"]
    sel, seg = R["selective (attention)"], R[f"sqrt(n): {segments(n_layers)} segments"]
    out = []
    if cuda:
        out.append(C.Claim("checkpointing every block: 55% less memory (whole step)", LIPPE, "55% less",
                           C.approx(0.55, abs_tol=0.10), C.exact(1 - full["peak_bytes"] / none["peak_bytes"],
                                                                   "CUDA max_memory_allocated")))
    else:
        out.append(C.not_measurable("checkpointing every block: 55% less memory (whole step)", LIPPE, "55% less",
                                    "the whole step's device memory needs CUDA's allocator; the saved-activation "
                                    "rows below are its device-independent part", C.approx(0.55, abs_tol=0.10)))
    plan = {r["config"]: r for r in plan_rows}
    full_cut = 1 - plan["policy: every 1"]["activations"] / plan["policy: none"]["activations"]
    out += [
        C.Claim("often 90% of the activation memory can go (every block, this run)", LIPPE, ">= 90%",
                C.at_least(0.9, ">= 0.9"), C.exact(1 - full["peak_saved_bytes"] / none["peak_saved_bytes"],
                                                   "saved-tensor bytes, exact")),
        C.Claim("often 90% of the activation memory can go (every block, full profile)", LIPPE, ">= 90%",
                C.at_least(0.9, ">= 0.9"), C.exact(full_cut, "dlo plan: counted on the meta device")),
        C.Claim("checkpointing every block recomputes one forward: 4/3 of the step's FLOPs (backward = 2 forwards)",
                "Chen et al. 2016 (one extra forward)", "4/3", C.approx(4 / 3, rel=0.05),
                compare_flops(none, full)),
        C.Claim("checkpointing every block costs one extra forward: 1.25x there, 4/3 by FLOPs", LIPPE,
                "1.25x (4/3)", C.approx(1.25, abs_tol=0.15, text="1.10 .. 1.40"), full["time_vs_none"]),
        C.Claim(f"sqrt(n) segments keep at most (s + n/s)/n of the activations (s={segments(n_layers)}, n={n_layers})",
                "Chen et al. 2016", f"<= {(segments(n_layers) + n_layers / segments(n_layers)) / n_layers:.2f}",
                C.at_most((segments(n_layers) + n_layers / segments(n_layers)) / n_layers),
                C.exact(seg["saved_vs_none"], "saved-tensor bytes, exact")),
        C.Claim("selective recomputation costs a small part of full recomputation's overhead (2.7% vs 36%): "
                "recomputed FLOPs", "Korthikanti et al. 2022, Table 4", "overhead ratio 0.075",
                C.at_most(0.25, "<= 0.25"),
                C.exact((sel["flops"] - none["flops"]) / (full["flops"] - none["flops"]),
                        "(sel - none) / (full - none), counted FLOPs")),
        C.Claim("... the same overhead ratio in step time (this device)", "Korthikanti et al. 2022, Table 4",
                "overhead ratio 0.075", C.at_most(0.25, "<= 0.25"),
                C.median_interval([(s - 1) / (f - 1) if f > 1 else math.inf
                                   for s, f in zip(sel["ratios"], full["ratios"])],
                                  "(sel - none) / (full - none), paired rounds")),
    ]
    why_transfer = "on a CPU the host is the device: nothing is transferred, nothing freed on an accelerator"
    off_row = R.get(OFFLOAD)
    text = "offloading saved activations is slow: only a last resort"
    if cuda and off_row is not None:
        out.append(C.Claim(text, LIPPE, "slow", C.at_least(1.25, ">= 1.25x no checkpointing"), off_row["time_vs_none"]))
    else:
        out.append(C.not_measurable(text, LIPPE, "slow", why_transfer))
    saved = (offload["plain_state_bytes"] - offload["offload_bytes"]["device"]) / offload["n_params"]
    out.append(C.Claim("optimizer-state offload frees AdamW's 8 bytes per parameter on the device (fp32; 12 with "
                       "mixed precision's master copy)", ZERO_OFFLOAD, "8 bytes / parameter",
                       C.approx(8.0, rel=0.02), C.exact(saved, "bytes by accounting (dlo.measure)")))
    text = "an offloaded step keeps most of the GPU's speed (CPU-Adam overlapped with the transfers)"
    if cuda:
        out.append(C.Claim(text, ZERO_OFFLOAD, "close to GPU-only", C.at_most(1.5, "<= 1.5x AdamW on the GPU"),
                           C.median_interval(offload["ratios"], "offload / plain step time, paired steps")))
    else:
        out.append(C.not_measurable(text, ZERO_OFFLOAD, "close to GPU-only", why_transfer))
    return out


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Per policy: the fp32 model and its gradients (the table runs forward + backward, no optimizer)
    and the peak saved bytes at the preset's batch, counted on the meta device; then the resume run
    (AdamW state, no checkpointing), the same with the optimizer state offloaded to host memory.
    Single process: `gpus` does not change the rows."""
    with torch.device("meta"):
        model = build_model(P)
        idx = torch.randint(0, P.vocab, (P.batch_size, P.seq_len + 1))
    params = list(model.parameters())
    n_bytes = param_bytes(model)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    rows, none = [], 0
    for name, policy in policies(P.n_layers).items():
        policy = dict(policy)
        offload = policy.pop("offload", False)
        acts = activation_bytes(lambda policy=policy: lm_loss(model, inputs, targets, **policy), exclude=params)
        none = none or acts
        note = "saved tensors in host memory: ~0 on the GPU" if offload else ""
        rows.append(row(f"policy: {name}", 1, params=n_bytes, grads=n_bytes, optimizer=0,
                        activations=0 if offload else acts, gpu_mem_gb=gpu_mem_gb, note=note, main=name == "none"))
    rows.append(row("resume run (AdamW, GradScaler)", 1, params=n_bytes, grads=n_bytes,
                    optimizer=optimizer_bytes("adamw", n_bytes), activations=none,
                    gpu_mem_gb=gpu_mem_gb, note=f"{P.batch_size} x {P.seq_len} tokens, no checkpointing"))
    rows.append(row("AdamW state offloaded (ZeRO-Offload)", 1, params=n_bytes, grads=n_bytes, optimizer=0,
                    activations=none, gpu_mem_gb=gpu_mem_gb,
                    note=f"{optimizer_bytes('adamw', n_bytes) / GIB:.2g} GiB of state + "
                         f"{n_bytes / GIB:.2g} GiB master copy in host memory"))
    rows.append(row("SIGKILL demo (host memory, disk)", 1, params=0, grads=0, optimizer=0, activations=0,
                    gpu_mem_gb=gpu_mem_gb, note=f"{P.big_numel * 4 / GIB:.2g} GiB per checkpoint, on disk"))
    return rows
