"""Presets of the days that launch several ranks (4: DDP, 5: ZeRO and FSDP2, 6: pipeline, 7: tensor
parallelism): one frozen dataclass per day, its defaults the `tiny` scale (gloo ranks on a CPU).

Apart from the one-process days because these carry what a launch needs (`world_size`, the world
sizes of sweeps, launch timeouts) and validate against the distributed engines. `dlo.presets` holds
their instances per profile and is the one public path of the classes: import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Day4Preset:
    """Day 4 (data parallelism). Defaults are the `tiny` scale: 2 gloo ranks on a CPU, a small MLP."""

    world_size: int = 2            # ranks of the experiments (the checks pick their own)
    scaling_world_sizes: tuple = (1, 2)  # world sizes of the scaling table (one launch each)
    msg_sizes: tuple = tuple(1 << k for k in range(10, 23, 2))  # bytes of the bus-bandwidth sweep, 1 KB..4 MB
    bw_reps: int = 5               # all-reduces back to back per timing
    bw_trials: int = 7             # timed rounds over all sizes, after one untimed warm-up round
    wire_bytes: int = 1 << 22      # all-reduce size whose bytes on the rank's TCP sockets are counted (gloo)
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
    bn_steps: int = 100            # training steps per BatchNorm variant and seed
    bn_lr: float = 0.01            # SGD with momentum 0.9 (batch-2 statistics diverge at 0.05)
    bn_seeds: int = 3              # paired seeds (weights and data) of local vs synchronized BatchNorm
    onebit_steps: int = 40         # steps of fp32 Adam and of 1-bit Adam (MLP), per seed
    onebit_warmup: int = 8         # 1-bit Adam's full-precision warm-up steps (then the variance is frozen)
    onebit_lr: float = 1e-3
    onebit_chunk: int = 1024       # values per fp32 scale of the 1-bit messages (a multiple of 8)
    onebit_seeds: int = 3          # repeats (initial weights and data) of the loss comparison
    launch_timeout_s: float = 300.0  # limit of one launch of the experiments (ranks still talking: progress)

    def sizes(self) -> str:
        """The sizes in one line (`dlo.config.Run.where`)."""
        side = self.image_size
        net = (f"ResNet-18 (width {self.width}) on {side}x{side} images" if self.model == "resnet18"
               else f"MLP {self.d_in}-{self.hidden}x{self.layers}")
        top = self.msg_sizes[-1]
        return (f"{net}, {self.batch_per_rank} per rank, {self.max_steps} timed steps, all-reduces up to "
                + (f"{top >> 20} MiB" if top >= 1 << 20 else f"{top >> 10} KiB"))

    def validate(self) -> None:
        if (self.world_size < 1 or not self.scaling_world_sizes or min(self.scaling_world_sizes) < 1
                or len(self.msg_sizes) < 2):
            raise ValueError(f"need world_size >= 1, scaling_world_sizes >= 1 and >= 2 message sizes (the alpha-beta "
                             f"fit), got {self.world_size}, {self.scaling_world_sizes}, {len(self.msg_sizes)} sizes")
        if min(self.max_steps, self.compress_steps, self.bn_steps, self.bw_reps, self.bw_trials, self.wire_calls,
               self.onebit_seeds) < 1 or self.wire_trials < 2:
            raise ValueError("max_steps, compress_steps, bn_steps, bw_reps, bw_trials, wire_calls and onebit_seeds "
                             "must be >= 1, wire_trials >= 2 (a mean with its interval)")
        if not 1 <= self.onebit_warmup < self.onebit_steps or self.onebit_chunk % 8 or self.onebit_chunk < 8:
            raise ValueError(f"need 1 <= onebit_warmup < onebit_steps (a warm-up, then compressed steps) and "
                             f"onebit_chunk a multiple of 8, got {self.onebit_warmup}, {self.onebit_steps}, "
                             f"{self.onebit_chunk}")
        if self.bn_seeds < 1:
            raise ValueError(f"bn_seeds must be >= 1 (3 give a paired interval), got {self.bn_seeds}")

    def smoke(self) -> Day4Preset:
        """The same model and ranks; 2 samples per rank (BatchNorm needs more than one), the fewest steps
        and a two-size bandwidth sweep (PowerSGD starts compressing at step 2, hence 3 compression steps;
        2 counted wire calls, the fewest that give an interval)."""
        return replace(self, msg_sizes=self.msg_sizes[:2], bw_reps=1, bw_trials=1, batch_per_rank=2, max_steps=1,
                       compress_steps=3, bn_steps=2, wire_bytes=1 << 16, wire_calls=2, wire_trials=2,
                       onebit_steps=3, onebit_warmup=1, onebit_seeds=1, bn_seeds=1,
                       launch_timeout_s=self.launch_timeout_s)


@dataclass(frozen=True)
class Day7Preset:
    """Day 7 (tensor parallelism). Defaults are the `tiny` scale: 4 gloo ranks, a tiny GQA Llama."""

    world_size: int = 4            # ranks of the experiment launch: the largest TP degree (or dp x tp)
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
    fsdp_tp: tuple = (2, 2)        # (dp, tp) of the 2D FSDP x TP run; dp * tp must equal world_size
    plan_gpus: int = 64            # the 2D plan of Llama 3.2 3B without GPUs (fake process group)
    plan_tp: tuple = (1, 2, 4, 8)  # TP degrees of the plan (FSDP over the rest)
    plan_batch: int = 1            # micro-batch and sequence of the plan's activation estimate
    plan_seq: int = 4096
    launch_timeout_s: float = 600.0  # the experiment launch (a stuck collective ends here)

    def sizes(self) -> str:
        """The sizes in one line (`dlo.config.Run.where`)."""
        return (f"Llama {self.model}, TP degrees {self.degrees}, {self.batch} x {self.seq_len} tokens, "
                f"{self.max_steps} timed steps; GPT layer h={self.gpt_dim}, s={self.gpt_seq}")

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
        if max(self.degrees) > self.world_size:
            raise ValueError(f"degrees {self.degrees} need {max(self.degrees)} ranks, the preset has "
                             f"world_size={self.world_size}")
        if self.fsdp_tp[0] * self.fsdp_tp[1] not in (0, self.world_size):
            raise ValueError(f"fsdp_tp={self.fsdp_tp}: dp x tp must equal "
                             f"world_size={self.world_size} (or (0, 0): no 2D run)")
        if self.batch % max(self.fsdp_tp[0], 1):
            raise ValueError(f"batch={self.batch} must split evenly over dp={self.fsdp_tp[0]}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: need at least one timed step")

    def smoke(self) -> Day7Preset:
        """The same models on 2 ranks (degrees <= 2), one timed step, short sequences, no 2D run. The
        3B model does not fit a CPU box at t = 2 (19 GB per rank): `dlo plan` is its test there."""
        return replace(self, world_size=2, degrees=tuple(t for t in self.degrees if t <= 2), max_steps=1,
                       seq_len=64, gpt_seq=64, gpt_layers=1, fsdp_tp=(0, 0))


@dataclass(frozen=True)
class Day6Preset:
    """Day 6 (pipeline parallelism). Defaults are the `tiny` scale: 2 gloo ranks, CoAtNet "tiny" at 64 x 64."""

    world_size: int = 2            # pipeline ranks p of the experiment launch
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

    def sizes(self) -> str:
        """The sizes in one line (`dlo.config.Run.where`)."""
        return (f"CoAtNet {self.model} at {self.image_size}x{self.image_size}, micro-batches of {self.micro_batch}, "
                f"m in {self.m_values}; bubble stack {self.stack_blocks} blocks x {self.stack_width} channels")

    def with_max_steps(self, n: int) -> Day6Preset:
        """n timed steps per configuration (the notebook's max_steps)."""
        return replace(self, reps=n)

    def validate(self) -> None:
        if self.world_size < 1 or self.stack_blocks < 2 * self.world_size:
            raise ValueError(f"need world_size >= 1 and stack_blocks >= 2 x world_size (interleaving puts 2 chunks "
                             f"on each rank), got world_size={self.world_size}, stack_blocks={self.stack_blocks}")
        if not self.m_values or min(self.m_values) < 1 or self.reps < 1 or self.warmup < 0 or self.micro_batch < 1:
            raise ValueError(f"need m_values >= 1, reps >= 1, warmup >= 0, micro_batch >= 1; got {self.m_values}, "
                             f"{self.reps}, {self.warmup}, {self.micro_batch}")
        if self.gantt_m % self.world_size or self.gantt_m not in self.m_values:
            raise ValueError(f"gantt_m={self.gantt_m} must be one of m_values {self.m_values} and a multiple of "
                             f"world_size={self.world_size} (the interleaved schedule needs m a multiple of p)")
        if self.split_m < self.world_size:
            raise ValueError(f"split_m={self.split_m}: torch's 1F1B needs at least p=world_size={self.world_size} "
                             "micro-batches")
        unknown = set(self.split_costs) - {"params", "flops", "saved_bytes", "time"}
        if unknown or not self.split_costs:
            raise ValueError(f"split_costs {self.split_costs}: choose among params, flops, saved_bytes, time")

    def smoke(self) -> Day6Preset:
        """The same CoAtNet and block sizes; one micro-batch size of 1, one m (the smallest the
        interleaved schedule takes), one cut, one timed step without warm-up."""
        p = self.world_size
        return replace(self, micro_batch=1, m_values=(p,), gantt_m=p, split_m=p,
                       split_costs=("flops",), reps=1, warmup=0, stack_blocks=2 * p)


@dataclass(frozen=True)
class Day5Preset:
    """Day 5 (ZeRO and FSDP2). Defaults are the `tiny` scale: 2 gloo ranks on a CPU, CPU-sized Llamas."""

    world_size: int = 2            # ranks of the experiments (the checks pick their own)
    model: str = "tiny"            # dlo.models.llama config trained with FSDP2 ("llama3.2-3b" on GPUs)
    compare_model: str = "tiny"    # config of DDP vs ZeRO-1/2/3 (dlo) vs FSDP2 in fp32: memory, bytes, time
    compare_seq_len: int = 64      # tokens per sequence of that comparison (fp32, no checkpointing: DDP holds it all)
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
    timing_steps: int = 12         # timed steps of ZeRO-3 (dlo) vs FSDP2, interleaved (after 2 warm-up)
    accum_micro: int = 4           # micro-batches per step of section 6.8 (accumulation + clipping, sharded)
    memory_world_sizes: tuple = (1, 2, 4, 8)  # world sizes of the memory table (fake process group)
    plan_gpus: int = 8             # the planned Llama 3.2 3B run (`dlo plan day5_fsdp`)
    launch_timeout_s: float = 900.0  # limit of the experiments' launch (ranks still talking: progress)

    def sizes(self) -> str:
        """The sizes in one line (`dlo.config.Run.where`)."""
        cut = "".join(f", {k}={v}" for k, v in self.model_overrides)
        return (f"Llama {self.model} ({self.param_dtype}{cut}), engines on {self.compare_model}, "
                f"{self.batch_per_rank} x {self.seq_len} tokens per rank, {self.max_steps} steps")

    def validate(self) -> None:
        from dlo.distributed.fsdp import AC_MODES

        if self.compare_seq_len < 2:
            raise ValueError(f"compare_seq_len={self.compare_seq_len}: the engine comparison needs >= 2 tokens")
        if self.world_size < 1 or self.max_steps < 2 or self.timing_steps < 1 or self.batch_per_rank < 1:
            raise ValueError(f"need world_size >= 1, max_steps >= 2 (a loss curve), timing_steps >= 1 and "
                             f"batch_per_rank >= 1; got {self.world_size}, {self.max_steps}, {self.timing_steps}, "
                             f"{self.batch_per_rank}")
        if self.ac_mode not in AC_MODES:
            raise ValueError(f"ac_mode={self.ac_mode!r}: choose one of {', '.join(AC_MODES)}")
        if self.accum_micro < 2:
            raise ValueError(f"accum_micro={self.accum_micro}: need >= 2 micro-batches (accumulation)")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}: choose float32, bfloat16 or float16")
        if not self.memory_world_sizes or min(self.memory_world_sizes) < 1:
            raise ValueError(f"memory_world_sizes={self.memory_world_sizes}: world sizes >= 1")

    def smoke(self) -> Day5Preset:
        """The real widths (Llama 3.2 3B's block: dim 3072, 24 heads, MLP 8192; the 1B's for the
        comparison) cut to one block and a 4096-token vocabulary (113M and 68M parameters), 2 gloo
        ranks, 2 steps of one 32-token sequence, the memory table at 2 ranks. The whole 3B needs 51 GB
        of model state: `dlo plan` is its test on a CPU."""
        return replace(self, world_size=2, model_overrides=(("n_layers", 1), ("vocab_size", 4096)), seq_len=32,
                       compare_seq_len=32, batch_per_rank=1, max_steps=2, timing_steps=1, memory_world_sizes=(2,),
                       compile=False, param_dtype="float32", reduce_dtype="float32", accum_micro=2)


