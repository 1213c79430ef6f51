"""Day 2's claims tables and the sentences made from its numbers: the accuracy runs, the underflow demo
and the GPU speed table (`precision_claims`), fused attention and torch.compile (`kernel_claims`), FLOPs,
bytes per parameter and MFU (`flops_claims`); the runners that make the numbers are `dlo.experiments.day2`.
"""

from __future__ import annotations

import torch

from dlo import claims as C
from dlo import estimates as E

LIPPE, MICIK, KALAM = "Lippe 2024 (case study)", "Micikevicius et al. 2018", "Kalamkar et al. 2019"
# the speed-up's baselines: plain fp32 matmuls, and TF32 (fp32 storage, tensor-core matmuls), the fair fp32 on Ampere+
SPEED_BASES = {"fp32": "fp32 without TF32", "tf32": "fp32 with TF32 matmuls"}


def demo_summary(demo: dict) -> str:
    """The underflow demo in words generated from its numbers (means over seeds), so the text says what
    this run showed: fp16's share of zero gradient entries against fp32's (the ReLUs' own zeros), and
    each run's final loss against fp32's (nan: it diverged)."""
    def mean(xs):
        return sum(xs) / len(xs)
    zero = {k: mean([mean(h["zero_grads"]) for h in hs]) for k, hs in demo.items()}
    loss = {k: mean([h["loss"][-1] for h in hs]) for k, hs in demo.items()}

    def final(k):
        return "nan: it diverged" if loss[k] != loss[k] else f"{loss[k]:.3g}, {loss[k] / loss['fp32']:.2f}x fp32's"
    return (f"fp16 without a scaler: {zero['fp16']:.0%} of the gradient entries were 0, averaged over its steps (fp32: "
            f"{zero['fp32']:.0%}); final loss {final('fp16')}. With the scaler: final loss {final('fp16 + scaler')}. "
            f"bf16: {final('bf16')}. fp32: {loss['fp32']:.3g} (means over {len(demo['fp32'])} seeds).")


def accuracy_gap(a: list[float], b: list[float], n_test: int) -> E.Estimate:
    """Accuracy a - b on the same n_test images, paired by seed (training noise included); fewer than
    3 seeds give no interval (dlo.estimates rule 2)."""
    if len(a) != len(b):
        raise ValueError(f"pair the runs by seed: {len(a)} vs {len(b)} accuracies")
    return E.paired_difference(a, b, f"paired over {len(a)} seeds, {n_test} test images")


