"""Day 8, AWQ (weight-only int4) against round-to-nearest on the course's small language model.

The model, its data, its training and the controlled outlier case are `day8_smooth`'s (`data`,
`train_lm`, `scores`, `dlo.smoothquant.inject_outliers_` with its channels and factor), so the two
experiments read side by side. Per seed: fp32; W4 RTN and W4 AWQ (`dlo.awq`), each with symmetric
codes and with zero points; and AWQ with zero points plus the clipping search (the authors' released
recipe), on the model as trained and with injected outlier channels, scored on the same held-out
batches. The claims compare variants paired by seed (each seed's mean over its held-out batches):
quantizing one model twice has no training noise, but whether a method helps depends on the model,
and a seed is a new model.
"""

from __future__ import annotations

import copy
import statistics

import torch

from dlo import awq
from dlo import claims as C
from dlo import estimates as E
from dlo import smoothquant as sq
from dlo.experiments import day8_smooth as ds

CALIB_TOKENS = 512  # of day8_smooth's 2 calibration batches (2048 tokens): the search's cost is linear in them
CASES = ("as trained", "injected outliers")
VARIANTS = ("fp32", "W4 RTN sym", "W4 RTN asym", "W4 AWQ sym", "W4 AWQ asym", "W4 AWQ asym + clip")
# (what the difference isolates, the variant that should be better, the one it is compared with)
COMPARISONS = (("zero points, RTN", "W4 RTN asym", "W4 RTN sym"),
               ("zero points, AWQ", "W4 AWQ asym", "W4 AWQ sym"),
               ("AWQ scaling, symmetric", "W4 AWQ sym", "W4 RTN sym"),
               ("AWQ scaling, zero points", "W4 AWQ asym", "W4 RTN asym"),
               ("clipping search after AWQ", "W4 AWQ asym + clip", "W4 AWQ asym"),
               ("AWQ as released vs RTN", "W4 AWQ asym + clip", "W4 RTN asym"))


def quantized(model, calib, n_grid: int, tokens: int) -> tuple[dict, dict, list]:
    """({variant: model}, the searches' reports, the two scaled float models) for one model. The
    clipped model clips the zero-point AWQ copy: one scale search serves both."""
    sym, rep_sym = awq.awq_llama(model, calib, n_grid, tokens)
    asym, rep_asym = awq.awq_llama(model, calib, n_grid, tokens, symmetric=False)
    clipped = copy.deepcopy(asym)
    clip_rows = awq.clip_llama_(clipped, calib, symmetric=False, max_tokens=tokens)
    variants = {"fp32": model, "W4 RTN sym": awq.quantize_w4(model), "W4 RTN asym": awq.quantize_w4(model, False),
                "W4 AWQ sym": awq.quantize_w4(sym), "W4 AWQ asym": awq.quantize_w4(asym, False),
                "W4 AWQ asym + clip": awq.quantize_w4(clipped, False)}
    return variants, {"sym": rep_sym["scales"], "asym": rep_asym["scales"], "clip": clip_rows}, [sym, asym]


def run_seed(seed: int, device, steps: int = 0, n_grid: int = awq.N_GRID, tokens: int = CALIB_TOKENS) -> dict:
    """One seed: train (`steps`, default day8_smooth's), inject, search, score every variant on both cases."""
    d = ds.data(seed, device)
    model = ds.train_lm(d["train"], device, seed, steps)
    injected = copy.deepcopy(model)
    sq.inject_outliers_(injected, list(ds.OUTLIER_CHANNELS), ds.OUTLIER_FACTOR)
    out = {"seed": seed, "scores": {}, "search": {}, "fold error": 0.0}
    x = d["eval"][0][0]
    with torch.no_grad():
        z = model(x)
        # the float model's logits, once: ds.scores would recompute them for each variant
        logits = {id(xe): model(xe) for xe, _ in d["eval"]}
        for case, m in zip(CASES, (model, injected)):
            variants, out["search"][case], scaled = quantized(m, d["calib"], n_grid, tokens)
            out["scores"][case] = {k: ds.scores(v, lambda xe: logits[id(xe)], d["eval"]) for k, v in variants.items()}
            # the scaled float models against the trained one: only float rounding may differ
            out["fold error"] = max([out["fold error"]] + [((s(x) - z).norm() / z.norm()).item() for s in scaled])
    return out


