"""Day 2 experiments: the decoder-only transformer of the memory/speed table, the accuracy runs, the
fp16 underflow demo, the speed table, a TinyLM step counted and measured, and the day's plan; the
claims tables made from their numbers are `dlo.experiments.day2_report`.

`TinyLM` is GPT-2's shape at the full profile (12 layers, d_model 768, a 50257-token vocabulary,
1024 positions: ~160M parameters with its untied head, near the 155M model of the course's float32
vs bfloat16 case study) and a toy at the tiny one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlo.accounting import optimizer_bytes
from dlo.models.small import MLP, SmallCNN
from dlo.plan import fake_cpu, first_step, param_bytes, row, step_memory


class TinyLM(nn.Module):
    """Decoder-only transformer (pre-norm nn.TransformerEncoder with a causal mask); returns (B*T, vocab) logits."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx):  # (B, T) token ids
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        h = self.blocks(h, mask=self.mask[:idx.shape[1], :idx.shape[1]], is_causal=True)
        return self.head(self.norm(h)).flatten(0, 1)  # (B*T, vocab)


def make_lm(P) -> TinyLM:
    return TinyLM(P.lm_vocab, P.lm_d_model, P.lm_layers, P.lm_heads, P.lm_seq)


def make_cnn(P) -> SmallCNN:
    return SmallCNN(width=P.width)


def make_mlp(P) -> MLP:
    return MLP(3 * P.image_size ** 2, 256, 10, depth=3)


# ----------------------------------------------------------------------------- accuracy runs

def accuracy_runs(P, train_ds, test_ds, device, writer=None, progress: bool = True) -> dict:
    """fp32 and bf16-autocast SmallCNN runs (AdamW, P.max_steps steps) for seeds 0..P.seeds-1, each
    pair from the same initial weights and batches. {label: [history per seed]}; `writer(label, seed)`
    gives a SummaryWriter or None."""
    from dlo.amp import train_amp
    from dlo.train import make_loader

    out: dict[str, list] = {"fp32": [], "bf16": []}
    for seed in range(P.seeds):
        for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            torch.manual_seed(seed)
            model = make_cnn(P).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
            w = writer(label, seed) if writer else None
            out[label].append(train_amp(model, opt, make_loader(train_ds, P.batch_size, seed=seed), steps=P.max_steps,
                                        device=device, dtype=dtype, writer=w, eval_data=test_ds, progress=progress))
            if w is not None:
                w.close()
    return out


def underflow_demo(P, train_ds, test_ds, device, writer=None, progress: bool = True) -> dict:
    """The fp16 underflow situation, built on purpose: an MLP whose loss is weighted by
    2^-P.demo_loss_log2 (every gradient that many binades smaller), trained by SGD with the lr
    divided by the same power of two (in fp32, where scaling by 2^-k is exact, the updates are the
    unweighted ones). Four runs per seed: fp32, bf16, fp16 without and with a DynamicLossScaler that
    starts at P.demo_init_scale. {label: [history per seed]}."""
    from dlo.amp import DynamicLossScaler, train_amp
    from dlo.train import make_loader

    weight = 2.0 ** -P.demo_loss_log2
    runs = {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
            "fp16 + scaler": (torch.float16, True)}
    out: dict[str, list] = {label: [] for label in runs}
    for seed in range(P.seeds):
        for label, (dtype, scaled) in runs.items():
            torch.manual_seed(seed)
            model = make_mlp(P).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=P.demo_lr / weight, momentum=0.9)
            scaler = (DynamicLossScaler(init_scale=P.demo_init_scale, growth_interval=P.growth_interval)
                      if scaled else None)
            w = writer(label, seed) if writer else None
            out[label].append(train_amp(model, opt, make_loader(train_ds, P.batch_size, seed=seed), steps=P.demo_steps,
                                        device=device, dtype=dtype, scaler=scaler, loss_weight=weight, writer=w,
                                        eval_data=test_ds, progress=progress))
            if w is not None:
                w.close()
    return out


