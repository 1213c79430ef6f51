"""Day 5's claims beside its measurements (`dlo.experiments.day5`'s `run_all`): the engines'
bytes held and sent beside the ZeRO paper, our ZeRO-3 beside FSDP2, the MFU anchors; and
`plan(P, gpus=, gpu_mem_gb=)`, the full profile without a GPU (`dlo plan day5_fsdp`): Llama 3.2 3B
on the meta device, sharded by FSDP2 at `gpus` ranks inside a fake process group, beside the
accountant.
"""

from __future__ import annotations

import dataclasses

import torch

from dlo.distributed import fsdp
from dlo.distributed.fsdp import apply_fsdp
from dlo.distributed.zero import memory_per_rank
from dlo.experiments.day5 import STAGE, llama_config, lm_loss
from dlo.plan import GIB

# ----------------------------------------------------------------------------- claimed vs measured

ZERO_PAPER = "Rajbhandari et al. 2020, Sec. 5 and 7"
# FSDP's MFU beside FSDP figures only: Megatron-LM's table (seed 000, 41-49% on 1.7B-462B models) is 3-D
# parallelism (tensor, pipeline, data), another recipe (an earlier version compared with it)
LLM_FOUNDRY = "MosaicML llm-foundry benchmarks (FSDP, 8 H100, bf16)"
TORCHTITAN = "issue / torchtitan: Llama 3.1 8B, FSDP, 8 H100"
COMM_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}


def fsdp2_sent_factor(cfg) -> float:
    """What `apply_fsdp` sends per step, in units of (N-1)/N Psi, predicted from its units: every
    parameter is all-gathered for forward and its gradient reduce-scattered (2), and all-gathered
    again for backward unless its unit stays gathered after forward (`fsdp.fsdp_units`, the policy
    `apply_fsdp` wraps with: the last block, and the final norm with an untied output head).
    3 - Psi_kept / Psi, counted on the meta device; a unit's parameters are those no inner unit took."""
    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    seen, kept = {}, 0  # id -> numel (a tied weight counts once)
    for unit, reshard in fsdp.fsdp_units(model):
        own = {id(p): p.numel() for m in (unit if isinstance(unit, list) else [unit]) for p in m.parameters()
               if id(p) not in seen}
        seen.update(own)
        kept += 0 if reshard else sum(own.values())
    return 3 - kept / sum(seen.values())


def engine_claims(engines: dict, cfg=None) -> list:
    """Bytes sent per step (ring model, in units of (N-1)/N Psi) and bytes held per rank, beside the
    paper's 2 Psi / 3 Psi and memory formulas (fp32 training: K = 8 bytes of AdamW moments); the
    FSDP2 row beside `fsdp2_sent_factor(cfg)` (`cfg`: the engines' Llama config, needed for it)."""
    from dlo.claims import Claim, approx, exact

    claims = []
    for name, e in engines.items():
        n, world_size, stage = e["n_params"], e["world"], STAGE[name]
        unit = 4 * n * (world_size - 1) / world_size
        if world_size > 1:
            k, claimed, rel = COMM_FACTOR[stage], f"{COMM_FACTOR[stage]} Psi", 0.03
            if name.startswith("FSDP2"):  # a predicted count, not a range: anything in [2, 3] is any ZeRO
                if cfg is None:
                    raise ValueError("engine_claims: the FSDP2 row needs the engines' Llama config (cfg=...)")
                k, rel = fsdp2_sent_factor(cfg), 0.01
                claimed = f"3 - Psi_kept/Psi = {k:.3f} Psi (last block kept gathered)"
            claims.append(Claim(f"{name}: bytes sent per step", ZERO_PAPER, claimed, approx(k, rel=rel),
                                exact(e["sent"] / unit, "counted (CommCounter), in (N-1)/N Psi")))
        want = memory_per_rank(n, world_size, stage, param_dtype=torch.float32)["total"]
        claims.append(Claim(f"{name}: model-state bytes per rank", ZERO_PAPER, f"{want:,} (fp32 AdamW, N={world_size})",
                            approx(want, rel=0.03, text=f"{want:,} +- 3%"),
                            exact(e["total"], "counted (held_bytes) after a step")))
    return claims


def mfu_estimate(train: dict):
    """MFU with the interval of its median step (the first step, a warm-up, left out as in
    `train_fsdp`); None without MFU (no GPU peak) or with one timed step (no interval)."""
    from dlo.claims import per_median_time

    if train["mfu"] is None:
        return None
    return per_median_time(train["mfu"], train.get("times_s", [])[1:], "6N + 12 l h s FLOPs / peak / median step")


