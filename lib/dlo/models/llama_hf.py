"""Load a local Hugging Face Llama checkpoint (config.json + *.safetensors) into `dlo.models.llama.Llama`.

Nodes are offline: this reads a folder, never the Hub. Every problem (no config.json, not a Llama,
a tensor missing, of the wrong shape, or left over) is a one-line `CheckpointError` that names it,
raised from the safetensors headers before a single tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

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


def _tensor_files(weights_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index when there is one)."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (weights_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{index.name} names files absent from {weights_dir}: {', '.join(missing)}")
        return {key: weights_dir / f for key, f in weight_map.items()}
    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{weights_dir} has no *.safetensors file")
    where = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            where.update({key: f for key in st.keys()})
    return where


def _shape(path: Path, key: str) -> tuple[int, ...]:
    with safe_open(path, framework="pt") as st:
        return tuple(st.get_slice(key).get_shape())


def load_hf_weights(model: Llama, weights_dir: str | Path, device: str | torch.device = "cpu") -> Llama:
    """Load a local HF Llama checkpoint into `model` (in its parameters' dtype) and return it.

    A model on the meta device gets the tensors assigned on `device`; a materialised one is copied
    into, where it lives. The tie is restored and the RoPE buffer recomputed. Not for DTensor-sharded
    models (load first, then shard; or use torch.distributed.checkpoint).
    """
    weights_dir = Path(weights_dir)
    ours = dict(model.named_parameters())  # a tied weight appears once
    if any(isinstance(p, DTensor) for p in ours.values()):
        raise ValueError("load_hf_weights: the model is already sharded (DTensor); load it first, then shard")
    theirs, mine = config_from_hf(weights_dir).to_dict(), model.config.to_dict()
    differ = [f"{k} {theirs[k]} vs {mine[k]}" for k in mine if k != "max_seq_len" and theirs[k] != mine[k]]
    if differ:
        raise CheckpointError(f"{weights_dir}/config.json differs from the model's config: {'; '.join(differ)}")
    where = _tensor_files(weights_dir)
    names = {name: hf for name, hf in hf_names(model.config).items() if name in ours}  # a stage may lack blocks
    if model.config.tie_embeddings and "output.weight" in ours and "tok_embeddings.weight" not in ours:
        names["output.weight"] = "model.embed_tokens.weight"  # a last pipeline stage: its head is the embedding
    for name, hf in names.items():  # every check on the headers, before any tensor is read
        if hf not in where:
            raise CheckpointError(f"{weights_dir} lacks tensor {hf} (for {name})")
        got, want = _shape(where[hf], hf), tuple(ours[name].shape)
        if got != want:
            raise CheckpointError(f"{hf} in {where[hf].name} has shape {list(got)}, expected {list(want)} (for {name})")
    known = set(hf_names(model.config).values()) | {"lm_head.weight"}  # some tied checkpoints keep lm_head
    extra = sorted(k for k in where if k not in known and not k.endswith("rotary_emb.inv_freq"))  # old HF buffers
    if extra:
        raise CheckpointError(f"{weights_dir} has {len(extra)} unexpected tensor(s): {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""))
    meta = any(p.is_meta for p in ours.values())
    state = {}
    for name, hf in names.items():
        p = ours[name]
        with safe_open(where[hf], framework="pt", device=str(device if meta else p.device)) as st:
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
