"""Day 8, AWQ (weight-only int4) against round-to-nearest on the course's small language model.

The model, its data, its training and the controlled outlier case are `day8_smooth`'s (`data`,
`train_lm`, `scores`, `dlo.smoothquant.inject_outliers_` with its channels and factor), so the two
experiments read side by side. Per seed: fp32, W4 RTN and W4 AWQ (`dlo.awq`) on the model as trained
and with injected outlier channels, scored on the same held-out batches. The claims compare the
methods paired by seed (each seed's mean over its held-out batches): quantizing one model twice has
no training noise, but whether AWQ helps depends on the model, and a seed is a new model.
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
VARIANTS = ("fp32", "W4 RTN", "W4 AWQ")


def quantized(model, calib, n_grid: int, tokens: int) -> tuple[dict, list[dict], torch.nn.Module]:
    """({variant: model}, the search's report, the scaled float model) for one model."""
    scaled, report = awq.awq_llama(model, calib, n_grid, tokens)
    return {"fp32": model, "W4 RTN": awq.quantize_w4(model), "W4 AWQ": awq.quantize_w4(scaled)}, report, scaled


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
        # the float model's logits, once: ds.scores would recompute them for each of the 6 variants
        logits = {id(xe): model(xe) for xe, _ in d["eval"]}
        for case, m in zip(CASES, (model, injected)):
            variants, out["search"][case], scaled = quantized(m, d["calib"], n_grid, tokens)
            out["scores"][case] = {k: ds.scores(v, lambda xe: logits[id(xe)], d["eval"]) for k, v in variants.items()}
            # the scaled float model against the trained one: only float rounding may differ
            out["fold error"] = max(out["fold error"], ((scaled(x) - z).norm() / z.norm()).item())
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


def alpha_table(res: dict) -> list[dict]:
    """The searched alpha of each group (one column per seed) and the calibration error it leaves, AWQ / RTN."""
    rows = []
    for case in CASES:
        for i, g in enumerate(res["runs"][0]["search"][case]):
            per = [r["search"][case][i] for r in res["runs"]]
            rows.append({"case": case, "layer": g["layer"], "input of": g["group"],
                         "alpha per seed": " ".join(f"{p['alpha']:.2f}" for p in per),
                         "calib. error AWQ / RTN": _mean(p["AWQ / RTN"] for p in per)})
    return rows


def gain(res: dict, case: str) -> list[float]:
    """Per seed: (ppl RTN - ppl AWQ) / ppl fp32, each the mean over the held-out batches."""
    def ppl(r, v):
        return _mean(r["scores"][case][v]["ppl"])
    return [(ppl(r, "W4 RTN") - ppl(r, "W4 AWQ")) / ppl(r, "fp32") for r in res["runs"]]


def claims(res: dict) -> list[C.Claim]:
    """The AWQ rows: the paper's comparison on both cases (paired by seed) and two rows that hold by construction."""
    n = len(res["runs"])
    inj = f"injected ({len(ds.OUTLIER_CHANNELS)} channels x{ds.OUTLIER_FACTOR:g})"
    how = f"(ppl RTN - ppl AWQ) / ppl fp32, paired by seed over {n} seed(s), each over {ds.LM['eval']} held-out batches"
    worst = max(g["AWQ / RTN"] for r in res["runs"] for case in CASES for g in r["search"][case])
    fold = max(r["fold error"] for r in res["runs"])
    return [
        C.Claim("AWQ's W4 keeps perplexity closer to the float model than round-to-nearest",
                "Lin et al. 2024 (AWQ), Table 4 (INT4 g128, Llama perplexity)", "AWQ < RTN perplexity",
                C.at_least(0.0, "> 0"), E.from_samples(gain(res, "as trained"), how, "seeds")),
        C.Claim(f"with salient input channels ({inj}), AWQ recovers what RTN loses",
                "Lin et al. 2024, Sec. 3.1-3.2 (salient channels, activation-aware scaling)", "AWQ < RTN perplexity",
                C.at_least(0.0, "> 0"), E.from_samples(gain(res, "injected outliers"), how, "seeds")),
        C.by_construction("the scaling leaves the float model unchanged", "Lin et al. 2024, Eq. 4 (an identity)",
                          "same outputs", "fold_ divides the producer and multiplies the consumers by the same s; "
                          "only float rounding differs",
                          E.exact(fold, "max relative logit difference, one batch per seed"),
                          C.at_most(1e-5, "<= 1e-5")),
        C.by_construction("the search never leaves a larger calibration error than RTN", "Lin et al. 2024, Eq. 5",
                          "AWQ / RTN <= 1", "alpha = 0 (s = 1: RTN exactly) is in the grid and wins ties",
                          E.exact(worst, "largest AWQ / RTN over groups, cases and seeds"), C.at_most(1.0, "<= 1")),
    ]
