"""Day 4's tables, claims and pictures from `dlo.experiments.day4.run_all`'s results (plain data);
the overlap's own (timeline, exposed time, bucket sweep) are in `day4_overlap`.

Every verdict goes through `dlo.claims`: counted bytes are exact; bytes read from the rank's TCP
sockets are a mean over trials with its t-interval; step times are paired round by round (the
versions run in turn, so a slow phase of the machine hits all of them) and summarised by the median
ratio with its order-statistics interval; two trainings scored on one test set (BatchNorm variants,
the losses of the 1-bit Adam runs) are paired by seed, a t-interval over >= 3 seeds (McNemar's
interval per seed in the BatchNorm table).
"""

from __future__ import annotations

import math

from dlo import claims as C
from dlo import estimates as E
from dlo.experiments.day4_controls import sync_bn_claim, update_claims
from dlo.experiments.day4_overlap import overlap_claims
from dlo.measure import gloo_wire_bytes

LI = "Li et al. 2020 (PyTorch DDP); seed 003"
META_AWS = "Meta and AWS 2021 (seed 003)"
TANG = "Tang et al. 2021 (1-bit Adam); seed 003"


# ----------------------------------------------------------------------------- tables

def bandwidth_rows(bw: list[dict]) -> list[dict]:
    """The sweep with each size's median time and its 95% interval."""
    return [{"bytes": r["bytes"], "time us [95%]": str(E.median_interval(r["times_s"]).scaled(1e6)),
             "algbw GB/s": r["algbw GB/s"], "busbw GB/s": r["busbw GB/s"]} for r in bw]


def compression_rows(comp: dict, world_size: int) -> list[dict]:
    """Per DDP hook: the bytes CommCounter saw handed to the all-reduces of a step, the bytes each rank
    handed to its TCP sockets (mean of the measured steps; gloo only), the hook's definition (fp32: the
    gradients; fp16: half; PowerSGD: the formula) as ring bytes per rank, the rate against fp32, and
    the final training loss."""
    f = 2 * (world_size - 1) / world_size
    fp32 = comp["fp32 (no compression)"]["bytes/step"]
    rows = []
    for name, v in comp.items():
        want = v.get("formula bytes", v["bytes/step"])  # PowerSGD: CommCounter may miss its callbacks
        wire = v.get("wire sent/step")
        rows.append({"scheme": name, "counted bytes/step": v["bytes/step"],
                     "TCP sent/step": round(sum(b for b, _ in wire) / len(wire)) if wire else "-",
                     "definition: sent/step": round(f * want), "rate": fp32 / want, "final loss": v["final loss"]})
    return rows


def throughput_ratio(tp: dict, ours: str = "bucketed DDP (dlo)", ref: str = "torch DDP") -> E.Estimate:
    """Throughput of `ours` over `ref`: the reference's step time over ours, paired round by round."""
    return E.median_interval([b / a for a, b in zip(tp[ours]["times_s"], tp[ref]["times_s"])],
                             f"paired rounds, median of {len(tp[ours]['times_s'])}")


def final_loss(losses: list[float], last: int = 10) -> float:
    """The mean training loss of the last steps; inf when the run diverged (a non-finite loss)."""
    tail = losses[-last:]
    return sum(tail) / len(tail) if all(math.isfinite(v) for v in losses) else math.inf


def onebit_summary(ob: dict) -> dict:
    """Bytes per step (seed 0): the fp32 run's, a warm-up and a compressed step of 1-bit Adam, both
    whole runs; per run and seed, the final training loss (`final_loss`)."""
    fp32, one = ob["Adam (fp32 all-reduce)"], ob["1-bit Adam"]
    return {"fp32 step": fp32["sent"][0][-1], "1-bit warm-up step": one["sent"][0][0],
            "1-bit compressed step": one["sent"][0][-1], "fp32 run": sum(fp32["sent"][0]),
            "1-bit run": sum(one["sent"][0]), "warmup share": ob["warmup"] / ob["steps"],
            "final": {name: [final_loss(ls) for ls in run["losses"]] for name, run in ob.items()
                      if isinstance(run, dict)}}


