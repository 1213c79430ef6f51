"""Presets of the days that run in one process (1: optimizers, 2: mixed precision, 3: checkpointing,
8: quantization and pruning, 9: inference): one frozen dataclass per day, its defaults the `tiny` scale.

`dlo.presets` holds their instances per profile; import the classes from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Day1Preset:
    """Day 1 (optimizers and LR schedules). Defaults are the `tiny` scale: synthetic 16x16 images."""

    n_train: int = 2048            # training images
    n_test: int = 2048             # held-out images for eval_acc (Wilson interval +-2 points at 70%)
    image_size: int = 16           # 32 is CIFAR-10's size; smaller keeps the CPU profile fast
    width: int = 16                # SmallCNN base width (about 100k params at 16, 1.6M at 64)
    small_batch: int = 32
    large_batch: int = 256         # the "large batch" regime where LAMB and warmup matter
    max_steps: int = 128           # steps of a small-batch run (2 epochs); a batch-B run sees as many samples
    warmup_steps: int = 13         # warmup of a small-batch run (10%); the same samples' worth at every batch
    seeds: int = 3                 # repeats of the SGD linear-scaling runs and their controls
    sgd_lr: float = 0.1            # SGD with momentum 0.9
    adamw_lr: float = 5e-3
    lamb_lr: float = 3e-2          # relative to each layer's weight norm (trust ratio), hence larger
    momentum: float = 0.9
    sgd_weight_decay: float = 5e-4  # coupled (added to the gradient)
    adamw_weight_decay: float = 0.05  # decoupled (applied to the weights)
    lamb_weight_decay: float = 0.01
    clip: float = 1.0              # global gradient-norm clipping threshold
    lr_finder_steps: int = 80      # points of the LR range test (1e-4 to 10)
    bench_numel: int = 1 << 20     # total parameters in the optimizer-step timing table
    profile_steps: int = 6         # profiled training steps per data pipeline
    jpeg_size: int = 512           # side of the JPEGs the slow pipeline decodes per sample
    bn_samples: int = 512          # training images BatchNorm's statistics are recomputed on before a test

    def with_max_steps(self, n: int) -> Day1Preset:
        """n steps per small-batch run; warmup and the LR range test's length scale with it (warmup < n)."""
        k = n / self.max_steps
        return replace(self, max_steps=n, warmup_steps=min(round(self.warmup_steps * k), n - 1),
                       lr_finder_steps=max(min(10, self.lr_finder_steps), round(self.lr_finder_steps * k)))

    def validate(self) -> None:
        if self.max_steps < 6:
            raise ValueError(f"max_steps={self.max_steps}: Day 1 needs >= 6 steps per small-batch run (a warmup, "
                             f"a decay and the window of its early-loss claim)")
        if self.seeds < 2 or self.profile_steps < 1:
            raise ValueError(f"need seeds >= 2 (the noise of a claim) and profile_steps >= 1, got {self.seeds}, "
                             f"{self.profile_steps}")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, max_steps={self.max_steps})")
        if self.lr_finder_steps < 2 or not 1 <= self.small_batch <= self.large_batch <= self.n_train:
            raise ValueError(f"need lr_finder_steps >= 2 and 1 <= small_batch <= large_batch <= n_train, got "
                             f"{self.lr_finder_steps}, {self.small_batch}, {self.large_batch}, {self.n_train}")

    def smoke(self) -> Day1Preset:
        """The same SmallCNN and image size; the fewest images, steps, seeds, LR-finder points and
        profiled steps the notebook runs with, batches 2 and 8 (k = 4), the tiny benchmark size."""
        return replace(self, n_train=32, n_test=16, small_batch=2, large_batch=8, max_steps=8, warmup_steps=1,
                       seeds=2, lr_finder_steps=5, bench_numel=min(self.bench_numel, 1 << 20), profile_steps=1,
                       jpeg_size=min(self.jpeg_size, 64))


