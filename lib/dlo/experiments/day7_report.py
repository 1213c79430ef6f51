"""Day 7's claims beside its measurements (`dlo.experiments.day7`'s `run_all`): the formulas
(communication per layer, Korthikanti et al.'s activation bytes, the pipeline bubble with tensor
parallelism), the claims built from rank 0's results, Megatron-LM's MFU table, the ring-attention
picture, and `plan(preset, gpus=, gpu_mem_gb=)`: the full profile on the meta device (`dlo plan`),
Llama 3.2 3B on a (dp, tp) mesh inside a fake process group, placements and bytes per rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlo.claims import Claim, approx, exact, not_measurable, per_median_time
from dlo.comm_compute import tp_bytes
from dlo.experiments.day7 import llama_config, local_bytes

KORTHIKANTI = "Korthikanti et al. 2022, Table 2"
EQ5 = "seminar (seed 003), eq. 5; Narayanan et al. 2021"


# ----------------------------------------------------------------------------- the formulas

def comm_bytes_per_layer(b: int, s: int, h: int, t: int, elem: int = 2) -> float:
    """Bytes one rank sends per transformer layer, forward + backward: 4 all-reduces of (b, s, h),
    2 (t-1)/t of it each under the ring model: 8 b s h (t-1)/t elements (`dlo.comm_compute.tp_bytes`)."""
    return tp_bytes(b, s, h, t, 1, elem)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks):
    none s b h (34 + 5 a s/h); tp s b h (10 + 24/t + 5 a s/(h t)); tp+sp s b h (34/t + 5 a s/(h t))."""
    attn = 5 * a * s / h
    if mode == "none" or t == 1:
        return s * b * h * (34 + attn)
    if mode == "tp":
        return s * b * h * (10 + 24 / t + attn / t)
    return s * b * h * (34 / t + attn / t)


def pipeline_bubble(n: int, t: int, m: int) -> float:
    """Bubble fraction of a pipeline over n / t stages with m micro-batches: (n - t) / (t m)
    (the seminar's eq. 4, from Narayanan et al. 2021 with p = n / t)."""
    return (n - t) / (t * m)


# ----------------------------------------------------------------------------- claims

def comm_claims(P, rows: list[dict]) -> list[Claim]:
    """The collectives' payload per layer (forward + backward), measured, beside what the papers' counts
    are made of: 8 b s h (t-1)/t (2-byte elements) is 4 all-reduces of b s h times the ring's 2 (t-1)/t;
    Megatron's sequence parallelism, 10 b s h (t-1)/t, is 10 all-gathers / reduce-scatters of b s h
    times the ring's (t-1)/t (one all-gather per column layer more in backward). The payload is
    compared, not the ring-model bytes: those apply the ring factor the formula states, so only the
    collectives and their sizes are a measurement here (Day 4 measures a ring's per-connection bytes)."""
    b, s, h = P.gpt_batch, P.gpt_seq, P.gpt_dim
    out = []
    for r in rows:
        t = r["t"]
        if t == 1:
            continue
        measured = exact(r["payload/layer"], "CommCounter payload")
        sent = comm_bytes_per_layer(b, s, h, t)  # 8bsh(t-1)/t, bytes
        if r["mode"] == "tp+sp (megatron)":
            claimed = sent * 10 / 8 * t / (t - 1)  # 10 all-gathers / reduce-scatters of bsh
            text, source = f"10bsh(t-1)/t: 10 x bsh = {claimed:,.0f} B", \
                "eq. 5 + one all-gather per column layer (Sec. 4.2.2)"
        elif r["mode"] == "tp":
            claimed = sent * t / (2 * (t - 1))  # 4 all-reduces of bsh
            text, source = f"8bsh(t-1)/t: 4 x bsh = {claimed:,.0f} B", EQ5
        else:  # each all-reduce becomes a reduce-scatter and an all-gather: 8 of bsh, the same bytes sent
            claimed = sent * t / (t - 1)
            text, source = f"8bsh(t-1)/t: 8 x bsh = {claimed:,.0f} B", "Korthikanti et al. 2022, Sec. 4.2.2"
        out.append(Claim(f"collectives' payload per layer, {r['mode']}, t={t}", source, text,
                         approx(claimed, rel=0.01), measured))
    return out


