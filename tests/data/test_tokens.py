"""`dlo data tokens`: Day 5's tokens.npy from a local corpus and a local tokenizer.json (a small BPE the
test trains: no download), ids checked against the model's vocabulary, the dtype fitted to it, written
atomically and never over an existing file unless asked; token_batches reads windows of it."""

import os

import numpy as np
import pytest
import torch

from dlo.cli import main as cli_main
from dlo.data import tokens as T
from dlo.data.layout import DataError
from dlo.experiments import day5 as E
from dlo.registry import DAYS
from tests.data.folders import TEXT, small_tokenizer

TINY = DAYS["day5_fsdp"].presets["tiny"]


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i, text in enumerate(TEXT):
        (folder / ("sub" if i == 2 else "") / f"doc{i}.txt").write_text((text + "\n") * 12)
    (folder / "notes.md").write_text("not a .txt file: left out")
    return folder


def expected_ids(tok_path, folder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    tok.no_truncation()
    files = sorted(folder.rglob("*.txt"))
    return np.concatenate([tok.encode(f.read_text(), add_special_tokens=True).ids for f in files])


def test_tokens_from_a_local_corpus(tmp_path, corpus, capsys, monkeypatch):
    tok = small_tokenizer(tmp_path / "tok" / "tokenizer.json", truncate=8)  # saved with truncation: switched off
    out = tmp_path / "data"
    monkeypatch.setattr(T, "CHUNK_CHARS", 100)  # several chunks per file, several batches of them
    monkeypatch.setattr(T, "BATCH_CHUNKS", 2)
    assert cli_main(["data", "tokens", str(corpus), "--tokenizer", str(tok.parent), "--out", str(out),
                     "--profile", "tiny"]) == 0
    said = capsys.readouterr().out
    ids = np.load(out / "tokens.npy")
    assert ids.dtype == np.uint8 and ids.ndim == 1  # the tiny Llama's 256 ids fit a byte
    assert np.array_equal(ids, expected_ids(tok, corpus))  # every file whole, opened by <s> (id 1)
    assert (ids == 1).sum() == 3 and ids[0] == 1
    assert said.startswith(f"wrote {out / 'tokens.npy'}: {len(ids):,} token ids (uint8) from 3 file(s)")
    assert sorted(os.listdir(out)) == ["tokens.npy"]  # no temporary file left
    assert cli_main(["data", "check", str(out), "day5_fsdp", "--profile", "tiny"]) == 0
    x, y = E.token_batches(TINY, E.llama_config(TINY), 0, "cpu", data_dir=out, n=2)[0]
    assert x.shape == (TINY.batch_per_rank, TINY.seq_len) and torch.equal(x[:, 1:], y[:, :-1])
    starts = [next(s for s in range(len(ids)) if np.array_equal(ids[s:s + TINY.seq_len], row.numpy()))
              for row in x]  # every row is a window of the file
    assert len(starts) == TINY.batch_per_rank


def test_the_dtype_fits_the_vocabulary():
    assert [T.id_dtype(v) for v in (256, 257, 65536, 128256)] == [np.uint8, np.uint16, np.uint16, np.uint32]


def test_refusals_before_anything_is_written(tmp_path, corpus, capsys):
    tok = small_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "data"
    args = ["data", "tokens", str(corpus), "--tokenizer", str(tok), "--out", str(out), "--profile", "tiny"]
    assert cli_main(args) == 0
    first = (out / "tokens.npy").read_bytes()
    assert cli_main(args) == 2  # an existing tokens.npy is never overwritten...
    assert (out / "tokens.npy").read_bytes() == first
    assert cli_main([*args, "--force"]) == 0  # ...unless asked
    big = small_tokenizer(tmp_path / "big.json", extra_tokens=300)
    (tmp_path / "empty").mkdir()
    for bad in (["--tokenizer", str(big)], ["--tokenizer", str(tmp_path / "nothing.json")]):
        assert cli_main(["data", "tokens", str(corpus), *bad, "--out", str(tmp_path / "d2"), "--profile", "tiny"]) == 2
    assert cli_main(["data", "tokens", str(tmp_path / "empty"), "--tokenizer", str(tok), "--out",
                     str(tmp_path / "d2"), "--profile", "tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"dlo data: {out / 'tokens.npy'} exists: move it away first, or pass --force to replace it"
    assert "the tokenizer has" in err[1] and "more than the vocabulary of tiny (profile tiny) (256)" in err[1]
    assert err[2].startswith("dlo data: no tokenizer at") and err[3].startswith("dlo data: no text in")
    assert not (tmp_path / "d2").exists()


def test_a_write_cut_short_leaves_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "data"
    T.write_tokens(np.arange(10, dtype=np.uint8), out)

    def broken_save(f, arr, allow_pickle=False):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        T.write_tokens(np.arange(20, dtype=np.uint8), out, force=True)
    monkeypatch.undo()
    assert np.array_equal(np.load(out / "tokens.npy"), np.arange(10)) and sorted(os.listdir(out)) == ["tokens.npy"]


def test_token_files_that_do_not_fit(tmp_path):
    np.save(tmp_path / "tokens.npy", np.zeros((4, 100), dtype=np.int32))
    with pytest.raises(DataError, match=r"int32 array of shape \[4, 100\], not a 1-D array of integer token ids"):
        T.check_tokens(tmp_path, 256, 10)
    np.save(tmp_path / "tokens.npy", np.linspace(0, 1, 100))
    with pytest.raises(DataError, match="float64 array"):
        T.check_tokens(tmp_path, 256, 10)
    np.save(tmp_path / "tokens.npy", np.array([3, -1] * 50))
    with pytest.raises(DataError, match=r"ids in \[-1, 3\], outside the vocabulary"):
        T.check_tokens(tmp_path, 256, 10)
    np.save(tmp_path / "tokens.npy", np.array(["a"] * 20, dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="is not a NumPy array"):
        T.check_tokens(tmp_path, 256, 10)
    (tmp_path / "tokens.npy").write_text("not numpy")
    with pytest.raises(DataError, match="is not a NumPy array"):
        T.check_tokens(tmp_path, 256, 10)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match="is not UTF-8 text"):
        T.make_tokens([tmp_path / "bad.txt"], small_tokenizer(tmp_path / "t.json"), tmp_path / "o", 256)
