"""Day 8, activation outliers and SmoothQuant on the course's small language model.

The model is `dlo.models.llama`'s "tiny" Llama (RMSNorm, SwiGLU, 2 layers of width 64) trained for a
few seconds on Day 5's synthetic noisy-bigram tokens (`dlo.experiments.day5_data.token_batches`).
It is far too small for the systematic outlier channels of LLMs (Dettmers et al. 2022 saw them
emerge around 6.7B parameters), so the experiment counts them first with LLM.int8()'s own criterion
(`outlier_features`; a released model's, `real_outliers`, when its weights are given) and then builds
a controlled case, a demonstration of the mechanism and no evidence for the papers' claims:
`dlo.smoothquant.inject_outliers_` makes a few input channels of every smoothable Linear `factor` x
larger (the float model unchanged). Every quantized variant is scored on the same held-out batches,
so comparisons are paired per batch (`dlo.estimates.paired_difference`).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from dlo import claims as C
from dlo import estimates as E
from dlo import smoothquant as sq
from dlo.experiments.day5_data import build, lm_loss, token_batches
from dlo.models.llama import LlamaConfig

# The tiny profile's LM (also at full size: the point is the mechanism, measured in seconds):
# batches of 16 sequences of 64 tokens; 48 training batches (no memorising), 2 calibration, 8 held out.
LM = dict(model="tiny", batch=16, seq_len=64, steps=300, lr=3e-3, train=48, calib=2, eval=8)
# LLM.int8()'s outlier features (Dettmers et al. 2022, Sec. 4.1): a hidden dimension whose magnitude is
# >= 6 in >= 6% of the tokens of >= 25% of the layers' inputs (attention and FFN expansion)
MAGNITUDE, TOKEN_SHARE, LAYER_SHARE = 6.0, 0.06, 0.25
OUTLIER_CHANNELS, OUTLIER_FACTOR = (3, 17, 40, 51), 60.0  # LLM.int8(): a few channels, 20-100x
ALPHAS = (0.0, 0.5, 0.8)
# rank ids of token_batches' generators: one stream per use, the same pi (the language) for all
STREAMS = {"train": 0, "calib": 1, "eval": 2}


def data(seed: int, device) -> dict[str, list]:
    """Training, calibration and held-out batches (x, y) of the synthetic language."""
    cfg = LlamaConfig.from_name(LM["model"])
    P = SimpleNamespace(batch_per_rank=LM["batch"], seq_len=LM["seq_len"])
    return {k: token_batches(P, cfg, 100 * seed + r + 7, device, n=LM[k]) for k, r in STREAMS.items()}


def train_lm(batches: list, device, seed: int, steps: int = 0) -> torch.nn.Module:
    """The tiny Llama trained `steps` (LM["steps"]) AdamW steps on `batches`, cycled; eval mode."""
    model = build(LlamaConfig.from_name(LM["model"]), device, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LM["lr"], weight_decay=0.01)
    for step in range(steps or LM["steps"]):
        x, y = batches[step % len(batches)]
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def scores(model, ref, batches) -> dict[str, list[float]]:
    """Per held-out batch: perplexity exp(mean CE), and the logits' relative error ||z - z_ref|| / ||z_ref||."""
    out = {"ppl": [], "rel. error": []}
    for x, y in batches:
        z, z_ref = model(x), ref(x)
        out["ppl"].append(math.exp(torch.nn.functional.cross_entropy(z.flatten(0, 1), y.flatten()).item()))
        out["rel. error"].append(((z - z_ref).norm() / z_ref.norm()).item())
    return out


def outlier_table(model, calib) -> list[dict]:
    """Per smoothable input (the first consumer of each group), its channel absmax statistics."""
    groups = sq.llama_groups(model)
    stats = sq.act_absmax(model, calib, [cs[0] for _, cs in groups])
    return [{"input of": "/".join(c.rsplit(".", 1)[-1] for c in cs), "layer": cs[0].split(".")[1],
             **sq.outlier_stats(stats[cs[0]])} for _, cs in groups]


def outlier_features(model, batches) -> dict:
    """Dettmers et al.'s criterion (module constants) on the inputs of the attention (wq) and FFN
    expansion (w1) of every block: the hidden dimensions it flags, and over how many inputs it looked."""
    names = [cs[0] for _, cs in sq.llama_groups(model) if cs[0].endswith((".wq", ".w1"))]
    big, tokens = {}, {}

    def record(name, x):  # per channel: how many tokens reach the magnitude
        big[name] = big.get(name, 0) + (x.abs() >= MAGNITUDE).sum(0).float()
        tokens[name] = tokens.get(name, 0) + x.shape[0]

    sq.watch_inputs(model, batches, names, record)
    layers = torch.stack([big[n] / tokens[n] >= TOKEN_SHARE for n in names]).float().mean(0)  # (hidden,)
    return {"features": torch.nonzero(layers >= LAYER_SHARE).flatten().tolist(), "inputs": len(names),
            "tokens": tokens[names[0]]}


