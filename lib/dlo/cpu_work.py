"""What a day's notebook asks of the CPU at a preset, counted from the preset (issue 32).

At the full profile the heavy work belongs on the GPU; what stays on the CPU must be small or there on
purpose. `cpu_work(day, preset)` lists, per day, every part that computes on real CPU tensors or moves
bytes through the CPU in the notebook's own process (or in CPU ranks), whatever the device:

- "flops": matmul FLOPs (FlopCounterMode's convention: 2 per multiply-add; attention's products
  counted in full) or, for an optimizer step on the host, 12 per parameter and step (AdamW's
  elementwise arithmetic, which no FLOP counter sees);
- "bytes": bytes through a codec or to disk (JPEG encoding and decoding, `torch.save` of checkpoints).

Not listed, because they cost the CPU nothing of the profile's size: what runs on the GPU, what runs
on the meta device or on fake tensors (`dlo plan`, Day 5's memory table, Day 6's block costs), and the
graded checks, whose sizes do not depend on the profile. `BUDGET` is what no day may exceed: a part
that grows with the model (the memory table that ran 20 fp32 passes of Llama 3.2 1B at 8192 tokens on
the CPU, 1.7e15 FLOP) fails `tests/test_cpu_work.py` instead of a student's cell timeout.
"""

from __future__ import annotations

# per day, at most: ~20 s of one core's matmuls at 50 GFLOP/s; ~20 s of JPEG or torch.save at 1 GB/s
BUDGET = {"flops": 1e12, "bytes": 2e10}
ADAMW_FLOPS = 12  # per parameter and step: two moment updates, the square root, the division, the decay


def _llama_training_flops(cfg, tokens: int) -> float:
    """FLOPs of one forward and backward of `tokens` tokens in one sequence (6N + 12 l h s per token)."""
    import torch

    from dlo.accounting import matmul_params
    from dlo.measure import transformer_flops_per_token
    from dlo.models.llama import Llama

    with torch.device("meta"):
        n = matmul_params(Llama(cfg))
    return tokens * transformer_flops_per_token(n, cfg.n_layers, cfg.dim, tokens)


def day1(P) -> dict:
    """The data-pipeline profile: `n` images encoded to JPEG at P.jpeg_size once, then decoded by each
    of its three pipelines (per sample, once up front, in two workers)."""
    n = P.small_batch * (P.profile_steps + 2)
    return {"flops": {}, "bytes": {"JPEG encode + 3 decodes (data pipeline profile)": 4 * n * 3 * P.jpeg_size ** 2}}


def day3(P) -> dict:
    """The offloaded AdamW (its step on the host, P.offload_steps steps), the exact-resume runs'
    checkpoints (model, AdamW's two moments: 12 bytes per parameter; the uninterrupted run, job 1 up
    to the preemption, job 2 from its last checkpoint) and the SIGKILL demo's payloads (>= 3 written)."""
    import torch

    from dlo.experiments.day3 import build_model
    from dlo.models import count_parameters

    with torch.device("meta"):
        n = count_parameters(build_model(P))
    every = P.save_every
    resumed = P.interrupt_at // every * every
    saves = P.max_steps // every + P.interrupt_at // every + P.max_steps // every - resumed // every
    return {"flops": {"offloaded AdamW steps on the host": ADAMW_FLOPS * n * P.offload_steps},
            "bytes": {f"resume: {saves} checkpoints written": saves * 12 * n,
                      "SIGKILL demo payloads": 3 * 4 * P.big_numel}}


def day5(P) -> dict:
    """The `fully_shard` variants (`day5_reshard`: 6 at 8 ranks) and the HSDP layouts (`day5_hsdp`: 2),
    each two fp32 forward + backward passes of P.compare_model cut to 4 blocks, 16 tokens, as rank 0 of
    a fake process group (the gathered blocks computed in full). The memory table (`day5.memory_vs_world`)
    runs on fake tensors: nothing."""
    from dataclasses import replace

    from dlo.experiments.day5_data import llama_config
    from dlo.experiments.day5_reshard import BLOCKS, TOKENS, variants

    cfg = replace(llama_config(P, "compare_model"), n_layers=BLOCKS)
    world = 8  # the notebook's reshard cell plans the full preset's 8 ranks; HSDP 2 nodes x 4
    step = _llama_training_flops(cfg, TOKENS)
    return {"flops": {f"reshard/prefetch: {len(variants(world))} variants x 2 passes": len(variants(world)) * 2 * step,
                      "HSDP vs FSDP: 2 layouts x 2 passes": 2 * 2 * step,
                      "memory table (fake tensors)": 0},
            "bytes": {}}


def _nothing(P) -> dict:
    """Everything of the profile's size runs on the GPU (or on meta / fake tensors)."""
    return {"flops": {}, "bytes": {}}


WORK = {"day1_optimizers": day1, "day2_mixed_precision": _nothing, "day3_checkpointing": day3, "day4_ddp": _nothing,
        "day5_fsdp": day5, "day6_pipeline": _nothing, "day7_tensor_parallel": _nothing,
        "day8_quantization_pruning": _nothing, "day9_inference": _nothing, "day10_context_experts": _nothing,
        "day11_learning_faster": _nothing}


def cpu_work(day: str, preset) -> dict:
    """{"flops": {part: FLOPs}, "bytes": {part: bytes}} the day's notebook asks of the CPU at `preset`."""
    if day not in WORK:
        raise ValueError(f"no CPU inventory for {day!r}; days: {', '.join(WORK)}")
    return WORK[day](preset)


def over_budget(day: str, preset) -> list[str]:
    """The kinds ("flops", "bytes") whose total exceeds `BUDGET`, each as one line."""
    work = cpu_work(day, preset)
    return [f"{day}: {kind} {sum(parts.values()):.3g} > {BUDGET[kind]:.3g} ({parts})" for kind, parts in work.items()
            if sum(parts.values()) > BUDGET[kind]]
