"""Day 5's weights: a Llama 3.2 3B folder checked by its config and shapes from the headers (`dlo data
check --weights-dir`, Day 5's preflight), and each rank reading only its slices of every tensor straight
into its FSDP2 shards (`load_hf_sharded`): equal to the full load on its rows, never a whole tensor read,
on a fake world of 3 ranks (uneven rows) and on 2 real gloo ranks through Day 5's `train_fsdp`."""

import dataclasses

import pytest
import torch

from dlo.cli import main as cli_main
from dlo.config import resolve
from dlo.distributed import launch
from dlo.experiments import day5 as E
from dlo.models import llama_hf as H
from dlo.models.llama import Llama, LlamaConfig
from dlo.registry import DAYS
from tests.data.folders import LLAMA_3B_CONFIG, write_sparse_checkpoint
from tests.models.test_llama import tiny_model, write_hf_checkpoint
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


class ReadLog:
    """Stands in for `safetensors.safe_open` in `dlo.models.llama_hf`: records every tensor read (name,
    elements read, the tensor's full shape); headers (shapes, dtypes) are free."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, *args, **kwargs):
        log = self

        class Opened:
            def __enter__(self):
                self.st = log.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.st.__exit__(*exc)

            def keys(self):
                return self.st.keys()

            def get_tensor(self, key):
                t = self.st.get_tensor(key)
                log.reads.append((key, t.numel(), tuple(t.shape)))
                return t

            def get_slice(self, key):
                sl = self.st.get_slice(key)

                class Slice:
                    get_shape, get_dtype = sl.get_shape, sl.get_dtype

                    def __getitem__(self, index):
                        t = sl[index]
                        log.reads.append((key, t.numel(), tuple(sl.get_shape())))
                        return t
                return Slice()
        return Opened()


def llama_3b_shapes() -> dict:
    cfg = LlamaConfig.from_name("llama3.2-3b")
    with torch.device("meta"):
        params = dict(Llama(cfg).named_parameters())
    return {hf: tuple(params[ours].shape) for ours, hf in H.hf_names(cfg).items()}


def test_the_3b_config_is_llama_3_2_3b():
    """The published config.json gives exactly the config of shared/notes-parallel-days.md: vocab 128256,
    hidden 3072, 28 layers, 24 heads of 128, 8 KV heads, MLP 8192, eps 1e-5, RoPE 500000 with llama3
    scaling (32, 1, 4, 8192), tied embedding; 3,212,749,824 parameters."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(LLAMA_3B_CONFIG))
        cfg = H.config_from_hf(d)
    assert cfg == LlamaConfig.from_name("llama3.2-3b") == E.llama_config(DAYS["day5_fsdp"].presets["full"])
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads, cfg.ffn_dim) == \
        (128256, 3072, 28, 24, 128, 8, 8192)
    assert (cfg.norm_eps, cfg.rope_theta, cfg.tie_embeddings) == (1e-5, 500000.0, True)
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
    assert sum(torch.Size(s).numel() for s in llama_3b_shapes().values()) == 3_212_749_824


def test_a_llama_3b_folder_is_checked_by_config_and_shapes(tmp_path, capsys):
    """The real 3B's headers (254 bf16 tensors in 2 files; the data sparse: 6.4 GB on paper, nothing on
    disk, nothing read), then the same folder with one thing wrong at a time."""
    w = tmp_path / "Llama-3.2-3B"
    shapes = llama_3b_shapes()
    assert write_sparse_checkpoint(w, LLAMA_3B_CONFIG, shapes) == 2 * 3_212_749_824
    try:
        assert cli_main(["data", "check", str(tmp_path), "day4_ddp", "--weights-dir", str(w)]) == 0
        line = capsys.readouterr().out.splitlines()[1]
        assert line.startswith("ok   weights")
        assert "llama3.2-3b (day5_fsdp, full): 254 tensors in 2 file(s), BF16" in line
        write_sparse_checkpoint(w, {**LLAMA_3B_CONFIG, "num_key_value_heads": 4}, shapes)
        assert cli_main(["data", "check", str(tmp_path), "day4_ddp", "--weights-dir", str(w)]) == 1
        assert "config.json differs from llama3.2-3b's config: n_kv_heads 4 vs 8" in capsys.readouterr().out
        shapes.pop("model.layers.27.mlp.down_proj.weight")
        write_sparse_checkpoint(w, LLAMA_3B_CONFIG, shapes)
        assert cli_main(["data", "check", str(tmp_path), "day4_ddp", "--weights-dir", str(w)]) == 1
        assert "lacks tensor model.layers.27.mlp.down_proj.weight" in capsys.readouterr().out
    finally:
        for f in w.glob("*.safetensors"):
            f.unlink()