def fp16_step_times(P, batch, device, reps: int = 3) -> dict:
    """Interleaved timings of one SmallCNN training step in bf16 and fp16 autocast (the CPU's fp16 path)."""
    from dlo.amp import precision_step
    from dlo.measure import time_interleaved

    fns = {m: precision_step(lambda: make_cnn(P), batch, mode=m, device=device) for m in ("bf16", "fp16")}
    return time_interleaved(fns, device=device, warmup=1, reps=reps)


def speed_table(P, lm_batch, cnn_batch, device) -> list[dict]:
    """GPU only: per model and precision (+ torch.compile, + channels_last for the CNN) the Timing of
    a full AdamW training step and the CUDA allocator's peak bytes."""
    from dlo.amp import MODES, precision_step
    from dlo.measure import peak_memory, time_fn

    rows = []
    configs = [dict(mode=m) for m in MODES] + [dict(mode="bf16", compile=True)]
    for name, make, batch, extra in (("TinyLM", make_lm, lm_batch, []),
                                     ("SmallCNN", make_cnn, cnn_batch, [dict(mode="bf16", channels_last=True)])):
        for cfg in configs + extra:
            step = precision_step(lambda make=make: make(P), batch, device=device, **cfg)
            timing = time_fn(step, device=device, warmup=3, reps=P.measure_steps)
            with peak_memory(device) as peak:
                step()
            rows.append(dict(model=name, mode=cfg["mode"], compile=cfg.get("compile", False),
                             channels_last=cfg.get("channels_last", False), timing=timing, peak_bytes=peak.bytes))
            torch.cuda.empty_cache()
    return rows