def run(seeds, device, steps: int = 0, n_grid: int = awq.N_GRID, tokens: int = CALIB_TOKENS) -> dict:
    """`run_seed` for each seed (day8_smooth's seeding: seed s reads data stream 100 s + 7..)."""
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and at least one, got {seeds}")
    return {"seeds": seeds, "runs": [run_seed(s, device, steps, n_grid, tokens) for s in seeds]}


def _mean(xs) -> float:
    return statistics.fmean(xs)


def table(res: dict) -> list[dict]:
    """Per case and variant, over seeds: mean perplexity and relative logit error (against the float model)."""
    return [{"case": case, "variant": v,
             "ppl": _mean(_mean(r["scores"][case][v]["ppl"]) for r in res["runs"]),
             "rel. logit error": _mean(_mean(r["scores"][case][v]["rel. error"]) for r in res["runs"])}
            for case in CASES for v in VARIANTS]


def gain(res: dict, case: str, better: str = "W4 AWQ sym", than: str = "W4 RTN sym",
         metric: str = "ppl") -> list[float]:
    """Per seed: (ppl `than` - ppl `better`) / ppl fp32, each the mean over the held-out batches
    (> 0: `better` is closer to the float model); metric="rel. error": the same difference of the
    relative logit errors (already relative to the float model's logits)."""
    def m(r, v):
        return _mean(r["scores"][case][v][metric])
    return [(m(r, than) - m(r, better)) / (m(r, "fp32") if metric == "ppl" else 1.0) for r in res["runs"]]


def _how(res: dict) -> str:
    return f"/ ppl fp32, paired by seed over {len(res['runs'])} seed(s), each over {ds.LM['eval']} held-out batches"


def differences(res: dict) -> list[dict]:
    """Every comparison of COMPARISONS in both cases: the perplexity gained and the relative logit error
    removed, each the mean and t-interval over seeds (> 0: the first variant is better)."""
    rows = []
    for case in CASES:
        for what, better, than in COMPARISONS:
            ppl, err = (E.from_samples(gain(res, case, better, than, m), what="seeds") for m in ("ppl", "rel. error"))
            rows.append({"case": case, "isolates": what, "comparison": f"{better} vs {than}",
                         "ppl gained / ppl fp32 [95%]": str(ppl), "logit error removed [95%]": str(err)})
    return rows


def alpha_table(res: dict) -> list[dict]:
    """The searched alpha of each group (one per seed), symmetric and with zero points, and the calibration
    error it leaves against RTN with the same quantizer (mean over seeds)."""
    rows = []
    for case in CASES:
        for i, g in enumerate(res["runs"][0]["search"][case]["sym"]):
            row = {"case": case, "layer": g["layer"], "input of": g["group"]}
            for q in ("sym", "asym"):
                per = [r["search"][case][q][i] for r in res["runs"]]
                row[f"alpha per seed, {q}"] = " ".join(f"{p['alpha']:.2f}" for p in per)
                row[f"AWQ / RTN, {q}"] = _mean(p["AWQ / RTN"] for p in per)
            rows.append(row)
    return rows


def clip_table(res: dict) -> list[dict]:
    """Per clipped linear: the groups clipped (per seed), the mean ratio, and the clip search's objective
    with its chosen clips / without clipping (mean over seeds)."""
    rows = []
    for case in CASES:
        for i, c in enumerate(res["runs"][0]["search"][case]["clip"]):
            per = [r["search"][case]["clip"][i] for r in res["runs"]]
            rows.append({"case": case, "layer": c["layer"], "linear": c["linear"],
                         "clipped groups per seed": " ".join(p["clipped groups"] for p in per),
                         "mean ratio": _mean(p["mean ratio"] for p in per),
                         "clip / no clip": _mean(p["clip / no clip"] for p in per)})
    return rows


