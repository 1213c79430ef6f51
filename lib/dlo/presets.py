"""Per-day presets: one instance per day and profile.

`tiny` fits a 2-core CPU in about a minute; `full` is the real scale on GPU nodes.
Notebooks never hold these numbers: they call `dlo.setup(day, profile=...)`. `DAYn` maps a profile
to Day n's preset; `dlo.registry` (the one list of days) names it for its day. The classes (their
fields, `validate` and `smoke`) live in `presets_local` (one-process days) and `presets_distributed`
(days that launch ranks).

`dlo.presets` is the one public import path of the preset classes (`from dlo.presets import
Day4Preset`): the tests and the library (`dlo.registry`) import them from here, never from the two
modules that define them (they import dlo only inside `validate`: this re-export makes no cycle). Notebooks
name no preset class: they get their day's instance as `run.preset` from `dlo.setup`.
"""

from __future__ import annotations

from dlo.presets_distributed import Day4Preset, Day5Preset, Day6Preset, Day7Preset, Day10Preset
from dlo.presets_local import Day1Preset, Day2Preset, Day3Preset, Day8Preset, Day9Preset
from dlo.presets_tuning import Day11Preset

__all__ = ["DAY1", "DAY2", "DAY3", "DAY4", "DAY5", "DAY6", "DAY7", "DAY8", "DAY9", "DAY10", "DAY11", "Day1Preset",
           "Day2Preset", "Day3Preset", "Day4Preset", "Day5Preset", "Day6Preset", "Day7Preset", "Day8Preset",
           "Day9Preset", "Day10Preset", "Day11Preset"]


DAY1: dict[str, Day1Preset] = {  # day1_optimizers
    "tiny": Day1Preset(),
    # 10 epochs of 50k images: 3910 steps at batch 128, 122 at batch 4096 (k = 32)
    "full": Day1Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, small_batch=128,
                       large_batch=4096, max_steps=3910, warmup_steps=391, sgd_lr=0.1, adamw_lr=3e-3,
                       lamb_lr=2e-2, lr_finder_steps=200, bench_numel=1 << 26, profile_steps=10,
                       bn_samples=8192),
}


DAY2: dict[str, Day2Preset] = {  # day2_mixed_precision
    "tiny": Day2Preset(),
    # 12 layers, d_model 768, untied 50257-token embedding and head: ~160M parameters, near the
    # 155M model of the seed's float32 vs bfloat16 case study.
    "full": Day2Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, batch_size=256, max_steps=1500,
                       lr=2e-3, growth_interval=2000, lm_vocab=50257, lm_d_model=768, lm_layers=12,
                       lm_heads=12, lm_seq=1024, lm_batch=16, measure_steps=10, seeds=3, demo_steps=200,
                       attn_lengths=(1024, 2048, 4096, 8192), attn_heads=12, attn_head_dim=64),
}


DAY3: dict[str, Day3Preset] = {  # day3_checkpointing
    "tiny": Day3Preset(),
    # the seed's case study: a 12-layer, 155M-parameter GPT-2-size transformer
    "full": Day3Preset(vocab=50257, d_model=768, n_heads=12, n_layers=12, seq_len=1024, batch_size=8,
                       measure_reps=10, max_steps=100, interrupt_at=45, save_every=25, keep_last=3,
                       big_numel=1 << 27),
}


DAY4: dict[str, Day4Preset] = {  # day4_ddp
    "tiny": Day4Preset(),
    # 4 GPUs over NCCL, messages up to 256 MB, ResNet-18 on 224x224 images (the DDP paper's benchmark
    # family); the compression runs use it too, the BatchNorm experiment a wide MLP
    "full": Day4Preset(world_size=4, scaling_world_sizes=(1, 2, 4), msg_sizes=tuple(1 << k for k in range(10, 29, 2)),
                       bw_reps=10, bw_trials=10, model="resnet18", image_size=224, width=64, d_in=1024, hidden=1024,
                       layers=4, batch_per_rank=64, max_steps=30,
                       bucket_cap_mb=25.0, powersgd_rank=4, compress_steps=200, bn_batch=4, bn_steps=500,
                       onebit_steps=300, onebit_warmup=60, launch_timeout_s=3600.0),
}


DAY5: dict[str, Day5Preset] = {  # day5_fsdp
    "tiny": Day5Preset(),
    # Llama 3.2 3B with FSDP2 + bf16 + activation checkpointing + compile on 8 GPUs, one 8192-token
    # sequence per GPU (torchtitan's Llama recipe); the engine comparison on the 1B in fp32 at 2048 tokens
    # (DDP's 18.4 GiB of model state and every activation: 27 GiB, a 40 GB A100 at any world size; `dlo plan`)
    "full": Day5Preset(world_size=8, model="llama3.2-3b", compare_model="llama3.2-1b", seq_len=8192,
                       compare_seq_len=2048, batch_per_rank=1,
                       max_steps=50, lr=3e-4, param_dtype="bfloat16", reduce_dtype="float32", ac_mode="full",
                       compile=True, bucket_cap_mb=25.0, timing_steps=10, memory_world_sizes=(1, 2, 4, 8),
                       launch_timeout_s=3600.0),
}


