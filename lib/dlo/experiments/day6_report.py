"""Day 6 tables, claims and pictures from `dlo.experiments.day6.run_all`'s results (plain data).

Kept apart from the runners so that the notebook's cells stay short and the runners stay readable;
`plan(P, gpus=, gpu_mem_gb=)` is the full profile on the meta device (`dlo plan day6_pipeline`).
Every verdict goes through `dlo.claims`: a bubble fraction is the mean of the timed steps with its
t-interval, a byte count is exact; fewer than 3 timed steps give no interval, and a timing taken where
the ranks and the notebook's kernel share cores (`dlo.claims.timed`) is no evidence: what rests on
either is "not measurable here". Rows that hold whatever the timing (the bubble at m = 1) are "by
construction"; rows read off the plan are "planned", and a plan row computed with the very formula it
would test is not a claim at all. (Over 300 lines: one table-and-claims pair per experiment of
`day6`, and `plan`, whose rows the planned claims read.)
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from dlo.claims import Claim, approx, at_least, at_most, between, by_construction, not_measurable, planned, timed
from dlo.distributed.pipeline_fit import fit_timeline, makespan, residuals, simulate_fitted
from dlo.distributed.pipeline_schedules import bubble_fraction, simulate, split_stages
from dlo.estimates import REPEATS, Estimate, exact, from_samples, median_interval, ratio
from dlo.experiments.day6 import COSTS, meta_model, model_config, stack
from dlo.models.coatnet import block_costs

HUANG = "Huang et al. 2019 (GPipe); seminar (seed 003) eq. 3"
NARAYANAN = "Narayanan et al. 2021 (PipeDream-Flush; Megatron-LM Sec. 2.2); seed 003"
COLORS = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}


ONE_STEP = "one timed step: no interval; raise reps"
M1 = ("at m = 1 the stages run one after the other: the idle share is (p-1)/p whatever the durations "
      "(messages only add to it)")


def estimate(xs, how: str = "") -> Estimate | None:
    """Mean with a t-interval over repeats (`from_samples`: no interval below 3); None for a single
    step (a claim built on None is "not measurable here", with ONE_STEP as the reason)."""
    return from_samples(xs, how) if len(xs) > 1 else None


def median_estimate(times) -> Estimate | None:
    """Median step time with its interval (order statistics); None for a single step."""
    return median_interval(times) if len(times) > 1 else None


def on_ranks(R: dict, est: Estimate | None) -> Estimate | None:
    """A timing of `R`'s ranks, judged only where each rank and the notebook's kernel have a core
    (`dlo.claims.timed`: otherwise no evidence, with the reason)."""
    return None if est is None else timed(est, device=R["device"], world_size=R["world"], kernel=True)


def median_text(times_s) -> str:
    """Step times in ms as a table cell: the median [interval of the median] from 3 timings or more,
    the median alone below that (rule 1 of `dlo.estimates`: no interval from fewer than 3)."""
    ms = [1e3 * t for t in times_s]
    if len(ms) >= 3:
        return str(median_interval(ms))
    return f"{statistics.median(ms):.3g} ({len(ms)} step{'s' * (len(ms) > 1)}, no interval)"


def bubble_rows(R: dict) -> list[dict]:
    """Measured bubble fraction (mean [95% interval] over the timed steps) beside the formula."""
    rows = []
    for r in R["bubble"]["rows"]:
        est = estimate(r["bubbles"], f"mean of {len(r['bubbles'])} steps")
        shown = str(est) if est is not None else f"{r['bubbles'][0]:.3g} (one step)"
        rows.append({"schedule": r["schedule"], "p": r["p"], "v": r["v"], "m": r["m"],
                     "(p-1)/(vm+p-1)": round(r["formula"], 3), "measured [95%]": shown,
                     "step ms": round(1e3 * min(r["times_s"]), 1)})
    return rows


def bubble_claims(R: dict, tol: float = 0.05) -> list[Claim]:
    """One claim per (schedule, m): the measured idle share is the formula within `tol` (communication
    and the engine's own overhead are not in the formula)."""
    out = []
    for r in R["bubble"]["rows"]:
        src = HUANG if r["schedule"] == "gpipe" else NARAYANAN
        what = (f"{r['schedule']} bubble, p={r['p']}, m={r['m']}", src,
                f"(p-1)/({'v' if r['v'] > 1 else ''}m+p-1) = {r['formula']:.3f}")
        if r["m"] == 1 and r["v"] == 1:
            out.append(by_construction(*what, M1, estimate(r["bubbles"])))
        else:
            out.append(Claim(*what, approx(r["formula"], abs_tol=tol), on_ranks(R, estimate(r["bubbles"])), ONE_STEP))
    return out


def memory_rows(R: dict) -> list[dict]:
    """Peak saved bytes per rank and how many stage-micro-batches that is, per schedule and m."""
    one, rows = R["bubble"]["one_microbatch"], []
    for r in R["bubble"]["rows"]:
        row = {"schedule": r["schedule"], "m": r["m"]}
        for k, b in enumerate(r["peak_bytes"]):
            row[f"rank {k} MiB"] = round(b / 2 ** 20, 2)
            row[f"rank {k} / one micro-batch"] = round(b / one, 2)
        rows.append(row)
    return rows


def memory_claims(R: dict) -> list[Claim]:
    """GPipe keeps m micro-batches alive on the first stage, 1F1B min(p, m). On the CPU the saved
    bytes count them exactly, per run. CUDA's allocator peak also holds the weights, gradients,
    inputs and workspace, so alone it only bounds the count from above (a claim that cannot fail);
    at the same m those extras are the same under both schedules and cancel in the difference
    GPipe - 1F1B, which must be m - min(p, m) micro-batches (0 if 1F1B kept GPipe's m alive)."""
    one, p, out = R["bubble"]["one_microbatch"], R["world"], []
    kind = R["bubble"]["memory_kind"]
    if kind == "saved-tensor peak":
        for r in R["bubble"]["rows"]:
            if r["schedule"] == "interleaved":
                continue
            want = r["m"] if r["schedule"] == "gpipe" else min(p, r["m"])
            out.append(Claim(f"{r['schedule']}: micro-batches alive on stage 0, m={r['m']}", NARAYANAN,
                             f"{'m' if r['schedule'] == 'gpipe' else 'min(p, m)'} = {want}",
                             approx(want, abs_tol=0.01), exact(r["peak_bytes"][0] / one, kind)))
        return out
    peaks = {(r["schedule"], r["m"]): r["peak_bytes"][0] for r in R["bubble"]["rows"]}
    for m in sorted({mm for (s, mm) in peaks if s == "gpipe" and ("1f1b", mm) in peaks}):
        want = m - min(p, m)
        # one memory step per run: the allocator's bytes repeat run to run, so the tolerance is not
        # noise but what the count leaves out: each micro-batch's stage output held for its backward
        # (a few % of its saved bytes) and the allocator's rounding
        out.append(Claim(f"GPipe - 1F1B: extra micro-batches alive on stage 0, m={m}", NARAYANAN,
                         f"m - min(p, m) = {want}", approx(want, rel=0.1, abs_tol=0.5),
                         exact((peaks[("gpipe", m)] - peaks[("1f1b", m)]) / one, f"{kind}, difference")))
    return out


def split_rows(R: dict) -> list[dict]:
    """The CoAtNet cut balancing each cost: per stage its blocks and sums, and the 1F1B step time."""
    blocks, rows = R["splits"]["blocks"], []
    for cost, s in R["splits"]["splits"].items():
        b = s["bounds"]
        row = {"balanced by": cost, "stages (blocks)": " | ".join(f"{x}:{y}" for x, y in zip(b, b[1:]))}
        for k in COSTS:
            sums = [sum(r[k] for r in blocks[x:y]) for x, y in zip(b, b[1:])]
            row[f"{k} max/mean"] = round(max(sums) / (sum(sums) / len(sums)), 2)
        row["1F1B step ms [95%]"] = str(median_interval(s["times_s"]).scaled(1e3))
        row["bubble"] = round(sum(s["bubbles"]) / len(s["bubbles"]), 3)
        rows.append(row)
    return rows


def stage_rows(blocks: list[dict]) -> list[dict]:
    """Per paper stage (S0..S4, head): blocks, parameters, forward GFLOP and saved MiB per micro-batch."""
    from dlo.models.coatnet import stage_table

    return [{"stage": s["stage"], "blocks": s["blocks"], "params (M)": round(s["params"] / 1e6, 3),
             "GFLOP fwd": round(s["flops"] / 1e9, 3), "saved MiB": round(s["saved_bytes"] / 2 ** 20, 2),
             **({"fwd ms": round(1e3 * sum(b["time"] for b in blocks if b["stage"] == s["stage"]), 2)}
                if "time" in blocks[0] else {})} for s in stage_table(blocks)]


def other_claims(R: dict, on_gpu: bool, plan_rows: list[dict]) -> list[Claim]:
    """Interleaving, 1F1B vs GPipe, stage balancing, torch's pipelining, and the full-profile rows."""
    rows = {(r["schedule"], r["m"]): r for r in R["bubble"]["rows"]}
    out = []
    m = max(mm for (s, mm) in rows if s == "interleaved")
    f1, fi = estimate(rows[("1f1b", m)]["bubbles"]), estimate(rows[("interleaved", m)]["bubbles"])
    why = ONE_STEP if f1 is None or fi is None else "1F1B shows no bubble here: the ratio is undefined"
    out.append(Claim(f"interleaving (v=2) divides the bubble by v, m={m}", NARAYANAN, "PBS / v: ratio 0.5",
                     approx(0.5, abs_tol=0.15), on_ranks(R, _pbs_ratio(fi, f1)), why))
    g, o = rows[("gpipe", m)], rows[("1f1b", m)]
    diff = estimate([a - b for a, b in zip(o["bubbles"], g["bubbles"])], "paired over steps")
    out.append(Claim(f"1F1B has GPipe's bubble, m={m}", NARAYANAN, "same (p-1)/(m+p-1)", between(-0.05, 0.05),
                     on_ranks(R, diff), ONE_STEP))
    splits = R["splits"]["splits"]
    if "params" in splits and "flops" in splits:
        t_par, t_flop = (median_estimate(splits[k]["times_s"]) for k in ("params", "flops"))
        both = t_par is not None and t_flop is not None
        out.append(Claim("balancing FLOPs beats balancing parameters (1F1B step time ratio)",
                         "Narayanan et al. 2019 (PipeDream's partitioner)", "> 1 (the slowest stage sets the pace)",
                         at_least(1.0), on_ranks(R, ratio(t_par, t_flop) if both else None), ONE_STEP))
    diff = max(v["max_grad_diff"] for v in R["torch"].values())
    out.append(Claim("torch.distributed.pipelining computes our gradients", "torch docs",
                     "identical up to float32 rounding", at_most(1e-5), exact(diff, "max |difference|")))
    # "1F1B trains the same batch" is not a claim here: the plan counts 1F1B's activations with the
    # min(p - r, m) it would test (the memory rows above measure that count on real ranks)
    ddp = next(r for r in plan_rows if r["config"].startswith("DDP, batch"))
    batch = ddp["config"].split(",")[1].strip()
    out.append(planned(f"DDP without gradient accumulation cannot train the {batch} on {ddp['world']} GPUs",
                       "seed 001 (DP splits only the activations)", "does not fit", at_least(1.0),
                       exact(ddp["total"] / ddp["gpu"], "dlo plan: bytes per GPU / GPU memory"),
                       "the plan's arithmetic (meta device), not a run; accumulating gradients over micro-batches "
                       "would fit"))
    if not on_gpu:
        why = "needs 4 GPUs (a 2-core CPU cannot run 4 stages at once)"
        out += [not_measurable("bubble vs m at p = 4", HUANG, "(p-1)/(m+p-1)", why),
                not_measurable("CoAtNet-3 throughput vs m on 4 stages", NARAYANAN, "rises with m", why),
                not_measurable("pipeline vs data parallel throughput, CoAtNet-3", "seed 001", "DDP faster when it fits",
                               why)]
    return out


def _pbs(f: float) -> float:
    """Bubble over ideal time from the idle share f; f kept in [0, 1) (a t-interval may leave it)."""
    f = min(max(f, 0.0), 0.999)
    return f / (1 - f)


def _pbs_ratio(fi: Estimate | None, f1: Estimate | None) -> Estimate | None:
    """Interleaved over 1F1B bubble as PBS (Narayanan et al.), with the interval of the idle shares'
    intervals; None where either has no interval (one timed step) or 1F1B shows no bubble."""
    if fi is None or f1 is None or f1.value <= 0:
        return None
    value = _pbs(fi.value) / _pbs(f1.value)
    lo, hi = _pbs(fi.lo) / max(_pbs(f1.hi), 1e-9), _pbs(fi.hi) / max(_pbs(f1.lo), 1e-9)
    return Estimate(value, min(lo, value), max(hi, value), min(fi.n, f1.n), "ratio of intervals", REPEATS,
                    fi.reason or f1.reason)


def zero_bubble_claims(p: int = 4, m: int = 8) -> list[Claim]:
    """The course's 1F1B and ZB-H1 lists replayed by the course's simulator at t_F = t_B = t_W = 1 (B, W the
    two halves of a backward), beside Qi et al.'s Table 1. By construction: arithmetic on our own lists
    (it shows that they reach the table's bubbles; `tests/distributed` holds them to it), not a measured
    run, so no evidence for the paper."""
    from dlo.distributed.pipeline_schedules import one_f_one_b_schedule, zero_bubble_schedule

    def excess(sched, t_b, t_w):
        ev = simulate(sched, 1.0, t_b, t_w)
        return max(e["end"] for e in ev) - 3 * m

    src = "Qi et al. 2023, Table 1"
    why = "the course's own list replayed by the course's simulator: arithmetic, not a run"
    return [by_construction(f"1F1B bubble (simulated, p={p}, m={m})", src, "(p-1)(T_F+T_B+T_W)", why,
                            exact(excess(one_f_one_b_schedule(p, m), 2.0, 0.0), "simulated"),
                            approx(3 * (p - 1), abs_tol=1e-9)),
            by_construction(f"ZB-H1 bubble (simulated, p={p}, m={m})", src, "(p-1)(T_F+T_B-T_W)", why,
                            exact(excess(zero_bubble_schedule(p, m), 1.0, 1.0), "simulated"),
                            approx(p - 1, abs_tol=1e-9))]


def gantt(ax, events: list[dict], title: str, label: bool = True) -> None:
    """One row per rank, a bar per action (F blue, B green, W orange), micro-batch (and stage) written in."""
    ranks = sorted({e["rank"] for e in events})
    t0 = min(e["start"] for e in events)
    chunks = len({e["stage"] for e in events}) > len(ranks)
    for e in events:
        y = ranks.index(e["rank"])
        ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - 0.4, 0.8), color=COLORS[e["kind"]],
                       alpha=0.6 + 0.4 * (e["stage"] < len(ranks)), edgecolor="white")
        if label:
            text = f"{e['mb']}" + ("\u2032" if chunks and e["stage"] >= len(ranks) else "")
            ax.text(e["start"] - t0 + (e["end"] - e["start"]) / 2, y, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_title(f"{title}: bubble {bubble_fraction(events):.2f}", fontsize=9)


def timeline_fit_rows(gantt: dict, lists: dict) -> list[dict]:
    """Per schedule, the recorded step beside `simulate` with the durations and the message time fitted to
    it (`dlo.distributed.pipeline_fit`: per-stage medians, t_comm the median idle wait for a message),
    and the recorded-minus-simulated start of each action: a description of one step, not a verdict."""
    out = []
    for schedule, events in gantt.items():
        fit = fit_timeline(events, lists[schedule])
        res = [abs(r["residual"]) for r in residuals(events, simulate_fitted(events, lists[schedule]))]
        gaps = sorted(fit["gaps"])
        out.append({"schedule": schedule, "fitted t_comm ms": round(1e3 * fit["t_comm"], 2),
                    "gaps (min..max ms)": f"{len(gaps)} ({1e3 * gaps[0]:.2f}..{1e3 * gaps[-1]:.2f})" if gaps else "0",
                    "step ms recorded": round(1e3 * makespan(events), 1),
                    "simulated, t_comm=0": round(1e3 * makespan(simulate_fitted(events, lists[schedule], 0.0)), 1),
                    "simulated, fitted": round(1e3 * makespan(simulate_fitted(events, lists[schedule])), 1),
                    "|residual| ms median": round(1e3 * statistics.median(res), 2), "max": round(1e3 * max(res), 2)})
    return out


# ----------------------------------------------------------------------------- the full profile on paper

def stage_partition(cfg, p: int, cost: str = "flops") -> list[dict]:
    """CoAtNet's blocks cut into p stages balancing `cost`: per stage its blocks, parameters and the
    bytes one sample saves for backward (block_costs on the meta device)."""
    rows = block_costs(meta_model(cfg), 1)
    out = []
    for idx in split_stages([r[cost] for r in rows], p):
        out.append({"blocks": f"{idx[0]}:{idx[-1] + 1}", "params": sum(rows[i]["params"] for i in idx),
                    "saved_per_sample": sum(rows[i]["saved_bytes"] for i in idx)})
    return out


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Bytes per GPU of the full profile: CoAtNet (fp32, AdamW) cut into `gpus` stages balancing FLOPs.
    A pipeline rank holds its stage's parameters, gradients and optimizer state, and the activations
    of the micro-batches alive on it: min(p - r, m) under 1F1B, m under GPipe (the worst rank is
    shown). Data parallelism holds the whole model and its per-GPU share of the batch. Rows: the
    claim (a global batch of P.plan_batch that 1F1B trains and neither GPipe nor DDP fits), DDP at
    the largest batch that fits, and the configurations the notebook runs (marked main)."""
    from dlo.accounting import optimizer_bytes
    from dlo.plan import activation_bytes, row, split_evenly

    cfg, p, b = model_config(P), gpus, P.micro_batch
    split_evenly("data parallel", {"the claim's batch": P.plan_batch, "the notebook's DDP batch": P.split_m * b}, p)
    stages, total = stage_partition(cfg, p), meta_model(cfg)
    n_params = sum(q.numel() for q in total.parameters())
    per_sample = sum(s["saved_per_sample"] for s in stages)

    def pipeline_row(label, m, gpipe=False, main=False):
        worst = None
        for r, s in enumerate(stages):
            alive = m if gpipe else min(p - r, m)
            fp32 = 4 * s["params"]
            cand = row(label, p, params=fp32, grads=fp32, optimizer=optimizer_bytes("adamw", fp32),
                       activations=alive * b * s["saved_per_sample"], gpu_mem_gb=gpu_mem_gb, main=main,
                       note=f"{cfg.name}, worst stage: rank {r} (blocks {s['blocks']}), {alive} micro-batches of {b} "
                            f"alive")
            worst = cand if worst is None or cand["total"] > worst["total"] else worst
        return worst

    def ddp_row(label, per_gpu, main=False):
        return row(label, p, params=4 * n_params, grads=4 * n_params, optimizer=optimizer_bytes("adamw", 4 * n_params),
                   activations=per_gpu * per_sample, gpu_mem_gb=gpu_mem_gb, main=main,
                   note=f"{cfg.name}, the whole model on every GPU, {per_gpu} samples each")

    m_claim = max(1, P.plan_batch // b)
    fixed = (4 + 4) * n_params + optimizer_bytes("adamw", 4 * n_params)  # fp32 weights, gradients, AdamW
    fit = max(0, int((gpu_mem_gb * 2 ** 30 - fixed) // per_sample))
    rows = [pipeline_row(f"1F1B, batch {m_claim * b} = {m_claim} x {b}", m_claim),
            pipeline_row(f"GPipe, batch {m_claim * b} = {m_claim} x {b}", m_claim, gpipe=True),
            ddp_row(f"DDP, batch {P.plan_batch} = {p} x {P.plan_batch // p}", P.plan_batch // p),
            ddp_row(f"DDP, largest batch that fits: {p} x {fit}", fit),
            pipeline_row(f"notebook: 1F1B splits, m = {P.split_m} x {b}", P.split_m, main=True),
            ddp_row(f"notebook: DDP, {P.split_m * b} samples", max(1, P.split_m * b // p), main=True)]
    with torch.device("meta"):
        blocks = nn.Sequential(*stack(P, "meta")[: max(1, P.stack_blocks // p)])
    x = torch.empty(b, P.stack_width, P.stack_grid, P.stack_grid, device="meta")
    acts = activation_bytes(lambda: blocks(x).sum(), exclude=list(blocks.parameters()))
    n_stack = sum(q.numel() for q in blocks.parameters())
    m_max = max(P.m_values)
    rows.append(row(f"notebook: bubble sweep, GPipe m = {m_max} x {b}", p, params=4 * n_stack, grads=4 * n_stack,
                    optimizer=0, activations=m_max * acts, gpu_mem_gb=gpu_mem_gb, main=True,
                    note=f"{P.stack_blocks // p} blocks of {P.stack_width} channels, {P.stack_grid}^2 tokens per rank"))
    return rows