def activation_claims(P, rows: list[dict]) -> list[Claim]:
    """Measured bytes saved per layer beside Korthikanti et al.'s formula for the same mode and t;
    DTensor-style sequence parallelism (the column layers save their all-gathered input) keeps
    4 s b h (t-1)/t more than the paper's count."""
    b, s, h, a = P.gpt_batch, P.gpt_seq, P.gpt_dim, P.gpt_heads
    out = []
    for r in rows:
        t, mode = r["t"], r["mode"]
        formula = "tp+sp" if mode.startswith("tp+sp") else mode
        claimed = activation_bytes_per_layer(s, b, h, a, t, formula)
        text = {"none": "sbh(34+5as/h)", "tp": "sbh(10+24/t+5as/ht)", "tp+sp": "sbh(34/t+5as/ht)"}[formula]
        source = KORTHIKANTI
        if mode == "tp+sp":
            claimed += 2 * 2 * s * b * h * (t - 1) / t
            text, source = "sbh(34/t+5as/ht) + 4sbh(t-1)/t", KORTHIKANTI + " + the gathered inputs"
        out.append(Claim(f"bytes saved per layer, {mode}, t={t}", source, f"{text} = {claimed:,.0f} B",
                         approx(claimed, rel=0.05), exact(r["saved/layer"], "SavedTensorMeter")))
    return out


def split_claims(R: dict, tol: float = 1e-4) -> list[Claim]:
    """The loss of every split run beside the unsplit (or the TP-only) run's: the same model on the
    same data, only the order of the sums differs (float32: differences of ~1e-6)."""
    from dlo.claims import at_most

    h, out = R["history"], []
    base = min(h)
    for t in sorted(h):
        if t != base:
            gap = max(abs(a - b) for a, b in zip(h[t]["loss"], h[base]["loss"]))
            out.append(Claim(f"loss at t={t} vs t={base}", "Shoeybi et al. 2019 (an exact split)", "equal",
                             at_most(tol, f"max |difference| <= {tol:g}"), exact(gap, "max over steps")))
    two_d = R.get("fsdp_tp")
    if two_d and two_d["tp"] in h:
        gap = max(abs(a - b) for a, b in zip(two_d["loss"], h[two_d["tp"]]["loss"]))
        out.append(Claim(f"loss of FSDP {two_d['dp']} x TP {two_d['tp']} vs TP {two_d['tp']} alone",
                         "data parallelism: the mean of equal shares", "equal",
                         at_most(tol, f"max |difference| <= {tol:g}"), exact(gap, "max over steps")))
    return out


# Megatron-LM's weak-scaling table (the seeds' IDRIS slides, from the Megatron-LM repository: H100
# GPUs, bf16): model, tensor / pipeline degree, GPUs, MFU.
MEGATRON_TABLE = [("1.7B", 1, 1, 48, 0.41), ("7.1B", 2, 1, 96, 0.47), ("16B", 4, 1, 192, 0.49),
                  ("32B", 8, 1, 384, 0.46), ("70B", 8, 2, 768, 0.42), ("119B", 8, 4, 1536, 0.43),
                  ("177B", 8, 6, 2304, 0.44), ("314B", 8, 8, 3072, 0.48), ("462B", 8, 16, 6144, 0.47)]


def megatron_claims(steps: list[dict], device_type: str, world_size: int = 1) -> list[Claim]:
    """The seeds' Megatron-LM MFU (41-49% with TP up to 8) beside what this run's Llama reaches, judged
    only where the launch's `world_size` ranks and the notebook's kernel have a core each (`dlo.claims.timed`)."""
    from dlo.claims import timed

    out = []
    for model, tp, pp, gpus, mfu in MEGATRON_TABLE:
        if pp > 1:
            continue
        row = next((r for r in steps if r["t"] == tp and r.get("mfu") is not None), None)
        claim = f"MFU, Megatron-LM {model} at TP={tp} on {gpus} GPUs vs our Llama at t={tp}"
        if row is None:
            why = ("CPU run: no peak FLOP/s to compare with" if device_type != "cuda"
                   else f"no t={tp} run on this node")
            out.append(not_measurable(claim, "Megatron-LM README (IDRIS slides, seed 000)", f"{mfu:.0%}", why))
        else:  # MFU = FLOPs / peak / t: the interval of the median step maps through 1/t
            est = per_median_time(row["mfu"], row.get("step_s", []), "one node, bf16, median step")
            if est is not None:
                est = timed(est, device=device_type, gpu_claim=True, world_size=world_size, kernel=True)
            out.append(Claim(claim, "Megatron-LM README (IDRIS slides, seed 000)", f"{mfu:.0%}",
                             approx(mfu, abs_tol=0.05), est, "one timed step: no interval; raise max_steps"))
    return out


