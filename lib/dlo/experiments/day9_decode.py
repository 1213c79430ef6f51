"""Day 9's quantized decoding: the weight bytes one token reads in bf16 and in W4A16, how many programs the
split-K layout launches at one token against the GPU's SMs, the kernel against Day 8's reference, and (on a GPU)
torch bf16, Day 8's W4A16 kernel and the split-K kernel timed side by side, with their claims."""

from __future__ import annotations

import copy

import torch
import triton

from dlo.claims import Claim, approx, at_least, by_construction, not_measurable, timed
from dlo.estimates import formula, from_samples, median_interval
from dlo.inference.kv_cache import decode_step_times
from dlo.inference.w4a16 import linear_bytes, quantize_linears
from dlo.kernels.runtime import kernel_available, time_ms
from dlo.kernels.weight_only_decode import (
    LLAMA_LAYERS,
    blocks_for,
    decode_impls,
    pack_weight,
    split_k,
    w4a16_decode,
    w4a16_decode_ref,
)

LAYERS = {"1B": 16, "3B": 28}  # num_hidden_layers of Llama 3.2 1B and 3B (their config.json)
SRC = "Frantar et al. 2023 (GPTQ); Lin et al. 2024 (AWQ)"
TIMED = ("gate,up", "k,v")  # the widest and the narrowest projection: many output tiles, and few