@dataclass(frozen=True)
class Day2Preset:
    """Day 2 (mixed precision). Defaults are the `tiny` scale; `full` times a GPT-2-sized model on a GPU."""

    n_train: int = 1024            # training images for the short fp32 vs bf16 runs
    n_test: int = 2048             # held-out images (Wilson interval +-2 points at 60%)
    image_size: int = 16
    width: int = 16                # SmallCNN base width
    batch_size: int = 64
    max_steps: int = 30            # optimizer steps of each accuracy run
    seeds: int = 4                 # repeats of every accuracy comparison (paired by seed)
    lr: float = 3e-3               # AdamW
    init_scale: float = 2.0 ** 16  # loss scaler start, as torch.amp.GradScaler
    growth_interval: int = 10      # clean steps before the scale doubles (GradScaler: 2000)
    demo_steps: int = 60           # steps of each run of the fp16 underflow demo (an MLP: fp16 is cheap there)
    demo_loss_log2: int = 16       # the demo weights its loss by 2^-16: gradients 16 binades smaller
    demo_init_scale: float = 2.0 ** 40  # the demo's scaler starts too high on purpose: it must back off
    demo_lr: float = 0.05          # SGD lr of the demo's unweighted loss (divided by the weight)
    lm_vocab: int = 256            # the decoder-only transformer of the memory/speed table
    lm_d_model: int = 64
    lm_layers: int = 2
    lm_heads: int = 4
    lm_seq: int = 64
    lm_batch: int = 4
    measure_steps: int = 2         # timed steps per configuration (GPU table only)
    attn_lengths: tuple = (128, 256, 512, 1024)  # sequence lengths of naive vs fused attention
    attn_heads: int = 4
    attn_head_dim: int = 16

    def validate(self) -> None:
        if self.max_steps < 1 or not 1 <= self.batch_size <= self.n_train:
            raise ValueError(f"need max_steps >= 1 and 1 <= batch_size <= n_train, got {self.max_steps}, "
                             f"{self.batch_size}, {self.n_train}")
        if self.seeds < 2 or self.demo_steps < 1 or len(self.attn_lengths) < 2:
            raise ValueError(f"need seeds >= 2 (the noise of a claim), demo_steps >= 1 and >= 2 attention lengths, "
                             f"got {self.seeds}, {self.demo_steps}, {self.attn_lengths}")

    def smoke(self) -> Day2Preset:
        """The same SmallCNN and GPT-2-sized TinyLM (12 layers, d_model 768, 50257 tokens); 2 steps of
        batch 8 over 2 seeds, and the LM's saved-bytes forward on 1 x 64 tokens (1024 on a GPU: `dlo plan`)."""
        return replace(self, n_train=16, n_test=16, batch_size=8, max_steps=2, seeds=2, demo_steps=2, lm_seq=64,
                       lm_batch=1, measure_steps=1, attn_lengths=(64, 128))


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
    measure_reps: int = 16         # interleaved rounds of timed forward+backward passes (paired ratios to none;
                                   # 16: the median's 95% interval runs from the 4th to the 13th, not min..max)
    offload_steps: int = 6         # AdamW steps of the optimizer-offload comparison
    max_steps: int = 24            # optimizer steps of the exact-resume run
    interrupt_at: int = 10         # the simulated preemption happens after this step
    save_every: int = 4
    keep_last: int = 2
    lr: float = 3e-3
    big_numel: int = 1 << 21       # floats in the payload of the SIGKILL demo (8 MB)

    def with_max_steps(self, n: int) -> Day3Preset:
        """n steps of the resume run; the interruption and the checkpoint interval scale with it."""
        if n < 2:
            raise ValueError(f"max_steps={n}: the resume experiment needs >= 2 steps (a checkpoint, an "
                             f"interruption, a resumed step)")
        interrupt = min(max(1, round(self.interrupt_at * n / self.max_steps)), n - 1)
        every = min(max(1, round(self.save_every * n / self.max_steps)), interrupt)
        return replace(self, max_steps=n, interrupt_at=interrupt, save_every=every)

    def validate(self) -> None:
        if not 1 <= self.save_every <= self.interrupt_at < self.max_steps:
            raise ValueError(f"need 1 <= save_every <= interrupt_at < max_steps (a checkpoint before the "
                             f"interruption, steps after it), got {self.save_every}, {self.interrupt_at}, "
                             f"{self.max_steps}")
        if self.keep_last < 1 or self.measure_reps < 1 or self.offload_steps < 1:
            raise ValueError(f"need keep_last, measure_reps and offload_steps >= 1, got {self.keep_last}, "
                             f"{self.measure_reps}, {self.offload_steps}")

    def smoke(self) -> Day3Preset:
        """The same 12-layer GPT-2-size stack (163M parameters); batch 1 x 64 tokens (the full 8 x 1024
        needs > 20 GB: `dlo plan`), one timed rep, 4 resume steps, a small SIGKILL payload."""
        return replace(self, seq_len=64, batch_size=1, measure_reps=1, max_steps=4, interrupt_at=2, save_every=2,
                       keep_last=2, big_numel=1 << 16, offload_steps=2)