DAY6: dict[str, Day6Preset] = {  # day6_pipeline
    "tiny": Day6Preset(),
    # 4 GPUs: CoAtNet-3 at 224 x 224 (168M parameters) on 4 stages; the bubble sweep on 16 blocks
    # of its S3 stage (768 channels, 14 x 14 tokens)
    "full": Day6Preset(world_size=4, model="coatnet-3", image_size=224, micro_batch=8, m_values=(4, 8, 16, 32),
                       gantt_m=8, split_m=16, reps=5, warmup=2, stack_blocks=16, stack_width=768, stack_grid=14,
                       head_dim=32, plan_batch=640, launch_timeout_s=3600.0),
}


DAY7: dict[str, Day7Preset] = {  # day7_tensor_parallel
    "tiny": Day7Preset(),
    # one 8-GPU node: Llama 3.2 3B at t = 2, 4, 8 (its 8 KV heads bound t), Korthikanti et al.'s
    # GPT layer at h = 2048, a = 16, s = 2048; FSDP 2 x TP 4 for the 2D run
    "full": Day7Preset(world_size=8, degrees=(2, 4, 8), model="llama3.2-3b", model_overrides=(), batch=2,
                       seq_len=2048, max_steps=10, lr=0.01, gpt_dim=2048, gpt_heads=16, gpt_layers=2,
                       gpt_seq=2048, gpt_batch=1, fsdp_tp=(2, 4), launch_timeout_s=3600.0),
}


DAY8: dict[str, Day8Preset] = {  # day8_quantization_pruning
    "tiny": Day8Preset(),
    # real CIFAR-10 at 32x32 (3072 inputs), a wider MLP; the Llama-7B MLP block (4096 -> 11008) on GPU
    "full": Day8Preset(n_train=50_000, n_test=10_000, image_size=32, hidden=1024, student_hidden=256,
                       batch_size=256, max_steps=3000, finetune_steps=500, calib_batches=32,
                       llama_d_model=4096, llama_hidden=11008, llama_tokens=2048, seeds=3),
}


DAY10: dict[str, Day10Preset] = {  # day10_context_experts
    "tiny": Day10Preset(),
    # one 8-GPU node: Llama 3.2 3B's attention (24 heads of 128; Ulysses at N = 8 needs 8 | H: 24 heads do)
    # at 8k-32k tokens, an MoE of 8 experts top-2 at its width 3072 (experts of 2048: 4 x 3B's MLP total)
    "full": Day10Preset(world_size=8, batch=1, heads=24, head_dim=128, seq_lens=(8192, 16384, 32768),
                        work_seq=32768, timing_reps=10, moe_dim=3072, moe_hidden=2048, n_experts=8, top_k=2,
                        moe_tokens=8192, max_steps=500, aux_weight=0.01, lr=1e-3, launch_timeout_s=3600.0),
}


DAY9: dict[str, Day9Preset] = {  # day9_inference
    "tiny": Day9Preset(),
    # Llama 3.2 3B in bf16 on one GPU (lr 3e-4: AdamW on bf16 weights): decode timed to 8k cached tokens,
    # sequences of up to 8k tokens reserved vs used, 64 requests served, a 16k-block budget
    "full": Day9Preset(model="llama3.2-3b", dtype="bfloat16", train_steps=200, distill_steps=200, lr=3e-4,
                       decode_lengths=(512, 2048, 8000), reps=15, max_len=8192, n_sequences=32,
                       budget_tokens=262_144, n_requests=64, max_batch=32, num_blocks=16_384, spec_tokens=64,
                       spec_prompts=8),
}


DAY11: dict[str, Day11Preset] = {  # day11_learning_faster
    "tiny": Day11Preset(),
    # real CIFAR-10 at 32x32 (classes 0-4 pretrain, 5-9 transfer), SmallCNN of width 32; a study of 81 trials
    # (9 x 9 grid) of 2025 steps each as a SLURM array, ASHA's rungs 25, 75, 225, 675, 2025; BO 27 trials,
    # PBT 16 members exploiting every 225 steps (9 generations)
    "full": Day11Preset(image_size=32, width=32, batch_size=128, n_test=5000, n_pretrain=25_000, pretrain_steps=3000,
                        labelled=(100, 1000, 5000, 25_000), transfer_steps=1000, es_train=25_000, max_epochs=60,
                        patience=5, n_search_train=50_000, n_search_test=5000, trials=81, trial_steps=2025,
                        min_steps=25, eta=3, search_seeds=3, seeds=3, bayes_trials=27, bayes_init=5,
                        pbt_population=16, pbt_interval=225),
}
