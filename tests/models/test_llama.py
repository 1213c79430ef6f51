"""dlo.models.llama: sizes on meta, the attention and RoPE maths against independent forms, the tie
through to_empty / sharding / loading, and the Hugging Face loader on checkpoints written here."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from dlo.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    apply_rope,
    count_parameters,
    grouped_query_attention,
    rope_cos_sin,
    rope_frequencies,
)
from dlo.models.llama_hf import CheckpointError, config_from_hf, hf_names, load_hf_weights
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

def formula_count(c: LlamaConfig) -> int:
    """V d (embedding, once if tied) + L (q, o: d*H*hd; k, v: d*Hkv*hd; SwiGLU 3 d f; two norms) + final norm."""
    hd = c.dim // c.n_heads
    per_layer = 2 * c.dim * c.n_heads * hd + 2 * c.dim * c.n_kv_heads * hd + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.n_layers * per_layer + c.dim


def tiny_model(seed=0, **overrides) -> Llama:
    model = Llama(LlamaConfig.from_name("tiny", **overrides))
    model.init_weights(seed=seed)
    return model


# ---------------------------------------------------------------- config and sizes
def test_parameter_counts_on_meta():
    for name, want in [("llama3.2-3b", 3_212_749_824), ("llama3.2-1b", 1_235_814_400)]:
        cfg = LlamaConfig.from_name(name)
        with torch.device("meta"):
            model = Llama(cfg)
        assert all(p.is_meta for p in model.parameters()) and model.inv_freq.is_meta  # nothing allocated
        assert model.output.weight is model.tok_embeddings.weight
        assert count_parameters(model) == formula_count(cfg) == want, name
    with torch.device("meta"):
        untied = Llama(LlamaConfig.from_name("llama3.2-3b", tie_embeddings=False))
    assert count_parameters(untied) == 3_606_752_256


def test_presets_and_bad_config():
    c = LlamaConfig.from_name("llama3.2-3b")
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.head_dim) == \
        (128256, 3072, 28, 24, 8, 8192, 128)
    assert c.rope_scaling["factor"] == 32 and c.rope_scaling["original_max_position_embeddings"] == 8192
    assert set(PRESETS) == {"llama3.2-3b", "llama3.2-1b", "llama3.1-8b", "llama3.1-70b", "tiny"}
    with pytest.raises(ValueError, match="unknown Llama preset 'llama9'"):
        LlamaConfig.from_name("llama9")
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        LlamaConfig.from_name("tiny", n_kv_heads=3)


# ---------------------------------------------------------------- forward
def test_forward_shape_and_causality():
    model = tiny_model()
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))  # T > original context 64
    logits = model(tokens)
    assert logits.shape == (2, 96, 256)
    changed = tokens.clone()
    changed[:, 50] = (changed[:, 50] + 1) % 256
    logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :50], logits[:, :50], rtol=0, atol=1e-6)  # the past does not see t=50
    assert (logits2[:, 50:] - logits[:, 50:]).abs().amax() > 1e-3  # ...the present and future do
    with pytest.raises(ValueError, match="longer than max_seq_len=256"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_gqa_attention_equals_naive_float64():
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, D = 2, 6, 2, 7, 5
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    group = H // Hkv
    k_rep, v_rep = k[:, [h // group for h in range(H)]], v[:, [h // group for h in range(H)]]  # (B, H, T, D)
    scores = q @ k_rep.transpose(-1, -2) / math.sqrt(D)
    scores = scores + torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    want = scores.softmax(-1) @ v_rep
    torch.testing.assert_close(grouped_query_attention(q, k, v), want, rtol=0, atol=1e-12)


def reference_llama3_frequency(i: int, head_dim: int, theta: float, factor, low, high, L) -> tuple[float, str]:
    """Meta's scalar loop (apply_scaling), written out independently, and the band of index i."""
    freq = theta ** (-2 * i / head_dim)
    wavelen = 2 * math.pi / freq
    if wavelen < L / high:
        return freq, "high"
    if wavelen > L / low:
        return freq / factor, "low"
    s = (L / wavelen - low) / (high - low)
    return (1 - s) * freq / factor + s * freq, "smoothed"