def precision_claims(act_ratio: dict, accs: dict, n_test: int, demo: dict | None = None, speed: dict | None = None,
                     tol: float = 0.05) -> list[C.Claim]:
    """The claims table of the day. act_ratio: {"TinyLM", "SmallCNN"} -> bf16/fp32 saved bytes;
    accs: {"fp32", "bf16"} -> accuracies per seed; demo: {"fp32", "bf16", "fp16", "fp16 + scaler"} ->
    accuracies per seed, plus "skipped" -> skipped steps per seed of the scaled run; speed (GPU):
    {"fp32", "bf16", "tf32"} -> {"timing": Timing, "peak_bytes"} of the TinyLM step (the speed-up is judged
    against fp32 and, where given, TF32). `tol`: accuracy points."""
    within = C.between(-tol, tol, f"gap within +-{tol:.0%}")
    rows = [C.Claim(f"activations 50% smaller in bf16 ({m})", LIPPE, "50% smaller", C.approx(0.5, abs_tol=0.05),
                    E.exact(act_ratio[m], "saved bytes bf16 / fp32, counted")) for m in ("TinyLM", "SmallCNN")]
    rows.append(C.Claim("equivalent accuracy, bf16 vs fp32 (SmallCNN)", LIPPE, "equivalent performance", within,
                        accuracy_gap(accs["bf16"], accs["fp32"], n_test)))
    if demo is not None:
        rows += [
            C.Claim("small gradients: fp16 without loss scaling trains worse", MICIK, "gradients flush to zero",
                    C.at_most(0.0, "gap < 0"), accuracy_gap(demo["fp16"], demo["fp32"], n_test)),
            C.Claim("small gradients: loss scaling recovers fp32 accuracy", MICIK, "matches fp32", within,
                    accuracy_gap(demo["fp16 + scaler"], demo["fp32"], n_test)),
            C.Claim("small gradients: bf16 needs no loss scaling", KALAM, "fp32's range", within,
                    accuracy_gap(demo["bf16"], demo["fp32"], n_test)),
            C.by_construction("dynamic scaling skips overflowing steps and backs off", MICIK, "skip, S x 0.5",
                              "the demo's scaler starts at 2^40 on purpose: its first fp16 gradients overflow "
                              "whatever the model (the skips shown, fewest over seeds)",
                              E.exact(min(demo["skipped"]), "skipped steps"), C.at_least(1.0, ">= 1 skip")),
        ]
    if speed is not None:
        f32, b16 = speed["fp32"], speed["bf16"]
        rows += [
            C.Claim("30% memory reduction (20.6 -> 14.6 GB)", LIPPE, "30% less", C.approx(0.30, abs_tol=0.1),
                    E.exact(1 - b16["peak_bytes"] / f32["peak_bytes"], "1 - peak bf16 / peak fp32 (CUDA allocator)")),
        ]
        for base in ("fp32", "tf32"):  # fp32 without TF32 flatters bf16; TF32 is fp32's fair baseline on Ampere+
            if base in speed:
                rows.append(C.Claim(f"2x speed-up (2.1 -> 1.1 s/step), against {SPEED_BASES[base]}", LIPPE, "2x",
                                    C.approx(2.0, rel=0.25),
                                    C.timed(E.ratio(speed[base]["timing"].estimate(), b16["timing"].estimate(),
                                                    how=f"{base} / bf16, ratio of median steps"),
                                            device="cuda", gpu_claim=True)))
    else:
        why = "no GPU: CPU bf16 kernels say nothing about tensor cores or the CUDA allocator"
        rows += [C.not_measurable("30% memory reduction (20.6 -> 14.6 GB)", LIPPE, "30% less", why)]
        rows += [C.not_measurable(f"2x speed-up (2.1 -> 1.1 s/step), against {SPEED_BASES[b]}", LIPPE, "2x", why)
                 for b in SPEED_BASES]
    return rows