@dataclass(frozen=True)
class Day8Preset:
    """Day 8 (quantization, pruning, distillation). Defaults are the `tiny` scale: an MLP on 16x16 images."""

    n_train: int = 8192            # training images (synthetic stand-in): 2.3 epochs, so the teacher is not
    #                                memorising (2048 left it at train loss 0.04, held-out 1.72 and falling accuracy)
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
    seeds: int = 5                 # repeats of the compared trainings (the claims' paired differences)

    def validate(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1 (the claims' repeats), got {self.seeds}")
        if len(self.sparsities) < 2 or self.finetune_steps < 2 or self.calib_batches < 1 or self.max_steps < 1:
            raise ValueError(f"need >= 2 sparsities (the lottery ticket uses the second), finetune_steps >= 2, "
                             f"calib_batches >= 1 and max_steps >= 1; got {self.sparsities}, {self.finetune_steps}, "
                             f"{self.calib_batches}, {self.max_steps}")
        if (3 * self.image_size ** 2) % 128 or self.hidden % 128 or self.llama_hidden % 128:
            raise ValueError("3 x image_size^2, hidden and llama_hidden must be multiples of the 128-wide groups")

    def smoke(self) -> Day8Preset:
        """The same MLPs and Llama-7B MLP block (4096 -> 11008); 5 steps, two sparsities, 2 calibration
        batches, 16 tokens through the block."""
        return replace(self, n_train=256, n_test=128, batch_size=32, max_steps=5, finetune_steps=5,
                       calib_batches=2, sparsities=self.sparsities[:2], llama_tokens=16, seeds=1)


@dataclass(frozen=True)
class Day9Preset:
    """Day 9 (serving: KV cache, paged attention, continuous batching, speculative decoding). Defaults are the
    `tiny` scale: the CPU-sized Llama (`dlo.models.llama` "tiny"), short sequences."""

    model: str = "tiny"            # dlo.models.llama config served ("llama3.2-3b" on GPUs)
    dtype: str = "float32"         # the served weights' and cache's dtype ("bfloat16" on GPUs)
    train_steps: int = 100         # the target's training on the synthetic corpus (so that it has something to say)
    distill_steps: int = 120       # the draft's distillation from the target (Day 8's loss)
    batch_size: int = 16           # sequences per training step
    seq_len: int = 64              # tokens per training sequence
    lr: float = 3e-3               # AdamW
    decode_lengths: tuple = (16, 64, 128, 240)  # cached tokens L at which one decode step is timed
    reps: int = 15                 # timings per length (a median and its order-statistics interval)
    block_size: int = 16           # tokens per block of the paged cache (vLLM's default)
    max_len: int = 256             # the server's max sequence length: what a contiguous cache reserves
    n_sequences: int = 64          # sequences of random lengths in the reserved-vs-used comparison
    budget_tokens: int = 4096      # the cache budget (token slots) of "the batch that fits"
    n_requests: int = 24           # requests of the continuous-vs-static trace
    max_batch: int = 8             # sequences a step runs at most
    num_blocks: int = 48           # the scheduler's block budget
    spec_k: int = 4                # draft tokens per speculative round
    spec_tokens: int = 32          # tokens generated per prompt by speculative decoding
    spec_prompts: int = 8          # prompts (samples of alpha and of tokens per round)
    seeds: int = 3                 # repeats of the random-length draws (the waste's interval)

    def validate(self) -> None:
        if self.seeds < 3 or self.spec_prompts < 3 or self.reps < 3:
            raise ValueError(f"seeds, spec_prompts and reps must be >= 3 (a claim's interval), got {self.seeds}, "
                             f"{self.spec_prompts}, {self.reps}")
        if max(self.decode_lengths) >= self.max_len or self.block_size < 1 or self.spec_k < 1:
            raise ValueError(f"need decode_lengths below max_len={self.max_len}, block_size >= 1 and spec_k >= 1; got "
                             f"{self.decode_lengths}, {self.block_size}, {self.spec_k}")

    def with_max_steps(self, max_steps: int) -> Day9Preset:
        """The parameters cell's max_steps: the target's training and the draft's distillation."""
        return replace(self, train_steps=max_steps, distill_steps=max_steps)

    def smoke(self) -> Day9Preset:
        """The same model; the fewest steps, lengths, requests and prompts the notebook runs with, a batch of at
        most 4 sequences of at most 4096 tokens (the 3B model's cut run fits a 24 GB box: `dlo plan`)."""
        return replace(self, train_steps=4, distill_steps=4, decode_lengths=self.decode_lengths[:2], n_requests=6,
                       spec_tokens=8, spec_prompts=3, n_sequences=8, max_batch=min(self.max_batch, 4),
                       max_len=min(self.max_len, 4096))