REAL = dict(batches=4, batch=4, seq_len=512)  # real_outliers' calibration: 8192 tokens of tokens.npy


def preflight(run) -> None:
    """Day 8's refusal before any work (`dlo.registry`): a weights_dir that is not a Hugging Face Llama
    folder with every tensor of its own config, or without data_dir's tokens.npy of that vocabulary
    (`real_outliers` reads both), one line each (CheckpointError and DataError are ValueErrors)."""
    from dlo.data.tokens import check_tokens
    from dlo.models.llama_hf import check_checkpoint, config_from_hf

    weights_dir = run.params.get("weights_dir", "")
    if not weights_dir:
        return
    cfg = config_from_hf(weights_dir)
    check_checkpoint(weights_dir, cfg, what="its own config.json")
    if run.data_dir is None:
        raise ValueError(f"weights_dir={weights_dir!r} needs data_dir holding tokens.npy made with its tokenizer "
                         "(`dlo data tokens`): the real outliers are measured on text")
    check_tokens(run.data_dir, cfg.vocab_size, REAL["seq_len"] + 2, model=f"the Llama of {weights_dir}")


def real_outliers(run) -> dict | None:
    """`outlier_features` of the released Llama of the run's weights_dir (a Hugging Face folder, e.g. Llama
    3.2 3B, loaded in bf16) on windows of its data_dir's tokens.npy, made with that model's tokenizer (both
    checked by `preflight`): the systematic outliers the injected case imitates, measured. None without a
    weights_dir. A 3B model wants a GPU (~6.4 GB of weights)."""
    from dlo.models.llama import Llama
    from dlo.models.llama_hf import config_from_hf, load_hf_weights

    weights_dir, data_dir, device = run.params.get("weights_dir", ""), run.data_dir, run.device
    if not weights_dir:
        return None
    cfg = config_from_hf(weights_dir)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    load_hf_weights(model, weights_dir, device)
    P = SimpleNamespace(batch_per_rank=REAL["batch"], seq_len=REAL["seq_len"])
    with torch.no_grad():
        found = outlier_features(model.eval(), token_batches(P, cfg, 0, device, data_dir, n=REAL["batches"]))
    return {**found, "model": f"{cfg.n_layers} layers, width {cfg.dim}"}


def variants(model, calib) -> dict[str, torch.nn.Module]:
    """Weight-only W8A16; W8A8 per-tensor without smoothing, per-token, and smoothed at each alpha."""
    out = {"W8A16 (weight-only)": sq.quantize_llama(model, calib, "w8a16"),
           "W8A8 per-tensor": sq.quantize_llama(model, calib),
           "W8A8 per-token (dynamic)": sq.quantize_llama(model, calib, act="token")}
    for a in ALPHAS:
        out[f"W8A8 SmoothQuant alpha={a}"] = sq.quantize_llama(sq.smooth_llama(model, calib, a), calib)
    return out


def run(seed: int, device, steps: int = 0) -> dict:
    """The whole experiment for one seed: the trained model (`steps`, default LM["steps"]), the outlier
    tables (as trained and with injected outliers), and per-batch scores of every variant on both."""
    d = data(seed, device)
    model = train_lm(d["train"], device, seed, steps)
    injected = copy.deepcopy(model)
    sq.inject_outliers_(injected, list(OUTLIER_CHANNELS), OUTLIER_FACTOR)
    res = {"seed": seed, "model": model, "outliers": outlier_table(model, d["calib"]),
           "outlier features": outlier_features(model, d["calib"]),
           "outliers injected": outlier_table(injected, d["calib"]), "scores": {}}
    for case, m in (("as trained", model), ("injected outliers", injected)):
        res["scores"][case] = {"fp32": scores(m, model, d["eval"])}
        for name, v in variants(m, d["calib"]).items():
            res["scores"][case][name] = scores(v, model, d["eval"])
    return res


def table(res: dict, case: str) -> list[dict]:
    """Mean over the held-out batches of each variant's perplexity and relative logit error."""
    return [{"variant": k, "ppl": sum(v["ppl"]) / len(v["ppl"]),
             "rel. logit error": sum(v["rel. error"]) / len(v["rel. error"])} for k, v in res["scores"][case].items()]


def _rel_ppl(res: dict, case: str, a: str, b: str = "fp32") -> E.Estimate:
    """ppl(a) / ppl(b) - 1 per held-out batch (paired: the same batch for both), t-interval."""
    s = res["scores"][case]
    return E.from_samples([x / y - 1 for x, y in zip(s[a]["ppl"], s[b]["ppl"])],
                          f"paired over {len(s[a]['ppl'])} held-out batches", "batches", "paired by batch")


