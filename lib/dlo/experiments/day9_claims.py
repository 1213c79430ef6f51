"""Day 9's claims tables: the seeds' and the papers' statements about serving, against what the notebook
measured (`dlo.claims`: a verdict only from an interval, a control that can fail, a GPU claim only on a GPU).

`results` is the dict the notebook fills, section by section (keys named where each table reads them).
"""

from __future__ import annotations

import statistics

from dlo.claims import Claim, approx, at_least, at_most, between, by_construction, timed
from dlo.estimates import exact, formula, from_samples, median_interval, self_reported
from dlo.inference.speculative import expected_speedup, expected_tokens_per_round

SEED_KV = "seed 000 (KV Caching); Pope et al. 2022"
SEED_VLLM = "seed 001 (vLLM)"
VLLM = "Kwon et al. 2023 (vLLM), Sec. 3, Fig. 2"
ORCA = "Yu et al. 2022 (Orca); Kwon et al. 2023, Sec. 4.5"
SPEC = "Leviathan et al. 2023"


def cache_claims(kv: dict, equality: dict, steps: dict, device: str, tol: float = 1e-5) -> list[Claim]:
    """kv: `kv_rows`' row of Llama 3.2 3B; equality: `cache_equality`; steps: `interleaved_steps`; tol: the
    relative difference the served dtype allows (1e-5 in fp32; bf16's rounding, 2^-8, sums over 28 layers)."""
    (n0, nc0), (n1, nc1), (_, c1) = steps.items()

    def per_round(xs, ys, how):  # the median of the rounds' ratios, with its order-statistics interval
        return timed(median_interval([x / y for x, y in zip(xs, ys)], f"{how}, median over {len(xs)} interleaved "
                                     "rounds"), device=device)
    return [
        by_construction("the cache holds 2 x layers x KV heads x head dim x bytes per token", SEED_KV,
                        "2 x 28 x 8 x 128 x 2 B = 112 KiB (Llama 3.2 3B, bf16)",
                        "a cache's tensors are shaped from those very factors (KVCache on the meta device)",
                        exact(kv["tensors B/token"], "bytes per token of the cache's tensors")),
        by_construction("grouped-query attention divides the cache by H / Hkv", "Ainslie et al. 2023",
                        "8 KV heads of 24: 3x smaller", "the ratio of two bytes-per-token formulas",
                        formula(kv["no GQA B/token"] / kv["formula B/token"], "no-GQA / GQA bytes per token")),
        by_construction("at 128k tokens one sequence's cache outweighs the weights", SEED_VLLM,
                        "the cache is 'extremely memory-consuming'",
                        "arithmetic from the config: 128k x 112 KiB against 3.2B parameters x 2 B",
                        formula(kv["cache GB at 128k"] / kv["weights GB"], "cache at 128k / weights")),
        Claim("decoding with the cache gives the model's own logits", SEED_KV, "the same output, less work",
              at_most(tol, f"relative max |diff| <= {tol:g}"),
              exact(equality["max_diff"], "max |logits with cache - the model's forward over the whole sequence| / "
                    "max |logit|"),
              control=exact(equality["control_diff"], "each new token alone, without its context")),
        Claim("without the cache a decode step's time grows with the prefix", SEED_KV,
              "it recomputes all t tokens: O(t) per layer's projections, O(t^2) attention", at_least(1.5),
              per_round(nc1, nc0, f"step time {n1} / {n0}")),
        Claim("with the cache a step at a long prefix costs less than recomputing the prefix", SEED_KV,
              "only the new token goes through the model", at_least(1.0),
              per_round(nc1, c1, f"step time {n1} / with the cache")),
    ]