def onebit_rows(ob: dict) -> list[dict]:
    """Bytes a rank sends: an fp32 Adam step, a 1-bit Adam warm-up and compressed step, a whole run."""
    s = onebit_summary(ob)
    rows = [("Adam, fp32 all-reduce", s["fp32 step"], s["fp32 step"]),
            ("1-bit Adam, warm-up (fp32)", s["1-bit warm-up step"], s["fp32 step"]),
            (f"1-bit Adam, compressed (a scale per {ob['chunk']} values)", s["1-bit compressed step"], s["fp32 step"]),
            (f"1-bit Adam, whole run: {ob['steps']} steps, {s['warmup share']:.0%} warm-up", s["1-bit run"],
             s["fp32 run"])]
    return [{"step": name, "bytes sent per rank": int(b), "vs fp32 Adam": b / ref} for name, b, ref in rows]


def plot_onebit(ax, ob: dict) -> None:
    """Training losses of every run and seed, one colour per run, the end of the warm-up dotted; a
    run that diverges is drawn until it leaves the plot (marked x)."""
    runs = [(name, run) for name, run in ob.items() if isinstance(run, dict)]
    top = 3 * max(ls[0] for _, run in runs for ls in run["losses"])
    for (name, run), color in zip(runs, ("k", "tab:red", "tab:blue", "tab:olive", "tab:gray")):
        for k, losses in enumerate(run["losses"]):
            out = next((i for i, v in enumerate(losses) if not math.isfinite(v) or v > top), None)
            shown = losses if out is None else losses[:out]
            ax.plot(shown, color=color, lw=1, alpha=0.8, label=name if k == 0 else None)
            if out is not None:
                ax.plot([out - 1], [min(top, shown[-1] if shown else top)], "x", color=color, ms=8)
    ax.axvline(ob["warmup"], color="gray", ls=":", lw=1, label="end of warm-up")
    ax.set(xlabel="step", ylabel="training loss (rank 0)", ylim=(None, top), title="Adam vs 1-bit Adam, every seed")
    ax.legend(fontsize=7)


# ----------------------------------------------------------------------------- claims

def claims(R: dict, wire_more: dict | None = None, scale: dict | None = None) -> list[C.Claim]:
    """Day 4's claims table from `run_all`'s results `R`, `wire_only` at another world size
    (`wire_more`) and the scaling launches ({world: `scaling` result})."""
    N, gpu = R["world"], R["device"].startswith("cuda")
    f = 2 * (N - 1) / N
    ring = E.exact(R["ring sent"], "CommCounter on the course's ring: bytes of its sends / n")
    out = [C.by_construction(f"a ring all-reduce sends 2(N-1)/N of the data per rank (the exercise's ring, N={N})",
                             "Patarasuk & Yuan 2009", f"{f:.3f} n", COURSE_RING, ring, C.approx(f, rel=1e-3))]
    for wire in (w for w in (R.get("wire"), wire_more) if w):
        out += [_wire_total_claim(wire), _wire_connection_claim(wire)]
    if not R.get("wire"):
        for what in ("sends 2(N-1)/N of the data per rank on the wire", "sends all of it to one neighbour"):
            out.append(C.not_measurable(f"the backend's all-reduce {what}", "Patarasuk & Yuan 2009", f"{f:.3f} n",
                                        "NCCL's traffic does not go through TCP sockets (NVLink, InfiniBand)"))
    comp = R["compression"]
    fp32 = comp["fp32 (no compression)"]["bytes/step"]
    out += [C.by_construction("fp16 compression halves the bytes (rate 2x)", META_AWS, "2x", CAST,
                              E.exact(fp32 / comp["fp16 compress"]["bytes/step"], "CommCounter, bytes per step"),
                              C.approx(2.0, rel=1e-3)),
            _powersgd_claim(comp["PowerSGD"], N),
            C.not_measurable("FP16 + PowerSGD compress 1,969x", META_AWS, "1,969x",
                             f"a property of their model's shapes and rank; this model at its rank: "
                             f"{fp32 / comp['PowerSGD']['formula bytes']:.0f}x by the same formula"),
            C.not_measurable("fp16 compression alone: 1.4x-2.1x faster", META_AWS, "1.4x-2.1x",
                             "needs a bandwidth-bound multi-node GPU job")]
    if "bf16 compress" in comp:
        out.append(C.by_construction("bf16 compression halves the bytes", META_AWS, "2x", CAST,
                                     E.exact(fp32 / comp["bf16 compress"]["bytes/step"], "CommCounter, bytes per step"),
                                     C.approx(2.0, rel=1e-3)))
    else:
        out.append(C.not_measurable("bf16 compression halves the bytes", META_AWS, "2x",
                                    "gloo has no bf16 sum (torch's bf16 hook needs NCCL >= 2.10)"))
    # N rank processes (one thread each) beside the notebook's kernel: on a small CPU they share its cores
    setup = dict(device=R["device"].split(":")[0], world_size=N, kernel=True)
    out += update_claims(R["throughput"])
    out.append(C.Claim("dlo's bucketed DDP (DataParallelBucket) reaches 0.9x torch DDP's throughput", COURSE_BAR,
                       ">= 0.9x", C.at_least(0.9, ">= 0.9"),
                       C.timed(throughput_ratio(R["throughput"]), gpu_claim=True, **setup)))
    out += overlap_claims(R)
    out.append(_scaling_claim(scale, gpu))
    out += _onebit_claims(R)
    if "sync_bn_gap" in R:
        out.append(sync_bn_claim(R["sync_bn_gap"], N, R["bn_batch"]))
    out.append(batchnorm_claim(R["batchnorm"], R["bn_batch"]))
    return out


