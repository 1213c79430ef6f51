"""Day 3's table, memory/time frontier and claims from `dlo.experiments.day3`'s rows (plain data).

`table` puts the policies' rows in table units; `frontier` keeps the recomputing policies no other
beats on both saved bytes and cost (measured time with its interval, or counted FLOPs), and says
which the noise leaves undecided; `claims` turns the rows, the plan and the offload comparison into
`dlo.claims` verdicts.
"""

from __future__ import annotations

import math

import torch

from dlo import claims as C
from dlo import estimates as E
from dlo.experiments.day3 import OFFLOAD, segments

LIPPE = "Lippe 2024 case study (seed 004)"
ZERO_OFFLOAD = "Ren et al. 2021 (ZeRO-Offload)"


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


def compare_times(p: dict, q: dict) -> E.Estimate:
    """q's step time over p's, paired round by round (both rows from the same `policy_rows` call)."""
    return E.median_interval([tq / tp for tp, tq in zip(p["times_s"], q["times_s"])],
                             f"paired ratio, median of {len(p['times_s'])} rounds")


def compare_flops(p: dict, q: dict) -> E.Estimate:
    """q's counted FLOPs over p's: exact."""
    return E.exact(q["flops"] / p["flops"], "counted FLOPs")


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


# ----------------------------------------------------------------------------- claims

def claims(rows: list[dict], n_layers: int, plan_rows: list[dict], offload: dict, cuda: bool) -> list[C.Claim]:
    """Day 3's claims table. `rows`: `policy_rows`; `plan_rows`: this day's `plan` (full profile,
    counted on the meta device); `offload`: `offload_comparison`; `cuda`: whether the rows were
    measured on a GPU (the whole-step memory and the transfer costs need one)."""
    R = {r["policy"]: r for r in rows}
    none, full = rows[0], R["every 1"]
    # Lippe's and Korthikanti et al.'s times are GPU times: on a CPU the step times are shown, no verdict;
    # the counted FLOPs and saved-tensor bytes rows are the CPU-measurable proxies
    where = dict(device="cuda" if cuda else "cpu", gpu_claim=True, threads=torch.get_num_threads())
    sel, seg = R["selective (attention)"], R[f"sqrt(n): {segments(n_layers)} segments"]
    out = []
    if cuda:
        out.append(C.Claim("checkpointing every block: 55% less memory (whole step)", LIPPE, "55% less",
                           C.approx(0.55, abs_tol=0.10), E.exact(1 - full["peak_bytes"] / none["peak_bytes"],
                                                                   "CUDA max_memory_allocated")))
    else:
        out.append(C.not_measurable("checkpointing every block: 55% less memory (whole step)", LIPPE, "55% less",
                                    "the whole step's device memory needs CUDA's allocator; the saved-activation "
                                    "rows below are its device-independent part", C.approx(0.55, abs_tol=0.10)))
    plan = {r["config"]: r for r in plan_rows}
    full_cut = 1 - plan["policy: every 1"]["activations"] / plan["policy: none"]["activations"]
    out += [
        C.Claim("often 90% of the activation memory can go (every block, this run)", LIPPE, ">= 90%",
                C.at_least(0.9, ">= 0.9"), E.exact(1 - full["peak_saved_bytes"] / none["peak_saved_bytes"],
                                                   "saved-tensor bytes, exact")),
        C.planned("often 90% of the activation memory can go (every block, full profile)", LIPPE, ">= 90%",
                  C.at_least(0.9, ">= 0.9"), E.exact(full_cut, "dlo plan: counted on the meta device"),
                  "the full profile's plan, not run here"),
        C.Claim("checkpointing every block recomputes one forward: 4/3 of the step's FLOPs (backward = 2 forwards)",
                "Chen et al. 2016 (one extra forward)", "4/3", C.approx(4 / 3, rel=0.05),
                compare_flops(none, full)),
        # the seed's 1.25x is its arithmetic slip: its own 0.9 / 0.7 s is 1.29x; the band holds both
        C.Claim("checkpointing every block costs one extra forward: 1.25x there (0.9 / 0.7 s = 1.29x), 4/3 by FLOPs",
                LIPPE, "1.25x (1.29x; 4/3)", C.approx(1.25, abs_tol=0.15, text="1.10 .. 1.40"),
                C.timed(full["time_vs_none"], **where)),
        C.Claim(f"sqrt(n) segments keep at most (s + n/s)/n of the activations (s={segments(n_layers)}, n={n_layers})",
                "Chen et al. 2016", f"<= {(segments(n_layers) + n_layers / segments(n_layers)) / n_layers:.2f}",
                C.at_most((segments(n_layers) + n_layers / segments(n_layers)) / n_layers),
                E.exact(seg["saved_vs_none"], "saved-tensor bytes, exact")),
        C.Claim("selective recomputation costs a small part of full recomputation's overhead (2.7% vs 36%): "
                "recomputed FLOPs", "Korthikanti et al. 2022, Table 4", "overhead ratio 0.075",
                C.at_most(0.25, "<= 0.25"),
                E.exact((sel["flops"] - none["flops"]) / (full["flops"] - none["flops"]),
                        "(sel - none) / (full - none), counted FLOPs")),
        C.Claim("... the same overhead ratio in step time (this device)", "Korthikanti et al. 2022, Table 4",
                "overhead ratio 0.075", C.at_most(0.25, "<= 0.25"),
                C.timed(E.median_interval([(s - 1) / (f - 1) if f > 1 else math.inf
                                           for s, f in zip(sel["ratios"], full["ratios"])],
                                          "(sel - none) / (full - none), paired rounds"), **where)),
    ]
    why_transfer = "on a CPU the host is the device: nothing is transferred, nothing freed on an accelerator"
    off_row = R.get(OFFLOAD)
    text = "offloading saved activations is slow: only a last resort"
    if cuda and off_row is not None:
        out.append(C.Claim(text, LIPPE, "slow", C.at_least(1.25, ">= 1.25x no checkpointing"),
                           C.timed(off_row["time_vs_none"], **where)))
    else:
        out.append(C.not_measurable(text, LIPPE, "slow", why_transfer))
    out.append(offload_frees_claim(offload, cuda, why_transfer))
    text = "an offloaded step keeps most of the GPU's speed (CPU-Adam overlapped with the transfers)"
    if cuda:
        out.append(C.Claim(text, ZERO_OFFLOAD, "close to GPU-only", C.at_most(1.5, "<= 1.5x AdamW on the GPU"),
                           C.timed(E.median_interval(offload["ratios"], "offload / plain step time, paired steps"),
                                   **where)))
    else:
        out.append(C.not_measurable(text, ZERO_OFFLOAD, "close to GPU-only", why_transfer))
    return out


