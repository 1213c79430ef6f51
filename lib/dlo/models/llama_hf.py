"""Load a local Hugging Face Llama checkpoint (config.json + *.safetensors) into `dlo.models.llama.Llama`.

Nodes are offline: this reads a folder, never the Hub. Every problem (no config.json, not a Llama,
a tensor missing, of the wrong shape, or left over) is a one-line `CheckpointError` that names it,
raised from the safetensors headers before a single tensor is read (`check_checkpoint`, which `dlo data
check --weights-dir` runs too).

Two loads: `load_hf_weights` reads whole tensors into an unsharded model (one process, a pipeline
stage); `load_hf_sharded` reads only this rank's slices of each tensor into a model sharded by FSDP2 on
the meta device, so that N ranks of a node hold the model once between them, not N full copies (Llama
3.2 3B in fp32: 12.9 GB each).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dlo.models.llama import Llama, LlamaConfig


class CheckpointError(ValueError):
    """A weights folder that is not a loadable Llama checkpoint (one line, names the problem)."""


# HF name -> ours, per block; `{i}` is the block index
_BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def hf_names(cfg: LlamaConfig) -> dict[str, str]:
    """Our parameter name -> the HF tensor name, for every parameter of a `Llama(cfg)` (tied: no lm_head)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for hf, ours in _BLOCK_NAMES.items()})
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def _read_config(weights_dir: Path) -> dict:
    if not weights_dir.is_dir():
        raise CheckpointError(f"weights_dir {weights_dir} is not a folder")
    path = weights_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{weights_dir} has no config.json: not a Hugging Face checkpoint folder")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
        raise CheckpointError(f"{path} describes model_type={hf.get('model_type')!r} architectures={archs}, "
                              "not a Llama (model_type 'llama', LlamaForCausalLM)")
    return hf


def config_from_hf(weights_dir: str | Path) -> LlamaConfig:
    """The `LlamaConfig` of a local HF Llama folder, from its config.json."""
    weights_dir = Path(weights_dir)
    hf = _read_config(weights_dir)
    rope = hf.get("rope_scaling")
    if rope is not None:
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type != "llama3":
            raise CheckpointError(f"{weights_dir}/config.json: rope_scaling type {rope_type!r} is not supported "
                                  "(only 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    try:
        rope = None if rope is None else {"rope_type": "llama3", **{k: rope[k] for k in keys}}
        cfg = LlamaConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0), rope_scaling=rope,
            max_seq_len=hf.get("max_position_embeddings", 2048), tie_embeddings=hf.get("tie_word_embeddings", False))
    except KeyError as e:
        raise CheckpointError(f"{weights_dir}/config.json lacks {e.args[0]!r} (a Llama config field)") from None
    if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise CheckpointError(f"{weights_dir}/config.json: head_dim={hf['head_dim']} != hidden_size/num_attention_heads"
                              f"={cfg.head_dim} is not supported")
    return cfg