def batchnorm_claim(bn: dict, per_rank: int) -> C.Claim:
    """SyncBatchNorm's test accuracy minus local BatchNorm's, paired by seed (the same weights and data
    for both, one shared test set): a t-interval over >= 3 seeds, else no evidence (`dlo.claims` rule 2)."""
    loc, syn = bn["local BatchNorm"], bn["SyncBatchNorm (dlo)"]
    k = len(syn["test acc"])
    return C.Claim(f"SyncBatchNorm (dlo's, held to torch's BatchNorm above) beats local BatchNorm at {per_rank} "
                   f"samples per rank",
                   "Peng et al. 2018; Wu & He 2018", "sync > local", C.at_least(0.0, "> 0"),
                   E.paired_difference(syn["test acc"], loc["test acc"],
                                       f"test accuracy, sync - local, paired over {k} seed(s), n={syn['n']} shared"))


def batchnorm_rows(bn: dict) -> list[dict]:
    """Per seed: each variant's test accuracy and SyncBatchNorm - local on the same examples (McNemar's
    paired interval: only the examples one gets right and the other wrong carry the difference)."""
    loc, syn = bn["local BatchNorm"], bn["SyncBatchNorm (dlo)"]
    rows = []
    for seed, (a, b) in enumerate(zip(syn["correct"], loc["correct"])):
        rows.append({"seed": seed, **{f"{name} acc": v["test acc"][seed] for name, v in bn.items()},
                     "sync - local [95%, McNemar]": str(E.paired_examples(a, b))})
    return rows


def _wire_total_claim(wire: dict) -> C.Claim:
    """gloo's all-reduce: the bytes a rank hands to its TCP sockets, in all, over n (`day4_comm.wire_bytes`)."""
    fw = 2 * (wire["world"] - 1) / wire["world"]
    text = (f"gloo's all-reduce puts 2(N-1)/N of the data per rank on the wire (N={wire['world']}; a ring, a tree "
            f"and reduce + broadcast all do: this total does not tell them apart)")
    args = (text, "Patarasuk & Yuan 2009; NCCL/gloo ring", f"{fw:.3f} n")
    region = C.approx(fw, rel=0.01, text=f"{fw:.3f} +- 1% (gloo's message headers)")
    est = E.from_samples(wire["ratio"], f"TCP socket counters (TCP_INFO), {len(wire['ratio'])} trials")
    return C.Claim(*args, region, est) if wire["world"] > 2 else C.by_construction(*args, AT_TWO, est, region)