def training_claims(train: dict, same: dict, device_type: str, world_size: int = 1) -> list:
    """FSDP2 and our ZeRO-3 give the same losses; the MFU anchors (GPU only, and only where the
    `world_size` ranks and the notebook's kernel have a core each: `dlo.claims.timed`)."""
    from dlo.claims import Claim, at_most, between, exact, timed

    a, b = same["ZeRO-3 (dlo)"], same["FSDP2 (torch)"]
    diff = max(abs(x - y) for x, y in zip(a, b))
    claims = [Claim("ZeRO-3 (dlo) and FSDP2 train alike: max |loss difference| over the run", "ZeRO-3 = FSDP",
                    "0 (fp32 rounding)", at_most(1e-4, "<= 1e-4"), exact(diff, f"{len(a)} steps, same weights"))]
    est = mfu_estimate(train)
    if est is not None:
        est = timed(est, device=device_type, gpu_claim=True, world_size=world_size, kernel=True)
    why = (f"no GPU peak here ({device_type})" if train["mfu"] is None
           else "one timed step: no interval; raise max_steps")
    for claim, source, claimed, region in (("MFU of FSDP training", LLM_FOUNDRY,
                                            "41.8% (1B, 2,048 tokens) - 46.2% (3B, 1,024 tokens)",
                                            between(0.418, 0.462)),
                                           ("MFU of FSDP2 training", TORCHTITAN, "33-39%", between(0.33, 0.39))):
        claims.append(Claim(claim, source, claimed, region, est, why))  # est None: not measurable, why
    return claims


# ----------------------------------------------------------------------------- the full profile without GPUs

_COUNTED: dict = {}  # the planner asks for the same counts several times (each builds a model): once each


def _once(what, *key):
    k = (what.__name__, repr(key))  # repr: a LlamaConfig holds a dict, it cannot be hashed
    if k not in _COUNTED:
        _COUNTED[k] = what(*key)
    return _COUNTED[k]


def fsdp2_shards(cfg, world_size: int) -> dict:
    """FSDP2 on the meta Llama at `world_size` ranks (fake process group): elements this rank holds,
    and the sizes of a block and of the root (tied embedding + norm)."""
    return dict(_once(_fsdp2_shards, cfg, world_size))