def _headers(weights_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """HF tensor name -> (the safetensors file holding it, its shape, its dtype), from the headers only
    (each file opened once; the index says which files when there is one)."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index} is not valid JSON ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (weights_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{index.name} names files absent from {weights_dir}: {', '.join(missing)}")
        files = sorted({weights_dir / f for f in weight_map.values()})
    else:
        files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{weights_dir} has no *.safetensors file")
    headers = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    headers[key] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own errors for a bad header
            raise CheckpointError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0][:100]})") from None
    return headers


def check_checkpoint(weights_dir: str | Path, cfg: LlamaConfig, names: dict[str, str] | None = None,
                     shapes: dict[str, tuple[int, ...]] | None = None,
                     what: str = "the model's config") -> dict[str, tuple[Path, str, str]]:
    """Every check of a local HF Llama folder against `cfg`, on its config.json and the safetensors
    headers (not a tensor read): the config equal to `cfg` (the context length aside), each tensor of
    `names` (ours -> HF; default: all of `hf_names(cfg)`) present with the shape of `shapes` (default:
    a `Llama(cfg)`'s), none left over. Our name -> (file, HF name, dtype), or CheckpointError (one line)."""
    weights_dir = Path(weights_dir)
    theirs, mine = config_from_hf(weights_dir).to_dict(), cfg.to_dict()
    differ = [f"{k} {theirs[k]} vs {mine[k]}" for k in mine if k != "max_seq_len" and theirs[k] != mine[k]]
    if differ:
        raise CheckpointError(f"{weights_dir}/config.json differs from {what}: {'; '.join(differ)}")
    if shapes is None:
        with torch.device("meta"):
            shapes = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters(remove_duplicate=False)}
    headers = _headers(weights_dir)
    names = hf_names(cfg) if names is None else names
    for name, hf in names.items():
        if hf not in headers:
            raise CheckpointError(f"{weights_dir} lacks tensor {hf} (for {name})")
        got, want = headers[hf][1], tuple(shapes[name])
        if got != want:
            raise CheckpointError(f"{hf} in {headers[hf][0].name} has shape {list(got)}, expected {list(want)} "
                                  f"(for {name})")
    known = set(hf_names(cfg).values()) | {"lm_head.weight"}  # some tied checkpoints keep lm_head
    extra = sorted(k for k in headers if k not in known and not k.endswith("rotary_emb.inv_freq"))  # old HF buffers
    if extra:
        raise CheckpointError(f"{weights_dir} has {len(extra)} unexpected tensor(s): {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""))
    return {name: (headers[hf][0], hf, headers[hf][2]) for name, hf in names.items()}


def load_hf_weights(model: Llama, weights_dir: str | Path, device: str | torch.device = "cpu") -> Llama:
    """Load a local HF Llama checkpoint into `model` (in its parameters' dtype) and return it.

    A model on the meta device gets the tensors assigned on `device`; a materialised one is copied
    into, where it lives. The tie is restored and the RoPE buffer recomputed. Every tensor is read whole:
    for a model sharded by FSDP2 (DTensors), `load_hf_sharded` reads each rank's slices only.
    """
    weights_dir = Path(weights_dir)
    ours = dict(model.named_parameters())  # a tied weight appears once
    if any(isinstance(p, DTensor) for p in ours.values()):
        raise ValueError("load_hf_weights: the model is already sharded (DTensor); use load_hf_sharded")
    names = {name: hf for name, hf in hf_names(model.config).items() if name in ours}  # a stage may lack blocks
    if model.config.tie_embeddings and "output.weight" in ours and "tok_embeddings.weight" not in ours:
        names["output.weight"] = "model.embed_tokens.weight"  # a last pipeline stage: its head is the embedding
    where = check_checkpoint(weights_dir, model.config, names, {n: tuple(ours[n].shape) for n in names},
                             what="the model's config")  # every check on the headers, before any tensor is read
    meta = any(p.is_meta for p in ours.values())
    state = {}
    for name, (path, hf, _) in where.items():
        p = ours[name]
        with safe_open(path, framework="pt", device=str(device if meta else p.device)) as st:
            state[name] = st.get_tensor(hf).to(p.dtype)
    if "output.weight" not in state and model.output is not None:  # tied: load_state_dict expects both names
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.no_grad():
        model.load_state_dict(state, strict=True, assign=meta)
    model.tie_weights()  # assign=True gave output its own Parameter
    with torch.no_grad():
        if model.inv_freq.is_meta:
            model.inv_freq = torch.empty(model.inv_freq.shape, device=device)
        model.init_rope()  # never in the checkpoint: it follows from the config
    return model


# ---------------------------------------------------------------- straight into each rank's shards

def parameter_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Our name -> (module, attribute) of every parameter. Take it before activation checkpointing,
    compile or FSDP wrap the model: they change the parameters' paths (and FSDP the Parameters), never
    the modules that hold them, so `load_hf_sharded` finds each parameter where it lives afterwards."""
    return {f"{path}.{attr}" if path else attr: (module, attr)
            for path, module in model.named_modules() for attr, _ in module.named_parameters(recurse=False)}


def local_region(p: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor that this rank holds of `p`: all of it for a plain tensor; for a
    DTensor, its Shard placements applied mesh dimension by mesh dimension, each cutting `torch.chunk`'s
    way (chunks of ceil(n/k) rows, the last ones shorter or empty), as DTensor and FSDP2 cut."""
    bounds = [[0, n] for n in p.shape]
    if not isinstance(p, DTensor):
        return tuple(slice(lo, hi) for lo, hi in bounds)
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:  # _StridedShard (FSDP over TP), Partial: not cut by rows
            raise ValueError(f"load_hf_sharded: placement {placement} is not supported (plain Shard and Replicate "
                             "only): FSDP2 over a tensor-parallel layout is not loaded by slices here")
        lo, hi = bounds[placement.dim]
        step = -(-(hi - lo) // p.device_mesh.size(mesh_dim))
        c = p.device_mesh.get_local_rank(mesh_dim)  # the process group's rank, as FSDP2 reads it
        bounds[placement.dim] = [min(lo + c * step, hi), min(lo + (c + 1) * step, hi)]
    return tuple(slice(lo, hi) for lo, hi in bounds)


def load_hf_sharded(model: Llama, slots: dict[str, tuple[nn.Module, str]], weights_dir: str | Path) -> int:
    """Fill every parameter of a sharded, materialised `model` (FSDP2 `fully_shard` on the meta device,
    then `to_empty`) with this rank's slices of a local HF checkpoint; return the bytes read.

    `slots`: `parameter_slots(model)` taken before sharding. Each tensor's slice is read on its own
    (`safe_open(...).get_slice`, memory-mapped) and copied into the local shard in the shard's dtype and
    device, so a rank's host memory holds at most one slice beside its shards: never a full tensor, never
    a full copy of the model. The checks of `check_checkpoint` come first; the tie and RoPE are restored.
    """
    cfg = model.config
    params = {name: getattr(module, attr) for name, (module, attr) in slots.items()}
    if any((p.to_local() if isinstance(p, DTensor) else p).is_meta for p in params.values()):
        raise ValueError("load_hf_sharded: the model is still on the meta device; call model.to_empty(device=...) "
                         "after sharding, then load")
    names = {name: hf for name, hf in hf_names(cfg).items() if name in params}
    where = check_checkpoint(weights_dir, cfg, names, {n: tuple(params[n].shape) for n in names})
    by_file: dict[Path, list[str]] = {}
    for name, (path, _, _) in where.items():
        by_file.setdefault(path, []).append(name)
    read = 0
    with torch.no_grad():
        for path, file_names in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as st:
                for name in file_names:
                    p = params[name]
                    local = p.to_local() if isinstance(p, DTensor) else p
                    region = local_region(p)
                    if tuple(s.stop - s.start for s in region) != tuple(local.shape):
                        raise RuntimeError(f"load_hf_sharded: {name}'s local shard has shape {list(local.shape)}, "
                                           f"its rows by the placements {[(s.start, s.stop) for s in region]}")
                    if local.numel() == 0:
                        continue  # a rank past the last row (more ranks than rows of this tensor)
                    piece = st.get_slice(where[name][1])[region]
                    local.copy_(piece)  # to the shard's device and dtype (bf16 on disk, fp32 master here)
                    read += piece.numel() * piece.element_size()
                    del piece
        model.tie_weights()
        model.init_rope()  # never in the checkpoint: after to_empty the buffer holds garbage
    return read