def _wire_connection_claim(wire: dict) -> C.Claim:
    """gloo's all-reduce, per connection (one TCP socket per peer): the share of the rank's bytes on its
    busiest connection. A ring puts all of its 2(N-1)/N n there; a tree or reduce + broadcast moves the same
    total over several connections (from the root of a tree at N = 3: half on each), and is caught. At N = 2
    there is one connection only, whatever the algorithm (by construction)."""
    world_size, f = wire["world"], 2 * (wire["world"] - 1) / wire["world"]
    peers = wire["peers"]
    shares = [p[0] / sum(p) for p in peers]
    used = max(sum(1 for x in p if x > 0.01) for p in peers)
    text = (f"a ring rank sends all of its 2(N-1)/N n to one neighbour (gloo's all-reduce, per connection, "
            f"N={world_size})")
    args = (text, "Patarasuk & Yuan 2009", f"all {f:.3f} n on 1 connection")
    est = E.from_samples(shares, f"TCP socket counters per connection, {len(peers)} trials: the busiest carried "
                                 f"{sum(p[0] for p in peers) / len(peers):.4f} n of the rank's "
                                 f"{sum(sum(p) for p in peers) / len(peers):.4f} n; {used} connection(s) over 1% of n")
    region = C.at_least(0.99, "share >= 0.99 (gloo's headers, barriers)")
    if world_size <= 2:
        return C.by_construction(*args, "at N = 2 each rank has one peer: a ring, a tree and sending everything "
                                        "all use that one connection", est, region)
    return C.Claim(*args, region, est)


def _powersgd_claim(ps: dict, world_size: int) -> C.Claim:
    """PowerSGD's bytes per step against Vogels et al.'s formula, judged on the rank's TCP sockets (the
    kernel's counters, independent of the hook): the bytes sent in a step, less gloo's headers for its
    three all-reduces (`dlo.measure.gloo_wire_bytes`, measured), over the formula's three messages at
    2(N-1)/N. `CommCounter` sees only the all-reduce issued on the training thread (the uncompressed
    tensors): P and Q are all-reduced from callbacks on gloo's threads, outside its dispatch mode.
    PowerSGDState's own count is the code under test's bookkeeping: shown, never the evidence."""
    text = ("PowerSGD all-reduces (n + m) r values per n x m gradient (rank r; vectors, and matrices too small "
            "to gain, sent whole)")
    wire, parts = ps.get("wire sent/step"), ps.get("formula parts")
    state = f"; PowerSGDState's own count: {ps['state bytes/step']:,} B" if "state bytes/step" in ps else ""
    if not wire or not parts:
        return C.not_measurable(text, "Vogels et al. 2019", "the formula's bytes",
                                "no TCP socket counters here (NCCL's traffic does not go through TCP sockets)" + state)
    records = [{"kind": "all_reduce", "bytes": b, "group": world_size} for b in parts.values() if b]
    payload, headers = gloo_wire_bytes(records)
    sent = sum(b for b, _ in wire) / len(wire)
    seen = ps["bytes/step"]
    why = (" = the uncompressed tensors, the one all-reduce on the training thread" if seen == parts["uncompressed"]
           else " (the all-reduces issued on the training thread)")
    est = E.from_samples([(b - headers) / payload for b, _ in wire],
                         f"TCP socket counters, {len(wire)} steps: {sent:,.0f} B sent - {headers:,.0f} B of gloo's "
                         f"headers ({len(records)} all-reduces) over the formula's {payload:,.0f} B at 2(N-1)/N; "
                         f"CommCounter saw {seen:,} B{why}{state}")
    return C.Claim(text, "Vogels et al. 2019", "the formula's bytes", C.approx(1.0, rel=0.01, text="1 +- 1%"), est)


def _scaling_claim(scale: dict | None, gpu: bool) -> C.Claim:
    text = "DDP scales nearly linearly (weak scaling: efficiency T_1 / T_N)"
    if not gpu or not scale or len(scale) < 2:
        return C.not_measurable(text, LI + " (256 GPUs)", "near-linear",
                                "the ranks share one CPU's cores: their compute itself does not scale")
    lo, hi = min(scale), max(scale)
    t1, tn = (E.median_interval(scale[w]["torch DDP"]["times_s"]) for w in (lo, hi))
    est = E.ratio(t1, tn, "median step times, two launches")
    return C.Claim(f"{text}, {lo} -> {hi} GPUs", LI + " (256 GPUs)", "near-linear", C.at_least(0.9, ">= 0.9"),
                   C.timed(est, device="cuda", world_size=hi, kernel=True))


COURSE_BAR = "the course's bar for its engine, on GPUs (torch DDP: Li et al. 2020)"
NO_NORM = "this notebook's control (why the runs use BatchNorm); not a claim of Tang et al."
ZERO_ONE = ("0/1 Adam (adaptive variance freezing, local steps) is not implemented in this course; its bytes and "
            "rounds would be countable on a CPU as 1-bit Adam's are")
