"""Day 5, section 6.8: gradient accumulation and clipping when no rank holds the whole gradient.

`accumulate_and_clip(world_size, micro)` trains the `tiny` Llama config (whatever the profile: the
counts and the equality do not depend on the size; the ranks run on CPUs over gloo) for `STEPS` SGD
steps with each of our ZeRO engines, every step as `micro` micro-batches (loss / micro, one backward
each) followed by clipping at `max_norm`, and once more with the mistake of clipping each rank's shard
by its own norm. Beside them, one process on the whole global batch with torch's `clip_grad_norm_`.
It counts, exactly (`dlo.measure.CommCounter`, per rank, the last step):

- the reduce-scatter bytes: ZeRO-1 keeps the full gradient and reduces it once per step; ZeRO-2 and
  ZeRO-3 reduce every micro-batch's gradient as backward produces it, `micro` times the bytes, which
  is what they exchange for never holding the whole gradient (FSDP2's `set_requires_gradient_sync(False)`
  makes the other choice: full gradients kept until the last micro-batch);
- the all-reduce the clipping adds: one scalar, the sum of the squared shards.

and the largest difference of the parameters from the one-process run. Nothing here is timed.
"""

from __future__ import annotations

import torch

from dlo import claims as C
from dlo import estimates as E

STEPS = 2
BATCH, SEQ = 2, 16  # sequences per micro-batch and rank, tokens per sequence
TORCH_FSDP = "torch fully_shard docs (set_requires_gradient_sync: accumulation without communication)"


def _engine(stage: int, model, lr: float):
    from dlo.distributed.zero import ZeRO1, ZeRO2, ZeRO3

    if stage == 1:
        return ZeRO1(model, torch.optim.SGD, lr=lr)
    if stage == 2:
        return ZeRO2(model, torch.optim.SGD, lr=lr, bucket_cap_mb=0.25)
    return ZeRO3(model, torch.optim.SGD, lr=lr, units=list(model.layers.values()))


def _micro_batches(step: int, rank: int, micro: int) -> list[tuple]:
    """This rank's `micro` micro-batches (x, y) of `step`: random tokens, drawn from (step, rank) alone."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    vocab = _config().vocab_size
    return [tuple(torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(2)) for _ in range(micro)]


def _config():
    from dlo.models.llama import LlamaConfig

    return LlamaConfig.from_name("tiny")


def _worker(micro: int, max_norm: float, lr: float) -> dict:
    import torch.distributed as dist

    from dlo.experiments.day5_data import build, lm_loss
    from dlo.measure import CommCounter

    r = dist.get_rank()
    cfg = _config()
    out = {}
    for name, stage, local in (("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3", 3, False),
                               ("ZeRO-2, each shard clipped by its own norm", 2, True)):
        model = build(cfg, "cpu", seed=0)
        engine = _engine(stage, model, lr)
        for step in range(STEPS):
            mine = _micro_batches(step, r, micro)
            with CommCounter() as comm:
                for x, y in mine:
                    (lm_loss(engine, x, y) / micro).backward()
                if local:  # the mistake: a factor per rank, from 1/N of the gradient
                    engine.reduce_gradients()
                    norm = torch.nn.utils.clip_grad_norm_([g.shard for g in engine.groups], max_norm)
                else:
                    norm = engine.clip_grad_norm_(max_norm)
                engine.step()
            engine.zero_grad()
        seen = _seen_blocks(model, engine, mine[0][0][:1])
        out[name] = {"kinds": comm.by_kind(), "norm": float(norm), "params": seen}
    dist.barrier()
    return out


def _seen_blocks(model, engine, x) -> dict:
    """Every block's parameters as the block sees them during a forward (ZeRO-3 holds them only then)."""
    seen: dict = {}

    def record(module, args, i):
        seen.update({f"layers.{i}.{k}": v.detach().clone() for k, v in module.named_parameters()})

    for i, layer in model.layers.items():
        layer.register_forward_pre_hook(lambda m, a, i=i: record(m, a, i))
    with torch.no_grad():
        engine(x)
    return seen


