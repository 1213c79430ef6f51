"""Day 10's tables and claims from the launch's results (`dlo.experiments.day10.run_all`, one dict per rank)
and the one-process MoE runs (`dlo.experiments.day10_moe`), and the planner of `dlo plan day10_context_experts`.

Every claims row goes through `dlo.claims`: the measured side comes from outside the code it judges
(one process's attention, torch's FLOP counter, autograd's saved-tensor meter, the kernel's TCP counters,
the router's top-k counted in the experiment), a control that must fail where one exists, intervals from
>= 3 seeds or timings; GPU-only or many-core timings are "not measurable here" with the reason.
"""

from __future__ import annotations

from dlo import claims as C
from dlo import estimates as E
from dlo.accounting import optimizer_bytes
from dlo.distributed import context_parallel as cp
from dlo.distributed import ulysses
from dlo.plan import row, split_evenly

RING = "Liu et al. 2023 (Ring Attention)"
STRIPED = "Brandon et al. 2023; torchtitan head-tail"
ULYSSES = "Jacobs et al. 2023 (Ulysses)"
SWITCH = "Fedus et al. 2021 (Switch)"
GSHARD = "Lepikhin et al. 2020 (GShard)"
TOL = 1e-10  # float64: a correct split differs from one process by summation order only (~1e-15)


# ----------------------------------------------------------------------------- tables

def equality_table(R: list[dict]) -> list[dict]:
    """Max |error| over ranks, per implementation, mask and split (outputs and q, k, v gradients)."""
    keys = [k for k in R[0]["equality"] if k != "control"]
    return [{"implementation": impl, "causal": causal, "split": "zig-zag" if zz else "contiguous",
             "max |error| vs one process": max(r["equality"][impl, causal, zz] for r in R)}
            for impl, causal, zz in keys]


def work_table(R: list[dict], P) -> list[dict]:
    """Per rank and split: FLOPs counted by torch and the scores `ring_work` counts, the median step time."""
    n, rows = len(R), []
    for split in ("contiguous", "zig-zag"):
        counted = cp.ring_work(P.work_seq, n, causal=True, zigzag=split == "zig-zag")
        for r in R:
            w = r["work"][split]
            rows.append({"split": split, "rank": r["rank"], "FLOPs (torch counter)": w["flops"],
                         "scores (ring_work, per head)": counted[r["rank"]],
                         "step ms (median)": 1e3 * E.median_interval(w["times"]).value})
    return rows


def when_better(heads: int, kv_heads: int, T: int, D: int, itemsize: int = 2,
                degrees=(2, 4, 8, 16, 32, 64)) -> list[dict]:
    """Ring vs Ulysses per degree N for one attention layer (B = 1, forward + backward): bytes per rank from the
    formulas, and whether Ulysses can split the heads (N | H and, without repeating K/V, N | H_kv)."""
    rows = []
    for n in degrees:
        ring = cp.ring_bytes_per_rank(1, kv_heads, T, D, n, itemsize, backward=True)
        uly = ulysses.ulysses_bytes_per_rank(1, heads, T, D, n, itemsize, H_kv=kv_heads, backward=True)
        ok = heads % n == 0
        possible = "yes" if ok and kv_heads % n == 0 else "K/V heads repeated" if ok else f"no ({heads} heads)"
        fewer = "-" if not ok else "Ulysses" if uly < ring else "ring" if ring < uly else "equal"
        rows.append({"N": n, "ring MB/rank": ring / 1e6, "Ulysses MB/rank": uly / 1e6 if ok else "-",
                     "Ulysses possible": possible, "fewer bytes": fewer})
    return rows


def moe_table(pairs: list[dict], factors) -> list[dict]:
    rows = []
    for p in pairs:
        for aux in (False, True):
            a = p[aux]
            rows.append({"seed": a["seed"], "aux loss": aux, "imbalance at start": a["imbalance_start"],
                         "imbalance at end": a["imbalance"], "final MSE": a["losses"][-1],
                         **{f"dropped f={f:g}": a["dropped"][f] for f in factors}})
    return rows


# ----------------------------------------------------------------------------- claims

def _where(R: list[dict]) -> dict:
    return {"device": R[0]["device"].split(":")[0], "world_size": len(R), "kernel": True}