def test_day5_preflight_checks_every_tensor_not_only_the_config(tmp_path):
    """A weights_dir whose config.json is right but whose tensors are not is refused by resolve (it used to
    pass the preflight and fail on every rank after the processes started)."""
    P = DAYS["day5_fsdp"].presets["tiny"]
    write_hf_checkpoint(tiny_model(seed=0), tmp_path, shards=1)
    resolve("day5_fsdp", profile="tiny", weights_dir=str(tmp_path))
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(H.CheckpointError, match=r"k_proj.weight in model.safetensors has shape \[16, 64\], expected "
                                                r"\[32, 64\]"):
        resolve("day5_fsdp", profile="tiny", weights_dir=str(tmp_path))
    assert P.model == "tiny"


def _sharded(cfg, world_size, weights_dir):
    """This rank's model: meta, sharded by FSDP2 over every rank, materialised, its slices loaded."""
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.distributed.fsdp import apply_fsdp

    with torch.device("meta"):
        model = Llama(cfg)
    slots = H.parameter_slots(model)
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)), param_dtype=None, reduce_dtype=None)
    model.to_empty(device="cpu")
    return model, H.load_hf_sharded(model, slots, weights_dir)


@pytest.mark.parametrize("tied", [True, False])
def test_each_rank_reads_only_its_rows(tmp_path, monkeypatch, tied):
    """3 ranks of a fake process group (rows 256 -> 86, 86, 84; 176 -> 59, 59, 58): every local shard equals
    its rows of the full load, each tensor is read once as a slice of exactly those rows, and the bytes
    read add up to the rank's shard (1/3 of the model), never a whole tensor."""
    from torch.distributed.tensor import DTensor

    from dlo.plan import fake_world

    source = tiny_model(seed=3, tie_embeddings=tied)
    write_hf_checkpoint(source, tmp_path, shards=2)
    full = dict(source.named_parameters())
    total = sum(p.numel() for p in full.values())
    for rank in range(3):
        log = ReadLog(H.safe_open)
        monkeypatch.setattr(H, "safe_open", log)
        with fake_world(3, rank):
            model, read = _sharded(source.config, 3, tmp_path)
            local = {n: p.to_local() for n, p in model.named_parameters()}
            assert all(isinstance(p, DTensor) for p in model.parameters())
            assert (model.output.weight is model.tok_embeddings.weight) == tied
        monkeypatch.undo()
        for name, shard in local.items():
            rows = full[name].chunk(3)[rank] if rank < len(full[name].chunk(3)) else full[name][:0]
            torch.testing.assert_close(shard, rows, rtol=0, atol=0, msg=name)
        held = sum(t.numel() for t in local.values())
        assert read == 4 * held and sum(n for _, n, _ in log.reads) == held  # fp32 on disk: 4 bytes each
        assert len(log.reads) == len(full) and all(n <= -(-shape[0] // 3) * torch.Size(shape[1:]).numel()
                                                   for _, n, shape in log.reads)
        assert abs(held / total - 1 / 3) < 0.02  # the last rank has fewer rows


def _train_rank(P, weights_dir):
    import torch.distributed as dist

    from dlo.experiments import day5
    from dlo.models import llama_hf

    log = ReadLog(llama_hf.safe_open)
    llama_hf.safe_open = log
    out = day5.train_fsdp(P, torch.device("cpu"), None, None, weights_dir)
    biggest = max(n / torch.Size(shape).numel() for _, n, shape in log.reads)
    return {"loss": out["losses"][0], "biggest": biggest, "read": sum(n for _, n, _ in log.reads),
            "world": dist.get_world_size()}


@pytest.mark.slow
def test_train_fsdp_loads_each_ranks_shards(tmp_path):
    """Day 5's production run with weights_dir on 2 gloo ranks (activation checkpointing, FSDP2): each rank
    reads half of every tensor and nothing more (it read every tensor whole: the model in fp32 per rank),
    and its first loss is the full model's on its batch."""
    P = dataclasses.replace(DAYS["day5_fsdp"].presets["tiny"], max_steps=2, seq_len=16, batch_per_rank=2,
                            model_overrides=(("n_layers", 1),))
    cfg = E.llama_config(P)
    source = Llama(cfg)
    source.init_weights(seed=11)
    write_hf_checkpoint(source, tmp_path, shards=2)
    results = launch(_train_rank, 2, P, str(tmp_path), backend="gloo", timeout=180)
    n = sum(p.numel() for p in source.parameters())
    for rank, r in enumerate(results):
        assert r["world"] == 2 and r["biggest"] == 0.5 and r["read"] == n // 2
        with torch.no_grad():
            want = E.lm_loss(source, *E.token_batches(P, cfg, rank, "cpu")[0]).item()
        assert abs(r["loss"] - want) < 1e-5, (rank, r["loss"], want)