def weight_bytes(K: int, N: int, G: int) -> dict[str, float]:
    """Bytes of one (N, K) weight read once: bf16 2 per weight; W4A16 half a byte and a 4-byte scale per G."""
    return {"bf16": 2.0 * N * K, "W4A16": N * K / 2 + 4.0 * N * (K // G)}


def weight_bytes_rows(model: str = "3B", G: int = 128) -> list[dict]:
    """Per projection kind of a Llama 3.2 layer, and for the whole model's linear layers: the MB a decoded
    token reads in bf16 and in W4A16 (embeddings and the output layer apart: they stay in bf16)."""
    rows, total = [], {"bf16": 0.0, "W4A16": 0.0}
    for kind, (K, N) in LLAMA_LAYERS[model].items():
        b = {k: v * len(kind.split(",")) for k, v in weight_bytes(K, N, G).items()}
        rows.append({"layer": kind, "K": K, "N": N, "bf16 MB": b["bf16"] / 1e6, "W4A16 MB": b["W4A16"] / 1e6,
                     "ratio": b["bf16"] / b["W4A16"]})
        total = {k: total[k] + LAYERS[model] * b[k] for k in total}
    rows.append({"layer": f"all {LAYERS[model]} layers", "K": "-", "N": "-", "bf16 MB": total["bf16"] / 1e6,
                 "W4A16 MB": total["W4A16"] / 1e6, "ratio": total["bf16"] / total["W4A16"]})
    return rows


def programs_rows(model: str = "3B", sms: int = 132, M: int = 1, G: int = 128) -> list[dict]:
    """Programs launched at M tokens for each projection: one per column tile walking all of K (split 1),
    against split-K's choice (`split_k`), each over the SM count."""
    _, block_n, block_k = blocks_for(M, G)
    rows = []
    for kind, (K, N) in LLAMA_LAYERS[model].items():
        tiles, split = triton.cdiv(N, block_n), split_k(N, K, sms, block_n, block_k)
        rows.append({"layer": kind, "K": K, "N": N, "BLOCK_N x BLOCK_K": f"{block_n} x {block_k}",
                     "programs, split 1": tiles, "per SM": tiles / sms, "split": split,
                     "programs, split-K": tiles * split, "per SM, split-K": tiles * split / sms})
    return rows


def _weights(K: int, N: int, G: int, device: torch.device, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(torch.bfloat16)
    packed, scale = pack_weight(w, G)
    return w.to(device), packed.to(device), scale.to(device)


def kernel_check(device: torch.device, seed: int = 0, M: int = 1, K: int = 256, N: int = 40, G: int = 32) -> dict:
    """The split-K kernel against Day 8's reference (dequantize, then matmul) where it can run (a GPU, or
    Triton's interpreter on a CPU); elsewhere the reference alone, and `ran` False."""
    w, packed, scale = _weights(K, N, G, device, seed)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch.bfloat16)
    ref = w4a16_decode_ref(x, packed, scale)
    out = {"shape": f"M={M} K={K} N={N} G={G}", "ran": kernel_available(device), "y_ref_max": ref.abs().max().item()}
    if out["ran"]:
        y = w4a16_decode(x, packed, scale)
        out["max_diff"] = (y.float() - ref.float()).abs().max().item()
    return out


def time_decode(device: torch.device, model: str = "3B", ms: tuple[int, ...] = (1, 4, 16), G: int = 128,
                rounds: int = 7, seed: int = 0) -> dict:
    """On a GPU: {(layer, M): {impl: [ms per round]}} for `decode_impls` on the TIMED projections, the three
    interleaved round by round (each round: triton's do_bench median, L2 flushed between calls)."""
    out = {}
    for kind in TIMED:
        K, N = LLAMA_LAYERS[model][kind]
        w, packed, scale = _weights(K, N, G, device, seed)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            calls, times = decode_impls(x, w, packed, scale), {}
            for _ in range(rounds):
                for name, fn in calls.items():
                    times.setdefault(name, []).append(time_ms(fn, device, warmup=5, rep=20))
            out[kind, M] = times
    return out


def timing_rows(times: dict) -> list[dict]:
    """Every timing: median ms with its interval per implementation, and bf16 / each, by layer and M."""
    rows = []
    for (kind, M), t in times.items():
        base = t["torch bf16"]
        for name, xs in t.items():
            rows.append({"layer": kind, "M": M, "impl": name, "ms [95%]": str(median_interval(xs)),
                         "bf16 / it [95%]": str(median_interval([b / x for b, x in zip(base, xs)]))})
    return rows


def decode_loop(target: torch.nn.Module, sequences: torch.Tensor, *, length: int, rounds: int, reps: int,
                impl: str | None = None) -> dict:
    """`target` (a trained Llama) against its copy with W4A16 projections (`quantize_linears`: the split-K kernel
    at decode where the kernels run, else Day 8's reference), both in bf16: top-1 agreement of their next-token
    predictions at every position of `sequences` (B, T) (teacher forcing, so one difference does not cascade),
    the projections' bytes, and on a GPU one decode step after `length` cached tokens, the two interleaved over
    `rounds` (each the median of `reps` steps). `impl`: W4A16Linear's, to choose it."""
    device = sequences.device
    dense = target if next(target.parameters()).dtype in (torch.bfloat16, torch.float16) else \
        copy.deepcopy(target).to(torch.bfloat16)
    impl = impl or ("kernel" if kernel_available(device) else "reference")
    quantized = quantize_linears(dense, impl=impl)
    with torch.no_grad():
        a, b = dense(sequences).float(), quantized(sequences).float()
    out = {"impl": impl, "agree": (a.argmax(-1) == b.argmax(-1)).float().mean(dim=1).tolist(),
           "logit_diff": ((a - b).abs().amax() / a.abs().amax()).item(), "bf16 bytes": linear_bytes(dense)["dense"],
           "W4A16 bytes": linear_bytes(quantized)["W4A16"]}
    if device.type == "cuda":
        steps = {"bf16": [], "W4A16": []}
        for _ in range(rounds):
            for name, model in (("bf16", dense), ("W4A16", quantized)):
                steps[name].append(decode_step_times(model, [length], reps=reps)[0].median_s)
        out["step_s"], out["length"] = steps, length
    return out


def decode_claims(times: dict | None, loop: dict, device: str, model: str = "3B", G: int = 128) -> list[Claim]:
    """times: `time_decode`'s, or None where there is no GPU (the timed claims are then "not measurable here");
    loop: `decode_loop`'s."""
    K, N = LLAMA_LAYERS[model]["gate,up"]
    b = weight_bytes(K, N, G)
    bytes_ratio = b["bf16"] / b["W4A16"]
    where = f"Llama 3.2 {model} gate/up ({K} -> {N}), one token"
    rows = [by_construction("W4A16 reads ~4x fewer weight bytes than bf16", SRC, "3-4x less memory traffic",
                            f"counted: 2 B a weight against 1/2 + 4/G at G = {G}",
                            formula(bytes_ratio, "bf16 bytes / W4A16 bytes"))]
    faster = ("W4A16 at one token is faster than bf16 (split-K layout)", SRC, "weight-only int4 speeds up decoding")
    bytes_claim = ("W4A16 at one token is as much faster as its bytes are fewer", "memory-bound: time = bytes / "
                   "bandwidth", f"{bytes_ratio:.2f}x (the bytes' ratio)")
    step_claim = ("W4A16 projections speed up a whole decode step", SRC, "weight-only int4 speeds up decoding")
    rows.append(Claim("W4A16 keeps the model's next-token choice", SRC, "int4 with groups of 128 loses little",
                      at_least(0.9, ">= 90% of positions"),
                      from_samples(loop["agree"], "top-1 agreement with the bf16 model, teacher-forced, per sequence",
                                   "sequences")))
    why = "a GPU's HBM against its SMs: on a CPU the kernel only runs in Triton's interpreter (numpy)"
    if "step_s" in loop:
        s = loop["step_s"]
        rows.append(Claim(*step_claim, at_least(1.0), timed(median_interval(
            [x / y for x, y in zip(s["bf16"], s["W4A16"])], f"bf16 / W4A16 decode step after {loop['length']} "
            "tokens, per interleaved round"), device=device, gpu_claim=True)))
    else:
        rows.append(not_measurable(*step_claim, why, at_least(1.0)))
    if times is None:
        return rows + [not_measurable(*faster, why, at_least(1.0)), not_measurable(*bytes_claim, why)]
    t = times["gate,up", 1]

    def speedup(name):
        return timed(median_interval([x / y for x, y in zip(t["torch bf16"], t[name])],
                                     f"bf16 / {name} per interleaved round, {where}"), device=device, gpu_claim=True)
    return rows + [Claim(*faster, at_least(1.0), speedup("W4A16 split-K"),
                         control=speedup("W4A16 Day 8 (GEMM tiles)")),
                   Claim(*bytes_claim, approx(bytes_ratio, rel=0.25), speedup("W4A16 split-K"))]


__all__ = ["decode_claims", "decode_loop", "kernel_check", "programs_rows", "time_decode", "timing_rows",
           "weight_bytes_rows"]