def lm_accounting(P, batch, device, reps: int = 5) -> dict:
    """One AdamW training step of the TinyLM (bf16 autocast on a GPU, fp32 elsewhere): its FLOPs
    counted by FlopCounterMode and by 6N + 12 l h s per token, its time (a Timing); "held_per_param":
    the model-state bytes per parameter a bf16-autocast AdamW step leaves held, measured by the
    allocator (`dlo.accounting.held_after_step`); "bytes_per_param": ZeRO's split, built
    (`mixed_precision_bytes`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dlo.accounting import held_after_step, matmul_params
    from dlo.amp import train_step
    from dlo.measure import count_flops, time_fn, transformer_flops_per_token

    device = torch.device(device)
    model = make_lm(P).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
    x, y = (t.to(device) for t in batch)
    dtype = torch.bfloat16 if device.type == "cuda" else None

    def step():
        return train_step(model, opt, x, y, dtype=dtype)
    with sdpa_kernel(SDPBackend.MATH):  # FlopCounterMode has no formula for the CPU's fused attention kernel:
        flops = count_flops(step)       # the math backend runs the same FLOPs as matmuls it does count
    timing = time_fn(step, device=device, warmup=2, reps=reps)
    n = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(model)
    zero_split = mixed_precision_bytes(model, x, y, P.lr)
    held = held_after_step(model, opt, lambda: train_step(model, opt, x, y, dtype=torch.bfloat16), device)
    return {"flops_per_step": flops, "tokens": x.numel(), "counted_per_token": flops / x.numel(),
            "formula_per_token": transformer_flops_per_token(n_matmul, P.lm_layers, P.lm_d_model, P.lm_seq),
            "matmul_params": n_matmul, "params": n, "timing": timing, "held_per_param": held,
            "bytes_per_param": zero_split, "dtype": "bf16" if dtype else "fp32"}


def mixed_precision_bytes(model: nn.Module, x, y, lr: float) -> float:
    """Model-state bytes per parameter of mixed-precision AdamW as ZeRO counts it: one real step of a
    bf16 copy of `model` (bf16 weights and gradients) whose update is made on fp32 master weights
    with fp32 moments, then copied back. Counted as the distinct storages the copy, the master
    weights and the optimizer hold after the step (`dlo.measure.held_bytes`): what the setup
    keeps, not the 2 + 2 + 4 + 8 of the formula."""
    import copy

    from dlo.measure import held_bytes

    low = copy.deepcopy(model).to(torch.bfloat16)
    params = [p for p in low.parameters() if p.requires_grad]
    master = [p.detach().float() for p in params]  # fp32 copies (new storages)
    opt = torch.optim.AdamW(master, lr=lr)
    F.cross_entropy(low(x).float(), y).backward()  # bf16 gradients on the bf16 weights
    for m, p in zip(master, params):
        m.grad = p.grad.float()  # the update in fp32; this copy lives only during the step
    opt.step()
    with torch.no_grad():
        for m, p in zip(master, params):
            p.copy_(m)  # round the master weights to the bf16 weights the next forward uses
            m.grad = None
    return held_bytes(low, master, opt) / sum(p.numel() for p in params)


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """One row per model and precision of the day: fp32 master weights and gradients, AdamW's two fp32
    moments, the bytes autograd saves under autocast, and the whole training step's peak: the speed
    table's step (`dlo.amp.train_step`, AdamW with the GPU's foreach kernels, after a first step made
    its state) run op by op on fake CPU tensors (`dlo.plan.fake_cpu`: the CPU's autocast rules and
    attention kernel, the closest a CPU gets to a GPU's; `dlo.plan.step_memory`). Its `transient`
    column is mostly the loss: the (B*T, vocab) logits the step keeps through backward, log-softmax's
    output, and their two gradients, each B*T*vocab*4 bytes. fp16 saves what bf16 does; tf32 what
    fp32 does. Single process."""
    from dlo.amp import train_step
    from dlo.measure import optimizer_state_bytes, tensor_bytes

    rows = []
    for name, build, shape, high in (("TinyLM", make_lm, (P.lm_batch, P.lm_seq), P.lm_vocab),
                                     ("SmallCNN", make_cnn, (P.batch_size, 3, P.image_size, P.image_size), 0)):
        with torch.device("meta"):
            model = build(P)
        n = param_bytes(model)
        mode = fake_cpu(model)
        with mode:
            x = torch.randint(0, high, shape) if high else torch.randn(shape)
            y = torch.randint(0, P.lm_vocab if high else 10, (shape[0] * (shape[1] if high else 1),))
            for label, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
                opt = torch.optim.AdamW(model.parameters(), lr=P.lr, foreach=True)

                def step(dtype=dtype, model=model, opt=opt, x=x, y=y):
                    train_step(model, opt, x, y, dtype=dtype)
                first_step(opt)
                before = n + tensor_bytes(model.buffers()) + optimizer_state_bytes(opt) + tensor_bytes((x, y))
                counted = step_memory(step, exclude=[*model.parameters(), *model.buffers()])
                rows.append(row(f"{name} {label}", 1, params=n, grads=n, optimizer=optimizer_bytes("adamw", n),
                                activations=counted["saved"], peak=before + counted["allocated"],
                                gpu_mem_gb=gpu_mem_gb, main=name == "TinyLM" and dtype is None,
                                note=f"batch {' x '.join(map(str, shape))}, AdamW"))
    rows.append(attention_row(P, gpu_mem_gb))
    return rows


def attention_row(P, gpu_mem_gb: float) -> dict:
    """The attention sweep's largest case (`dlo.attention.attention_costs`): naive attention's forward and
    backward at the longest of P.attn_lengths, fp32, counted op by op on fake tensors: the (T, T) scores
    and probabilities of every head, kept for backward and formed again as gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dlo.attention import naive_attention, qkv
    from dlo.measure import tensor_bytes

    t = max(P.attn_lengths)
    with FakeTensorMode():
        inputs = qkv(1, P.attn_heads, t, P.attn_head_dim)
        counted = step_memory(lambda: naive_attention(*inputs).sum().backward(), exclude=inputs)
        before = tensor_bytes(inputs)
    return row(f"attention sweep: naive, T = {t}", 1, params=0, grads=0, optimizer=0, activations=counted["saved"],
               peak=before + counted["allocated"], gpu_mem_gb=gpu_mem_gb,
               note=f"{P.attn_heads} heads of {P.attn_head_dim}, fp32; SDPA keeps O(T) instead")