@dataclass(frozen=True)
class Day10Preset:
    """Day 10 (context and expert parallelism). Defaults are the `tiny` scale: 2 gloo ranks, 4 heads of 16,
    sequences of 64-256 positions, an MoE of 4 small SwiGLU experts."""

    world_size: int = 2            # ranks of the launches: the context- and expert-parallel degree N
    batch: int = 1                 # sequences B of the attention runs
    heads: int = 4                 # H (Ulysses needs N | H)
    head_dim: int = 16             # D
    seq_lens: tuple = (64, 128, 256)  # T of the memory sweep (2N | T: zig-zag)
    work_seq: int = 256            # T of the timed causal-imbalance run
    timing_reps: int = 5           # timed repeats per rank and split (intervals need >= 3)
    moe_dim: int = 32              # the MoE layer: model width
    moe_hidden: int = 64           # each expert's SwiGLU width
    n_experts: int = 4             # E (N | E: expert parallelism)
    top_k: int = 2
    moe_tokens: int = 256          # S tokens per rank and step
    capacity_factors: tuple = (0.5, 1.0, 1.25, 2.0)
    max_steps: int = 40            # steps of the auxiliary-loss training, per arm and seed
    aux_weight: float = 0.1        # Switch uses 0.01 over long trainings; 40 steps need more
    lr: float = 0.01               # Adam
    seeds: int = 5                 # paired seeds of the auxiliary-loss comparison (t(2) = 4.3 is too wide)
    launch_timeout_s: float = 300.0

    def sizes(self) -> str:
        return (f"attention B={self.batch} H={self.heads} D={self.head_dim}, T in {self.seq_lens}; "
                f"MoE E={self.n_experts} top-{self.top_k}, dim {self.moe_dim}, hidden {self.moe_hidden}, "
                f"{self.moe_tokens} tokens per rank")

    def validate(self) -> None:
        n = self.world_size
        for T in (*self.seq_lens, self.work_seq):
            if T % (2 * n):
                raise ValueError(f"sequence length {T} must be a multiple of 2 x world_size = {2 * n} (zig-zag)")
        if self.heads % n:
            raise ValueError(f"heads={self.heads} must be divisible by world_size={n} (Ulysses)")
        if self.n_experts % n:
            raise ValueError(f"n_experts={self.n_experts} must be divisible by world_size={n} (expert parallelism)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must lie in 1..n_experts={self.n_experts}")
        if self.timing_reps < 3 or self.seeds < 3:
            raise ValueError(f"timing_reps={self.timing_reps} and seeds={self.seeds}: intervals need >= 3 samples")

    def smoke(self) -> Day10Preset:
        """Two ranks, the two shortest sequences (the timed one too: at the full profile's 32k tokens on 2 ranks
        one score block of 24 heads would be 26 GB, and backward holds four), a few training steps."""
        lens = self.seq_lens[:2]
        return replace(self, world_size=2, seq_lens=lens, work_seq=min(self.work_seq, lens[-1]), max_steps=4,
                       timing_reps=3, seeds=3)
