"""Per-day presets: one frozen dataclass per day, one instance per profile.

`tiny` fits a 2-core CPU in about a minute; `full` is the real scale on GPU nodes.
Notebooks never hold these numbers: they call `dlo.setup(day, profile=...)`.
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
class Day4Preset:
    """Day 4 (data parallelism). Defaults are the `tiny` scale: 2 gloo ranks on a CPU, a small MLP."""

    ranks: int = 2                 # world size of the experiments (the checks pick their own)
    scaling_ranks: tuple = (1, 2)  # world sizes of the scaling table (one launch each)
    msg_sizes: tuple = tuple(1 << k for k in range(10, 23, 2))  # bytes of the bus-bandwidth sweep, 1 KB..4 MB
    bw_reps: int = 5               # all-reduces back to back per timing
    bw_trials: int = 7             # timed rounds over all sizes, after one untimed warm-up round
    wire_bytes: int = 1 << 22      # all-reduce size whose bytes on the loopback interface are counted (gloo)
    wire_calls: int = 6            # all-reduces per counted trial (and compression steps read on the wire)
    wire_trials: int = 5           # counted trials (mean with a t-interval)
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
    onebit_steps: int = 40         # steps of fp32 Adam and of 1-bit Adam (MLP), per seed
    onebit_warmup: int = 8         # 1-bit Adam's full-precision warm-up steps (then the variance is frozen)
    onebit_lr: float = 1e-3
    onebit_chunk: int = 1024       # values per fp32 scale of the 1-bit messages (a multiple of 8)
    onebit_seeds: int = 3          # repeats (initial weights and data) of the loss comparison
    launch_timeout_s: float = 300.0  # limit of one launch of the experiments (ranks still talking: progress)

    def validate(self) -> None:
        if self.ranks < 1 or not self.scaling_ranks or min(self.scaling_ranks) < 1 or len(self.msg_sizes) < 2:
            raise ValueError(f"need ranks >= 1, scaling_ranks >= 1 and >= 2 message sizes (the alpha-beta fit), got "
                             f"{self.ranks}, {self.scaling_ranks}, {len(self.msg_sizes)} sizes")
        if min(self.max_steps, self.compress_steps, self.bn_steps, self.bw_reps, self.bw_trials, self.wire_calls,
               self.onebit_seeds) < 1 or self.wire_trials < 2:
            raise ValueError("max_steps, compress_steps, bn_steps, bw_reps, bw_trials, wire_calls and onebit_seeds "
                             "must be >= 1, wire_trials >= 2 (a mean with its interval)")
        if not 1 <= self.onebit_warmup < self.onebit_steps or self.onebit_chunk % 8 or self.onebit_chunk < 8:
            raise ValueError(f"need 1 <= onebit_warmup < onebit_steps (a warm-up, then compressed steps) and "
                             f"onebit_chunk a multiple of 8, got {self.onebit_warmup}, {self.onebit_steps}, "
                             f"{self.onebit_chunk}")

    def smoke(self) -> Day4Preset:
        """The same model and ranks; 2 samples per rank (BatchNorm needs more than one), the fewest steps
        and a two-size bandwidth sweep (PowerSGD starts compressing at step 2, hence 3 compression steps;
        2 counted wire calls, the fewest that give an interval)."""
        return replace(self, msg_sizes=self.msg_sizes[:2], bw_reps=1, bw_trials=1, batch_per_rank=2, max_steps=1,
                       compress_steps=3, bn_steps=2, wire_bytes=1 << 16, wire_calls=2, wire_trials=2,
                       onebit_steps=3, onebit_warmup=1, onebit_seeds=1, launch_timeout_s=self.launch_timeout_s)


@dataclass(frozen=True)
class Day7Preset:
    """Day 7 (tensor parallelism). Defaults are the `tiny` scale: 4 gloo ranks, a tiny GQA Llama."""

    ranks: int = 4                 # ranks of the experiment launch: the largest TP degree (or dp x tp)
    degrees: tuple = (1, 2, 4)     # TP degrees t of the sweeps (degree t runs on ranks 0..t-1)
    model: str = "tiny"            # dlo.models.llama config name
    model_overrides: tuple = (("n_heads", 8), ("n_kv_heads", 4))  # 4 KV heads: t = 4 possible, still GQA
    batch: int = 2                 # sequences per step (one TP group's micro-batch b)
    seq_len: int = 32              # tokens per sequence s (divisible by every degree: sequence parallelism)
    max_steps: int = 3             # timed SGD steps per degree (after one warm-up step)
    lr: float = 0.05               # SGD with momentum 0.9
    gpt_dim: int = 64              # the GPT layers of the communication / activation tables (h)
    gpt_heads: int = 4             # a
    gpt_layers: int = 2
    gpt_seq: int = 32              # s
    gpt_batch: int = 2             # b
    dropout: float = 0.1           # dropout masks are part of Korthikanti et al.'s count
    fsdp_tp: tuple = (2, 2)        # (dp, tp) of the 2D FSDP x TP run; dp * tp must equal ranks
    plan_gpus: int = 64            # the 2D plan of Llama 3.2 3B without GPUs (fake process group)
    plan_tp: tuple = (1, 2, 4, 8)  # TP degrees of the plan (FSDP over the rest)
    plan_batch: int = 1            # micro-batch and sequence of the plan's activation estimate
    plan_seq: int = 4096
    launch_timeout_s: float = 600.0  # the experiment launch (a stuck collective ends here)

    def validate(self) -> None:
        """One line per problem, before any process starts: degrees that do not divide the model."""
        from dlo.distributed.tensor_parallel import check_tp_degree
        from dlo.models.llama import LlamaConfig

        cfg = LlamaConfig.from_name(self.model, **dict(self.model_overrides))
        for t in self.degrees:
            check_tp_degree(cfg, t)
            for name, size in (("seq_len", self.seq_len), ("gpt_heads", self.gpt_heads), ("gpt_seq", self.gpt_seq)):
                if size % t:
                    raise ValueError(f"tensor-parallel degree {t} does not divide {name}={size}")
        if max(self.degrees) > self.ranks:
            raise ValueError(f"degrees {self.degrees} need {max(self.degrees)} ranks, the preset has "
                             f"ranks={self.ranks}")
        if self.fsdp_tp[0] * self.fsdp_tp[1] not in (0, self.ranks):
            raise ValueError(f"fsdp_tp={self.fsdp_tp}: dp x tp must equal ranks={self.ranks} (or (0, 0): no 2D run)")
        if self.batch % max(self.fsdp_tp[0], 1):
            raise ValueError(f"batch={self.batch} must split evenly over dp={self.fsdp_tp[0]}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: need at least one timed step")

    def smoke(self) -> Day7Preset:
        """The same models on 2 ranks (degrees <= 2), one timed step, short sequences, no 2D run. The
        3B model does not fit a CPU box at t = 2 (19 GB per rank): `dlo plan` is its test there."""
        return replace(self, ranks=2, degrees=tuple(t for t in self.degrees if t <= 2), max_steps=1, seq_len=64,
                       gpt_seq=64, gpt_layers=1, fsdp_tp=(0, 0))


@dataclass(frozen=True)
class Day6Preset:
    """Day 6 (pipeline parallelism). Defaults are the `tiny` scale: 2 gloo ranks, CoAtNet "tiny" at 64 x 64."""

    ranks: int = 2                 # pipeline ranks p of the experiment launch
    model: str = "tiny"            # dlo.models.coatnet preset of the split and DDP experiments
    image_size: int = 64
    micro_batch: int = 4           # samples per micro-batch b (images, or token grids of the stack)
    m_values: tuple = (1, 2, 4, 8)  # micro-batches per step of the bubble and memory sweeps
    gantt_m: int = 4               # m of the timelines drawn and of the torch-vs-ours comparison
    split_m: int = 4               # m of the CoAtNet split and DDP comparisons
    split_costs: tuple = ("params", "flops", "saved_bytes", "time")  # what the CoAtNet cuts balance
    reps: int = 3                  # timed steps per configuration (after `warmup` untimed ones)
    warmup: int = 1
    stack_blocks: int = 8          # the bubble sweep's stack of identical CoAtNet transformer blocks
    stack_width: int = 96          # their channels (S3's width); ~10 ms per stage forward, >> a message
    stack_grid: int = 8            # tokens per side (S3's grid)
    head_dim: int = 16
    plan_batch: int = 640          # `dlo plan`: the global batch of the pipeline-vs-DDP memory rows
    launch_timeout_s: float = 900.0  # the experiment launch (ranks still talking: progress, not deadlock)

    def with_max_steps(self, n: int) -> Day6Preset:
        """n timed steps per configuration (the notebook's max_steps)."""
        return replace(self, reps=n)

    def validate(self) -> None:
        if self.ranks < 1 or self.stack_blocks < 2 * self.ranks:
            raise ValueError(f"need ranks >= 1 and stack_blocks >= 2 x ranks (interleaving puts 2 chunks on each "
                             f"rank), got ranks={self.ranks}, stack_blocks={self.stack_blocks}")
        if not self.m_values or min(self.m_values) < 1 or self.reps < 1 or self.warmup < 0 or self.micro_batch < 1:
            raise ValueError(f"need m_values >= 1, reps >= 1, warmup >= 0, micro_batch >= 1; got {self.m_values}, "
                             f"{self.reps}, {self.warmup}, {self.micro_batch}")
        if self.gantt_m % self.ranks or self.gantt_m not in self.m_values:
            raise ValueError(f"gantt_m={self.gantt_m} must be one of m_values {self.m_values} and a multiple of "
                             f"ranks={self.ranks} (the interleaved schedule needs m a multiple of p)")
        if self.split_m < self.ranks:
            raise ValueError(f"split_m={self.split_m}: torch's 1F1B needs at least p={self.ranks} micro-batches")
        unknown = set(self.split_costs) - {"params", "flops", "saved_bytes", "time"}
        if unknown or not self.split_costs:
            raise ValueError(f"split_costs {self.split_costs}: choose among params, flops, saved_bytes, time")

    def smoke(self) -> Day6Preset:
        """The same CoAtNet and block sizes; one micro-batch size of 1, one m (the smallest the
        interleaved schedule takes), one cut, one timed step without warm-up."""
        return replace(self, micro_batch=1, m_values=(self.ranks,), gantt_m=self.ranks, split_m=self.ranks,
                       split_costs=("flops",), reps=1, warmup=0, stack_blocks=2 * self.ranks)


@dataclass(frozen=True)
class Day5Preset:
    """Day 5 (ZeRO and FSDP2). Defaults are the `tiny` scale: 2 gloo ranks on a CPU, CPU-sized Llamas."""

    ranks: int = 2                 # world size of the experiments (the checks pick their own)
    model: str = "tiny"            # dlo.models.llama config trained with FSDP2 ("llama3.2-3b" on GPUs)
    compare_model: str = "tiny"    # config of DDP vs ZeRO-1/2/3 (ours) vs FSDP2 in fp32: memory, bytes, time
    model_overrides: tuple = ()    # (field, value) pairs applied to both configs (smoke runs cut them)
    seq_len: int = 64              # tokens per sequence
    batch_per_rank: int = 4        # sequences per rank and step
    max_steps: int = 30            # FSDP2 training steps; our ZeRO-3 and FSDP2 also train this long side by side
    lr: float = 3e-3               # AdamW
    param_dtype: str = "float32"   # FSDP2 MixedPrecisionPolicy: all-gather and compute dtype ("bfloat16" on GPUs)
    reduce_dtype: str = "float32"  # dtype of the gradient reduce-scatter
    ac_mode: str = "full"          # activation checkpointing per block: "none", "full", "selective"
    compile: bool = False          # torch.compile each block (GPU runs; minutes per block on a CPU)
    cpu_offload: bool = False      # FSDP2 CPUOffloadPolicy
    bucket_cap_mb: float = 0.05    # ZeRO-2 buckets (several on the tiny model)
    timing_steps: int = 12         # timed steps of ZeRO-3 (ours) vs FSDP2, interleaved (after 2 warm-up)
    memory_worlds: tuple = (1, 2, 4, 8)  # world sizes of the memory table (fake process group)
    plan_gpus: int = 8             # the planned Llama 3.2 3B run (`dlo plan day5_fsdp`)
    launch_timeout_s: float = 900.0  # limit of the experiments' launch (ranks still talking: progress)

    def validate(self) -> None:
        from dlo.distributed.fsdp import AC_MODES

        if self.ranks < 1 or self.max_steps < 2 or self.timing_steps < 1 or self.batch_per_rank < 1:
            raise ValueError(f"need ranks >= 1, max_steps >= 2 (a loss curve), timing_steps >= 1 and "
                             f"batch_per_rank >= 1; got {self.ranks}, {self.max_steps}, {self.timing_steps}, "
                             f"{self.batch_per_rank}")
        if self.ac_mode not in AC_MODES:
            raise ValueError(f"ac_mode={self.ac_mode!r}: choose one of {', '.join(AC_MODES)}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}: choose float32, bfloat16 or float16")
        if not self.memory_worlds or min(self.memory_worlds) < 1:
            raise ValueError(f"memory_worlds={self.memory_worlds}: world sizes >= 1")

    def smoke(self) -> Day5Preset:
        """The real widths (Llama 3.2 3B's block: dim 3072, 24 heads, MLP 8192; the 1B's for the
        comparison) cut to one block and a 4096-token vocabulary (113M and 68M parameters), 2 gloo
        ranks, 2 steps of one 32-token sequence, the memory table at 2 ranks. The whole 3B needs 51 GB
        of model state: `dlo plan` is its test on a CPU."""
        return replace(self, ranks=2, model_overrides=(("n_layers", 1), ("vocab_size", 4096)), seq_len=32,
                       batch_per_rank=1, max_steps=2, timing_steps=1, memory_worlds=(2,), compile=False,
                       param_dtype="float32", reduce_dtype="float32")


PRESETS: dict[str, dict[str, object]] = {
    "day1_optimizers": {
        "tiny": Day1Preset(),
        # 10 epochs of 50k images: 3910 steps at batch 128, 122 at batch 4096 (k = 32)
        "full": Day1Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, small_batch=128,
                           large_batch=4096, max_steps=3910, warmup_steps=391, sgd_lr=0.1, adamw_lr=3e-3,
                           lamb_lr=2e-2, lr_finder_steps=200, bench_numel=1 << 26, profile_steps=10),
    },
    "day2_mixed_precision": {
        "tiny": Day2Preset(),
        # 12 layers, d_model 768, untied 50257-token embedding and head: ~160M parameters, near the
        # 155M model of the seed's float32 vs bfloat16 case study.
        "full": Day2Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, batch_size=256, max_steps=1500,
                           lr=2e-3, growth_interval=2000, lm_vocab=50257, lm_d_model=768, lm_layers=12,
                           lm_heads=12, lm_seq=1024, lm_batch=16, measure_steps=10, seeds=3, demo_steps=200,
                           attn_lengths=(1024, 2048, 4096, 8192), attn_heads=12, attn_head_dim=64),
    },
    "day3_checkpointing": {
        "tiny": Day3Preset(),
        # the seed's case study: a 12-layer, 155M-parameter GPT-2-size transformer
        "full": Day3Preset(vocab=50257, d_model=768, n_heads=12, n_layers=12, seq_len=1024, batch_size=8,
                           measure_reps=10, max_steps=100, interrupt_at=45, save_every=10, keep_last=3,
                           big_numel=1 << 27),
    },
    "day4_ddp": {
        "tiny": Day4Preset(),
        # 4 GPUs over NCCL, messages up to 256 MB, ResNet-18 on 224x224 images (the DDP paper's benchmark
        # family); the compression runs use it too, the BatchNorm experiment a wide MLP
        "full": Day4Preset(ranks=4, scaling_ranks=(1, 2, 4), msg_sizes=tuple(1 << k for k in range(10, 29, 2)),
                           bw_reps=10, bw_trials=10, model="resnet18", image_size=224, width=64, d_in=1024, hidden=1024,
                           layers=4, batch_per_rank=64, max_steps=30,
                           bucket_cap_mb=25.0, powersgd_rank=4, compress_steps=200, bn_batch=4, bn_steps=500,
                           onebit_steps=300, onebit_warmup=60, launch_timeout_s=3600.0),
    },
    "day6_pipeline": {
        "tiny": Day6Preset(),
        # 4 GPUs: CoAtNet-3 at 224 x 224 (168M parameters) on 4 stages; the bubble sweep on 16 blocks
        # of its S3 stage (768 channels, 14 x 14 tokens)
        "full": Day6Preset(ranks=4, model="coatnet-3", image_size=224, micro_batch=8, m_values=(4, 8, 16, 32),
                           gantt_m=8, split_m=16, reps=5, warmup=2, stack_blocks=16, stack_width=768, stack_grid=14,
                           head_dim=32, plan_batch=640, launch_timeout_s=3600.0),
    },
    "day8_quantization_pruning": {
        "tiny": Day8Preset(),
        # real CIFAR-10 at 32x32 (3072 inputs), a wider MLP; the Llama-7B MLP block (4096 -> 11008) on GPU
        "full": Day8Preset(n_train=50_000, n_test=10_000, image_size=32, hidden=1024, student_hidden=256,
                           batch_size=256, max_steps=3000, finetune_steps=500, calib_batches=32,
                           llama_d_model=4096, llama_hidden=11008, llama_tokens=2048, seeds=3),
    },
    "day5_fsdp": {
        "tiny": Day5Preset(),
        # Llama 3.2 3B with FSDP2 + bf16 + activation checkpointing + compile on 8 GPUs, one 8192-token
        # sequence per GPU (torchtitan's Llama recipe); the engine comparison on the 1B in fp32
        "full": Day5Preset(ranks=8, model="llama3.2-3b", compare_model="llama3.2-1b", seq_len=8192, batch_per_rank=1,
                           max_steps=50, lr=3e-4, param_dtype="bfloat16", reduce_dtype="float32", ac_mode="full",
                           compile=True, bucket_cap_mb=25.0, timing_steps=10, memory_worlds=(1, 2, 4, 8),
                           launch_timeout_s=3600.0),
    },
    "day7_tensor_parallel": {
        "tiny": Day7Preset(),
        # one 8-GPU node: Llama 3.2 3B at t = 2, 4, 8 (its 8 KV heads bound t), Korthikanti et al.'s
        # GPT layer at h = 2048, a = 16, s = 2048; FSDP 2 x TP 4 for the 2D run
        "full": Day7Preset(ranks=8, degrees=(2, 4, 8), model="llama3.2-3b", model_overrides=(), batch=2,
                           seq_len=2048, max_steps=10, lr=0.01, gpt_dim=2048, gpt_heads=16, gpt_layers=2,
                           gpt_seq=2048, gpt_batch=1, fsdp_tp=(2, 4), launch_timeout_s=3600.0),
    },
}