@pytest.mark.parametrize("name", ["llama3.2-3b", "tiny"])
def test_llama3_scaled_frequencies(name):
    cfg = LlamaConfig.from_name(name)
    r = cfg.rope_scaling
    got = rope_frequencies(cfg)
    bands = set()
    for i in range(cfg.head_dim // 2):
        want, band = reference_llama3_frequency(i, cfg.head_dim, cfg.rope_theta, r["factor"], r["low_freq_factor"],
                                                r["high_freq_factor"], r["original_max_position_embeddings"])
        assert math.isclose(got[i].item(), want, rel_tol=1e-6), (i, band)
        bands.add(band)
    assert bands == {"high", "smoothed", "low"}  # every branch of the scaling was exercised


def test_rotate_half_rope_equals_complex_form():
    g = torch.Generator().manual_seed(2)
    B, H, T, D = 2, 3, 40, 16
    x = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    inv_freq = rope_frequencies(LlamaConfig.from_name("tiny"))
    cos, sin = rope_cos_sin(inv_freq, T)
    got = apply_rope(x, cos, sin)
    # Meta/RoFormer form: interleaved pairs (z_2i, z_2i+1) as complex numbers times e^{i t theta_i};
    # HF's half-split layout pairs (x_i, x_{i+D/2}), so interleave first and split back after.
    z = torch.stack((x[..., : D // 2], x[..., D // 2:]), dim=-1)  # (B, H, T, D/2, 2)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]  # (T, D/2)
    rotated = torch.view_as_real(torch.view_as_complex(z.contiguous()) * torch.polar(torch.ones_like(angles), angles))
    want = torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # angles are formed in float32, as Meta and HF do


# ---------------------------------------------------------------- init and the tie
def test_meta_to_empty_init_keeps_tie_and_is_deterministic():
    cfg = LlamaConfig.from_name("tiny")
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")  # nn.Module.to_empty alone gives output its own Parameter
    assert model.output.weight is model.tok_embeddings.weight
    model.init_weights(seed=0)
    assert count_parameters(model) == formula_count(cfg)
    torch.testing.assert_close(model.inv_freq, rope_frequencies(cfg), rtol=0, atol=0)
    ref = tiny_model(seed=0)
    tokens = torch.randint(0, 256, (1, 20))
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=0, atol=0)
    model(tokens).sum().backward()
    assert model.tok_embeddings.weight.grad is not None and model.output.weight.grad is model.tok_embeddings.weight.grad
    assert torch.all(model.layers["1"].ffn_norm.weight == 1)
    assert not torch.equal(tiny_model(seed=1).layers["0"].attention.wq.weight, ref.layers["0"].attention.wq.weight)


def test_init_per_parameter_independent_of_other_blocks_and_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = tiny_model(seed=5)
    stage = Llama(LlamaConfig.from_name("tiny"))
    del stage.layers["0"]  # a pipeline stage holding block 1 only
    stage.layers["1"] = checkpoint_wrapper(stage.layers["1"])
    stage.init_weights(seed=5)
    inner = stage.layers["1"]._checkpoint_wrapped_module
    for name, p in ref.layers["1"].named_parameters():
        torch.testing.assert_close(inner.get_parameter(name), p, rtol=0, atol=0)


def test_sharded_init_and_tie_under_fully_shard_and_tp():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dlo.plan import fake_world

    cfg = LlamaConfig.from_name("tiny")
    ref = tiny_model(seed=3)
    with fake_world(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            fsdp, tp = Llama(cfg), Llama(cfg)
        for block in fsdp.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)  # the root unit holds embedding, norm and output together: tie kept
        assert fsdp.output.weight is fsdp.tok_embeddings.weight
        fsdp.to_empty(device="cpu")
        fsdp.init_weights(seed=3)
        assert fsdp.output.weight is fsdp.tok_embeddings.weight and count_parameters(fsdp) == formula_count(cfg)
        for name, p in fsdp.named_parameters():  # each shard is its slice of the single-process init
            (coord,) = p.device_mesh.get_coordinate()  # (a fake world may cache the mesh of rank 0)
            want = ref.get_parameter(name).tensor_split(2, dim=0)[coord]
            torch.testing.assert_close(p.to_local(), want, rtol=0, atol=0, msg=name)
        parallelize_module(tp, mesh, {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()})
        assert tp.output.weight is not tp.tok_embeddings.weight  # parallelize_module unties...
        tp.to_empty(device="cpu")  # ...to_empty (or tie_weights()) ties again: both Shard(0) of the vocab
        assert tp.output.weight is tp.tok_embeddings.weight
        assert dist.get_world_size() == 2


# ---------------------------------------------------------------- the Hugging Face loader
def write_hf_checkpoint(model: Llama, folder, shards: int = 2, **config_changes) -> None:
    """A Hugging Face-style folder: config.json and the weights under HF names, in `shards` files."""
    c = model.config
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size,
                  hidden_size=c.dim, intermediate_size=c.ffn_dim, num_hidden_layers=c.n_layers,
                  num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps,
                  rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, max_position_embeddings=c.max_seq_len,
                  tie_word_embeddings=c.tie_embeddings, torch_dtype="float32")
    config.update(config_changes)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    params = dict(model.named_parameters())
    tensors = {hf: params[ours].detach().clone() for ours, hf in hf_names(c).items()}
    keys = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = keys[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, folder / fname)
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tied,shards", [(True, 2), (False, 1)])
def test_hf_round_trip(tmp_path, tied, shards):
    source = tiny_model(seed=7, tie_embeddings=tied)
    write_hf_checkpoint(source, tmp_path, shards=shards)
    cfg = config_from_hf(tmp_path)
    assert cfg == source.config
    tokens = torch.randint(0, 256, (2, 80))
    want = source(tokens)
    with torch.device("meta"):
        meta = Llama(cfg)
    load_hf_weights(meta, tmp_path)  # assigned onto the CPU
    materialised = load_hf_weights(tiny_model(seed=8, tie_embeddings=tied), tmp_path)  # copied into
    for model in (meta, materialised):
        assert (model.output.weight is model.tok_embeddings.weight) == tied
        assert not any(p.is_meta for p in model.parameters()) and not model.inv_freq.is_meta
        torch.testing.assert_close(model(tokens), want, rtol=0, atol=0)
    stage = Llama(cfg)  # a last pipeline stage: block 1 and the head (the embedding's weights when tied)
    stage.tok_embeddings = None
    del stage.layers["0"]
    load_hf_weights(stage, tmp_path)
    torch.testing.assert_close(stage.output.weight, source.output.weight, rtol=0, atol=0)
    torch.testing.assert_close(stage.layers["1"].ffn_norm.weight, source.layers["1"].ffn_norm.weight, rtol=0, atol=0)


def test_hf_loader_errors(tmp_path):
    good = tiny_model(seed=0)
    model = tiny_model(seed=1)

    def broken(name, edit=None, **config_changes):
        folder = tmp_path / name
        write_hf_checkpoint(good, folder, shards=1, **config_changes)
        if edit is not None:
            from safetensors.torch import load_file
            tensors = load_file(folder / "model.safetensors")
            edit(tensors)
            save_file(tensors, folder / "model.safetensors")
        return folder

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config.json: not a Hugging Face checkpoint folder"):
        load_hf_weights(model, tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"model_type='mistral'.*not a Llama"):
        config_from_hf(broken("mistral", model_type="mistral", architectures=["MistralForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"differs from the model's config: norm_eps 1e-06 vs 1e-05"):
        load_hf_weights(model, broken("eps", rms_norm_eps=1e-6))
    missing = r"lacks tensor model.layers.1.mlp.up_proj.weight \(for layers.1.feed_forward.w3"
    with pytest.raises(CheckpointError, match=missing):
        load_hf_weights(model, broken("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))

    def reshape(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    wrong = r"model.layers.0.self_attn.k_proj.weight .* shape \[16, 64\], expected \[32, 64\]"
    with pytest.raises(CheckpointError, match=wrong):
        load_hf_weights(model, broken("shape", reshape))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): model.layers.0.mlp.bias"):
        load_hf_weights(model, broken("extra", lambda t: t.update({"model.layers.0.mlp.bias": torch.zeros(3)})))
    for a, b in zip(model.parameters(), tiny_model(seed=1).parameters()):  # nothing was loaded by a failed call
        assert torch.equal(a, b)


def test_bfloat16_model_keeps_float32_rope():
    model = tiny_model(seed=0).to(torch.bfloat16)  # the cast rounds the inv_freq buffer too
    assert model.inv_freq.dtype == torch.bfloat16
    tokens = torch.randint(0, 256, (1, 200))
    got = model(tokens)
    model.inv_freq = rope_frequencies(model.config)  # the exact float32 frequencies
    torch.testing.assert_close(got, model(tokens), rtol=0, atol=0)  # forward recomputed them