def offload_frees_claim(offload: dict, cuda: bool, why_cpu: str) -> C.Claim:
    """ZeRO-Offload's 8 bytes per parameter. On a GPU, measured from CUDA's allocator: the bytes per parameter
    a step leaves held with AdamW minus with the offloaded AdamW (`offload_comparison`'s "held_per_param").
    On a CPU the host is the device: the offload optimizer's own account of where it put its tensors is all
    there is, shown as self-reported, by construction."""
    text = ("optimizer-state offload frees AdamW's 8 bytes per parameter on the device (fp32; 12 with mixed "
            "precision's master copy)")
    args, region = (text, ZERO_OFFLOAD, "8 bytes / parameter"), C.approx(8.0, rel=0.02)
    held = offload.get("held_per_param", {})
    if cuda and held:
        freed = E.exact(held["adamw"] - held["adamw_offload"],
                        f"CUDA allocator (memory_allocated) after a step: AdamW holds {held['adamw']:.2f} B/param, "
                        f"offloaded {held['adamw_offload']:.2f} (dlo.accounting.held_after_step)")
        return C.Claim(*args, region, freed)
    saved = (offload["plain_state_bytes"] - offload["offload_bytes"]["device"]) / offload["n_params"]
    freed = E.self_reported(saved, "CPUOffloadOptimizer.bytes_by_side: the device side of its own tensors")
    if cuda:  # no allocator reading (an older result): the optimizer's report is no evidence
        return C.by_construction(*args, "the offload optimizer's report of where it put its tensors, not the "
                                        "allocator's", freed, region)
    return C.by_construction(*args, why_cpu, freed, region)


def whole_step_summary(rows: list[dict]) -> str:
    """The whole step's CUDA peak without checkpointing and with every block checkpointed, in words made
    from the numbers, against the seed's 55% (which way a disagreement points included); '' unless the
    rows carry CUDA's max_memory_allocated (`policy_rows` on a GPU)."""
    none, full = rows[0], next(r for r in rows if r["policy"] == "every 1")
    if none.get("peak_kind") != "cuda max_memory_allocated":
        return ""
    fall = 1 - full["peak_bytes"] / none["peak_bytes"]
    side = "more than" if fall > 0.55 else "less than" if fall < 0.55 else "as"
    return (f"the whole step's peak (CUDA max_memory_allocated) went from {none['peak_bytes'] / 2**20:,.0f} to "
            f"{full['peak_bytes'] / 2**20:,.0f} MiB with every block checkpointed: {fall:.0%} less, {side} the "
            f"seed's 55%")
