"""Day 5's token file, `data_dir/tokens.npy`: made from a local text corpus with a local tokenizer, checked
against the model's vocabulary, read as windows without loading it whole.

`make_tokens` encodes every file of a corpus with the model's own `tokenizer.json` (the Hugging Face
`tokenizers` package reads it from disk: no Hub, no download), each file a document opened by what the
tokenizer puts around a text (Llama 3: `<|begin_of_text|>`), and writes one 1-D array of ids in the
smallest unsigned dtype that holds the vocabulary (uint32 for Llama 3's 128,256), atomically: a
temporary file renamed, so a cut-short run leaves no half file behind. An existing tokens.npy is
never overwritten unless asked (`force`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dlo.data.layout import TOKENS, DataError, how_to_make_tokens

CHUNK_CHARS = 1 << 20   # text encoded per call: whole lines up to ~1 MiB, so a large file never sits in memory
BATCH_CHUNKS = 16       # chunks per encode_batch (the tokenizer's threads share them)


def open_tokens(data_dir: str | Path) -> np.ndarray:
    """`data_dir/tokens.npy` memory-mapped (nothing read yet), or DataError (one line)."""
    path = Path(data_dir) / TOKENS
    if not path.is_file():
        raise DataError(f"{data_dir} has no {TOKENS} (Day 5's token ids): {how_to_make_tokens(data_dir)}")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path} is not a NumPy array ({str(exc).splitlines()[0][:100]}): "
                        f"{how_to_make_tokens(data_dir)}") from None


def check_tokens(data_dir: str | Path, vocab_size: int, min_len: int, model: str = "the model") -> str:
    """A 1-D array of at least `min_len` integer ids in [0, vocab_size): a description, or DataError."""
    tokens = open_tokens(data_dir)
    path = Path(data_dir) / TOKENS
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path} holds a {tokens.dtype} array of shape {list(tokens.shape)}, not a 1-D array of "
                        f"integer token ids: {how_to_make_tokens(data_dir)}")
    if len(tokens) < min_len:
        raise DataError(f"{path} holds {len(tokens)} tokens, fewer than the {min_len} one training window of "
                        f"{model} needs: a larger corpus")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise DataError(f"{path} holds ids in [{low}, {high}], outside the vocabulary of {model} [0, {vocab_size}): "
                        "ids of another tokenizer (or a profile whose model has a smaller vocabulary)")
    return f"{len(tokens):,} token ids ({tokens.dtype}) in [0, {vocab_size}) for {model}, in {path}"


def corpus_files(sources) -> list[Path]:
    """The files of a corpus: each source a file, or a folder whose *.txt files are taken (sorted, recursively)."""
    files = []
    for src in map(Path, sources):
        if src.is_dir():
            files += sorted(p for p in src.rglob("*.txt") if p.is_file())
        elif src.is_file():
            files.append(src)
        else:
            raise DataError(f"corpus {src} is neither a file nor a folder")
    if not files:
        raise DataError(f"no text in {', '.join(map(str, sources))}: give .txt files or folders holding them")
    return files


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json (or a folder holding one, e.g. the model's weights
    folder), with any truncation or padding it was saved with switched off: every token is kept."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"no tokenizer at {path}: give the model's tokenizer.json (it comes with the weights)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises plain Exceptions for a bad file
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({str(exc).splitlines()[0][:100]})") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _chunks(path: Path):
    """Whole lines of a UTF-8 text file, about CHUNK_CHARS at a time."""
    lines, size = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                lines.append(line)
                size += len(line)
                if size >= CHUNK_CHARS:
                    yield "".join(lines)
                    lines, size = [], 0
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if lines:
        yield "".join(lines)


def encode_files(files, tok, vocab_size: int) -> np.ndarray:
    """Every file encoded as one document, opened by the tokenizer's own special tokens, in `id_dtype`;
    DataError at the first id outside [0, vocab_size) (another model's tokenizer)."""
    dtype, opening = id_dtype(vocab_size), tok.encode("", add_special_tokens=True).ids  # Llama 3: [128000]
    parts = []

    def add(ids, where):
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DataError(f"the tokenizer gave id {int(ids.max())} in {where}, outside the model's vocabulary "
                            f"[0, {vocab_size}): not this model's tokenizer")
        parts.append(ids.astype(dtype))

    for path in files:
        add(opening, path)
        batch = []
        for chunk in _chunks(path):
            batch.append(chunk)
            if len(batch) == BATCH_CHUNKS:
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    add(enc.ids, path)
                batch = []
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            add(enc.ids, path)
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def write_tokens(ids: np.ndarray, out_dir: str | Path, force: bool = False) -> Path:
    """`out_dir/tokens.npy`, written to a temporary file and renamed: readers see the old file or the new one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest, tmp = out_dir / TOKENS, out_dir / f".{TOKENS}.{os.getpid()}.tmp"
    if dest.exists() and not force:
        raise DataError(f"{dest} exists: move it away first, or pass --force to replace it")
    try:
        with open(tmp, "wb") as f:
            np.save(f, ids, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def make_tokens(sources, tokenizer: str | Path, out_dir: str | Path, vocab_size: int, min_len: int = 2,
                force: bool = False, model: str = "the model") -> str:
    """Encode a local corpus with a local tokenizer into `out_dir/tokens.npy`; every refusal (an existing
    file, no text, a tokenizer larger than the model's vocabulary, too few tokens) before anything is written."""
    if (Path(out_dir) / TOKENS).exists() and not force:
        raise DataError(f"{Path(out_dir) / TOKENS} exists: move it away first, or pass --force to replace it")
    files = corpus_files(sources)
    tok = load_tokenizer(tokenizer)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(f"the tokenizer has {size:,} tokens, more than the vocabulary of {model} ({vocab_size:,}): "
                        "not this model's tokenizer")
    ids = encode_files(files, tok, vocab_size)
    if len(ids) < min_len:
        raise DataError(f"the corpus gives {len(ids)} tokens, fewer than the {min_len} one training window of "
                        f"{model} needs: a larger corpus")
    dest = write_tokens(ids, out_dir, force)
    return f"wrote {dest}: {len(ids):,} token ids ({ids.dtype}) from {len(files)} file(s), in [0, {vocab_size}) " \
           f"for {model}"


__all__ = ["check_tokens", "corpus_files", "encode_files", "id_dtype", "load_tokenizer", "make_tokens",
           "open_tokens", "write_tokens"]