def real_outlier_claim(found: dict | None) -> C.Claim:
    """The systematic outliers themselves, in a released model (`real_outliers`), or why not measured."""
    claim = "a released LLM has outlier features (the case the injection imitates)"
    source = "Dettmers et al. 2022 (LLM.int8()), Sec. 4; criterion of Sec. 4.1"
    region = C.at_least(1.0, ">= 1 feature")
    if found is None:
        return C.not_measurable(claim, source, "outlier features present",
                                "needs weights_dir (a released Llama, e.g. Llama 3.2 3B) and data_dir's tokens.npy "
                                "made with its tokenizer: the full profile on a GPU", region)
    return C.Claim(claim, source, "outlier features present", region,
                   E.exact(len(found["features"]), f"features flagged in {found['model']}, {found['inputs']} inputs, "
                                                    f"{found['tokens']} tokens"))


def _demo(claim: str, source: str, claimed: str, why: str, measured: E.Estimate, region: C.Region) -> C.Claim:
    """An injected-outlier row: shown with its number, never counted as evidence for the paper's claim."""
    return C.by_construction(claim, source, claimed, why, measured, region)


def claims(res: dict, real: dict | None = None) -> list[C.Claim]:
    """The SmoothQuant rows. The outlier count uses LLM.int8()'s own criterion (`outlier_features`); the
    released model's (`real_outliers`, None: not measured) is the evidence that outliers exist at scale.
    The injected case only demonstrates the mechanism: its rows are labelled so, never evidence (the
    injection was built to break per-tensor scales, and smoothing is scale-equivariant: every smoothed
    row is the same with and without it)."""
    best = f"W8A8 SmoothQuant alpha={0.5}"
    found = res["outlier features"]
    inj = f"injected ({len(OUTLIER_CHANNELS)} channels x{OUTLIER_FACTOR:g})"
    demo = "a demonstration of the mechanism, not evidence for the paper: the outliers were injected"
    same = ("holds by design: smoothing is scale-equivariant (X_j c and W_j / c give s_j c for every alpha), so "
            "the smoothed model, hence this row, is the same with and without the injection")
    return [
        C.Claim("a small model has no outlier features (they emerge with scale, at ~6.7B parameters)",
                "Dettmers et al. 2022 (LLM.int8()), Sec. 4; criterion of Sec. 4.1",
                "|x| >= 6 in >= 25% of layers and >= 6% of tokens: none", C.at_most(0.0, "features = 0"),
                E.exact(len(found["features"]), f"features flagged over {found['inputs']} inputs (wq, w1), "
                                                f"{found['tokens']} calibration tokens")),
        real_outlier_claim(real),
        C.Claim("without outliers, W8A8 per-tensor keeps the perplexity (within 1%)", "Dettmers et al. 2022; "
                "Xiao et al. 2023, Table 3 (small OPTs)", "<= +1% perplexity", C.at_most(0.01, "<= 0.01"),
                _rel_ppl(res, "as trained", "W8A8 per-tensor")),
        _demo(f"outliers ({inj}) break W8A8 per-tensor", "Xiao et al. 2023, Sec. 3; Dettmers et al. 2022",
              "perplexity rises (> +1%)", f"{demo} (60x channels set the one per-tensor scale)",
              _rel_ppl(res, "injected outliers", "W8A8 per-tensor"), C.at_least(0.01, "> 0.01")),
        _demo(f"per-token activation scales do not fix channel outliers: they lose more than smoothing ({inj})",
              "Xiao et al. 2023, Sec. 3", "per-token > smoothed perplexity",
              f"{demo} (every token carries the injected channels)",
              _rel_ppl(res, "injected outliers", "W8A8 per-token (dynamic)", best), C.at_least(0.0, "> 0")),
        _demo(f"SmoothQuant (alpha = 0.5) recovers what W8A8 per-tensor loses ({inj})", "Xiao et al. 2023, Table 3",
              "smoothed < naive perplexity", same, _rel_ppl(res, "injected outliers", "W8A8 per-tensor", best),
              C.at_least(0.0, "> 0")),
        _demo(f"SmoothQuant W8A8 matches the float model ({inj})", "Xiao et al. 2023, Table 3",
              "within 1% perplexity", same, _rel_ppl(res, "injected outliers", best), C.between(-0.01, 0.01)),
        C.Claim("SmoothQuant W8A8 matches the float model (as trained)", "Xiao et al. 2023, Table 3",
                "within 1% perplexity", C.between(-0.01, 0.01), _rel_ppl(res, "as trained", best)),
    ]