def _reference(world_size: int, micro: int, max_norm: float, lr: float) -> tuple[list[float], dict]:
    from dlo.experiments.day5_data import build, lm_loss

    model = build(_config(), "cpu", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for step in range(STEPS):
        parts = [xy for rank in range(world_size) for xy in _micro_batches(step, rank, micro)]
        x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        opt.zero_grad()
        lm_loss(model, x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    return norms, {k: v.detach() for k, v in model.named_parameters() if k.startswith("layers.")}


def accumulate_and_clip(world_size: int = 2, micro: int = 4, max_norm: float = 0.5, lr: float = 0.5) -> dict:
    """Rows per engine (rank 0's counts; every rank's parameters compared) and the reference's norms."""
    from dlo.distributed import launch

    if world_size < 2 or micro < 1 or max_norm <= 0:
        raise ValueError(f"need world_size >= 2, micro >= 1, max_norm > 0; got {world_size}, {micro}, {max_norm}")
    ranks = launch(_worker, world_size, micro, max_norm, lr, backend="gloo", timeout=300)
    norms, want = _reference(world_size, micro, max_norm, lr)
    rows = []
    for name in ranks[0]:
        kinds = ranks[0][name]["kinds"]
        diff = max(float((got[name]["params"][k] - w).abs().max()) for got in ranks for k, w in want.items())
        rows.append({"engine": name, "reduce-scatters": kinds.get("reduce_scatter", {}).get("calls", 0),
                     "reduce-scatter B": kinds.get("reduce_scatter", {}).get("bytes", 0),
                     "all-reduce B": kinds.get("all_reduce", {}).get("bytes", 0),
                     "norm (rank 0)": ranks[0][name]["norm"], "max |param - one process|": diff})
    return {"rows": rows, "reference_norm": norms[-1], "micro": micro, "world_size": world_size,
            "clipped": min(norms) > max_norm}


def claims(res: dict) -> list[C.Claim]:
    """The counts beside what the mechanisms predict; the updates beside one process's."""
    by = {r["engine"]: r for r in res["rows"]}
    k = res["micro"]
    z1, z2, z3 = by["ZeRO-1"], by["ZeRO-2"], by["ZeRO-3"]
    local = next(r for name, r in by.items() if "own norm" in name)
    rows = [C.Claim(f"ZeRO-2/3 reduce-scatter every micro-batch: {k} x ZeRO-1's gradient bytes per step",
                    TORCH_FSDP, f"{k}x", C.approx(k, rel=0.01),
                    E.exact(z2["reduce-scatter B"] / z1["reduce-scatter B"], "ZeRO-2 / ZeRO-1 reduce-scatter "
                            "bytes of one step, counted")),
            C.Claim("clipping a sharded gradient costs one all-reduce of a scalar", "DeepSpeed ZeRO: the norm "
                    "from the partitions", "8 bytes", C.at_most(8.0, "<= 8 B"),
                    E.exact(float(z3["all-reduce B"]), "ZeRO-3 all-reduce bytes of one step, counted")),
            C.Claim("accumulated, clipped, sharded: the update of one process on the whole batch", "(definition)",
                    "same parameters", C.at_most(1e-5, "<= 1e-5"),
                    E.exact(max(r["max |param - one process|"] for r in (z1, z2, z3)),
                            "largest |difference| over ZeRO-1/2/3, every rank, fp32")),
            C.Claim("... but not when each rank clips its shard by its own norm", "(the usual slip)",
                    "different parameters", C.at_least(1e-5, "> 1e-5"),
                    E.exact(local["max |param - one process|"], "largest |difference|, every rank, fp32"))]
    if not res["clipped"]:
        rows = rows[:2] + [C.not_measurable(r.claim, r.source, r.claimed, "max_norm above the gradient's norm: "
                                             "nothing was clipped") for r in rows[2:]]
    return rows