def _fsdp2_shards(cfg, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.models.llama import Llama
    from dlo.plan import fake_world

    with fake_world(world_size):
        with torch.device("meta"):
            model = Llama(cfg)
        mesh = init_device_mesh("cpu", (world_size,))
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        local = sum(p.to_local().numel() for p in model.parameters())
        block = sum(p.numel() for p in model.layers["0"].parameters())
        total = sum(p.numel() for p in model.parameters())
    return {"local": local, "block": block, "root": total - cfg.n_layers * block, "total": total}


def activation_estimate(cfg, b: int, s: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """What a forward and backward of b sequences of s tokens holds beyond model state, computed in
    `dtype`, counted op by op on fake CPU tensors (`dlo.plan.step_memory`) for the embedding/norm/head/loss
    part ("head") and one block: the saved peaks, the totals without ("none") and with ("full") activation
    checkpointing (each block keeps only its input, and one block's activations live again while it is
    recomputed), and "transient": what the loss holds at its peak beyond what it saves and the head's
    gradient (the logits again in fp32 for the loss, their gradients, the embedding's dense gradient)."""
    return dict(_once(_activation_estimate, cfg, b, s, dtype))


def _activation_estimate(cfg, b: int, s: int, dtype: torch.dtype) -> dict:
    from dataclasses import replace

    from dlo.models.llama import Llama
    from dlo.plan import fake_cpu, param_bytes, step_memory

    saved, transient = {}, 0
    for k in (0, 1):
        with torch.device("meta"):
            model = Llama(replace(cfg, n_layers=k)).to(dtype)
        mode = fake_cpu(model)  # new (fake) parameters: the ones to leave out
        with mode:
            x = torch.randint(0, cfg.vocab_size, (b, s))
            counted = step_memory(lambda m=model, t=x: lm_loss(m, t, t).backward(), exclude=list(model.parameters()))
        saved[k] = counted["saved"]
        if k == 0:
            transient = counted["allocated"] - counted["saved"] - param_bytes(model)
    block, head = saved[1] - saved[0], saved[0]
    inputs = cfg.n_layers * b * s * cfg.dim * torch.empty((), dtype=dtype).element_size()
    return {"head": head, "block": block, "none": cfg.n_layers * block + head, "full": inputs + block + head,
            "transient": transient}


def recipe_row(P, gpus: int, gpu_mem_gb: float, main: bool = False, note: str = "") -> dict:
    """The FSDP2 recipe on `P.model` (bf16 compute, fp32 shards, `P.ac_mode` checkpointing) at `gpus`
    ranks: its fp32 shards counted on the meta model sharded in a fake process group (parameters =
    master, gradients reduced in fp32, two moments), plus the bf16 working set (the root, i.e. the
    tied embedding, and two blocks: the running one and the prefetched one); `P.cpu_offload` keeps
    the shards, gradients and moments in host memory. Transient: the loss's buffers and the root's
    unsharded bf16 gradient before its reduce-scatter."""
    from dlo.accounting import optimizer_bytes
    from dlo.plan import row

    cfg = llama_config(P)
    sh = fsdp2_shards(cfg, gpus)
    act = activation_estimate(cfg, P.batch_per_rank, P.seq_len)
    gathered = 2 * (sh["root"] + min(2, cfg.n_layers) * sh["block"])
    shard = 4 * sh["local"]  # fp32: the master weights, their gradients, and AdamW's moments beside them
    on_gpu = 0 if P.cpu_offload else 1
    activations = act["full"] if P.ac_mode == "full" else act["none"]
    params, grads, optimizer = shard * on_gpu + gathered, shard * on_gpu, optimizer_bytes("adamw", shard) * on_gpu
    where = (f"fp32 shards, gradients and moments ({4 * shard / GIB:.1f} GiB) in host memory" if P.cpu_offload
             else "fp32 shards")
    return row(f"FSDP2 bf16 + AC ({P.model}{', CPU offload' if P.cpu_offload else ''})", gpus, params=params,
               grads=grads, optimizer=optimizer, activations=activations, main=main, gpu_mem_gb=gpu_mem_gb,
               peak=params + grads + optimizer + activations + act["transient"] + 2 * sh["root"],
               note=note or f"{P.batch_per_rank} x {P.seq_len} tokens per rank; {where} + bf16 root and 2 blocks "
                            "gathered")


def instead(P, gpus: int, gpu_mem_gb: float, weights: bool = False) -> tuple:
    """(preset, its recipe row) the notebook trains with on `gpus` GPUs of `gpu_mem_gb`: `P` when its
    recipe fits, else the first that does of the same recipe on `P.compare_model` (not with `weights`
    of P.model to load), on P.model with CPU offload, on P.compare_model with CPU offload; `P` again
    when none does (the caller refuses it)."""
    from dataclasses import replace

    tries = [P] + ([replace(P, model=P.compare_model)] if not weights and P.compare_model != P.model else [])
    tries += [replace(p, cpu_offload=True) for p in tries if not p.cpu_offload]
    for p in tries:
        r = recipe_row(p, gpus, gpu_mem_gb, main=True)
        if r["fits"]:
            return p, r
    return P, recipe_row(P, gpus, gpu_mem_gb, main=True)


def engine_rows(P, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """The engine comparison (`dlo.experiments.day5.run_all`: DDP, ZeRO-1/2/3 and FSDP2 on
    `P.compare_model` in fp32, no checkpointing, `P.compare_seq_len` tokens): the accountant's model
    state beside the activations and the loss's buffers in fp32. DDP's row, the largest, is a main one:
    the comparison runs every engine."""
    from dlo.plan import row

    cfg = llama_config(P, "compare_model")
    n = fsdp2_shards(cfg, 1)["total"]
    act = activation_estimate(cfg, P.batch_per_rank, P.compare_seq_len, torch.float32)
    rows = []
    for stage, label in ((0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3 / FSDP2")):
        m = memory_per_rank(n, gpus, stage, param_dtype=torch.float32)
        rows.append(row(f"engines: {label} fp32 ({P.compare_model})", gpus, params=m["params"], grads=m["grads"],
                        optimizer=m["optimizer"], activations=act["none"], gpu_mem_gb=gpu_mem_gb, main=stage == 0,
                        peak=m["total"] + act["none"] + act["transient"],
                        note=f"{P.batch_per_rank} x {P.compare_seq_len} tokens per rank; 4 + 4 + 8 bytes per "
                             "parameter"))
    return rows


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Bytes per rank of `P.model` at `gpus` ranks, mixed-precision AdamW, P.batch_per_rank x
    P.seq_len tokens: the FSDP2 recipe (`recipe_row`; when it does not fit, the configuration the notebook
    runs instead, `instead`, is the main row), ZeRO-1/2/3 and DDP by the accountant (`memory_per_rank`),
    the engine comparison (`engine_rows`), and DDP without checkpointing, which does not fit."""
    from dlo.plan import row

    cfg = llama_config(P)
    chosen, fallback = instead(P, gpus, gpu_mem_gb)
    first = recipe_row(P, gpus, gpu_mem_gb, main=chosen is P)
    rows = [first]
    if chosen is not P:
        first["note"] = f"does not fit: the notebook runs {fallback['config']} instead"
        rows.append(fallback)
    n = fsdp2_shards(cfg, 1)["total"]
    act = activation_estimate(cfg, P.batch_per_rank, P.seq_len)
    what = f"{P.model}, {P.batch_per_rank} x {P.seq_len} tokens per rank"
    for stage, label in ((3, "ZeRO-3 (accountant)"), (2, "ZeRO-2"), (1, "ZeRO-1"), (0, "DDP")):
        m = memory_per_rank(n, gpus, stage, param_dtype=torch.bfloat16)
        rows.append(row(f"{label} bf16 + AC", gpus, params=m["params"], grads=m["grads"], optimizer=m["optimizer"],
                        activations=act["full"], peak=m["total"] + act["full"] + act["transient"],
                        gpu_mem_gb=gpu_mem_gb, note=f"{what}; 2 + 2 + 12 bytes per parameter"))
    rows += engine_rows(P, gpus, gpu_mem_gb)
    m = memory_per_rank(n, gpus, 0, param_dtype=torch.bfloat16)
    rows.append(row("DDP bf16, no activation checkpointing", gpus, params=m["params"], grads=m["grads"],
                    optimizer=m["optimizer"], activations=act["none"], peak=m["total"] + act["none"] + act["transient"],
                    gpu_mem_gb=gpu_mem_gb, note=f"{what}; every block's activations kept"))
    return rows


def preflight(run) -> None:
    """Day 5's refusals before any process starts (`dlo.registry`'s preflight: `dlo.setup` in the
    notebook and `dlo run` before it call it), each one line, about the launch (`run.ranks`: its preset
    and ranks): more ranks than a weight has rows, a weights_dir that is not a checkpoint of its model
    (or given to CPU ranks standing in for GPUs), and on GPU ranks a plan whose main configurations do
    not fit the GPU's memory (`dlo.plan.DoesNotFit`). Where the recipe does not fit but a smaller
    configuration does (`instead`: one 40 GB GPU, say), the launch's preset (and the notebook's, the
    same on GPU ranks) becomes that one, said in one line."""
    from dlo.experiments.day5 import check_weights, check_world
    from dlo.measure import fmt_bytes
    from dlo.plan import check_fits, device_memory_gb, main_configs

    P, weights_dir = run.ranks.preset, run.params.get("weights_dir", "")
    check_world(P, run.world_size)
    if weights_dir and run.ranks.why:
        raise ValueError(f"weights_dir is for {run.preset.model}, but the launch trains {P.model}: "
                         f"{run.ranks.why}; leave weights_dir empty here")
    check_weights(P, weights_dir)
    if run.ranks.device != "cuda":
        return
    gib = device_memory_gb(run.device)
    chosen, fallback = instead(P, run.world_size, gib, weights=bool(weights_dir))
    if chosen is not P:
        need = recipe_row(P, run.world_size, gib)["total"]
        print(f"{run.day}: {P.model}'s FSDP2 recipe needs {fmt_bytes(need)} per GPU at {run.world_size} "
              f"rank(s), more than this GPU's {gib:.0f} GiB: training {fallback['config']} instead "
              f"({fmt_bytes(fallback['total'])})")
        run.ranks = dataclasses.replace(run.ranks, preset=chosen)  # GPU ranks: the notebook's preset is theirs
        run.preset = chosen
    rows = plan(chosen, gpus=run.world_size, gpu_mem_gb=gib)
    check_fits(rows, main_configs(rows))


__all__ = ["activation_estimate", "engine_claims", "engine_rows", "fsdp2_sent_factor", "fsdp2_shards", "instead",
           "mfu_estimate", "plan", "preflight", "recipe_row", "training_claims"]