def cp_claims(R: list[dict], P) -> list[C.Claim]:
    n, out = len(R), []
    for impl, source in (("ring", RING), ("ulysses", ULYSSES), ("all-gather", "the naive version")):
        err = max(r["equality"][k] for r in R for k in r["equality"] if k != "control" and k[0] == impl)
        control = E.exact(max(r["equality"]["control"] for r in R), "the ring's mask on contiguous positions")
        out.append(C.Claim(f"{impl} attention on {n} ranks equals attention on one process (outputs, q/k/v grads)",
                           source, "equal (float64)", C.at_most(TOL),
                           E.exact(err, "max |error| over causal/not, contiguous/zig-zag, float64"),
                           control=control))
    work = {s: [r["work"][s]["flops"] for r in R] for s in ("contiguous", "zig-zag")}
    bal = {s: E.exact(max(w) / (sum(w) / n), f"max/mean of the FLOPs torch counts per rank ({s})")
           for s, w in work.items()}
    out.append(C.Claim("zig-zag balances the causal work: the busiest rank does the mean work", STRIPED,
                       "every rank (N+1)/2 blocks", C.approx(1.0, rel=0.02), bal["zig-zag"], control=bal["contiguous"]))
    # first: the imbalance the zig-zag split removes, before the equality rows and the fix
    out.insert(0, C.Claim("contiguous split: the last rank does 2N/(N+1) times the mean work", STRIPED,
                          f"{2 * n / (n + 1):.3g} at N = {n}", C.approx(2 * n / (n + 1), rel=0.05), bal["contiguous"]))
    steps = {s: E.median_interval([max(ts) for ts in zip(*(r["work"][s]["times"] for r in R))])
             for s in ("contiguous", "zig-zag")}
    speed = C.timed(E.ratio(steps["contiguous"], steps["zig-zag"], how="median step of the slowest rank, contiguous / "
                            "zig-zag"), **_where(R))
    out.append(C.Claim("the zig-zag ring step is faster than the contiguous one (causal)", STRIPED,
                       "faster (up to 2N/(N+1))", C.at_least(1.05, "> 1.05"), speed))
    mem = R[0]["memory"]
    T0, T1 = P.seq_lens[0], P.seq_lens[-1]
    growth = {k: E.exact(v[-1] / v[0], f"saved bytes at T={T1} / T={T0} (autograd's saved tensors)")
              for k, v in mem.items()}
    out.append(C.Claim("ring attention's memory per rank grows linearly with T (only O and L kept)", RING,
                       f"x{T1 // T0} for T x{T1 // T0}", C.approx(T1 / T0, rel=0.02), growth["ring"],
                       control=growth["all-gather"]))
    ring_saved = cp.ring_saved_bytes(P.batch, P.heads, T1, P.head_dim, n, 4)
    out.append(C.Claim("ring attention saves B H T/N (D+1) values beyond q, k, v", RING,
                       f"{ring_saved:,} B at T={T1}", C.approx(ring_saved, rel=0.01),
                       E.exact(mem["ring"][-1], "autograd's saved tensors, rank 0")))
    out += _wire_claims(R, P)
    out.append(C.not_measurable("torch's context_parallel API gives the same output", "torch 2.13",
                                "torch.distributed.tensor.experimental.context_parallel",
                                "no sharding rule for SDPA's CPU kernel: it runs on GPUs only (bench/gpu_session.py)"))
    return out


def _wire_claims(R: list[dict], P) -> list[C.Claim]:
    n, T = len(R), P.work_seq
    if "wire" not in R[0]:
        why = "NCCL: no TCP socket to read" if R[0]["backend"] != "gloo" else "no TCP counters here"
        return [C.not_measurable("ring and Ulysses bytes per rank on the wire", RING, "the formulas", why)]
    want = {"ring": cp.ring_bytes_per_rank(P.batch, P.heads, T, P.head_dim, n, 4, backward=True),
            "ulysses": ulysses.ulysses_bytes_per_rank(P.batch, P.heads, T, P.head_dim, n, 4, backward=True)}
    text = {"ring": "K/V to the next rank N-1 times, backward K/V again and dK/dV N times",
            "ulysses": "4 all-to-alls of (N-1)/N of a shard each way"}
    return [C.Claim(f"{name} attention: bytes each rank sends per forward + backward",
                    RING if name == "ring" else ULYSSES, text[name], C.approx(want[name], rel=0.05),
                    E.exact(max(r["wire"][name] for r in R), "the busiest rank's TCP counters, gloo headers included"))
            for name in ("ring", "ulysses")]