def ring_attention_schedule(n: int, causal: bool = True, zigzag: bool = False) -> Tensor:
    """Context parallelism's ring (Liu et al. 2023): at step k rank r holds the keys and values of
    chunk (r - k) mod n. Returns (n ranks, n steps) the fraction of that block's scores a causal
    mask keeps: 1 full, 0.5 diagonal, 0 skipped. With `zigzag` each rank holds chunks r and 2n-1-r
    of 2n, which balances the work (Brandon et al. 2023's striped/zigzag layouts)."""
    work = torch.zeros(n, n)
    for r in range(n):
        for k in range(n):
            src = (r - k) % n
            if not causal:
                work[r, k] = 1.0
            elif not zigzag:
                work[r, k] = 0.5 if src == r else float(src < r)
            else:
                mine, theirs = (r, 2 * n - 1 - r), (src, 2 * n - 1 - src)
                kept = sum((0.5 if q == kv else float(kv < q)) for q in mine for kv in theirs)
                work[r, k] = kept / 4
    return work


# ----------------------------------------------------------------------------- the full profile without GPUs

def _sharded(P, dims, world_size: int):
    """The Llama on the meta device split by `dims` inside a fake process group of `world_size` ranks."""
    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(llama_config(P))
    return parallelize_llama_on(model, dims)