def paging_claims(reservations: list[dict], fits: list[dict], sharing: dict, block_size: int) -> list[Claim]:
    """reservations: `measured_reservation` per seed; fits: `budget_batches` per seed; sharing: `prefix_sharing`."""
    waste = {kind: [1 - r[f"{kind}_written"] / r[f"{kind}_reserved"] for r in reservations]
             for kind in ("contiguous", "paged")}
    how = "1 - written / reserved token slots, counted in the cache tensors after a prefill, over {n} draws"
    return [
        Claim("a contiguous cache reserved at max length wastes most of its memory", VLLM,
              "60-80% of the KV cache wasted (20.4-38.2% used)", between(0.6, 0.8),
              from_samples(waste["contiguous"], how.format(n=len(reservations)), "draws")),
        Claim("paging wastes under 4%", VLLM, "< 4% (the last block's empty slots only)", at_most(0.04),
              from_samples(waste["paged"], how.format(n=len(reservations)), "draws")),
        by_construction("paging fits a larger batch in the same memory", f"{SEED_VLLM}; {VLLM}",
                        "'larger batches'; 2-4x the throughput",
                        f"arithmetic of the lengths: budget // max_len against the sequences whose {block_size}-token "
                        "blocks fit", formula(statistics.mean(f["paged"] / f["contiguous"] for f in fits),
                                              "paged / contiguous batch")),
        by_construction("parallel samples share their prompt's blocks", "Kwon et al. 2023, Sec. 4.4 and 6.3",
                        "6.1-9.8% of the memory saved in parallel sampling, 37.6-55.2% in beam search",
                        "fork shares every block of the prompt: the manager's own count",
                        self_reported(sharing["blocks_saved"], "blocks saved (the block manager's count)")),
    ]


def batching_claims(runs: list[dict], controls: list[dict], device: str) -> list[Claim]:
    """runs / controls: `day9_serving.batching` per trace seed (random / equal answer lengths). Rows with a
    control come after one without: `claims_table` takes its columns from the first row."""
    def forwards(rs):
        return [r["static"]["forwards"] / r["continuous"]["forwards"] for r in rs]
    tps = [r["continuous"]["summary"]["tokens_per_s"] / r["static"]["summary"]["tokens_per_s"] for r in runs]
    how = "static / continuous forwards of the model (a hook on its output layer), over {n} traces"
    return [
        Claim("continuous batching raises throughput (tokens/s)", ORCA,
              "Orca up to 36.9x; vLLM 2-4x over FasterTransformer and Orca",
              at_least(1.0), timed(from_samples(tps, "continuous / static tokens per second", "traces"),
                                   device=device, gpu_claim=True)),
        Claim("iteration-level scheduling serves a trace in fewer model forwards", ORCA,
              "no sequence waits for the batch's longest; new ones join at once", at_least(1.1),
              from_samples(forwards(runs), how.format(n=len(runs)), "traces"),
              control=from_samples(forwards(controls), "the same with every answer 24 tokens long", "traces")),
    ]


def speculative_claims(alpha: list[float], alpha_control: list[float], runs: list[dict], k: int, c: float,
                       speedups: list[float], device: str) -> list[Claim]:
    """alpha: `acceptance` of the distilled draft, per held-out sequence; alpha_control: the untrained
    draft's; runs: `speculative_runs` (distilled draft); c: `draft_cost`'s; speedups: plain / speculative
    generation time per prompt."""
    a = statistics.mean(alpha)
    expected = expected_tokens_per_round(a, k)
    return [
        Claim("a round emits (1 - alpha^(k+1)) / (1 - alpha) tokens per target pass", f"{SPEC}, Eq. 1",
              f"{expected:.2f} at alpha={a:.2f}, k={k}", approx(expected, rel=0.2),
              from_samples([r["tokens_per_pass"] for r in runs], "tokens / target forwards (a hook), per prompt",
                           "prompts")),
        Claim("a draft distilled from the target is accepted often", f"{SPEC}, Table 3; Zhou et al. 2024 (DistillSpec)",
              "alpha 0.5-0.9 for drafts that imitate the target", at_least(0.5),
              from_samples(alpha, "mean over positions of sum min(p, q), per held-out sequence", "sequences"),
              control=from_samples(alpha_control, "an untrained draft of the same size", "sequences")),
        by_construction("expected speed-up (1 - alpha^(k+1)) / ((1 - alpha)(c k + 1))", f"{SPEC}, Theorem 3.8",
                        "2-3x for T5-XXL", f"the formula at the measured alpha and c = {c:.2f} (this device's draft "
                        "forward / target forward)", formula(expected_speedup(a, k, c), "expected speed-up")),
        Claim("speculative decoding is faster than the target alone", SPEC, "2-3x (T5-XXL on a TPU)", at_least(1.0),
              timed(from_samples(speedups, "plain / speculative generation time, per prompt", "prompts"), device=device,
                    gpu_claim=True)),
    ]


__all__ = ["batching_claims", "cache_claims", "paging_claims", "speculative_claims"]

