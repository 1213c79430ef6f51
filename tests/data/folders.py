"""What the data tests write (never a download): CIFAR-10's binary release as sparse files of the real
sizes (no disk used, nothing read), its Python version, a token file, a small trained tokenizer, and a
Hugging Face Llama folder whose safetensors data are sparse (headers of the real Llama 3.2 3B)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from dlo.data.cifar import BATCH_BYTES, TEST_FILES, TRAIN_FILES

TEXT = ["the cat sat on the mat and the dog sat on the log",
        "a cat and a dog ran to the mat",
        "the log was on the mat the cat was on the log"]


def write_cifar_release(data_dir: Path, short: str | None = None) -> Path:
    """data_dir/cifar-10-batches-bin with the six batch files at the release's size (sparse); `short`:
    that file one record short."""
    folder = data_dir / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name in TRAIN_FILES + TEST_FILES:
        with open(folder / name, "wb") as f:
            f.truncate(BATCH_BYTES - (3073 if name == short else 0))
    (folder / "batches.meta.txt").write_text("airplane\nautomobile\n")
    return folder


def write_cifar_python(data_dir: Path) -> Path:
    """data_dir/cifar-10-batches-py as cifar-10-python.tar.gz unpacks it (pickles; small stand-ins here)."""
    folder = data_dir / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / name).write_bytes(b"\x80\x04pickled")
    return folder


def write_tokens(data_dir: Path, n: int = 1000, vocab: int = 256, dtype=np.uint16) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "tokens.npy"
    np.save(path, (np.arange(n) * 7 % vocab).astype(dtype))
    return path


def small_tokenizer(path: Path, extra_tokens: int = 0, truncate: int | None = None) -> Path:
    """A BPE tokenizer trained on TEXT (whitespace words, about 60 tokens; `<unk>` 0, `<s>` 1 opens every
    text), saved as tokenizer.json; `extra_tokens` added tokens make its vocabulary larger, `truncate` saves
    the truncation a tokenizer.json can carry."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT * 4, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>"],
                                                          show_progress=False))
    tok.add_tokens([f"extra{i}" for i in range(extra_tokens)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if truncate:
        tok.enable_truncation(max_length=truncate)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


# The config.json of meta-llama/Llama-3.2-3B as published (the fields a loader reads, and some it ignores)
LLAMA_3B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256}


def write_sparse_checkpoint(folder: Path, config: dict, shapes: dict[str, tuple[int, ...]], files: int = 2) -> int:
    """A Hugging Face folder: config.json, an index, and `files` bf16 safetensors files whose headers name
    `shapes` (HF names) and whose data are sparse zeros (no disk): the real 3B's layout in no time.
    Returns the bytes the data would take."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names, weight_map, total = sorted(shapes), {}, 0
    for k in range(files):
        fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names[k::files]:
            size = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total
