"""Published training layouts, each with its source, beside `dlo.layout.search` on the same problem.

Every row is copied from one table of one file and says which: a number that could not be read in
its source is not here. The rows are torchtitan's H100 benchmarks (`benchmarks/
llama3_h100_202412_torchtitan.md` in github.com/pytorch/torchtitan, runs of torchtitan commit 9dec370,
December 2024): Grand Teton hosts of 8 H100 (96 GB HBM2e, 500 W power limit: below the SXM's peak,
the file says), NVLink inside a host, 400 Gb/s RDMA per GPU between hosts. Their captions give the
degrees, batches and checkpointing, the tables tokens/s per GPU and the peak memory; the sequence
length is not in the captions: 8,192 is `seq_len` of `train_configs/llama3_{8b,70b,405b}.toml` at that
commit (an assumption: the configs the runs started from). Where a table lists several techniques,
the row keeps the one closest to what `dlo.layout` models (plain FSDP without compile for the 8B;
the 70B and 405B tables have no plain run: they include torch.compile, Float8 and async TP, named in
`extras`).

`compare(row)` runs the reference search on the row's model, GPU count, device and global batch (the
model on the meta device, `dlo.layout.Model.measure`), and evaluates the published layout with the same
two models (`memory_bytes`, `step_time`): `dlo.layout` knows no selective checkpointing, so a
"selective" row is evaluated with full checkpointing (its memory then a lower bound, its time an upper
bound). Context parallelism's rows (Table 2: the 8B at FSDP x CP = 8, one sequence per FSDP rank, 32k to
262k tokens) are compared too: FSDP shards over dp x cp there, as in `dlo.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.errors import BadInput

TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN_SEQ = "seq 8192: train_configs/llama3_{8b,70b,405b}.toml at torchtitan 9dec370 (not in the table)"


@dataclass(frozen=True)
class Published:
    source: str        # repository + path + table
    model: str         # a `dlo.models.llama` name where the library has the model
    gpus: int
    fsdp: int          # data_parallel_shard_degree (torchtitan), replicate degree 1
    tp: int
    pp: int
    cp: int
    local_batch: int   # sequences per data-parallel rank and step
    global_batch: int  # sequences per step
    seq: int
    ac: str            # "none", "selective" or "full"
    extras: str        # what else the run used (compile, Float8, async TP, the pipeline schedule)
    tokens_per_s_gpu: float
    mem_gib: float     # peak memory per GPU, as published
    gpu: str           # a `dlo.hardware.LINKS` label
    gpu_mem_gib: float


_H100_96 = dict(gpu="H100 SXM", gpu_mem_gib=96.0, seq=8192)

PUBLISHED: list[Published] = [
    Published(f"{TORCHTITAN}, Table 1 (row FSDP)", "llama3.1-8b", 8, 8, 1, 1, 1, 2, 16, ac="selective",
              extras="none", tokens_per_s_gpu=5762, mem_gib=82.4, **_H100_96),
    Published(f"{TORCHTITAN}, Table 3 (row FSDP)", "llama3.1-8b", 128, 128, 1, 1, 1, 2, 256, ac="selective",
              extras="none", tokens_per_s_gpu=5605, mem_gib=67.0, **_H100_96),
    Published(f"{TORCHTITAN}, Table 4 (row 2D)", "llama3.1-70b", 256, 32, 8, 1, 1, 16, 512, ac="full",
              extras="torch.compile, Float8", tokens_per_s_gpu=829, mem_gib=71.9, **_H100_96),
    *(Published(f"{TORCHTITAN}, Table 2 (row FSDP {8 // cp}, CP {cp})", "llama3.1-8b", 8, 8 // cp, 1, 1, cp, 1,
                8 // cp, ac="full", extras="torch.compile, Float8", tokens_per_s_gpu=tps, mem_gib=mem,
                **{**_H100_96, "seq": seq})
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))),
    Published(f"{TORCHTITAN}, Table 5 (row 1F1B)", "llama3.1-405b", 512, 8, 8, 8, 1, 32, 256, ac="full",
              extras="torch.compile, Float8, async TP, 1F1B", tokens_per_s_gpu=100, mem_gib=82.5, **_H100_96),
]


def check_row(row: Published) -> None:
    """BadInput unless the row is consistent: a source naming its table, fsdp tp pp cp = GPUs, and the
    global batch = local batch x data-parallel degree (TP, PP and CP ranks share their sequences)."""
    if "Table" not in row.source or "/" not in row.source:
        raise BadInput(f"{row.model}: the source must name a file and a table, got {row.source!r}")
    if row.fsdp * row.tp * row.pp * row.cp != row.gpus:
        raise BadInput(f"{row.source}: fsdp {row.fsdp} x tp {row.tp} x pp {row.pp} x cp {row.cp} != {row.gpus} GPUs")
    if row.local_batch * row.fsdp != row.global_batch:
        raise BadInput(f"{row.source}: local batch {row.local_batch} x dp {row.fsdp} != global {row.global_batch}")
    if row.ac not in ("none", "selective", "full"):
        raise BadInput(f"{row.source}: checkpointing {row.ac!r} is not one of none, selective, full")


def layout_text(dp: int, fsdp: bool, tp: int, pp: int, cp: int = 1) -> str:
    return f"{'FSDP' if fsdp else 'DP'} {dp} x TP {tp} x PP {pp}" + (f" x CP {cp}" if cp > 1 else "")


def attention_share(model, seq: int) -> float:
    """FLOPs of attention's score and value matmuls (12 l h s per token, forward and backward, no causal
    saving) over the 6 FLOPs per parameter that `dlo.layout.step_time` counts: what its time leaves out."""
    return 12 * model.layers * model.hidden * seq / (6 * (model.layers * model.layer_params + model.embedding))


def compare(row: Published, model=None) -> list[dict] | None:
    """Three rows for `row`: the published run (measured), its layout in `dlo.layout`'s models, and
    `dlo.layout.search`'s choice; None where the library has no such model. `model`: a `dlo.layout.Model`
    measured already (else measured here, meta device)."""
    from dlo.layout import Cluster, Layout, Model, fits, memory_bytes, search, step_time
    from dlo.models.llama import LlamaConfig

    check_row(row)
    try:
        LlamaConfig.from_name(row.model)
    except (KeyError, ValueError):
        return None
    model = model or Model.measure(row.model, row.seq)
    cluster = Cluster(row.gpu, row.gpus, mem_gib=row.gpu_mem_gib)
    theirs = Layout(row.fsdp, row.tp, row.pp, row.fsdp * row.cp > 1, max(1, row.pp), row.ac != "none", row.cp)
    ours = search(model, cluster, row.global_batch)
    tokens = row.global_batch * row.seq
    case = f"{row.model}, {row.gpus} GPUs, {row.global_batch} x {row.seq}"

    def modelled(lay, who, ac):
        return {"case": case, "layout by": who, "layout": layout_text(lay.dp, lay.fsdp, lay.tp, lay.pp, lay.cp),
                "m": lay.m,
                "AC": ac, "GiB/GPU": round(memory_bytes(model, lay, cluster, row.global_batch) / 2**30, 1),
                "fits": fits(model, lay, cluster, row.global_batch),
                "tokens/s/GPU": round(tokens / step_time(model, lay, cluster, row.global_batch) / row.gpus),
                "source": "dlo.layout (at peak bf16)"}

    published = {"case": case, "layout by": "published (measured)",
                 "layout": layout_text(row.fsdp, row.fsdp * row.cp > 1, row.tp, row.pp, row.cp), "m": "-", "AC": row.ac,
                 "GiB/GPU": row.mem_gib, "fits": "ran", "tokens/s/GPU": row.tokens_per_s_gpu,
                 "source": row.source + (f"; {row.extras}" if row.extras != "none" else "")}
    ac_theirs = "full" + (" (for selective)" if row.ac == "selective" else "") if theirs.ac else "none"
    return [published, modelled(theirs, "published layout, our model", ac_theirs),
            modelled(ours, "dlo.layout.search", "full" if ours.ac else "none")]


def compare_all(rows: list[Published] = PUBLISHED) -> tuple[list[dict], list[str]]:
    """`compare` of every row (one model measurement per model and sequence length), and the sources
    of the rows the library cannot compare, with the reason."""
    from dlo.layout import Model
    from dlo.models.llama import LlamaConfig

    out, skipped, models = [], [], {}
    for row in rows:
        try:
            LlamaConfig.from_name(row.model)
        except (KeyError, ValueError):
            skipped.append(f"{row.source}: no {row.model} in dlo.models.llama")
            continue
        key = (row.model, row.seq)
        models[key] = models.get(key) or Model.measure(*key)
        out += compare(row, models[key])
    return out, skipped


__all__ = ["PUBLISHED", "Published", "TORCHTITAN", "TORCHTITAN_SEQ", "attention_share", "check_row", "compare",
           "compare_all", "layout_text"]