def kernel_claims(attn_rows: list[dict], compiled: dict, on_gpu: bool) -> list[C.Claim]:
    """Fused attention and torch.compile: attn_rows from dlo.attention.attention_costs, compiled from
    dlo.attention.compile_speedup. Memory exponents are exact counts; times have their intervals."""
    from dlo.attention import loglog_slope

    dao = "Dao et al. 2022 (FlashAttention)"
    by = {impl: [r for r in attn_rows if r["impl"] == impl] for impl in ("naive", "sdpa")}
    slope = {impl: loglog_slope([r["T"] for r in rs], [r["saved_bytes"] for r in rs]) for impl, rs in by.items()}
    rows = [C.Claim("fused attention saves memory linear in T", dao, "O(T), not O(T^2)", C.approx(1.0, abs_tol=0.1),
                    E.exact(slope["sdpa"], "exponent of saved bytes vs T, last two lengths")),
            C.Claim("naive attention keeps the T x T scores", dao, "O(T^2)", C.approx(2.0, abs_tol=0.1),
                    E.exact(slope["naive"], "exponent of saved bytes vs T, last two lengths"))]
    if on_gpu:
        naive, fused = by["naive"][-1]["timing"].estimate(), by["sdpa"][-1]["timing"].estimate()
        rows.append(C.Claim(f"fused attention ~3x faster (T={by['sdpa'][-1]['T']})", LIPPE, "3x over eager",
                            C.approx(3.0, rel=0.5), C.timed(E.ratio(naive, fused, how="ratio of median fwd+bwd"),
                                                            device="cuda", gpu_claim=True)))
    else:
        rows.append(C.not_measurable("fused attention ~3x faster", LIPPE, "3x over eager", "a GPU claim (HBM traffic "
                                     "saved); the CPU times above are shown for information"))
    if "error" in compiled:
        rows.append(C.not_measurable("compiling fuses pointwise ops: faster", LIPPE, "fewer kernel calls",
                                     f"torch.compile failed here: {compiled['error']}"))
        return rows
    speedup = E.ratio(compiled["eager"].estimate(), compiled["compiled"].estimate(),
                      how=f"eager / compiled, medians of {compiled['eager'].n} interleaved calls")
    shape = " x ".join(map(str, compiled["shape"])) if "shape" in compiled else "its input"
    rows.append(C.Claim(f"compiling fuses pointwise ops: faster ({shape})", LIPPE, "fewer kernel calls",
                        C.at_least(1.0, "> 1x"),
                        C.timed(speedup, device="cuda" if on_gpu else "cpu", gpu_claim=True,
                                threads=torch.get_num_threads())))
    if "eager_kernels" in compiled:  # the CPU-measurable part: launches per call, counted
        e, c = compiled["eager_kernels"], compiled["compiled_kernels"]
        rows.append(C.Claim("compiling fuses pointwise ops: fewer kernel launches", LIPPE, "fewer kernel calls",
                            C.at_most(0.5, "<= half"), E.exact(c / e, f"{c} compiled / {e} eager launches per call, "
                                                                       "counted")))
    return rows


def flops_claims(counted: float, formula: float, held_per_param: float, mfu=None,
                 zero_split: float | None = None) -> list[C.Claim]:
    """FLOPs per token counted by FlopCounterMode vs 6N + 12 l h s; model-state bytes per parameter
    measured by the allocator after a bf16-autocast AdamW step (`held_per_param`) vs 16; ZeRO's
    2 + 2 + 4 + 8 split as `mixed_precision_bytes` builds it (`zero_split`: by construction); and
    MFU (an E.Estimate on a GPU with a known peak, else None)."""
    rows = [C.Claim("training FLOPs per token = 6N + 12 l h s", "6N: Kaplan et al. 2020, Sec. 2.1; 12 l h s: "
                    "PaLM app. B (Kaplan: 6 l h s)", "6N + 12 l h s", C.approx(1.0, rel=0.02),
                    E.exact(counted / formula, "FlopCounterMode count / formula")),
            C.Claim("16 bytes per parameter (mixed-precision AdamW, torch.autocast)", "Lippe 2024", "16 B",
                    C.approx(16.0, rel=0.02),
                    E.exact(held_per_param, "parameters + what a bf16-autocast torch AdamW step leaves allocated "
                            "(allocator), / parameters"))]
    if zero_split is not None:
        rows.append(C.by_construction(
            "16 = 2 + 2 + 4 + 8: bf16 weights and gradients, fp32 master and moments", "ZeRO (Rajbhandari et al. "
            "2020), Sec. 3.1", "16 B", "day2.mixed_precision_bytes builds exactly these four copies and counts "
            "them: it shows the split, it cannot disagree", E.exact(zero_split, "bytes held / parameters")))
    megatron = "Megatron-LM (41-49%) / Nemotron (41-42%), seeds 000, 004"
    if mfu is None:
        rows.append(C.not_measurable("MFU of a well-tuned large-model run", megatron, "41-49%",
                                     "no known peak FLOP/s here (CPU): the achieved GFLOP/s are shown instead"))
    else:
        rows.append(C.Claim("MFU of a well-tuned large-model run", megatron, "41-49%", C.at_least(0.3, ">= 30%"),
                            C.timed(mfu, device="cuda", gpu_claim=True)))
    return rows