def moe_claims(pairs: list[dict], fl: dict, R: list[dict], P) -> list[C.Claim]:
    noaux = [p[False] for p in pairs]
    aux = [p[True] for p in pairs]
    f = 1.25 if 1.25 in P.capacity_factors else P.capacity_factors[-1]
    out = [C.Claim("the auxiliary loss balances the experts (max/mean load, held-out tokens)", SWITCH,
                   "more balanced", C.at_least(0.0, "> 0 (no aux - aux)"),
                   E.paired_difference([a["imbalance"] for a in noaux], [a["imbalance"] for a in aux])),
           C.Claim(f"fewer assignments dropped at capacity factor {f:g} with the auxiliary loss", SWITCH,
                   "fewer dropped", C.at_least(0.0, "> 0 (no aux - aux)"),
                   E.paired_difference([a["dropped"][f] for a in noaux], [a["dropped"][f] for a in aux]))]
    moe, dense = fl["moe"]["flops/token"], fl["dense, same active"]["flops/token"]
    out.append(C.Claim("an MoE token costs what a dense layer of its active parameters costs", SWITCH,
                       "compute set by active parameters", C.approx(1.0, rel=0.05),
                       E.exact(moe / dense, "FLOPs/token counted by torch, MoE / dense (k x hidden)"),
                       control=E.exact(fl["dense, all parameters"]["flops/token"] / dense,
                                       "a dense layer of all the experts' parameters")))
    ep_err = E.exact(max(r["ep"]["error"] for r in R), "max |error| of output, input and expert gradients, float64")
    out.append(C.Claim(f"expert parallelism on {len(R)} ranks equals the one-process MoE", GSHARD, "equal",
                       C.at_most(TOL), ep_err,
                       control=E.exact(max(r["ep"]["control"] for r in R), "combine in arrival order")))
    out.append(_a2a_claim(R, P))
    return out


def _a2a_claim(R: list[dict], P) -> C.Claim:
    if "wire" not in R[0]["ep"]:
        return C.not_measurable("all-to-all bytes per rank", GSHARD, "the routed rows", "NCCL: no TCP socket to read")
    n, e_local, best = len(R), P.n_experts // len(R), None
    for r in R:
        to_others = sum(c for j, c in enumerate(r["ep"]["rows_by_destination"]) if j != r["rank"])
        from_others = sum(o["ep"]["rows_by_destination"][r["rank"]] for o in R if o is not r)
        # dispatch and combine, forward and backward: rows out and rows back; the counts' all-to-all (int64)
        want = 2 * (to_others + from_others) * P.moe_dim * 4 + (n - 1) * e_local * 8
        ratio = r["ep"]["wire"] / want
        best = ratio if best is None or abs(ratio - 1) > abs(best - 1) else best
    return C.Claim("all-to-all bytes per rank = the rows routed to other ranks, both ways, forward and backward",
                   GSHARD, "2 (out + back) x dim x bytes per row + counts", C.approx(1.0, rel=0.05),
                   E.exact(best, "TCP bytes / rows counted from the router's top-k (worst rank)"))


# ----------------------------------------------------------------------------- the planner

def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Bytes per rank at the full profile's longest sequence: ring, all-gather and Ulysses attention for one
    layer (bf16 q, k, v, o and what each keeps; the largest score block as transient), and the MoE layer
    over `gpus` expert-parallel ranks (fp32 weights, gradients and AdamW; its k S rows of activations)."""
    T, B, H, D = P.seq_lens[-1], P.batch, P.heads, P.head_dim
    split_evenly(f"the zig-zag split cuts T = {T} into 2N chunks", {"T/2": T // 2}, gpus)
    split_evenly("the experts", {"experts": P.n_experts}, gpus)
    t, s = T // gpus, 2
    qkvo = 4 * B * H * t * D * s
    rows = [row("ring attention (one layer)", gpus, params=0, grads=0, optimizer=0,
                activations=qkvo + cp.ring_saved_bytes(B, H, T, D, gpus, 4), gpu_mem_gb=gpu_mem_gb, main=True,
                peak=qkvo + B * H * t * (D + 1) * 4 + 2 * B * H * t * t * 4 + 2 * B * H * t * D * s,
                note=f"T={T}, N={gpus}: one (T/N)^2 score block in fp32 and the K/V in flight"),
            row("all-gather attention", gpus, params=0, grads=0, optimizer=0,
                activations=qkvo + 2 * B * H * T * D * s + B * H * t * T * 4, gpu_mem_gb=gpu_mem_gb,
                note="all T keys and values, T/N x T scores"),
            row("Ulysses attention", gpus, params=0, grads=0, optimizer=0,
                activations=qkvo + (B * H * T * T * 4 // gpus if H % gpus == 0 else 0), gpu_mem_gb=gpu_mem_gb,
                note=f"H/N heads x T x T scores (plain attention){'' if H % gpus == 0 else '; N does not divide H'}")]
    e_local = P.n_experts // gpus
    w = (e_local * 3 * P.moe_dim * P.moe_hidden + P.moe_dim * P.n_experts) * 4
    acts = P.top_k * P.moe_tokens * (P.moe_dim + 3 * P.moe_hidden) * 4
    rows.append(row(f"MoE layer, EP {gpus}", gpus, params=w, grads=w, optimizer=optimizer_bytes("adamw", w),
                    activations=acts, gpu_mem_gb=gpu_mem_gb,
                    note=f"{e_local} of {P.n_experts} experts per rank, {P.moe_tokens} tokens, top-{P.top_k}"))
    return rows
