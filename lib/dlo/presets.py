"""Per-day presets: one frozen dataclass per day, one instance per profile.

`tiny` fits a 2-core CPU in about a minute; `full` is the real scale on GPU nodes.
Notebooks never hold these numbers: they call `dlo.setup(day, profile=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Day1Preset:
    """Day 1 (optimizers and LR schedules). Defaults are the `tiny` scale: synthetic 16x16 images."""

    n_train: int = 2048            # training images
    n_test: int = 512              # held-out images for eval_acc
    image_size: int = 16           # 32 is CIFAR-10's size; smaller keeps the CPU profile fast
    width: int = 16                # SmallCNN base width (about 100k params at 16, 1.6M at 64)
    small_batch: int = 32
    large_batch: int = 256         # the "large batch" regime where LAMB and warmup matter
    max_steps: int = 50            # optimizer steps of each training run
    warmup_steps: int = 5
    sgd_lr: float = 0.1            # SGD with momentum 0.9
    adamw_lr: float = 5e-3
    lamb_lr: float = 3e-2          # relative to each layer's weight norm (trust ratio), hence larger
    momentum: float = 0.9
    sgd_weight_decay: float = 5e-4  # coupled (added to the gradient)
    adamw_weight_decay: float = 0.05  # decoupled (applied to the weights)
    lamb_weight_decay: float = 0.01
    clip: float = 1.0              # global gradient-norm clipping threshold
    lr_finder_steps: int = 40
    bench_numel: int = 1 << 20     # total parameters in the optimizer-step timing table


@dataclass(frozen=True)
class Day2Preset:
    """Day 2 (mixed precision). Defaults are the `tiny` scale; `full` times a GPT-2-sized model on a GPU."""

    n_train: int = 1024            # training images for the short fp32 vs bf16 runs
    n_test: int = 512
    image_size: int = 16
    width: int = 16                # SmallCNN base width
    batch_size: int = 64
    max_steps: int = 30            # optimizer steps of each accuracy run
    lr: float = 3e-3               # AdamW
    init_scale: float = 2.0 ** 16  # loss scaler start, as torch.amp.GradScaler
    growth_interval: int = 10      # clean steps before the scale doubles (GradScaler: 2000)
    lm_vocab: int = 256            # the decoder-only transformer of the memory/speed table
    lm_d_model: int = 64
    lm_layers: int = 2
    lm_heads: int = 4
    lm_seq: int = 64
    lm_batch: int = 4
    measure_steps: int = 2         # timed steps per configuration (GPU table only)


@dataclass(frozen=True)
class Day3Preset:
    """Day 3 (activation and training-state checkpointing). Defaults are the `tiny` scale."""

    vocab: int = 256               # byte-level tokens of the synthetic language-model data
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 8              # transformer blocks in the stack (sqrt(8) ~ 3 segments)
    seq_len: int = 64
    batch_size: int = 8
    dropout: float = 0.1           # dropout makes RNG replay in recomputation matter
    measure_reps: int = 3          # timed forward+backward passes per policy (median)
    max_steps: int = 24            # optimizer steps of the exact-resume run
    interrupt_at: int = 10         # the simulated preemption happens after this step
    save_every: int = 4
    keep_last: int = 2
    lr: float = 3e-3
    big_numel: int = 1 << 21       # floats in the payload of the SIGKILL demo (8 MB)


@dataclass(frozen=True)
class Day8Preset:
    """Day 8 (quantization, pruning, distillation). Defaults are the `tiny` scale: an MLP on 16x16 images."""

    n_train: int = 2048            # training images (synthetic CIFAR-10 stand-in without data_dir)
    n_test: int = 512
    image_size: int = 16           # flattened to 3 * 16 * 16 = 768 inputs: divisible by every group size
    hidden: int = 128              # teacher / base MLP width (groups of 32, 64, 128 divide it)
    student_hidden: int = 32       # distillation student width (a quarter of the teacher)
    batch_size: int = 128
    max_steps: int = 150           # steps of the base model's training
    finetune_steps: int = 40       # QAT and pruning fine-tuning steps
    lr: float = 2e-3               # AdamW
    temperature: float = 4.0       # distillation temperature
    distill_lambda: float = 0.5    # weight of the hard-label cross-entropy
    calib_batches: int = 4         # PTQ calibration batches
    sparsities: tuple = (0.5, 0.8, 0.9, 0.95)
    llama_d_model: int = 256       # the Llama-style MLP block for memory / latency (GPU table at full size)
    llama_hidden: int = 768         # a multiple of the 128-wide quantization groups
    llama_tokens: int = 16


@dataclass(frozen=True)
class Day4Preset:
    """Day 4 (data parallelism). Defaults are the `tiny` scale: 2 gloo ranks on a CPU, a small MLP."""

    ranks: int = 2                 # world size of the experiments (the checks pick their own)
    scaling_ranks: tuple = (1, 2)  # world sizes of the scaling table (one launch each)
    msg_sizes: tuple = tuple(1 << k for k in range(10, 23, 2))  # bytes of the bus-bandwidth sweep, 1 KB..4 MB
    bw_reps: int = 5               # all-reduces back to back per timing (median of 3 timings)
    model: str = "mlp"             # model of the DDP comparisons: "mlp" or "resnet18" (synthetic images)
    image_size: int = 32           # resnet18 inputs (B, 3, S, S)
    width: int = 64                # resnet18 base width (64: the real ResNet-18, 11.7M parameters)
    d_in: int = 256                # MLP (comparisons, BatchNorm experiment): d_in -> hidden x layers -> 10
    hidden: int = 256
    layers: int = 4
    batch_per_rank: int = 32
    max_steps: int = 20            # timed steps per DDP version, interleaved round-robin (after 2 warm-up)
    bucket_cap_mb: float = 0.25    # small enough that the tiny MLP fills several buckets
    lr: float = 0.05               # SGD with momentum 0.9
    powersgd_rank: int = 2         # matrix rank of PowerSGD's low-rank approximation
    compress_steps: int = 40       # training steps per gradient-compression variant
    bn_batch: int = 2              # per-rank batch of the SyncBatchNorm experiment (small: noisy stats)
    bn_steps: int = 200            # training steps per BatchNorm variant
    bn_lr: float = 0.01            # SGD with momentum 0.9 (batch-2 statistics diverge at 0.05)


PRESETS: dict[str, dict[str, object]] = {
    "day1_optimizers": {
        "tiny": Day1Preset(),
        "full": Day1Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, small_batch=128,
                           large_batch=4096, max_steps=2000, warmup_steps=200, sgd_lr=0.1, adamw_lr=3e-3,
                           lamb_lr=2e-2, lr_finder_steps=200, bench_numel=1 << 26),
    },
    "day2_mixed_precision": {
        "tiny": Day2Preset(),
        # 12 layers, d_model 768, untied 50257-token embedding and head: ~160M parameters, near the
        # 155M model of the seed's float32 vs bfloat16 case study.
        "full": Day2Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, batch_size=256, max_steps=1500,
                           lr=2e-3, growth_interval=2000, lm_vocab=50257, lm_d_model=768, lm_layers=12,
                           lm_heads=12, lm_seq=1024, lm_batch=16, measure_steps=10),
    },
    "day3_checkpointing": {
        "tiny": Day3Preset(),
        # the seed's case study: a 12-layer, 155M-parameter GPT-2-size transformer
        "full": Day3Preset(vocab=50257, d_model=768, n_heads=12, n_layers=12, seq_len=1024, batch_size=8,
                           measure_reps=5, max_steps=100, interrupt_at=45, save_every=10, keep_last=3,
                           big_numel=1 << 27),
    },
    "day4_ddp": {
        "tiny": Day4Preset(),
        # 4 GPUs over NCCL, messages up to 256 MB, ResNet-18 on 224x224 images (the DDP paper's benchmark
        # family); the compression runs use it too, the BatchNorm experiment a wide MLP
        "full": Day4Preset(ranks=4, scaling_ranks=(1, 2, 4), msg_sizes=tuple(1 << k for k in range(10, 29, 2)),
                           bw_reps=10, model="resnet18", image_size=224, width=64, d_in=1024, hidden=1024,
                           layers=4, batch_per_rank=64, max_steps=30,
                           bucket_cap_mb=25.0, powersgd_rank=4, compress_steps=200, bn_batch=4, bn_steps=500),
    },
    "day8_quantization_pruning": {
        "tiny": Day8Preset(),
        # real CIFAR-10 at 32x32 (3072 inputs), a wider MLP; the Llama-7B MLP block (4096 -> 11008) on GPU
        "full": Day8Preset(n_train=50_000, n_test=10_000, image_size=32, hidden=1024, student_hidden=256,
                           batch_size=256, max_steps=3000, finetune_steps=500, calib_batches=32,
                           llama_d_model=4096, llama_hidden=11008, llama_tokens=2048),
    },
}