def _paired(res: dict, claim: str, source: str, claimed: str, case: str, better: str, than: str) -> C.Claim:
    how = f"(ppl {than} - ppl {better}) {_how(res)}"
    return C.Claim(claim, source, claimed, C.at_least(0.0, "> 0"),
                   E.from_samples(gain(res, case, better, than), how, "seeds", E.PAIRED_BY_SEED))


def claims(res: dict) -> list[C.Claim]:
    """The paper's comparison (as released: zero points and clipping) on the model as trained, and on the
    injected case as a demonstration of the mechanism (alpha = 1 undoes the injection: by construction);
    the released code's two choices on the model as trained (zero points; clipping after scaling), each
    paired by seed; and three more rows that hold by construction."""
    inj = f"injected ({len(ds.OUTLIER_CHANNELS)} channels x{ds.OUTLIER_FACTOR:g})"
    code = "llm-awq (Lin et al.'s released code)"
    worst = max(g["AWQ / RTN"] for r in res["runs"] for case in CASES for q in ("sym", "asym")
                for g in r["search"][case][q])
    worst_clip = max(c["clip / no clip"] for r in res["runs"] for case in CASES for c in r["search"][case]["clip"])
    fold = max(r["fold error"] for r in res["runs"])
    full, rtn = "W4 AWQ asym + clip", "W4 RTN asym"
    return [
        _paired(res, "AWQ's W4 keeps perplexity closer to the float model than round-to-nearest",
                "Lin et al. 2024 (AWQ), Table 4 (INT4 g128, Llama perplexity)", "AWQ < RTN perplexity",
                "as trained", full, rtn),
        C.by_construction(f"with salient input channels ({inj}), AWQ recovers what RTN loses",
                          "Lin et al. 2024, Sec. 3.1-3.2 (salient channels, activation-aware scaling)",
                          "AWQ < RTN perplexity", "a demonstration of the mechanism, not evidence for the paper: the "
                          "outliers were injected, and alpha = 1 (s_j proportional to mean |x_j|, in the grid) scales "
                          "the divided weight columns back exactly",
                          _paired(res, "", "", "", "injected outliers", full, rtn).measured, C.at_least(0.0, "> 0")),
        _paired(res, "int4 with a zero point per group beats symmetric int4 (RTN)",
                f"{code}: q_config zero_point=True by default (entry.py; the symmetric branch 'never used')",
                "asym < sym perplexity", "as trained", "W4 RTN asym", "W4 RTN sym"),
        _paired(res, "the clipping search after the scaling lowers the error further",
                f"{code}: auto_clip.py, run after the scale search", "clip < no clip perplexity",
                "as trained", full, "W4 AWQ asym"),
        C.by_construction("the scaling leaves the float model unchanged", "Lin et al. 2024, Eq. 4 (an identity)",
                          "same outputs", "fold_ divides the producer and multiplies the consumers by the same s; "
                          "only float rounding differs",
                          E.exact(fold, "max relative logit difference, one batch per seed, sym and asym"),
                          C.at_most(1e-5, "<= 1e-5")),
        C.by_construction("the search never leaves a larger calibration error than RTN", "Lin et al. 2024, Eq. 5",
                          "AWQ / RTN <= 1", "alpha = 0 (s = 1: RTN exactly) is in the grid and wins ties",
                          E.exact(worst, "largest AWQ / RTN over groups, quantizers, cases and seeds"),
                          C.at_most(1.0, "<= 1")),
        C.by_construction("the clipping search never raises its own objective", f"{code}: auto_clip.py",
                          "clip / no clip <= 1", "ratio 1 (no clipping) is in the grid, tried first, kept on ties",
                          E.exact(worst_clip, "largest clip / no clip over linears, cases and seeds"),
                          C.at_most(1.0, "<= 1")),
    ]