def plan_3d(P, *, gpus: int, pp: int, tp: int) -> list[dict]:
    """Parameters per rank of the first and the last pipeline stage of the Llama split PP `pp` x FSDP
    (gpus / (pp tp)) x TP `tp`: one stage (n_layers / pp blocks) built on the meta device and split by
    `parallelize_llama` inside a fake process group of its dp x tp ranks (a stage's ranks hold nothing of
    another stage's), its shards read per parameter; the first stage has the embedding, the last the
    final norm and the head (a tied embedding copied there, as pipelines do: Narayanan et al. 2021)."""
    import dataclasses

    from dlo.distributed.parallelize import ParallelDims
    from dlo.models.llama import Llama
    from dlo.plan import fake_world

    cfg = llama_config(P)
    if pp < 1 or tp < 1 or cfg.n_layers % pp or gpus % (pp * tp):
        raise ValueError(f"plan_3d: pp={pp} must divide the {cfg.n_layers} layers and pp x tp = {pp * tp} the "
                         f"{gpus} GPUs")
    dims = ParallelDims(dp=gpus // (pp * tp), tp=tp)
    with fake_world(dims.world_size):
        with torch.device("meta"):
            stage = Llama(dataclasses.replace(cfg, n_layers=cfg.n_layers // pp))
        stage = parallelize_llama_on(stage, dims)
        size = {n: local_bytes([q]) for n, q in stage.named_parameters()}
    blocks = sum(v for n, v in size.items() if n.startswith("layers."))
    embedding = size["tok_embeddings.weight"]
    head = size.get("output.weight", embedding) + size["norm.weight"]
    return [{"layout": f"PP {pp} x FSDP {dims.dp} x TP {tp}", "stage": stage_name, "blocks": cfg.n_layers // pp,
             "parameter bytes per rank (fp32)": blocks + extra}
            for stage_name, extra in (("first", embedding), ("last", head))]


def parallelize_llama_on(model, dims):
    """`parallelize_llama` of `model` on `dims`' mesh of CPU ranks (inside `dlo.plan.fake_world`)."""
    from dlo.distributed.parallelize import parallelize_llama

    return parallelize_llama(model, dims, dims.build_mesh("cpu"))


def placements(P, *, gpus: int, tp: int, names=("tok_embeddings.weight", "layers.0.attention.wq.weight",
                                                  "layers.0.attention.wk.weight", "layers.0.feed_forward.w2.weight",
                                                  "layers.0.ffn_norm.weight")) -> list[dict]:
    """Placements and per-rank shapes of some parameters of the FSDP (gpus/tp) x TP (tp) Llama."""
    from dlo.distributed.parallelize import ParallelDims
    from dlo.plan import fake_world

    with fake_world(gpus):
        model = _sharded(P, ParallelDims(dp=gpus // tp, tp=tp), gpus)
        params = dict(model.named_parameters())
        return [{"parameter": n, "global shape": tuple(params[n].shape),
                 "placements (dp, tp)": ", ".join(map(str, params[n].placements)),
                 "shape on a rank": tuple(params[n].to_local().shape)} for n in names]


def block_activation_bytes(P, b: int, s: int) -> int:
    """Bytes one unsplit Llama block saves for forward + backward at (b, s) under bf16 autocast, on
    fake CPU tensors (`dlo.plan.fake_cpu`: the CPU's autocast and flash-attention kernels)."""
    from dlo.models.llama import TransformerBlock, rope_cos_sin, rope_frequencies
    from dlo.plan import activation_bytes, fake_cpu

    cfg = llama_config(P)
    with torch.device("meta"):
        block = TransformerBlock(cfg)
    mode = fake_cpu(block)
    with mode:
        x = torch.randn(b, s, cfg.dim, requires_grad=True)
        cos, sin = rope_cos_sin(rope_frequencies(cfg), s)

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(x, cos, sin)
        return activation_bytes(forward, exclude=list(block.parameters()))


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Bytes per rank of the full profile's runs (TP alone at each degree on one node, the 2D run;
    SGD with momentum, the preset's batch; marked main) and of the 2D plan FSDP (gpus/t) x TP t on
    `gpus` GPUs (AdamW, the plan's batch). Parameters and gradients: the fp32 shards each rank holds,
    counted on the meta model split inside a fake process group. Activations: one block measured on
    fake tensors, divided by t (tensor + sequence parallelism), plus the two all-gathered inputs
    DTensor's plan keeps (4 b s h (t-1)/t, bf16), times the layers, plus the fp32 logits' shard."""
    from dlo.accounting import optimizer_bytes
    from dlo.distributed.parallelize import ParallelDims
    from dlo.plan import fake_world, row
    from dlo.progress import tqdm

    cfg = llama_config(P)
    block = {}

    def activations(t: int, b: int, s: int) -> int:
        if (b, s) not in block:
            block[(b, s)] = block_activation_bytes(P, b, s)
        gathered = 2 * 2 * b * s * cfg.dim * (t - 1) / t
        return int(cfg.n_layers * (block[(b, s)] / t + gathered) + 4 * b * s * cfg.vocab_size / t)

    configs = [(f"TP {t} (one node)", ParallelDims(tp=t), "sgd_momentum", P.batch, P.seq_len, True)
               for t in P.degrees]
    dp, tp = P.fsdp_tp
    if dp * tp:
        configs.append((f"FSDP {dp} x TP {tp} (one node)", ParallelDims(dp=dp, tp=tp), "sgd_momentum", P.batch // dp,
                        P.seq_len, True))
    configs += [(f"FSDP {gpus // t} x TP {t}", ParallelDims(dp=gpus // t, tp=t), "adamw", P.plan_batch, P.plan_seq,
                 False) for t in P.plan_tp if gpus % t == 0 and cfg.n_kv_heads % t == 0]
    rows = []
    for name, dims, opt, b, s, main in tqdm(configs, desc="plan: splitting the meta model", leave=False):
        with fake_world(dims.world_size):
            model = _sharded(P, dims, dims.world_size)
            n = local_bytes(model.parameters())
        rows.append(row(name, dims.world_size, params=n, grads=n, optimizer=optimizer_bytes(opt, n),
                        activations=activations(dims.tp, b, s), gpu_mem_gb=gpu_mem_gb, main=main,
                        note=f"{'SGD momentum' if opt != 'adamw' else 'AdamW'}, b={b}, s={s}, fp32 shards"))
    return rows


__all__ = ["MEGATRON_TABLE", "activation_bytes_per_layer", "activation_claims", "block_activation_bytes",
           "comm_bytes_per_layer", "comm_claims", "megatron_claims", "parallelize_llama_on", "pipeline_bubble",
           "placements", "plan", "plan_3d",
           "ring_attention_schedule", "split_claims"]