COURSE_RING = ("counts the course's own ring (dlo.distributed.collectives.ring_all_reduce), whose code sends every "
               "chunk to rank + 1: the count restates that code; gloo's all-reduce is measured on the wire below")
AT_TWO = "at N = 2 a ring, a tree and sending everything all put n per rank on the wire"
CAST = "the hook casts the gradients to a 2-byte type before the all-reduce: half of fp32's 4 bytes by definition"
FORMULA = "restates the engine's own compression (1 bit per value + an fp32 scale per chunk): a count of its format"


def _loss_ratio(final: dict, name: str, baseline: str = "Adam (fp32 all-reduce)") -> E.Estimate:
    """The final training loss of `name` over `baseline`'s, paired by seed: a t-interval over seeds (no
    interval under 3: "one seed", "2 seeds < 3"). A diverged run (inf) is a definite disagreement
    whatever the seeds (a divergence is not noise); a diverged baseline leaves nothing to compare."""
    if not all(math.isfinite(b) for b in final[baseline]):
        return E.Estimate(math.nan, math.nan, math.nan, reason=f"{baseline} diverged")
    ratios = [a / b for a, b in zip(final[name], final[baseline])]
    if not all(math.isfinite(x) for x in ratios):
        return E.exact(math.inf, "diverged")
    return E.paired_ratio(final[name], final[baseline],
                          f"final training loss / {baseline}'s, paired over {len(ratios)} seed(s)")


def _onebit_claims(R: dict) -> list[C.Claim]:
    s = onebit_summary(R["onebit"])
    comp = R["compression"]  # the fp16 hook's share of fp32, applied to the 1-bit engine's (padded) buffer
    fp16_sent = s["fp32 step"] * comp["fp16 compress"]["sent/step"] / comp["fp32 (no compression)"]["sent/step"]
    w = s["warmup share"]
    want_run = 1 / (w + 0.03 * (1 - w))  # warm-up at full precision, 97% saved afterwards
    same = C.approx(1.0, rel=0.1, text="ratio 1 +- 0.1")
    return [
        C.by_construction("1-bit Adam: 97% less communication than fp32 (a compressed step)", TANG, "97% less",
                          FORMULA, E.exact(1 - s["1-bit compressed step"] / s["fp32 step"],
                                           "CommCounter, bytes sent per step"), C.approx(0.97, abs_tol=0.01)),
        C.by_construction("1-bit Adam: 94% less communication than fp16 (a compressed step)", TANG, "94% less",
                          FORMULA, E.exact(1 - s["1-bit compressed step"] / fp16_sent,
                                           "CommCounter, against the fp16 hook"), C.approx(0.94, abs_tol=0.01)),
        C.by_construction(f"over a run, the full-precision warm-up ({w:.0%} of the steps here) bounds the saving: "
                          f"1 / (w + 0.03 (1 - w))", "Tang et al. 2021: 'up to 5x less' overall", f"{want_run:.2f}x",
                          FORMULA, E.exact(s["fp32 run"] / s["1-bit run"], "CommCounter, whole run"),
                          C.approx(want_run, rel=0.02)),
        C.Claim("Adam's variance is stable after the warm-up: freezing it costs nothing (MLP with BatchNorm)", TANG,
                "same loss", same, _loss_ratio(s["final"], "frozen variance, fp32 momentum")),
        C.Claim(f"control: frozen after {R['onebit']['warmup']} steps without normalisation layers, where the variance "
                f"is not yet stable, the freeze costs loss (vs Adam on the same MLP)", NO_NORM, "worse than Adam",
                C.at_least(1.1, "ratio >= 1.1"), _loss_ratio(s["final"], "frozen variance, no BatchNorm",
                                                            "Adam, no BatchNorm")),
        C.Claim("1-bit Adam converges like Adam (training loss after the same steps)", TANG, "same", same,
                _loss_ratio(s["final"], "1-bit Adam")),
        C.not_measurable("1-bit Adam: up to 3.3x higher throughput (BERT-Large, 64 GPUs on Ethernet)", TANG, "3.3x",
                         "needs a bandwidth-limited multi-node cluster; here communication is loopback TCP"),
        C.not_tested("0/1 Adam: up to 87% less data and 54% fewer rounds than 1-bit Adam", "Lu et al. 2022",
                     "87% / 54%", ZERO_ONE),
    ]
